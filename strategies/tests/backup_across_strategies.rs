//! `BackupAndRestore` across strategies: a run under `MirroredStrategy::cpu(2)` that fails
//! mid-epoch resumes under `OneDeviceStrategy` (and the reverse) at the same global batch, and
//! ends within ten times the float32 spread of an uninterrupted one-device run (the spread of
//! the same run with each batch's samples reversed).

use std::path::Path;

use kandle::callbacks::{BackupAndRestore, Callback, SaveFreq};
use kandle::data::{digits, InMemoryDataset};
use kandle::params::Weights;
use kandle::prelude::*;
use kandle_strategies::MirroredStrategy;

use kandle_testing::crash::Crash;
use kandle_testing::strategies as support;
use support::equivalence_run::Order;
use support::Reference;

const GLOBAL_BATCH: usize = 40;

/// The first 410 digits in `order`, for batches of [`GLOBAL_BATCH`].
fn data(order: Order) -> kandle::Result<InMemoryDataset> {
    digits::load()?.subset(&order.indices(410, GLOBAL_BATCH))
}

/// Three epochs of the samples in the order `data` holds them.
fn train<S: Strategy + Clone + 'static>(
    strategy: &S,
    data: &InMemoryDataset,
    backups: &Path,
    crash: Option<(usize, usize)>,
) -> kandle::Result<Weights> {
    let mut model = Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Flatten)
        .add(Dense::new(24))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
        .compile(
            Sgd::new(0.05).momentum(0.9),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?;
    model.fit(
        data,
        FitOptions {
            epochs: 3,
            batch_size_per_replica: GLOBAL_BATCH / strategy.num_replicas_in_sync(),
            shuffle: false,
            seed: Some(4),
            verbosity: Verbosity::Silent,
            callbacks: vec![
                Box::new(Crash {
                    at: crash,
                    epoch: 0,
                }),
                BackupAndRestore::new(backups)
                    .save_freq(SaveFreq::Steps(6))
                    .boxed(),
            ],
            ..Default::default()
        },
    )?;
    model.get_weights()
}

#[test]
fn a_backup_resumes_under_another_strategy() -> anyhow::Result<()> {
    let data = data(Order::Fixed)?;
    let none = tempfile::tempdir()?;
    let reference = Reference::new(
        train(&OneDeviceStrategy::cpu(), &data, none.path(), None)?,
        &train(
            &OneDeviceStrategy::cpu(),
            &self::data(Order::ReversedInBatches)?,
            none.path(),
            None,
        )?,
    )?;
    let mirrored = MirroredStrategy::cpu(2)?;
    for (first, second) in [(true, false), (false, true)] {
        let dir = tempfile::tempdir()?;
        let crash = Some((1, 4));
        let failed = if first {
            train(&mirrored, &data, dir.path(), crash)
        } else {
            train(&OneDeviceStrategy::cpu(), &data, dir.path(), crash)
        };
        anyhow::ensure!(failed.is_err_and(|e| e.to_string().contains("simulated crash")));
        let resumed = if second {
            train(&mirrored, &data, dir.path(), None)?
        } else {
            train(&OneDeviceStrategy::cpu(), &data, dir.path(), None)?
        };
        let what = if first {
            "mirrored -> one device"
        } else {
            "one device -> mirrored"
        };
        reference.assert_matches(&resumed, what)?;
    }
    Ok(())
}
