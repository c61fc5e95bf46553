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

/// How a leg of an elastic run ended.
#[derive(Debug, PartialEq)]
enum Leg {
    /// Trained to the end: the test accuracy.
    Finished(f64),
    /// Stopped by the signal: the epoch and the steps done in it.
    Stopped(usize, usize),
}

/// One leg of an elastic run: trains digits at 16 samples per replica under `strategy` with
/// `BackupAndRestore` into `backups`, a stop signal raised during `(epoch, step)` when given.
fn elastic_leg<S: Strategy + Clone + 'static>(
    strategy: &S,
    backups: &Path,
    stop_at: Option<(usize, usize)>,
) -> anyhow::Result<Leg> {
    let (train, test) = digits::load()?.train_test_split(0.2, 42)?;
    let mut model = Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Flatten)
        .add(Dense::new(32))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
        .compile(
            Sgd::new(0.05).momentum(0.9),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?;
    let signal = kandle::preemption::StopSignal::new();
    let history = model.fit(
        &train,
        FitOptions {
            epochs: 4,
            batch_size_per_replica: 16,
            seed: Some(9),
            verbosity: Verbosity::Silent,
            callbacks: vec![
                Box::new(kandle_testing::crash::Preempt {
                    at: stop_at,
                    signal: signal.clone(),
                    epoch: 0,
                }),
                BackupAndRestore::new(backups)
                    .save_freq(SaveFreq::Steps(10))
                    .boxed(),
            ],
            stop_signal: Some(signal),
            ..Default::default()
        },
    )?;
    if let Some(p) = history.preempted {
        return Ok(Leg::Stopped(p.epoch, p.step));
    }
    Ok(Leg::Finished(
        model.evaluate(&test, 128)?.get("accuracy").unwrap_or(0.0),
    ))
}

/// A run stopped under two mirrored replicas (global batch 32) resumes on one device (16),
/// is stopped again and resumes under three replicas (48), each time at the samples already
/// seen in the epoch, and ends as accurate as an uninterrupted run.
#[test]
fn a_backup_resumes_on_other_replica_counts_at_the_same_batch_per_replica() -> anyhow::Result<()> {
    let none = tempfile::tempdir()?;
    let Leg::Finished(uninterrupted) = elastic_leg(&MirroredStrategy::cpu(2)?, none.path(), None)?
    else {
        anyhow::bail!("the uninterrupted run stopped");
    };

    let dir = tempfile::tempdir()?;
    let stopped = elastic_leg(&MirroredStrategy::cpu(2)?, dir.path(), Some((1, 5)))?;
    anyhow::ensure!(stopped == Leg::Stopped(1, 6), "{stopped:?}");
    // 6 steps of 32 are 192 samples: 12 steps of 16 on one device, stopped during its 20th.
    let stopped = elastic_leg(&OneDeviceStrategy::cpu(), dir.path(), Some((1, 19)))?;
    anyhow::ensure!(stopped == Leg::Stopped(1, 20), "{stopped:?}");
    // 20 steps of 16 are 320 samples: 6 whole steps of 48 (32 samples seen again).
    let Leg::Finished(accuracy) = elastic_leg(&MirroredStrategy::cpu(3)?, dir.path(), None)? else {
        anyhow::bail!("the last leg stopped");
    };
    eprintln!(
        "digits: uninterrupted {:.2}%, mirrored x2 -> one device -> mirrored x3 {:.2}%",
        100.0 * uninterrupted,
        100.0 * accuracy
    );
    anyhow::ensure!(uninterrupted >= 0.93, "{uninterrupted}");
    anyhow::ensure!(
        accuracy >= uninterrupted - 0.02,
        "{accuracy} against {uninterrupted}"
    );
    Ok(())
}
