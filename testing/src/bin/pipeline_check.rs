//! `kandle-pipeline-check`: the program every rank runs in the pipeline tests over MPI
//! (`testing/tests/pipeline_mpi.rs`), under `mpirun`.
//!
//! ```text
//! mpirun -n S*R kandle-pipeline-check [--replicas-per-stage R] [--stage-starts a,b]
//!        [--micro-batches M] [--schedule gpipe|1f1b] [--timeout-secs T]
//!        <equivalence --out FILE [--model plain|bn] [--samples S] [--accumulate K]
//!         | digits [--epochs E] [--min-accuracy A]
//!         | train [--epochs E] [--stall-worker R --stall-after-steps K [--fail]]
//!         | resume --state FILE --out FILE
//!         | backup --dir DIR --out FILE [--epochs E] [--every N] [--keep-backups]
//!         | checkpoints --dir DIR --out FILE>
//! ```
//!
//! Each rank holds one stage (`PipelineStrategy::from_env`), `R` replicas per stage make a mesh.
//! - `equivalence` runs the strategy tests' equivalence run; every rank saves the weights to
//!   `FILE` (the chief writes, gathering the other stages');
//! - `digits`, `train`, `resume` and `backup` are the tasks of the other worker programs
//!   (`worker_program/tasks.rs`);
//! - `checkpoints` trains the digits CNN for two epochs with `ModelCheckpoint` writing
//!   `DIR/epoch_01.safetensors` and `DIR/epoch_02.safetensors` (a callback of the chief alone, which gathers
//!   the other stages' weights while they wait in the next epoch), then saves the weights to
//!   `FILE`.
//!
//! Every rank prints `rank R/N pid P` first; an error is printed and the status is 1.

use std::process::ExitCode;

use kandle::callbacks::ModelCheckpoint;
use kandle::prelude::*;
use kandle_strategies::pipeline::{PipelineStrategy, Schedule, StageSplit};
use kandle_strategies::ReplicaOptions;

use kandle_testing::strategies::equivalence_run;
mod worker_program;

use worker_program::{number, tasks, Common};

#[derive(Debug, Default)]
struct Args {
    common: Common,
    replicas_per_stage: Option<usize>,
    stage_starts: Vec<String>,
    micro_batches: Option<usize>,
    schedule: Schedule,
}

fn parse_args() -> Result<Args> {
    let mut args = Args::default();
    args.common = worker_program::parse(
        &mut args,
        |args, arg, value| {
            match arg {
                "--replicas-per-stage" => args.replicas_per_stage = Some(number(arg, value()?)?),
                "--stage-starts" => {
                    args.stage_starts = value()?.split(',').map(str::to_string).collect()
                }
                "--micro-batches" => args.micro_batches = Some(number(arg, value()?)?),
                "--schedule" => args.schedule = value()?.parse()?,
                _ => return Ok(false),
            }
            Ok(true)
        },
        "equivalence, digits, train, resume, backup or checkpoints",
    )?;
    Ok(args)
}

fn strategy(args: &Args) -> Result<PipelineStrategy> {
    let mut strategy = PipelineStrategy::from_env()?.schedule(args.schedule);
    if let Some(r) = args.replicas_per_stage {
        strategy = strategy.replicas_per_stage(r)?;
    }
    if let Some(m) = args.micro_batches {
        strategy = strategy.micro_batches(m);
    }
    if !args.stage_starts.is_empty() {
        strategy = strategy.split(StageSplit::at(args.stage_starts.iter().cloned()));
    }
    Ok(strategy.with_options(ReplicaOptions::default().timeout(args.common.timeout()?)))
}

fn run(args: &Args) -> std::result::Result<(), String> {
    let strategy = strategy(args).map_err(|e| e.to_string())?;
    let worker = strategy.worker();
    let label = format!("rank {}/{}", worker.rank, worker.size);
    println!("{label} pid {}", std::process::id());
    let result = match args.common.task.as_str() {
        "equivalence" => tasks::equivalence(&strategy, &args.common),
        "digits" => tasks::digits(&strategy, &args.common, &label, false),
        "train" => {
            let stalls = args.common.stall_worker == Some(worker.rank);
            tasks::train(&strategy, &args.common, &label, stalls)
        }
        "resume" => tasks::resume(&strategy, &args.common),
        "backup" => tasks::backup(&strategy, &args.common, &label),
        "checkpoints" => checkpoints(&strategy, &args.common),
        other => Err(Error::invalid(format!("unknown task `{other}`"))),
    };
    result.map_err(|e| format!("{label}: {e}"))
}

fn checkpoints(strategy: &PipelineStrategy, common: &Common) -> Result<()> {
    let dir = common.path("--dir", &common.dir)?;
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = tasks::digits_model(strategy, 10)?;
    let every_epoch = ModelCheckpoint::new(format!("{dir}/epoch_{{epoch}}.safetensors"));
    model.fit(
        &train,
        FitOptions {
            epochs: 2,
            batch_size_per_replica: 16,
            validation: Some(&test),
            seed: Some(3),
            verbosity: Verbosity::Silent,
            callbacks: vec![every_epoch.boxed()],
            ..Default::default()
        },
    )?;
    model.save_weights(common.out()?)
}

fn main() -> ExitCode {
    worker_program::main("kandle-pipeline-check", parse_args, run)
}
