//! `kandle-ps-check`: the program behind the parameter-server tests, run by `mpirun` on every
//! rank, workers and servers alike (`testing/tests/parameter_server.rs`,
//! `.ci/mpi-tests.sh`).
//!
//! ```text
//! mpirun -n W+P kandle-ps-check [--num-ps P] [--sync] [--max-staleness K] [--timeout-secs T]
//!        <equivalence --out FILE [--samples S] [--model plain|bn|graph|three-in-two-out] [--accumulate K] [--dtype-policy P]
//!         | digits [--epochs E] [--min-accuracy A]
//!         | staleness [--epochs E] [--compute-ms C] [--slow-worker R --slow-ms M]
//!         | train [--stall-worker R --stall-after-steps K [--fail]]
//!         | resume --state FILE --out FILE
//!         | backup --dir DIR --out FILE [--epochs E] [--every N] [--keep-backups]
//!           [--step-millis MS]
//!         | mismatch>
//! ```
//!
//! - `equivalence` runs the equivalence run of the strategy tests (`kandle_testing::strategies::
//!   equivalence_run`); the chief writes the weights to `FILE`, and each
//!   server rank `R` the weights it holds after `fit` to `FILE.rankR`;
//! - `staleness` trains on digits with every worker sleeping `C` ms before each step (a stand-in
//!   for computation) and worker `R` `M` ms; every worker prints each epoch's loss, and the
//!   chief each epoch's `staleness_mean` and `staleness_max`;
//! - `digits`, `train`, `resume` and `backup` are the tasks both worker programs run
//!   (`worker_program/tasks.rs`): digits to a test accuracy of `A` (default 0.97), evaluated
//!   over every worker on the servers' weights; training that prints each step, so a test can
//!   stop or kill a rank (with `--stall-worker R`, worker `R` sleeps forever before step
//!   `K + 1`, or fails there with `--fail`); a save after 6 `train_on_batch` steps loaded by every rank into a fresh model for
//!   6 more; `BackupAndRestore` into `DIR` every `N` steps, run again after a kill;
//! - `mismatch` builds a model whose last layer is wider on worker 1 than elsewhere.
//!
//! Every rank prints `rank R/N <role> pid P` first. On an error the program prints it, prefixed
//! by its rank, and exits with status 1.

use std::process::ExitCode;
use std::time::Duration;

use kandle::prelude::*;
use kandle_strategies::ParameterServerStrategy;

use kandle_testing::strategies::equivalence_run;
mod worker_program;

use worker_program::{number, tasks, Common};

#[derive(Debug, Default)]
struct Args {
    common: Common,
    num_ps: usize,
    sync: bool,
    max_staleness: Option<u64>,
    slow_worker: Option<usize>,
    slow_ms: u64,
    compute_ms: u64,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        num_ps: 1,
        ..Default::default()
    };
    args.common = worker_program::parse(
        &mut args,
        |args, arg, value| {
            match arg {
                "--num-ps" => args.num_ps = number(arg, value()?)?,
                "--sync" => args.sync = true,
                "--max-staleness" => args.max_staleness = Some(number(arg, value()?)?),
                "--slow-worker" => args.slow_worker = Some(number(arg, value()?)?),
                "--slow-ms" => args.slow_ms = number(arg, value()?)?,
                "--compute-ms" => args.compute_ms = number(arg, value()?)?,
                _ => return Ok(false),
            }
            Ok(true)
        },
        "equivalence, digits, staleness, train, resume, backup or mismatch",
    )?;
    Ok(args)
}

fn strategy(args: &Args) -> Result<ParameterServerStrategy> {
    let mut strategy = ParameterServerStrategy::from_env()?.num_ps(args.num_ps);
    if args.sync {
        strategy = strategy.synchronous();
    }
    if let Some(k) = args.max_staleness {
        strategy = strategy.max_staleness(k);
    }
    if let Some(secs) = args.common.timeout_secs {
        strategy = strategy.timeout(worker_program::timeout(secs)?);
    }
    Ok(strategy)
}

fn run(args: &Args) -> std::result::Result<(), String> {
    let strategy = strategy(args).map_err(|e| e.to_string())?;
    let rank = strategy.worker().rank;
    let size = strategy.workers() + strategy.servers();
    let role = if strategy.is_server() {
        "server"
    } else {
        "worker"
    };
    let label = format!("rank {rank}/{size}");
    println!("{label} {role} pid {}", std::process::id());
    let result = match args.common.task.as_str() {
        "equivalence" => equivalence(&strategy, args),
        "digits" => tasks::digits(&strategy, &args.common, &label, strategy.is_server()),
        "staleness" => staleness(&strategy, args, &label),
        "train" => {
            let stalls = !strategy.is_server() && args.common.stall_worker == Some(rank);
            tasks::train(&strategy, &args.common, &label, stalls)
        }
        "resume" => tasks::resume(&strategy, &args.common),
        "backup" => tasks::backup(&strategy, &args.common, &label),
        "mismatch" => mismatch(&strategy),
        other => Err(Error::invalid(format!("unknown task `{other}`"))),
    };
    result.map_err(|e| format!("{label}: {e}"))
}

fn equivalence(strategy: &ParameterServerStrategy, args: &Args) -> Result<()> {
    let out = args.common.out()?;
    let net = args.common.equivalence_model()?;
    let (samples, k) = (args.common.samples, args.common.accumulate);
    let policy = args.common.dtype_policy;
    if strategy.is_server() {
        // A server ends the call holding every server's final variables: it writes them too.
        let model = equivalence_run::fit_with(net, strategy, samples, k, policy)?.0;
        let rank = strategy.worker().rank;
        return kandle::checkpoint::save(&model.get_weights()?, format!("{out}.rank{rank}"));
    }
    tasks::equivalence(strategy, &args.common)
}

fn staleness(strategy: &ParameterServerStrategy, args: &Args, label: &str) -> Result<()> {
    let data = kandle::data::digits::load()?;
    let data = data.subset(&(0..480).collect::<Vec<_>>())?;
    let mut model = tasks::digits_model(strategy, 10)?;
    let ms = if args.slow_worker == Some(strategy.worker().rank) {
        args.slow_ms
    } else {
        args.compute_ms
    };
    let history = model.fit(
        &data,
        FitOptions {
            epochs: args.common.epochs.unwrap_or(1),
            batch_size_per_replica: 8,
            verbosity: Verbosity::Silent,
            callbacks: vec![tasks::Steps {
                label: label.to_string(),
                before: Duration::from_millis(ms),
                quiet: true,
                ..Default::default()
            }
            .boxed()],
            ..Default::default()
        },
    )?;
    if !strategy.is_server() {
        // Every worker's epoch logs cover every worker's steps: the same on each.
        for (epoch, loss) in history.series("loss").iter().enumerate() {
            println!("{label} epoch {epoch} loss {loss:?}");
        }
    }
    if strategy.worker().is_chief() {
        for (epoch, (mean, max)) in history
            .series("staleness_mean")
            .iter()
            .zip(history.series("staleness_max"))
            .enumerate()
        {
            println!("{label} epoch {epoch} staleness mean {mean:.3} max {max}");
        }
    }
    Ok(())
}

/// Worker 1 builds a model with 11 classes, the other ranks one with 10.
fn mismatch(strategy: &ParameterServerStrategy) -> Result<()> {
    let classes = if !strategy.is_server() && strategy.worker().rank == 1 {
        11
    } else {
        10
    };
    let mut model = tasks::digits_model(strategy, classes)?;
    model.build(&[1, 8, 8])
}

fn main() -> ExitCode {
    worker_program::main("kandle-ps-check", parse_args, run)
}
