//! `BackupAndRestore` on real digits data: a run that fails mid-epoch and is started again
//! resumes at the step of its last backup and ends exactly where an uninterrupted run ends
//! (bit for bit on one CPU device: same weights, same optimizer state, same history, the CSV
//! log with each epoch once); a backup of another run is refused; the backups are deleted when
//! `fit` completes; a damaged latest backup falls back to the previous one. A stop signal
//! (SIGTERM's request) mid-epoch ends `fit` after that step with a backup there, which the same
//! program resumes bit for bit.

use std::path::Path;

use anyhow::{ensure, Result};
use kandle::callbacks::{BackupAndRestore, Callback, CsvLogger, SaveFreq};
use kandle::data::{digits, InMemoryDataset};
use kandle::params::Weights;
use kandle::prelude::*;

use kandle::preemption::{Preempted, StopSignal};
use kandle_testing::crash::{Crash, Preempt};

fn model() -> kandle::Result<Model> {
    model_with(Sgd::new(0.05).momentum(0.9))
}

fn model_with(optimizer: Sgd) -> kandle::Result<Model> {
    Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Flatten)
        .add(Dense::new(24))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
        .compile(
            optimizer,
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )
}

fn data() -> Result<(InMemoryDataset, InMemoryDataset)> {
    let all = digits::load()?;
    Ok(all
        .subset(&(0..500).collect::<Vec<_>>())?
        .train_test_split(0.2, 3)?)
}

/// Trains 4 epochs (10 steps each) with `backup`, crashing at `crash`.
fn fit(
    model: &mut Model,
    dir: &Path,
    backup: BackupAndRestore,
    crash: Option<(usize, usize)>,
) -> kandle::Result<History> {
    fit_in_batches(model, dir, backup, crash, 40)
}

/// [`fit`] in batches of `batch` (400 training samples).
fn fit_in_batches(
    model: &mut Model,
    dir: &Path,
    backup: BackupAndRestore,
    crash: Option<(usize, usize)>,
    batch: usize,
) -> kandle::Result<History> {
    fit_with(model, dir, Some(backup), crash, None, batch)
}

/// [`fit_in_batches`] with the backup optional and a stop signal raised during step
/// `preempt_at`.
fn fit_with(
    model: &mut Model,
    dir: &Path,
    backup: Option<BackupAndRestore>,
    crash: Option<(usize, usize)>,
    preempt_at: Option<(usize, usize)>,
    batch: usize,
) -> kandle::Result<History> {
    let (train, test) = data().map_err(|e| kandle::Error::invalid(e.to_string()))?;
    let signal = StopSignal::new();
    let mut callbacks = vec![
        LearningRateScheduler::new(PolynomialDecay::new(0.05, 4, 1.0)).boxed(),
        Box::new(Crash {
            at: crash,
            epoch: 0,
        }),
        CsvLogger::new(dir.join("log.csv")).boxed(),
        Box::new(Preempt {
            at: preempt_at,
            signal: signal.clone(),
            epoch: 0,
        }),
    ];
    if let Some(backup) = backup {
        callbacks.push(backup.boxed());
    }
    model.fit(
        &train,
        FitOptions {
            epochs: 4,
            batch_size_per_replica: batch,
            validation: Some(&test),
            seed: Some(11),
            verbosity: Verbosity::Silent,
            callbacks,
            stop_signal: Some(signal),
            ..Default::default()
        },
    )
}

fn same(a: &Weights, b: &Weights) -> Result<()> {
    ensure!(a.len() == b.len());
    for (name, x) in a {
        let y = &b[name];
        let diff = (x - y)?.abs()?.max_all()?.to_scalar::<f32>()?;
        ensure!(diff == 0.0, "{name} differs by {diff}");
    }
    Ok(())
}

#[test]
fn a_run_resumed_mid_epoch_ends_where_an_uninterrupted_run_ends() -> Result<()> {
    let plain_dir = tempfile::tempdir()?;
    let mut plain = model()?;
    let reference = fit(
        &mut plain,
        plain_dir.path(),
        BackupAndRestore::new(plain_dir.path().join("b")),
        None,
    )?;

    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = || BackupAndRestore::new(&backups).save_freq(SaveFreq::Steps(7));
    // Crashes at epoch 2 step 5: the last backup was after 21 steps (epoch 2, step 1 next).
    let mut first = model()?;
    let err = fit(&mut first, dir.path(), backup(), Some((2, 5)));
    ensure!(err.is_err_and(|e| e.to_string().contains("simulated crash")));
    ensure!(backups.join("backup.safetensors").is_file());

    // A fresh process: a new model, the same program.
    let mut second = model()?;
    let resumed = fit(&mut second, dir.path(), backup(), None)?;
    same(&plain.get_weights()?, &second.get_weights()?)?;
    ensure!(resumed == reference, "{resumed:?}\nvs\n{reference:?}");
    let csv = std::fs::read_to_string(dir.path().join("log.csv"))?;
    let want = std::fs::read_to_string(plain_dir.path().join("log.csv"))?;
    ensure!(csv == want, "{csv}\nvs\n{want}");
    // fit completed: the backups are gone.
    ensure!(!backups.join("backup.safetensors").exists());

    // The optimizer state came back too: one more step each stays identical.
    let (train, _) = data()?;
    let (x, y) = train.to_tensors()?;
    plain.train_on_batch(&x.narrow(0, 0, 40)?, &y.narrow(0, 0, 40)?, None)?;
    second.train_on_batch(&x.narrow(0, 0, 40)?, &y.narrow(0, 0, 40)?, None)?;
    same(&plain.get_weights()?, &second.get_weights()?)
}

#[test]
fn a_backup_of_another_run_is_refused_and_a_damaged_one_falls_back() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let keep = || {
        BackupAndRestore::new(&backups)
            .save_freq(SaveFreq::Steps(4))
            .double_checkpoint(true)
    };
    let mut first = model()?;
    ensure!(fit(&mut first, dir.path(), keep(), Some((1, 6))).is_err());
    let latest = backups.join("backup.safetensors");
    let previous = backups.join("backup.previous.safetensors");
    ensure!(latest.is_file() && previous.is_file());

    // Other data: another run. The error names the file and says what differs.
    let (train, _) = data()?;
    let train = train.subset(&(0..380).collect::<Vec<_>>())?;
    let mut other = model()?;
    let err = other
        .fit(
            &train,
            FitOptions {
                epochs: 4,
                batch_size_per_replica: 40,
                verbosity: Verbosity::Silent,
                callbacks: vec![
                    Box::new(Crash { at: None, epoch: 0 }),
                    CsvLogger::new(dir.path().join("other.csv")).boxed(),
                    keep().boxed(),
                ],
                ..Default::default()
            },
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.contains("backup.safetensors")
            && err.contains("over 400 samples, but this fit has 380"),
        "{err}"
    );

    // A torn latest backup: the previous one resumes the run, which then completes.
    let bytes = std::fs::read(&latest)?;
    std::fs::write(&latest, &bytes[..bytes.len() / 2])?;
    let mut second = model()?;
    let history = fit(&mut second, dir.path(), keep(), None)?;
    ensure!(history.epochs == [0, 1, 2, 3], "{:?}", history.epochs);
    ensure!(!latest.exists() && !previous.exists());
    Ok(())
}

/// Gradient accumulation over 3 batches of 20 (20 batches an epoch: six groups of 3 and a
/// last one of 2): backups asked for every 7 batches are written when a group's update is
/// applied (after batches 9, 15, 21, ...), and a run that crashes mid-group resumes from there
/// and ends bit for bit where an uninterrupted run ends.
#[test]
fn a_backup_asked_for_mid_group_resumes_exactly() -> Result<()> {
    let sgd = || Sgd::new(0.05).momentum(0.9).gradient_accumulation_steps(3);
    let plain_dir = tempfile::tempdir()?;
    let mut plain = model_with(sgd())?;
    let backup_of = |dir: &Path| BackupAndRestore::new(dir).save_freq(SaveFreq::Steps(7));
    let reference = fit_in_batches(
        &mut plain,
        plain_dir.path(),
        backup_of(&plain_dir.path().join("b")),
        None,
        20,
    )?;

    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    // Crashes at epoch 1, batch 13 (mid-group: 12, 13, 14), after the backup asked for at
    // batch 7 of that epoch was written at the end of its group (batch 9).
    let mut first = model_with(sgd())?;
    let err = fit_in_batches(
        &mut first,
        dir.path(),
        backup_of(&backups),
        Some((1, 13)),
        20,
    );
    ensure!(err.is_err_and(|e| e.to_string().contains("simulated crash")));
    let state = kandle::training_state::TrainingState::load(backups.join("backup.safetensors"))?;
    let fit = &state.extra["fit"];
    ensure!(
        fit["epoch"] == 1 && fit["step"] == 9,
        "the backup is at {fit}"
    );

    let mut second = model_with(sgd())?;
    let resumed = fit_in_batches(&mut second, dir.path(), backup_of(&backups), None, 20)?;
    same(&plain.get_weights()?, &second.get_weights()?)?;
    ensure!(resumed == reference, "{resumed:?}\nvs\n{reference:?}");
    Ok(())
}

#[test]
fn a_stop_signal_mid_epoch_backs_up_that_step_and_the_same_program_resumes_bit_for_bit(
) -> Result<()> {
    let plain_dir = tempfile::tempdir()?;
    let mut plain = model()?;
    let backup_of = |dir: &Path| BackupAndRestore::new(dir).save_freq(SaveFreq::Steps(7));
    let reference = fit(
        &mut plain,
        plain_dir.path(),
        backup_of(&plain_dir.path().join("b")),
        None,
    )?;

    // The signal comes during epoch 2's step 4 (the sixth step of ten counted from 0 is 5):
    // fit returns after it, with a backup there although the last scheduled one was at 21.
    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let mut first = model()?;
    let stopped = fit_with(
        &mut first,
        dir.path(),
        Some(backup_of(&backups)),
        None,
        Some((2, 4)),
        40,
    )?;
    let want = Preempted {
        epoch: 2,
        step: 5,
        reason: "requested by the program".into(),
        backed_up: true,
    };
    ensure!(
        stopped.preempted.as_ref() == Some(&want),
        "{:?}",
        stopped.preempted
    );
    ensure!(stopped.epochs == [0, 1], "{:?}", stopped.epochs);
    ensure!(first.preempted() == Some(&want));
    let state = kandle::training_state::TrainingState::load(backups.join("backup.safetensors"))?;
    let at = &state.extra["fit"];
    ensure!(at["epoch"] == 2 && at["step"] == 5, "the backup is at {at}");
    ensure!(
        want.to_string()
            == "stopped by requested by the program at epoch 3 step 5 (a backup was written there)",
        "{want}"
    );

    // The same program again, without a signal: it resumes there and ends bit for bit.
    let mut second = model()?;
    let resumed = fit(&mut second, dir.path(), backup_of(&backups), None)?;
    same(&plain.get_weights()?, &second.get_weights()?)?;
    ensure!(resumed == reference, "{resumed:?}\nvs\n{reference:?}");
    let csv = std::fs::read_to_string(dir.path().join("log.csv"))?;
    let want_csv = std::fs::read_to_string(plain_dir.path().join("log.csv"))?;
    ensure!(csv == want_csv, "{csv}\nvs\n{want_csv}");
    ensure!(
        !backups.join("backup.safetensors").exists(),
        "a finished run deletes its backup"
    );
    Ok(())
}

#[test]
fn a_stop_signal_in_an_epoch_s_last_step_ends_the_epoch_first_and_without_a_backup_says_so(
) -> Result<()> {
    // During the last of ten steps: the epoch ends (validation, callbacks) and fit stops
    // before the next one.
    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let mut first = model()?;
    let stopped = fit_with(
        &mut first,
        dir.path(),
        Some(BackupAndRestore::new(&backups)),
        None,
        Some((1, 9)),
        40,
    )?;
    let at = stopped
        .preempted
        .as_ref()
        .map(|p| (p.epoch, p.step, p.backed_up));
    ensure!(at == Some((2, 0, true)), "{:?}", stopped.preempted);
    ensure!(stopped.epochs == [0, 1] && stopped.last("val_accuracy").is_some());

    // Without BackupAndRestore, fit still stops cleanly, and says nothing was saved.
    let mut alone = model()?;
    let stopped = fit_with(&mut alone, dir.path(), None, None, Some((0, 3)), 40)?;
    let preempted = stopped.preempted.clone().unwrap_or_else(|| Preempted {
        epoch: 9,
        step: 9,
        reason: String::new(),
        backed_up: true,
    });
    ensure!((preempted.epoch, preempted.step, preempted.backed_up) == (0, 4, false));
    ensure!(stopped.epochs.is_empty());
    ensure!(preempted.to_string().contains("no backup"), "{preempted}");
    Ok(())
}
