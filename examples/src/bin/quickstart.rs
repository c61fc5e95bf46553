//! Trains a small CNN on the bundled digits set on the CPU: progress on stderr, the training
//! curves in `plots/quickstart.png`, the best weights in `checkpoints/quickstart.safetensors`.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin quickstart
//! cargo run --release -p kandle-examples --bin quickstart -- --strategy mirrored --replicas 2
//! mpirun -n 2 target/release/quickstart --strategy multi-worker   # built with --features mpi
//! mpirun -n 3 target/release/quickstart --strategy parameter-server   # 2 workers, 1 server
//! cargo run --release -p kandle-examples --bin quickstart -- --backup-dir backups/quickstart
//! ```
//!
//! With `--backup-dir`, running the same command again after a crash resumes where the last
//! backup was taken, and says so on its first line. SIGTERM or Ctrl-C stops it after the
//! current step with a backup there, a line saying so, and exit status 75 (a second signal, or
//! `--grace-seconds` passing, ends it at once). With `--epochs 0` it trains nothing (as
//! Keras's `fit` with `epochs=0`), writes no checkpoint, plot or CSV, and says so.
//! `--batch-size` is the global batch: a multiple of the replicas in sync, which share it.

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};
use kandle::callbacks::{CsvLogger, ModelCheckpoint, PlotHistory};
use kandle::prelude::*;
use kandle_examples::{BackupArgs, MonitorArgs, PipelineArgs, PrecisionArgs, PsArgs, StrategyKind};

#[derive(Parser, Debug)]
#[command(about = "Train a small CNN on the digits set and plot its curves")]
struct Args {
    /// Epochs to train (0 trains nothing and writes no checkpoint, plot or CSV).
    #[arg(long, default_value_t = 12)]
    epochs: usize,
    /// How training is distributed.
    #[arg(long, value_enum, default_value_t = StrategyKind::OneDevice)]
    strategy: StrategyKind,
    /// Replicas (per worker for multi-worker): GPUs when built with the cuda feature, else CPU replicas.
    #[arg(long, default_value_t = 1, value_parser = kandle_examples::at_least_one())]
    replicas: usize,
    /// Samples per step across all replicas: a multiple of the number of replicas, which share
    /// each batch equally.
    #[arg(long, default_value_t = 32, value_parser = kandle_examples::at_least_one())]
    batch_size: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Where the PNG goes.
    #[arg(long, default_value = "plots/quickstart.png")]
    plot: String,
    /// Where the best weights go.
    #[arg(long, default_value = "checkpoints/quickstart.safetensors")]
    checkpoint: String,
    /// Seed for the split, the weights and the shuffling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also write the final training state (weights and optimizer state, as Model::save writes it) here.
    #[arg(long)]
    save: Option<std::path::PathBuf>,
    #[command(flatten)]
    precision: PrecisionArgs,
    #[command(flatten)]
    backup: BackupArgs,
    #[command(flatten)]
    monitor: MonitorArgs,
    #[command(flatten)]
    ps: PsArgs,
    #[command(flatten)]
    pipeline: PipelineArgs,
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    let strategy = kandle_examples::build_strategy_with(
        args.strategy,
        args.replicas,
        &args.ps,
        &args.pipeline,
    )?;
    let replicas = strategy.num_replicas_in_sync();
    if args.batch_size % replicas != 0 {
        bail!(
            "--batch-size {} does not split evenly over the {replicas} replicas in sync: use a \
             multiple of {replicas}",
            args.batch_size
        );
    }
    let backup = args.backup.callback(&strategy);
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, args.seed)?;
    let model = kandle_models::digits_cnn(10)
        .compile(
            Adam::new(args.lr)
                .gradient_accumulation_steps(args.precision.gradient_accumulation_steps),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &strategy,
        )?
        .with_seed(args.seed)?;
    let mut model = args.precision.apply(model)?;
    model.build(&[1, 8, 8])?;
    if model.is_chief() {
        println!("{}", model.summary()?);
    }
    let csv = std::path::Path::new(&args.plot).with_extension("csv");
    let mut callbacks = vec![
        LearningRateScheduler::new(CosineDecay::new(args.lr, args.epochs)).boxed(),
        ModelCheckpoint::new(&args.checkpoint)
            .monitor("val_accuracy")
            .save_best_only(true)
            .boxed(),
        CsvLogger::new(&csv).boxed(),
        PlotHistory::new(&args.plot)
            .title("Small CNN on digits")
            .boxed(),
    ];
    callbacks.extend(args.monitor.callbacks());
    callbacks.extend(backup.map(Callback::boxed));
    let history = model.fit(
        &train,
        FitOptions {
            epochs: args.epochs,
            batch_size_per_replica: args.batch_size / replicas,
            validation: Some(&test),
            seed: Some(args.seed),
            callbacks,
            stop_signal: Some(args.backup.stop_signal()?),
            ..Default::default()
        },
    )?;
    kandle_examples::exit_if_preempted(&history, model.is_chief());
    if let Some(path) = &args.save {
        model.save(path)?;
    }
    // Every worker evaluates (the sums are reduced across workers); the chief reports.
    let logs = model.evaluate(&test, 256)?;
    if model.is_chief() {
        println!(
            "final model: test loss {:.4}, test accuracy {:.2}% after {} epochs under {} ({} replicas)",
            logs.get("loss").unwrap_or(f64::NAN),
            100.0 * logs.get("accuracy").unwrap_or(f64::NAN),
            history.epochs.len(),
            args.strategy.to_possible_value().map_or("?".into(), |v| v.get_name().to_string()),
            model.num_replicas_in_sync(),
        );
        if history.epochs.is_empty() {
            // As Keras's fit with epochs=0: nothing trained, so no epoch-end file either.
            println!(
                "trained no epoch, so wrote no checkpoint, plot or CSV ({}, {}, {})",
                args.checkpoint,
                args.plot,
                csv.display()
            );
        } else {
            println!(
                "wrote {}, {} (best val_accuracy) and {}",
                args.plot,
                args.checkpoint,
                csv.display()
            );
        }
    }
    Ok(())
}
