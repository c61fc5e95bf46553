//! `kandle-mpi-check`: the worker program behind the multi-worker tests, run by `mpirun`
//! (`strategies/tests/multi_worker.rs`, `.ci/mpi-tests.sh`).
//!
//! ```text
//! mpirun -n 2 kandle-mpi-check [--expect-world-size N] [--local-replicas L]
//!        [--replicas-on-worker R L] [--hierarchical] [--sync-batch-norm]
//!        [--communication auto|mpi|nccl] [--timeout-secs T]
//!        <world | equivalence --out FILE [--model plain|bn] [--samples S]
//!         | digits [--epochs E] [--min-accuracy A]
//!         | train [--epochs E] [--stall-worker R --stall-after-steps K]
//!         | resume --state FILE --out FILE
//!         | backup --dir DIR --out FILE [--epochs E] [--every N] [--keep-backups]
//!           [--step-millis MS]>
//! ```
//!
//! - `world` prints this worker's rank and the world size;
//! - `equivalence` runs the equivalence run of the strategy tests (`tests/support/
//!   equivalence_run.rs`, included here): the BN-free CNN (`plain`) or the CNN with batch norms
//!   (`bn`), one epoch on the first `S` digits (default 470) at a global batch of 24; the chief
//!   writes the weights to `FILE` (safetensors);
//! - `digits` trains a small CNN on the digits set and fails unless the test accuracy, evaluated
//!   across all workers, reaches `A` (default 0.97);
//! - `train` trains and prints each step, so a test can kill a worker; with `--stall-worker R`,
//!   worker `R` sleeps forever before step `K + 1`, and the others must fail naming it;
//! - `resume` trains the BN-free CNN [`RESUME_STEPS`] steps on global batches of 24 digits (each
//!   worker its share), saves the training state to `--state` (the chief writes), loads it on
//!   every worker into a model of other initial weights, trains as many steps more, and the
//!   chief writes the weights to `--out`;
//! - `backup` trains the digits CNN with Adam (`E` epochs, default 3, a validation set) with
//!   `BackupAndRestore` into `DIR` every `N` steps (default 4; `{rank}` in `DIR` becomes the
//!   worker's rank, for workers that do not share a directory), printing each step (pausing
//!   `MS` ms after it, so a test can kill the job mid-epoch); the chief writes the final
//!   training state to `--out`. Run again after a kill, it resumes; `--keep-backups` leaves the
//!   backup in place when the run completes.
//!
//! `--replicas-on-worker R L` gives worker `R` `L` local replicas instead, to test that workers
//! which disagree fail alike. Every worker prints `worker R/N pid P` first. On an error the program prints it and exits
//! with status 1, as any program using `MultiWorkerMirroredStrategy` should: after a failed
//! step the MPI job cannot continue.

use std::process::ExitCode;
use std::time::Duration;

use kandle::callbacks::{BackupAndRestore, Callback, SaveFreq};
use kandle::prelude::*;
use kandle_strategies::{CommunicationImplementation, CrossDeviceOps, MultiWorkerMirroredStrategy};

#[path = "../../tests/support/equivalence_run.rs"]
mod equivalence_run;
mod worker_program;

use worker_program::{number, Common};

#[derive(Debug, Default)]
struct Args {
    common: Common,
    expect_world_size: Option<usize>,
    local_replicas: usize,
    replicas_on_worker: Option<(usize, usize)>,
    hierarchical: bool,
    sync_batch_norm: bool,
    communication: CommunicationImplementation,
    state: Option<String>,
    dir: Option<String>,
    every: Option<usize>,
    keep_backups: bool,
    step_millis: u64,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        local_replicas: 1,
        ..Default::default()
    };
    args.common = worker_program::parse(
        &mut args,
        |args, arg, value| {
            match arg {
                "--expect-world-size" => args.expect_world_size = Some(number(arg, value()?)?),
                "--local-replicas" => args.local_replicas = number(arg, value()?)?,
                "--replicas-on-worker" => {
                    let rank = number(arg, value()?)?;
                    args.replicas_on_worker = Some((rank, number(arg, value()?)?));
                }
                "--hierarchical" => args.hierarchical = true,
                "--sync-batch-norm" => args.sync_batch_norm = true,
                "--communication" => {
                    args.communication = match value()?.as_str() {
                        "auto" => CommunicationImplementation::Auto,
                        "mpi" => CommunicationImplementation::Mpi,
                        "nccl" => CommunicationImplementation::Nccl,
                        other => {
                            return Err(Error::invalid(format!(
                                "--communication: `{other}` is not auto, mpi or nccl"
                            )))
                        }
                    }
                }
                "--state" => args.state = Some(value()?),
                "--dir" => args.dir = Some(value()?),
                "--every" => args.every = Some(number(arg, value()?)?),
                "--keep-backups" => args.keep_backups = true,
                "--step-millis" => args.step_millis = number(arg, value()?)?,
                "-h" | "--help" => {
                    return Err(Error::invalid(
                        "usage: kandle-mpi-check [--expect-world-size N] [--local-replicas L] \
                         [--replicas-on-worker R L] [--hierarchical] [--sync-batch-norm] \
                         [--communication auto|mpi|nccl] [--timeout-secs T] <world | \
                         equivalence --out FILE [--model plain|bn] [--samples S] | digits \
                         [--epochs E] [--min-accuracy A] | train [--epochs E] [--stall-worker R \
                         --stall-after-steps K] | resume --state FILE --out FILE | backup \
                         --dir DIR --out FILE [--epochs E] [--every N] [--keep-backups] \
                         [--step-millis MS]>",
                    ))
                }
                _ => return Ok(false),
            }
            Ok(true)
        },
        "world, equivalence, digits, train, resume or backup",
    )?;
    Ok(args)
}

/// A small CNN for the digits set.
fn digits_cnn() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(16, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(Conv2D::new(32, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Flatten)
        .add(Dense::new(64))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

/// Prints every training step, then pauses `pause`; on the stalling worker, sleeps forever
/// before step `after + 1`.
struct Steps {
    label: String,
    stall_after: Option<usize>,
    pause: Duration,
    done: usize,
}

impl Callback for Steps {
    fn on_train_batch_begin(&mut self, _batch: usize, _model: &mut Model) -> Result<()> {
        if self.stall_after == Some(self.done) {
            println!("{} stalling before step {}", self.label, self.done + 1);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        Ok(())
    }

    fn on_train_batch_end(
        &mut self,
        _batch: usize,
        _logs: &Logs,
        _model: &mut Model,
    ) -> Result<()> {
        self.done += 1;
        println!("{} finished step {}", self.label, self.done);
        std::thread::sleep(self.pause);
        Ok(())
    }
}

fn strategy(args: &Args) -> Result<MultiWorkerMirroredStrategy> {
    let strategy = MultiWorkerMirroredStrategy::from_env()?;
    let local = match args.replicas_on_worker {
        Some((rank, local)) if rank == strategy.worker().rank => local,
        _ => args.local_replicas,
    };
    let mut strategy = strategy
        .local_replicas_cpu(local)?
        .sync_batch_norm(args.sync_batch_norm)
        .communication(args.communication);
    if args.hierarchical {
        strategy = strategy.cross_device_ops(CrossDeviceOps::HierarchicalCopy);
    }
    if let Some(secs) = args.common.timeout_secs {
        strategy = strategy.timeout(worker_program::timeout(secs)?);
    }
    Ok(strategy)
}

/// Runs the task; an error message names the worker that reports it.
fn run(args: &Args) -> std::result::Result<(), String> {
    let strategy = strategy(args).map_err(|e| e.to_string())?;
    let worker = strategy.worker();
    let label = format!("worker {}/{}", worker.rank, worker.size);
    println!("{label} pid {}", std::process::id());
    let result = match args.expect_world_size {
        Some(expected) if worker.size != expected => Err(Error::Device(format!(
            "expected a world of {expected} workers but MPI reports {}: was this binary \
             started by the mpirun of the MPI library it was built against?",
            worker.size
        ))),
        _ => match args.common.task.as_str() {
            "world" => Ok(()),
            "equivalence" => equivalence(&strategy, args),
            "digits" => digits(&strategy, args, &label),
            "train" => train(&strategy, args, label.clone()),
            "resume" => resume(&strategy, args),
            "backup" => backup(&strategy, args, label.clone()),
            other => Err(Error::invalid(format!("unknown task `{other}`"))),
        },
    };
    result.map_err(|e| format!("{label}: {e}"))
}

fn equivalence(strategy: &MultiWorkerMirroredStrategy, args: &Args) -> Result<()> {
    let out = args.common.out()?;
    let net = args.common.equivalence_model()?;
    let model = equivalence_run::train(net, strategy, args.common.samples)?;
    model.save_weights(out)
}

/// Steps before the training state is saved, and as many after it is loaded.
const RESUME_STEPS: usize = 6;

fn resume(strategy: &MultiWorkerMirroredStrategy, args: &Args) -> Result<()> {
    let need = |v: &Option<String>, name: &str| {
        v.clone()
            .ok_or_else(|| Error::invalid(format!("resume needs {name} FILE")))
    };
    let (state, out) = (
        need(&args.state, "--state")?,
        need(&args.common.out, "--out")?,
    );
    let worker = strategy.worker();
    let global = equivalence_run::GLOBAL_BATCH;
    if global % worker.size != 0 {
        return Err(Error::invalid(format!(
            "{} workers do not divide the global batch of {global}",
            worker.size
        )));
    }
    let share = global / worker.size;
    let (x, y) = kandle::data::digits::load()?.to_tensors()?;
    let step = |model: &mut Model, i: usize| -> Result<()> {
        let start = i * global + worker.rank * share;
        model.train_on_batch(
            &x.narrow(0, start, share)?,
            &y.narrow(0, start, share)?,
            None,
        )?;
        Ok(())
    };
    let compile = |seed: u64| -> Result<Model> {
        let mut model = equivalence_run::plain_cnn()
            .compile(
                Sgd::new(0.05).momentum(0.9),
                SparseCategoricalCrossentropy::new(),
                [Accuracy],
                strategy,
            )?
            .with_seed(seed)?;
        model.build(&[1, 8, 8])?;
        Ok(model)
    };
    let mut first = compile(5)?;
    for i in 0..RESUME_STEPS {
        step(&mut first, i)?;
    }
    first.save(&state)?;
    // Every worker waits here until the chief has written the file.
    strategy.all_reduce_sum(&mut vec![0.0])?;
    drop(first);
    let mut resumed = compile(6)?;
    resumed.load(&state)?;
    for i in RESUME_STEPS..2 * RESUME_STEPS {
        step(&mut resumed, i)?;
    }
    resumed.save_weights(out)
}

/// The digits CNN with Adam, seeded, as `digits` and `backup` train it.
fn digits_model(strategy: &MultiWorkerMirroredStrategy) -> Result<Model> {
    digits_cnn()
        .compile(
            Adam::new(2e-3),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?
        .with_seed(1)
}

fn digits(strategy: &MultiWorkerMirroredStrategy, args: &Args, label: &str) -> Result<()> {
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = digits_model(strategy)?;
    let start = std::time::Instant::now();
    model.fit(
        &train,
        FitOptions {
            epochs: args.common.epochs.unwrap_or(15),
            batch_size_per_replica: 16,
            validation: Some(&test),
            verbosity: Verbosity::EpochLines,
            ..Default::default()
        },
    )?;
    let logs = model.evaluate(&test, 64)?;
    let accuracy = logs.get("accuracy").unwrap_or(0.0);
    println!(
        "{label} test accuracy {accuracy:.4} loss {:.4} after {:.1} s",
        logs.get("loss").unwrap_or(f64::NAN),
        start.elapsed().as_secs_f64()
    );
    if accuracy < args.common.min_accuracy {
        return Err(Error::invalid(format!(
            "test accuracy {accuracy:.4} is below {}",
            args.common.min_accuracy
        )));
    }
    Ok(())
}

fn train(strategy: &MultiWorkerMirroredStrategy, args: &Args, label: String) -> Result<()> {
    let data = kandle::data::digits::load()?;
    let mut model = digits_cnn().compile(
        Sgd::new(0.05),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        strategy,
    )?;
    let stall_after = (args.common.stall_worker == Some(strategy.worker().rank))
        .then_some(args.common.stall_after_steps);
    model.fit(
        &data,
        FitOptions {
            epochs: args.common.epochs.unwrap_or(1000),
            batch_size_per_replica: 8,
            verbosity: Verbosity::Silent,
            callbacks: vec![Steps {
                label,
                stall_after,
                pause: Duration::ZERO,
                done: 0,
            }
            .boxed()],
            ..Default::default()
        },
    )?;
    Ok(())
}

fn backup(strategy: &MultiWorkerMirroredStrategy, args: &Args, label: String) -> Result<()> {
    let (dir, out) = match (&args.dir, &args.common.out) {
        (Some(dir), Some(out)) => (dir, out),
        _ => return Err(Error::invalid("backup needs --dir DIR and --out FILE")),
    };
    let dir = dir.replace("{rank}", &strategy.worker().rank.to_string());
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = digits_model(strategy)?;
    let backups = BackupAndRestore::new(dir)
        .save_freq(SaveFreq::Steps(args.every.unwrap_or(4)))
        .delete_checkpoint(!args.keep_backups);
    model.fit(
        &train,
        FitOptions {
            epochs: args.common.epochs.unwrap_or(3),
            batch_size_per_replica: 16,
            validation: Some(&test),
            seed: Some(3),
            verbosity: Verbosity::Silent,
            callbacks: vec![
                backups.boxed(),
                Steps {
                    label,
                    stall_after: None,
                    pause: Duration::from_millis(args.step_millis),
                    done: 0,
                }
                .boxed(),
            ],
            ..Default::default()
        },
    )?;
    model.save(out)
}

fn main() -> ExitCode {
    worker_program::main("kandle-mpi-check", parse_args, run)
}
