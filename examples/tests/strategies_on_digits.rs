//! Every strategy learns real data: the digits CNN reaches at least 97% test accuracy under
//! each, and a checkpoint written under one strategy loads under another with identical
//! predictions.

use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy, ReplicaOptions};

const EPOCHS: usize = 12;
const GLOBAL_BATCH: usize = 32;

fn train<S: Strategy + Clone + 'static>(strategy: &S) -> anyhow::Result<(Model, f64)> {
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = kandle_models::digits_cnn(10)
        .compile(
            Adam::new(2e-3),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?
        .with_seed(7)?;
    model.fit(
        &train,
        FitOptions {
            epochs: EPOCHS,
            batch_size_per_replica: GLOBAL_BATCH / strategy.num_replicas_in_sync(),
            callbacks: vec![LearningRateScheduler::new(CosineDecay::new(2e-3, EPOCHS)).boxed()],
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let accuracy = model.evaluate(&test, 64)?.get("accuracy").unwrap_or(0.0);
    eprintln!(
        "{} x{}: test accuracy {accuracy:.4}",
        strategy.name(),
        strategy.num_replicas_in_sync()
    );
    Ok((model, accuracy))
}

#[test]
fn each_strategy_reaches_97_percent() -> anyhow::Result<()> {
    let (_, one) = train(&OneDeviceStrategy::cpu())?;
    let (_, mirrored) = train(&MirroredStrategy::cpu(2)?)?;
    let sync_bn = ReplicaOptions::default().sync_batch_norm(true);
    let (_, synced) = train(&MirroredStrategy::cpu(2)?.with_options(sync_bn))?;
    let (_, central) = train(&CentralStorageStrategy::cpu(2)?)?;
    for (name, accuracy) in [
        ("one device", one),
        ("mirrored", mirrored),
        ("mirrored + sync bn", synced),
        ("central storage", central),
    ] {
        assert!(accuracy >= 0.97, "{name}: {accuracy}");
    }
    Ok(())
}

fn compiled<S: Strategy + Clone + 'static>(strategy: &S) -> kandle::Result<Model> {
    kandle_models::digits_cnn(10).compile(
        Sgd::new(0.05),
        SparseCategoricalCrossentropy::new(),
        (),
        strategy,
    )
}

#[test]
fn checkpoints_move_between_strategies() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("mirrored.safetensors");
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 1)?;
    let mut mirrored = compiled(&MirroredStrategy::cpu(2)?)?;
    mirrored.fit(
        &train,
        FitOptions {
            batch_size_per_replica: 16,
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    mirrored.save_weights(&path)?;
    let (x, _) = test.to_tensors()?;
    let expected = mirrored.predict(&x, 64)?.flatten_all()?.to_vec1::<f32>()?;

    let mut one = compiled(&OneDeviceStrategy::cpu())?;
    one.build(&[1, 8, 8])?;
    one.load_weights(&path)?;
    let got = one.predict(&x, 50)?.flatten_all()?.to_vec1::<f32>()?;
    assert_close(&got, &expected, "one device")?;

    let mut central = compiled(&CentralStorageStrategy::cpu(3)?)?;
    central.build(&[1, 8, 8])?;
    central.load_weights(&path)?;
    let got = central.predict(&x, 64)?.flatten_all()?.to_vec1::<f32>()?;
    assert_close(&got, &expected, "central storage")
}

/// Predictions agree to float rounding (replicas predict different slices, so matrix
/// products run at other batch sizes).
fn assert_close(got: &[f32], expected: &[f32], what: &str) -> anyhow::Result<()> {
    assert_eq!(got.len(), expected.len(), "{what}");
    let worst = got
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-5, "{what}: predictions differ by up to {worst}");
    Ok(())
}
