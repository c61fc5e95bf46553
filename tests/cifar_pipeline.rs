//! The CIFAR-10 tutorial's input pipeline through the public API: fixture files in the official
//! binary format, one-hot targets, the training set's mean image subtracted from both sets,
//! and shifts and flips applied by the prefetching loader to the training set only.

use std::sync::Arc;

use kandle::data::{cifar10, Dataset, Loader, LoaderOptions, MeanImage, RandomShiftFlip, Targets};

use kandle_testing::cifar10_fixture::write_fixture;

fn epoch_inputs(loader: &Loader, epoch: usize) -> anyhow::Result<Vec<f32>> {
    std::thread::scope(|s| {
        let mut all = Vec::new();
        for batch in loader.spawn(s, epoch) {
            all.extend(batch?.inputs[0].flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(all)
    })
}

#[test]
fn tutorial_pipeline_on_a_fixture() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    write_fixture(dir.path(), 40, 30, 1)?;
    let data = cifar10::load(dir.path())?.one_hot();
    let mean = MeanImage::compute(&data.train)?;
    assert_eq!(mean.shape(), &[3, 32, 32]);
    let train = mean.subtract_from(data.train)?;
    let test = mean.subtract_from(data.test)?;
    assert_eq!((train.len(), test.len()), (200, 30));
    assert_eq!(train.targets(), Targets::Values(vec![10]));

    let options = LoaderOptions {
        batch_size: 64,
        shuffle: true,
        seed: 42,
        augment: Some(Arc::new(RandomShiftFlip::default())),
        ..Default::default()
    };
    let loader = Loader::new(&train, options.clone())?;
    assert_eq!(loader.steps_per_epoch(), 4);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let mut rows = 0;
        for batch in loader.spawn(s, 0) {
            let batch = batch?;
            assert_eq!(&batch.inputs[0].dims()[1..], &[3, 32, 32]);
            assert_eq!(&batch.targets[0].dims()[1..], &[10]);
            let sums = batch.targets[0].sum(1)?.to_vec1::<f32>()?;
            assert!(sums.iter().all(|&s| s == 1.0));
            rows += batch.len();
        }
        assert_eq!(rows, 200);
        Ok(())
    })?;

    // Same seed, same epoch: the same augmented inputs; another epoch: different ones.
    let again = Loader::new(&train, options)?;
    let first = epoch_inputs(&loader, 0)?;
    assert_eq!(first, epoch_inputs(&again, 0)?);
    assert_ne!(first, epoch_inputs(&loader, 1)?);
    // Mean-subtracted inputs are centred on average (augmentation barely moves the mean).
    let avg = first.iter().map(|&v| f64::from(v)).sum::<f64>() / first.len() as f64;
    assert!(avg.abs() < 2.0, "mean of centred inputs {avg}");

    // Evaluation: no augmentation, so every epoch reads the same inputs.
    let eval = Loader::new(
        &test,
        LoaderOptions {
            batch_size: 64,
            ..Default::default()
        },
    )?;
    assert_eq!(epoch_inputs(&eval, 0)?, epoch_inputs(&eval, 3)?);
    Ok(())
}
