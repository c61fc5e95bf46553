//! MiniGoogLeNet on CIFAR-10 with polynomial learning-rate decay: the classic Keras multi-GPU
//! tutorial (`train.py --output plot.png --gpus G`), in Rust.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin train_cifar10 -- --output plots/minigooglenet_cifar10.png
//! cargo run --release -p kandle-examples --features cuda --bin train_cifar10 -- --gpus 4 --strategy mirrored
//! mpirun -n 2 target/release/train_cifar10 --strategy multi-worker --gpus 2   # built with --features mpi
//! mpirun -n 4 target/release/train_cifar10 --strategy parameter-server --num-ps 2 --sync
//! ```
//!
//! Any data in the CIFAR-10 binary format will do: `digits_as_cifar` writes the bundled digits
//! set that way, for a run with no download (see `plots/README.md`).
//!
//! Defaults follow the tutorial: 70 epochs, SGD with learning rate 5e-3 and momentum 0.9, batch
//! 64 per replica, `alpha = base_lr * (1 - epoch / epochs)^1`, per-pixel mean subtraction,
//! one-hot labels, random shifts of up to 10% and horizontal flips, validation on the test set.
//! It writes the training curves (PNG), a CSV and a JSON history, and a checkpoint; with
//! `--epochs 0` it trains nothing (as Keras's `fit` with `epochs=0`), writes none of them, and
//! says so. With `--backup-dir`, SIGTERM or Ctrl-C stops it after the current step with a
//! backup there and exit status 75; the same command resumes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use kandle::callbacks::{Callback, CsvLogger, FitInfo, Logs, ModelCheckpoint, PlotHistory};
use kandle::data::{cifar10, RandomShiftFlip};
use kandle::prelude::*;
use kandle_examples::{
    BackupArgs, CifarModel, MonitorArgs, PipelineArgs, PrecisionArgs, PsArgs, StrategyKind,
};

#[derive(Parser, Debug)]
#[command(about = "Train MiniGoogLeNet on CIFAR-10, as the Keras multi-GPU tutorial does")]
struct Args {
    /// The network (MiniGoogLeNet by default).
    #[arg(long, value_enum, default_value = "mini-googlenet")]
    model: CifarModel,
    /// The training-curve PNG; the CSV, JSON and checkpoint are written beside it.
    #[arg(long, default_value = "plots/minigooglenet_cifar10.png")]
    output: PathBuf,
    /// Replicas per worker: GPUs when built with the cuda feature, otherwise CPU replicas.
    #[arg(long, default_value_t = 1, value_parser = kandle_examples::at_least_one())]
    gpus: usize,
    /// How training is distributed (default: one-device for one replica, mirrored otherwise).
    #[arg(long, value_enum)]
    strategy: Option<StrategyKind>,
    /// Epochs to train (0 trains nothing and writes nothing).
    #[arg(long, default_value_t = 70)]
    epochs: usize,
    /// Base learning rate of SGD (momentum 0.9).
    #[arg(long, default_value_t = 5e-3)]
    lr: f64,
    /// Samples per replica per step.
    #[arg(long, default_value_t = 64, value_parser = kandle_examples::at_least_one())]
    batch_size_per_replica: usize,
    /// Where the CIFAR-10 binary files are (data_batch_1.bin ... test_batch.bin).
    #[arg(long, default_value = "data/cifar-10")]
    data_dir: PathBuf,
    /// Download the official archive into --data-dir when the files are missing.
    #[arg(long)]
    download: bool,
    /// Epochs of linear warm-up before the polynomial decay takes over (0: none).
    #[arg(long, default_value_t = 0)]
    warmup_epochs: usize,
    /// Multiply the learning rate by the number of replicas (the linear scaling rule).
    #[arg(long)]
    scale_lr: bool,
    /// Stop each epoch after this many steps (smoke runs).
    #[arg(long, value_parser = kandle_examples::at_least_one())]
    max_steps_per_epoch: Option<usize>,
    /// Seed for the weights, shuffling and augmentation.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The title of the training-curve plot (say what the data is when it is not CIFAR-10;
    /// default: "<model> on CIFAR-10").
    #[arg(long)]
    title: Option<String>,
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

/// One epoch's timing.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct EpochTime {
    /// From the epoch's start to its end, validation included.
    seconds: f64,
    /// Images trained on in the epoch.
    images: usize,
    /// Seconds of the training steps: from the epoch's start to its last step's end.
    training_seconds: f64,
}

impl EpochTime {
    fn images_per_second(&self) -> f64 {
        self.images as f64 / self.training_seconds.max(f64::MIN_POSITIVE)
    }
}

/// Records each epoch's wall time and training throughput, and prints the throughput (on the
/// chief). Its record survives a resume (the epoch a run resumes in counts from the resume).
struct EpochTimer {
    /// Images in the training set, for the last, shorter step of an epoch.
    samples: usize,
    global_batch: usize,
    start: Option<Instant>,
    images: usize,
    last_step_end: Option<Instant>,
    record: Arc<std::sync::Mutex<Vec<EpochTime>>>,
}

impl EpochTimer {
    fn new(samples: usize) -> Self {
        Self {
            samples,
            global_batch: 0,
            start: None,
            images: 0,
            last_step_end: None,
            record: Arc::default(),
        }
    }
}

impl Callback for EpochTimer {
    fn on_train_begin(&mut self, info: &FitInfo, _model: &mut Model) -> kandle::Result<()> {
        self.global_batch = info.global_batch_size;
        Ok(())
    }

    fn on_epoch_begin(&mut self, _epoch: usize, _model: &mut Model) -> kandle::Result<()> {
        self.start = Some(Instant::now());
        self.images = 0;
        self.last_step_end = None;
        Ok(())
    }

    fn on_train_batch_end(
        &mut self,
        batch: usize,
        _logs: &Logs,
        _model: &mut Model,
    ) -> kandle::Result<()> {
        let before = batch * self.global_batch;
        self.images += self.global_batch.min(self.samples.saturating_sub(before));
        self.last_step_end = Some(Instant::now());
        Ok(())
    }

    fn on_epoch_end(
        &mut self,
        epoch: usize,
        _logs: &Logs,
        model: &mut Model,
    ) -> kandle::Result<()> {
        let Some(start) = self.start else {
            return Ok(());
        };
        let time = EpochTime {
            seconds: start.elapsed().as_secs_f64(),
            images: self.images,
            training_seconds: self
                .last_step_end
                .map_or(0.0, |end| end.duration_since(start).as_secs_f64()),
        };
        if model.is_chief() {
            println!(
                "epoch {}: {} images in {:.1} s of training steps, {:.1} images/s",
                epoch + 1,
                time.images,
                time.training_seconds,
                time.images_per_second()
            );
        }
        if let Ok(mut record) = self.record.lock() {
            record.push(time);
        }
        Ok(())
    }

    fn state(&self) -> Option<serde_json::Value> {
        let record = self.record.lock().ok()?;
        serde_json::to_value(&*record).ok()
    }

    fn load_state(&mut self, state: &serde_json::Value) -> kandle::Result<()> {
        let saved: Vec<EpochTime> = serde_json::from_value(state.clone())
            .map_err(|e| kandle::Error::invalid(format!("EpochTimer: bad saved state: {e}")))?;
        if let Ok(mut record) = self.record.lock() {
            *record = saved;
        }
        Ok(())
    }
}

fn sibling(output: &Path, extension: &str) -> PathBuf {
    output.with_extension(extension)
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    let started = Instant::now();
    let data = if args.download {
        cifar10::load_or_download(&args.data_dir)
    } else {
        cifar10::load(&args.data_dir)
    }
    .with_context(|| format!("loading CIFAR-10 from {}", args.data_dir.display()))?;
    let (train, test) = data.one_hot().mean_subtracted()?;

    let kind = args.strategy.unwrap_or(if args.gpus == 1 {
        StrategyKind::OneDevice
    } else {
        StrategyKind::Mirrored
    });
    let strategy = kandle_examples::build_strategy_with(kind, args.gpus, &args.ps, &args.pipeline)?;
    let backup = args.backup.callback(&strategy);
    let replicas = strategy.num_replicas_in_sync();
    let lr = if args.scale_lr {
        args.lr * replicas as f64
    } else {
        args.lr
    };
    let decay = PolynomialDecay::new(lr, args.epochs, 1.0);
    let schedule: Box<dyn Schedule> = if args.warmup_epochs > 0 {
        Box::new(LinearWarmup::new(decay, args.warmup_epochs))
    } else {
        Box::new(decay)
    };
    let model = args
        .model
        .network()?
        .compile(
            Sgd::new(lr)
                .momentum(0.9)
                .gradient_accumulation_steps(args.precision.gradient_accumulation_steps),
            CategoricalCrossentropy::new(),
            [Accuracy],
            &strategy,
        )?
        .with_seed(args.seed)?;
    let mut model = args.precision.apply(model)?;
    model.build(&[3, 32, 32])?;
    let chief = model.is_chief();
    if chief {
        println!("{}", model.summary()?);
        println!(
            "strategy {} with {replicas} replica(s), global batch {}, base lr {lr}",
            strategy.name(),
            args.batch_size_per_replica * replicas
        );
    }

    let title = args
        .title
        .clone()
        .unwrap_or_else(|| format!("{} on CIFAR-10", args.model.title()));
    let timer = EpochTimer::new(train.len());
    let epoch_times = Arc::clone(&timer.record);
    let checkpoint = sibling(&args.output, "safetensors");
    let history = model.fit(
        &train,
        FitOptions {
            epochs: args.epochs,
            batch_size_per_replica: args.batch_size_per_replica,
            validation: Some(&test),
            seed: Some(args.seed),
            steps_per_epoch: args.max_steps_per_epoch,
            augment: Some(Arc::new(RandomShiftFlip::default())),
            callbacks: [
                LearningRateScheduler::new(schedule).boxed(),
                CsvLogger::new(sibling(&args.output, "csv")).boxed(),
                PlotHistory::new(&args.output).title(&title).boxed(),
                ModelCheckpoint::new(&checkpoint).boxed(),
                timer.boxed(),
            ]
            .into_iter()
            .chain(args.monitor.callbacks())
            .chain(backup.map(Callback::boxed))
            .collect(),
            stop_signal: Some(args.backup.stop_signal()?),
            ..Default::default()
        },
    )?;
    kandle_examples::exit_if_preempted(&history, chief);

    if chief && history.epochs.is_empty() {
        // As Keras's fit with epochs=0: nothing trained, so no epoch-end file either.
        println!(
            "trained no epoch, so wrote no curves, CSV, JSON history or checkpoint ({}, {}, {}, \
             {})",
            args.output.display(),
            sibling(&args.output, "csv").display(),
            sibling(&args.output, "json").display(),
            checkpoint.display()
        );
    } else if chief {
        let times = epoch_times.lock().map(|t| t.clone()).unwrap_or_default();
        let seconds: Vec<f64> = times.iter().map(|t| t.seconds).collect();
        let mut json: serde_json::Value = serde_json::from_str(&history.to_json())?;
        json["epoch_seconds"] = serde_json::json!(seconds);
        json["epoch_images_per_second"] = serde_json::json!(times
            .iter()
            .map(EpochTime::images_per_second)
            .collect::<Vec<_>>());
        json["total_seconds"] = serde_json::json!(started.elapsed().as_secs_f64());
        json["strategy"] = serde_json::json!(strategy.name());
        json["replicas"] = serde_json::json!(replicas);
        let json_path = sibling(&args.output, "json");
        kandle::checkpoint::write_atomically(
            &json_path,
            serde_json::to_string_pretty(&json)?.as_bytes(),
        )?;
        let mean = seconds.iter().sum::<f64>() / seconds.len().max(1) as f64;
        println!(
            "total wall time {:.1} s; per epoch {:.1} s on average ({})",
            started.elapsed().as_secs_f64(),
            mean,
            seconds
                .iter()
                .map(|s| format!("{s:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!(
            "wrote {}, {}, {} and {}",
            args.output.display(),
            sibling(&args.output, "csv").display(),
            json_path.display(),
            checkpoint.display()
        );
    }
    Ok(())
}
