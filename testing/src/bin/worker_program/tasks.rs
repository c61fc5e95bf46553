//! The tasks both worker programs run under any strategy: the digits CNN and its training,
//! a step-printing callback that tests watch (and can make slow or stall), a save and resume
//! through `train_on_batch`, and a run with `BackupAndRestore`.

use std::path::Path;
use std::time::{Duration, Instant};

use kandle::callbacks::{BackupAndRestore, Callback, SaveFreq};
use kandle::preemption::StopSignal;
use kandle::prelude::*;

use super::Common;
use crate::equivalence_run;

/// A small CNN for the digits set, with `classes` outputs.
pub fn digits_cnn(classes: usize) -> Sequential {
    Sequential::new()
        .add(Conv2D::new(16, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(Conv2D::new(32, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Flatten)
        .add(Dense::new(64))
        .add(Activation::Relu)
        .add(Dense::new(classes))
        .add(Activation::Softmax)
}

/// The digits CNN with Adam, seeded, as `digits` and `backup` train it.
pub fn digits_model<S: Strategy + Clone + 'static>(strategy: &S, classes: usize) -> Result<Model> {
    digits_cnn(classes)
        .compile(
            Adam::new(2e-3),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?
        .with_seed(1)
}

/// Prints `<label> finished step N` after every step (unless `quiet`), sleeping `before` ahead
/// of each step and `after` once it is printed; sleeps forever before step `stall_after + 1`,
/// or fails there when `fail`.
#[derive(Default)]
pub struct Steps {
    pub label: String,
    pub before: Duration,
    pub after: Duration,
    pub stall_after: Option<usize>,
    pub fail: bool,
    pub quiet: bool,
    pub done: usize,
}

impl Callback for Steps {
    fn on_train_batch_begin(&mut self, _batch: usize, _model: &mut Model) -> Result<()> {
        if self.stall_after == Some(self.done) && self.fail {
            return Err(Error::invalid(format!(
                "failing on purpose before step {}",
                self.done + 1
            )));
        }
        if self.stall_after == Some(self.done) {
            println!("{} stalling before step {}", self.label, self.done + 1);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        std::thread::sleep(self.before);
        Ok(())
    }

    fn on_train_batch_end(
        &mut self,
        _batch: usize,
        _logs: &Logs,
        _model: &mut Model,
    ) -> Result<()> {
        self.done += 1;
        if !self.quiet {
            println!("{} finished step {}", self.label, self.done);
        }
        std::thread::sleep(self.after);
        Ok(())
    }
}

/// Trains the digits CNN and fails unless the test accuracy, evaluated over every worker,
/// reaches `--min-accuracy`. A process that `serves` the others has no accuracy to check.
pub fn digits<S: Strategy + Clone + 'static>(
    strategy: &S,
    common: &Common,
    label: &str,
    serves: bool,
) -> Result<()> {
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = digits_model(strategy, 10)?;
    let start = Instant::now();
    model.fit(
        &train,
        FitOptions {
            epochs: common.epochs.unwrap_or(15),
            batch_size_per_replica: 16,
            validation: Some(&test),
            verbosity: Verbosity::EpochLines,
            ..Default::default()
        },
    )?;
    let logs = model.evaluate(&test, 64)?;
    if serves {
        return Ok(());
    }
    let accuracy = logs.get("accuracy").unwrap_or(0.0);
    println!(
        "{label} test accuracy {accuracy:.4} loss {:.4} after {:.1} s",
        logs.get("loss").unwrap_or(f64::NAN),
        start.elapsed().as_secs_f64()
    );
    if accuracy < common.min_accuracy {
        return Err(Error::invalid(format!(
            "test accuracy {accuracy:.4} is below {}",
            common.min_accuracy
        )));
    }
    Ok(())
}

/// Trains for long (SGD), printing every step, so a test can stop or kill a process; when
/// `stalls`, this worker stalls after `--stall-after-steps` (or fails there, with `--fail`).
pub fn train<S: Strategy + Clone + 'static>(
    strategy: &S,
    common: &Common,
    label: &str,
    stalls: bool,
) -> Result<()> {
    let data = kandle::data::digits::load()?;
    let mut model = digits_cnn(10).compile(
        Sgd::new(0.05),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        strategy,
    )?;
    model.fit(
        &data,
        FitOptions {
            epochs: common.epochs.unwrap_or(1000),
            batch_size_per_replica: 8,
            verbosity: Verbosity::Silent,
            callbacks: vec![Steps {
                label: label.to_string(),
                stall_after: stalls.then_some(common.stall_after_steps),
                fail: common.fail,
                ..Default::default()
            }
            .boxed()],
            ..Default::default()
        },
    )?;
    Ok(())
}

/// The equivalence run of the strategy tests on the model `--model` names (`--samples`,
/// `--accumulate`, `--dtype-policy`); every process saves the weights to `--out`, the chief
/// writes.
pub fn equivalence<S: Strategy + Clone + 'static>(strategy: &S, common: &Common) -> Result<()> {
    let net = common.equivalence_model()?;
    let (samples, k) = (common.samples, common.accumulate);
    let model = equivalence_run::train_with(net, strategy, samples, k, common.dtype_policy)?;
    model.save_weights(common.out()?)
}

/// Steps before the training state is saved, and as many after it is loaded.
pub const RESUME_STEPS: usize = 6;

/// Trains the BN-free CNN [`RESUME_STEPS`] steps with `train_on_batch` on global batches of
/// 24 digits (each worker its share), saves the training state to `--state` (every process
/// takes part; the chief writes), loads it on every process into a model of other initial
/// weights once the file is there, trains as many steps more, and saves the weights to `--out`.
pub fn resume<S: Strategy + Clone + 'static>(strategy: &S, common: &Common) -> Result<()> {
    let state = common.path("--state", &common.state)?;
    let out = common.out()?;
    // Each process reads its part of every global batch (the stages of a pipeline share one).
    let (index, parts) = strategy.data_shard().unwrap_or((0, 1));
    let global = equivalence_run::GLOBAL_BATCH;
    if !global.is_multiple_of(parts) {
        return Err(Error::invalid(format!(
            "{parts} parts do not divide the global batch of {global}"
        )));
    }
    let share = global / parts;
    // A parameter server's rank is past the workers': it passes the chief's part, unused.
    let part = if index < parts { index } else { 0 };
    let (x, y) = kandle::data::digits::load()?.to_tensors()?;
    let step = |model: &mut Model, i: usize| -> Result<()> {
        let start = i * global + part * share;
        model.train_on_batch(
            &x.narrow(0, start, share)?,
            &y.narrow(0, start, share)?,
            None,
        )?;
        Ok(())
    };
    let compile = |seed: u64| {
        let sgd = Sgd::new(0.05).momentum(0.9);
        equivalence_run::compile(equivalence_run::plain_cnn(), sgd, strategy, seed)
    };
    let mut first = compile(5)?;
    for i in 0..RESUME_STEPS {
        step(&mut first, i)?;
    }
    first.save(state)?;
    drop(first);
    wait_for_file(Path::new(state), common.timeout()?)?;
    let mut resumed = compile(6)?;
    resumed.load(state)?;
    for i in RESUME_STEPS..2 * RESUME_STEPS {
        step(&mut resumed, i)?;
    }
    resumed.save_weights(out)
}

/// Waits until the chief's atomic write of `path` has put it in place (it appears whole).
fn wait_for_file(path: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if Instant::now() > deadline {
            return Err(Error::invalid(format!(
                "`{}` did not appear within {timeout:?}",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Trains the digits CNN with Adam (`--epochs`, default 3, with a validation set) and
/// `BackupAndRestore` into `--dir` every `--every` steps (default 4; `{rank}` in the directory
/// becomes the process's rank, for processes that do not share one), printing each step and
/// pausing `--step-millis` after it; saves the final training state to `--out` (every process
/// takes part; the chief writes). Run again after a kill, it resumes; `--keep-backups` leaves
/// the backup in place when the run completes. SIGTERM or SIGINT on any process stops every
/// worker after the same step, with a backup there: each prints `<label> stopped by ...` and
/// exits with status 75. A finished run prints `<label> val_accuracy A`.
pub fn backup<S: Strategy + Clone + 'static>(
    strategy: &S,
    common: &Common,
    label: &str,
) -> Result<()> {
    let dir = common.path("--dir", &common.dir)?;
    let out = common.out()?;
    let dir = dir.replace("{rank}", &strategy.worker().rank.to_string());
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = digits_model(strategy, 10)?;
    let backups = BackupAndRestore::new(dir)
        .save_freq(SaveFreq::Steps(common.every.unwrap_or(4)))
        .delete_checkpoint(!common.keep_backups);
    let history = model.fit(
        &train,
        FitOptions {
            epochs: common.epochs.unwrap_or(3),
            batch_size_per_replica: 16,
            validation: Some(&test),
            seed: Some(3),
            verbosity: Verbosity::Silent,
            callbacks: vec![
                backups.boxed(),
                Steps {
                    label: label.to_string(),
                    after: Duration::from_millis(common.step_millis),
                    ..Default::default()
                }
                .boxed(),
            ],
            stop_signal: Some(StopSignal::on_signals(None)?),
            ..Default::default()
        },
    )?;
    if let Some(preempted) = model.preempted() {
        // As the example programs: say where, and leave at once with their status.
        println!("{label} {preempted}");
        std::process::exit(kandle::preemption::EXIT_PREEMPTED);
    }
    if let Some(accuracy) = history.last("val_accuracy") {
        println!("{label} val_accuracy {accuracy}");
    }
    model.save(out)
}
