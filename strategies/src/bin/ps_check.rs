//! `kandle-ps-check`: the program behind the parameter-server tests, run by `mpirun` on every
//! rank, workers and servers alike (`strategies/tests/parameter_server.rs`,
//! `.ci/mpi-tests.sh`).
//!
//! ```text
//! mpirun -n W+P kandle-ps-check [--num-ps P] [--sync] [--max-staleness K] [--timeout-secs T]
//!        <equivalence --out FILE [--samples S] [--model plain|bn]
//!         | digits [--epochs E] [--min-accuracy A]
//!         | staleness [--epochs E] [--compute-ms C] [--slow-worker R --slow-ms M]
//!         | train [--stall-worker R --stall-after-steps K]
//!         | mismatch>
//! ```
//!
//! - `equivalence` runs the equivalence run of the strategy tests (`tests/support/
//!   equivalence_run.rs`, included here); the chief writes the weights to `FILE`, and each
//!   server rank `R` the weights it holds after `fit` to `FILE.rankR`;
//! - `digits` trains a small CNN on the digits set and fails unless the test accuracy, evaluated
//!   over every worker on the servers' weights, reaches `A` (default 0.97);
//! - `staleness` trains on digits with every worker sleeping `C` ms before each step (a stand-in
//!   for computation) and worker `R` `M` ms, and the chief prints each epoch's
//!   `staleness_mean` and `staleness_max`;
//! - `train` trains for long and prints each step, so a test can stop or kill a rank; with
//!   `--stall-worker R`, worker `R` sleeps forever before step `K + 1`;
//! - `mismatch` builds a model whose last layer is wider on worker 1 than elsewhere.
//!
//! Every rank prints `rank R/N <role> pid P` first. On an error the program prints it, prefixed
//! by its rank, and exits with status 1.

use std::process::ExitCode;
use std::time::Duration;

use kandle::callbacks::Callback;
use kandle::prelude::*;
use kandle_strategies::ParameterServerStrategy;

#[path = "../../tests/support/equivalence_run.rs"]
mod equivalence_run;
mod worker_program;

use worker_program::{number, Common};

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
        "equivalence, digits, staleness, train or mismatch",
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

/// A small CNN for the digits set.
fn digits_cnn(classes: usize) -> Sequential {
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

/// Prints every step; sleeps before each step on a slow worker, forever on a stalling one.
struct Steps {
    label: String,
    slow: Option<Duration>,
    stall_after: Option<usize>,
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
        if let Some(slow) = self.slow {
            std::thread::sleep(slow);
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
        if self.stall_after.is_some() || self.slow.is_none() {
            println!("{} finished step {}", self.label, self.done);
        }
        Ok(())
    }
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
        "digits" => digits(&strategy, args, &label),
        "staleness" => staleness(&strategy, args, &label),
        "train" => train(&strategy, args, &label),
        "mismatch" => mismatch(&strategy),
        other => Err(Error::invalid(format!("unknown task `{other}`"))),
    };
    result.map_err(|e| format!("{label}: {e}"))
}

fn equivalence(strategy: &ParameterServerStrategy, args: &Args) -> Result<()> {
    let out = args.common.out()?;
    let net = args.common.equivalence_model()?;
    if strategy.is_server() {
        // A server ends the call holding every server's final variables: it writes them too.
        let model = equivalence_run::fit(net, strategy, args.common.samples)?.0;
        let rank = strategy.worker().rank;
        return kandle::checkpoint::save(&model.get_weights()?, format!("{out}.rank{rank}"));
    }
    let model = equivalence_run::train(net, strategy, args.common.samples)?;
    model.save_weights(out)
}

fn compile(strategy: &ParameterServerStrategy, classes: usize) -> Result<Model> {
    digits_cnn(classes)
        .compile(
            Adam::new(2e-3),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?
        .with_seed(1)
}

fn digits(strategy: &ParameterServerStrategy, args: &Args, label: &str) -> Result<()> {
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = compile(strategy, 10)?;
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
    if strategy.is_server() {
        return Ok(());
    }
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

fn staleness(strategy: &ParameterServerStrategy, args: &Args, label: &str) -> Result<()> {
    let data = kandle::data::digits::load()?;
    let data = data.subset(&(0..480).collect::<Vec<_>>())?;
    let mut model = compile(strategy, 10)?;
    let ms = if args.slow_worker == Some(strategy.worker().rank) {
        args.slow_ms
    } else {
        args.compute_ms
    };
    let slow = Some(Duration::from_millis(ms));
    let history = model.fit(
        &data,
        FitOptions {
            epochs: args.common.epochs.unwrap_or(1),
            batch_size_per_replica: 8,
            verbosity: Verbosity::Silent,
            callbacks: vec![Steps {
                label: label.to_string(),
                slow,
                stall_after: None,
                done: 0,
            }
            .boxed()],
            ..Default::default()
        },
    )?;
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

fn train(strategy: &ParameterServerStrategy, args: &Args, label: &str) -> Result<()> {
    let data = kandle::data::digits::load()?;
    let mut model = digits_cnn(10).compile(
        Sgd::new(0.05),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        strategy,
    )?;
    let stall_after = (!strategy.is_server()
        && args.common.stall_worker == Some(strategy.worker().rank))
    .then_some(args.common.stall_after_steps);
    model.fit(
        &data,
        FitOptions {
            epochs: args.common.epochs.unwrap_or(1000),
            batch_size_per_replica: 8,
            verbosity: Verbosity::Silent,
            callbacks: vec![Steps {
                label: label.to_string(),
                slow: None,
                stall_after,
                done: 0,
            }
            .boxed()],
            ..Default::default()
        },
    )?;
    Ok(())
}

/// Worker 1 builds a model with 11 classes, the other ranks one with 10.
fn mismatch(strategy: &ParameterServerStrategy) -> Result<()> {
    let classes = if !strategy.is_server() && strategy.worker().rank == 1 {
        11
    } else {
        10
    };
    let mut model = compile(strategy, classes)?;
    model.build(&[1, 8, 8])
}

fn main() -> ExitCode {
    worker_program::main("kandle-ps-check", parse_args, run)
}
