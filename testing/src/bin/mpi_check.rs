//! `kandle-mpi-check`: the worker program behind the multi-worker tests, run by `mpirun`
//! (`testing/tests/multi_worker.rs`, `.ci/mpi-tests.sh`).
//!
//! ```text
//! mpirun -n 2 kandle-mpi-check [--expect-world-size N] [--local-replicas L]
//!        [--replicas-on-worker R L] [--hierarchical] [--sync-batch-norm]
//!        [--whole-buffer] [--communication auto|mpi|nccl] [--timeout-secs T]
//!        <world | equivalence --out FILE [--model plain|bn|graph|three-in-two-out] [--samples S] [--accumulate K] [--dtype-policy P]
//!         | digits [--epochs E] [--min-accuracy A]
//!         | train [--epochs E] [--stall-worker R --stall-after-steps K [--fail]]
//!         | resume --state FILE --out FILE
//!         | backup --dir DIR --out FILE [--epochs E] [--every N] [--keep-backups]
//!           [--step-millis MS]>
//! ```
//!
//! - `world` prints this worker's rank and the world size;
//! - `equivalence` runs the equivalence run of the strategy tests (`kandle_testing::strategies::
//!   equivalence_run`): the BN-free CNN (`plain`) or the CNN with batch norms
//!   (`bn`), one epoch on the first `S` digits (default 470) at a global batch of 24; the chief
//!   writes the weights to `FILE` (safetensors);
//! - `digits`, `train`, `resume` and `backup` are the tasks both worker programs run
//!   (`worker_program/tasks.rs`): digits to a test accuracy of `A` (default 0.97) evaluated
//!   across all workers; training that prints each step, so a test can kill a worker (with
//!   `--stall-worker R`, worker `R` sleeps forever before step `K + 1`, and the others must
//!   fail naming it, or it fails there with `--fail`); a save after 6 `train_on_batch` steps
//!   loaded by every worker into a fresh model for 6 more; `BackupAndRestore` into `DIR` every
//!   `N` steps, run again after a kill.
//!
//! `--replicas-on-worker R L` gives worker `R` `L` local replicas instead, to test that workers
//! which disagree fail alike. Every worker prints `worker R/N pid P` first. On an error the
//! program prints it and exits with status 1, as any program using
//! `MultiWorkerMirroredStrategy` should: after a failed step the MPI job cannot continue.

use std::process::ExitCode;

use kandle::prelude::*;
use kandle_strategies::{
    CommunicationImplementation, CrossDeviceOps, MultiWorkerMirroredStrategy, ReplicaOptions,
};

use kandle_testing::strategies::equivalence_run;
mod worker_program;

use worker_program::{number, tasks, Common};

#[derive(Debug, Default)]
struct Args {
    common: Common,
    expect_world_size: Option<usize>,
    local_replicas: usize,
    replicas_on_worker: Option<(usize, usize)>,
    hierarchical: bool,
    sync_batch_norm: bool,
    /// The gradients summed after the backward pass instead of in buckets during it.
    whole_buffer: bool,
    communication: CommunicationImplementation,
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
                "--whole-buffer" => args.whole_buffer = true,
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
                "-h" | "--help" => {
                    return Err(Error::invalid(
                        "usage: kandle-mpi-check [--expect-world-size N] [--local-replicas L] \
                         [--replicas-on-worker R L] [--hierarchical] [--sync-batch-norm] \
                         [--whole-buffer] [--communication auto|mpi|nccl] [--timeout-secs T] <world | \
                         equivalence --out FILE [--model plain|bn|graph|three-in-two-out] [--samples S] \
                         [--accumulate K] [--dtype-policy P] | digits [--epochs E] \
                         [--min-accuracy A] | train [--epochs E] [--stall-worker R \
                         --stall-after-steps K [--fail]] | resume --state FILE --out FILE | backup \
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

fn strategy(args: &Args) -> Result<MultiWorkerMirroredStrategy> {
    let strategy = MultiWorkerMirroredStrategy::from_env()?;
    let local = match args.replicas_on_worker {
        Some((rank, local)) if rank == strategy.worker().rank => local,
        _ => args.local_replicas,
    };
    let mut strategy = strategy
        .local_replicas_cpu(local)?
        .communication(args.communication);
    if args.hierarchical {
        strategy = strategy.cross_device_ops(CrossDeviceOps::HierarchicalCopy);
    }
    let mut options = ReplicaOptions::default().sync_batch_norm(args.sync_batch_norm);
    if args.whole_buffer {
        options = options.gradient_buckets(None);
    }
    if let Some(secs) = args.common.timeout_secs {
        options = options.timeout(worker_program::timeout(secs)?);
    }
    Ok(strategy.with_options(options))
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
            "equivalence" => tasks::equivalence(&strategy, &args.common),
            "digits" => tasks::digits(&strategy, &args.common, &label, false),
            "train" => {
                let stalls = args.common.stall_worker == Some(worker.rank);
                tasks::train(&strategy, &args.common, &label, stalls)
            }
            "resume" => tasks::resume(&strategy, &args.common),
            "backup" => tasks::backup(&strategy, &args.common, &label),
            other => Err(Error::invalid(format!("unknown task `{other}`"))),
        },
    };
    result.map_err(|e| format!("{label}: {e}"))
}

fn main() -> ExitCode {
    worker_program::main("kandle-mpi-check", parse_args, run)
}
