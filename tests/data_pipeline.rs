//! The data layer through the public API only: the bundled digits, a split, and an epoch
//! through the prefetching loader, as `Model::fit` drives it.

use kandle::data::{digits, split_tail, Dataset, Loader, LoaderOptions, Targets};

#[test]
fn digits_split_and_prefetched_epoch() -> anyhow::Result<()> {
    let (train, test) = digits::load()?.train_test_split(0.2, 42)?;
    assert_eq!((train.len(), test.len()), (1437, 360));

    // Keras's validation_split over a `&dyn Dataset`, as `fit` does.
    let data: &dyn Dataset = &train;
    let (head, tail) = split_tail(data, 0.1)?;
    assert_eq!((head.len(), tail.len()), (1293, 144));

    let loader = Loader::new(
        &head,
        LoaderOptions {
            batch_size: 64,
            shuffle: true,
            seed: 1,
            ..Default::default()
        },
    )?;
    assert_eq!(loader.steps_per_epoch(), 21);
    let (mut rows, mut steps) = (0, 0);
    std::thread::scope(|s| -> anyhow::Result<()> {
        for batch in loader.spawn(s, 0) {
            let batch = batch?;
            assert_eq!(&batch.inputs[0].dims()[1..], &[1, 8, 8]);
            assert_eq!(batch.targets[0].dtype(), candle_core::DType::U32);
            rows += batch.len();
            steps += 1;
        }
        Ok(())
    })?;
    assert_eq!((rows, steps), (1293, 21));

    let hot = test.one_hot()?;
    assert_eq!(hot.targets(), Targets::Values(vec![10]));
    Ok(())
}
