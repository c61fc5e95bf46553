//! Training learns real data: a small CNN reaches at least 97% test accuracy on the digits set
//! through `fit`, and its checkpoint reproduces its predictions in a freshly built model.

use kandle::prelude::*;

mod support;

fn compiled(seed: u64) -> kandle::Result<Model> {
    support::digits_cnn()
        .compile(
            Adam::new(3e-3),
            SparseCategoricalCrossentropy::new(),
            (Accuracy, TopKCategoricalAccuracy::new(3)),
            &OneDeviceStrategy::cpu(),
        )?
        .with_seed(seed)
}

#[test]
fn digits_cnn_reaches_97_percent_and_round_trips_through_a_checkpoint() -> anyhow::Result<()> {
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = compiled(1)?;
    let history = model.fit(
        &train,
        FitOptions {
            epochs: 12,
            batch_size_per_replica: 32,
            validation_split: 0.1,
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    assert_eq!(history.epochs.len(), 12);
    let losses = history.series("loss");
    assert!(
        losses[11] < losses[0] / 3.0,
        "loss did not fall: {losses:?}"
    );
    assert!(
        history.last("val_accuracy").is_some_and(|a| a > 0.9),
        "{:?}",
        history.to_map()
    );

    let logs = model.evaluate(&test, 128)?;
    let accuracy = logs.get("accuracy").unwrap_or(0.0);
    eprintln!("digits test accuracy: {accuracy:.4}");
    assert!(accuracy >= 0.97, "test accuracy {accuracy}");
    assert!(logs.get("top_k_categorical_accuracy").unwrap_or(0.0) >= accuracy);

    let dir = tempfile::tempdir()?;
    let path = dir.path().join("digits.safetensors");
    model.save_weights(&path)?;
    let (x, _) = test.to_tensors()?;
    let expected = model.predict(&x, 64)?;
    let mut fresh = compiled(99)?;
    fresh.build(&[1, 8, 8])?;
    fresh.load_weights(&path)?;
    let got = fresh.predict(&x, 100)?;
    assert_eq!(
        expected.flatten_all()?.to_vec1::<f32>()?,
        got.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}
