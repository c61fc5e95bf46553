//! How training throughput scales with replicas: measures images/s and scaling efficiency
//! (images/s at N / (N x images/s at 1)) of MiniGoogLeNet on CIFAR-shaped synthetic data for
//! N = 1, 2, 4 replicas under each strategy, then projects the efficiency of a ring all-reduce
//! to 512 replicas from the measured step time and from a GPU step time, and plots both against
//! the Keras tutorial's 4-GPU figure and Horovod's 512-GPU figure.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin scaling                       # CPU replicas
//! cargo run --release -p kandle-examples --features cuda --bin scaling -- --gpus
//! cargo build --release -p kandle-examples --features mpi --bin scaling
//! mpirun -n 2 target/release/scaling --strategies multi-worker               # N = 2, 4, 8
//! ```
//!
//! One-device gives the single-replica baseline; mirrored and central-storage run N replicas in
//! this process (CPU replicas, or GPUs with `--gpus`); multi-worker runs N local replicas in each
//! of the `mpirun` workers (built with the `mpi` feature), and is skipped otherwise. Under
//! `mpirun` the chief measures the single-process strategies while the other workers wait.
//! Every step goes through `Model::fit`; timings are medians of the timed steps (and of
//! `--rounds` interleaved rounds, for a machine whose load changes), never pass/fail.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Parser;
use kandle::Strategy;
use kandle_examples::scaling_model::{
    self, gradient_bytes, Link, Overlap, ScalingModel, DEFAULT_BANDWIDTH_GBIT_S,
    DEFAULT_LATENCY_US, HOROVOD_512_EFFICIENCY, PROJECTED_REPLICAS, TUTORIAL_BATCH,
};
use kandle_examples::scaling_plot::{self, Mark, Series};
use kandle_examples::throughput::{self, Measurement, Workload};
use kandle_examples::{build_strategy_on, StrategyKind};

#[derive(Parser, Debug)]
#[command(about = "Measure and project the scaling efficiency of data-parallel training")]
struct Args {
    /// Images per replica per step.
    #[arg(long, default_value_t = 64, value_parser = kandle_examples::at_least_one())]
    batch_size_per_replica: usize,
    /// Timed steps per configuration.
    #[arg(long, default_value_t = 3, value_parser = kandle_examples::at_least_one())]
    steps: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Measure every configuration this many times, interleaved, and keep the median (for a
    /// machine whose load changes during the run).
    #[arg(long, default_value_t = 1, value_parser = kandle_examples::at_least_one())]
    rounds: usize,
    /// How long a replica (or worker) may take to answer before the step fails, in seconds:
    /// well above the strategies' 60 s, as a step of 4 replicas on a busy CPU can take longer.
    #[arg(long, default_value_t = 600)]
    replica_timeout_s: u64,
    /// Replica counts to measure (per worker for multi-worker).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4", value_parser = kandle_examples::at_least_one())]
    replicas: Vec<usize>,
    /// Strategies to measure; one-device (N = 1) is always measured as the baseline.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "one-device,mirrored,central-storage,multi-worker"
    )]
    strategies: Vec<StrategyKind>,
    /// Put replicas on GPUs (needs the cuda feature and enough visible GPUs) instead of
    /// the CPU.
    #[arg(long)]
    gpus: bool,
    /// The PNG to write.
    #[arg(long, default_value = "plots/scaling.png")]
    output: PathBuf,
    /// The CSV of every measured and projected point (default: --output with .csv).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Link bandwidth between replicas for the projection, in Gbit/s (Horovod's benchmarks
    /// used 25 Gbit/s RoCE).
    #[arg(long, default_value_t = DEFAULT_BANDWIDTH_GBIT_S)]
    bandwidth_gbit: f64,
    /// Latency of each of the ring's 2 (N - 1) messages, in microseconds.
    #[arg(long, default_value_t = DEFAULT_LATENCY_US)]
    latency_us: f64,
    /// Single-GPU step time for the GPU projection, in ms (default: the Keras tutorial's
    /// 63 s per epoch of 50,000 images at batch 64, 80.64 ms).
    #[arg(long)]
    gpu_step_ms: Option<f64>,
}

/// This process's place in an `mpirun` job of more than one worker.
#[cfg(feature = "mpi")]
mod job {
    use std::time::Duration;

    use anyhow::Result;
    use kandle::Strategy;
    use kandle_strategies::MultiWorkerMirroredStrategy;

    /// How long the other workers wait for the chief's single-process measurements.
    const CHIEF_ALONE: Duration = Duration::from_secs(3600);

    /// Membership of the job; MPI stays initialised while it lives.
    pub struct Job {
        world: MultiWorkerMirroredStrategy,
    }

    impl Job {
        /// The job this process was launched in, when `mpirun` started two workers or more.
        pub fn join() -> Result<Option<Job>> {
            let world = MultiWorkerMirroredStrategy::from_env()?;
            Ok((world.worker().size > 1).then_some(Job { world }))
        }

        /// This worker's rank.
        pub fn rank(&self) -> usize {
            self.world.worker().rank
        }

        /// The number of workers.
        pub fn size(&self) -> usize {
            self.world.worker().size
        }

        /// Waits until every worker gets here (a guarded one-element all-reduce).
        pub fn barrier(&self) -> Result<()> {
            let options = self.world.options().timeout(CHIEF_ALONE);
            self.world
                .clone()
                .with_options(options)
                .all_reduce_sum(&mut vec![0.0])?;
            Ok(())
        }
    }

    /// Why multi-worker is skipped in a job of one process.
    pub const SKIPPED: &str = "launched without `mpirun -n W` (W >= 2)";
}

/// Without the `mpi` feature there is never a job: `Job` has no values.
#[cfg(not(feature = "mpi"))]
mod job {
    use anyhow::Result;

    /// Membership of an `mpirun` job, which this build cannot have.
    pub enum Job {}

    impl Job {
        /// Never in a job.
        pub fn join() -> Result<Option<Job>> {
            Ok(None)
        }

        /// This worker's rank.
        pub fn rank(&self) -> usize {
            match *self {}
        }

        /// The number of workers.
        pub fn size(&self) -> usize {
            match *self {}
        }

        /// Waits for every worker.
        pub fn barrier(&self) -> Result<()> {
            match *self {}
        }
    }

    /// Why multi-worker is skipped.
    pub const SKIPPED: &str = "built without the `mpi` feature";
}

fn replica_devices(replicas: usize, gpus: bool) -> Result<Vec<Device>> {
    if !gpus {
        return Ok(vec![Device::Cpu; replicas]);
    }
    if !cfg!(feature = "cuda") {
        bail!("--gpus needs a build with --features cuda");
    }
    kandle_examples::devices(replicas)
}

/// Runs and prints one configuration.
fn run(strategy: Arc<dyn Strategy>, workload: Workload, chief: bool) -> Result<Measurement> {
    if chief {
        print!(
            "measuring {} with {} replica(s)... ",
            strategy.name(),
            strategy.num_replicas_in_sync()
        );
        std::io::stdout().flush()?;
    }
    let m = throughput::measure(&strategy, workload)?;
    if chief {
        println!("{:.1} ms per step", m.step_seconds * 1e3);
    }
    Ok(m)
}

/// Measures each of `configs` (a strategy and its replicas per worker) `args.rounds` times,
/// interleaved (every configuration once, then again), so that a change in the machine's load
/// reaches all of them alike, and keeps each one's median round.
fn sweep(
    configs: &[(StrategyKind, usize)],
    args: &Args,
    workload: Workload,
    chief: bool,
) -> Result<Vec<Measurement>> {
    let mut rounds: Vec<Vec<Measurement>> = vec![Vec::new(); configs.len()];
    for round in 0..args.rounds {
        if chief && args.rounds > 1 {
            println!("round {} of {}", round + 1, args.rounds);
        }
        for (samples, &(kind, n)) in rounds.iter_mut().zip(configs) {
            let devices = replica_devices(n, args.gpus)?;
            let timeout = Duration::from_secs(args.replica_timeout_s);
            let strategy = build_strategy_on(kind, devices, Some(timeout))?;
            samples.push(run(strategy, workload, chief)?);
        }
    }
    rounds
        .into_iter()
        .map(|mut samples| {
            samples.sort_by(|a, b| a.step_seconds.total_cmp(&b.step_seconds));
            let middle = samples.len() / 2;
            samples
                .into_iter()
                .nth(middle)
                .context("no round was measured")
        })
        .collect()
}

fn measure_all(args: &Args, workload: Workload) -> Result<Vec<Measurement>> {
    // Kept for the whole sweep: MPI is finalised once no multi-worker strategy is left.
    let job = if args.strategies.contains(&StrategyKind::MultiWorker) {
        job::Job::join()?
    } else {
        None
    };
    let chief = job.as_ref().is_none_or(|j| j.rank() == 0);
    let mut rows = Vec::new();
    if chief {
        let mut configs = vec![(StrategyKind::OneDevice, 1)];
        for kind in [StrategyKind::Mirrored, StrategyKind::CentralStorage] {
            if args.strategies.contains(&kind) {
                configs.extend(args.replicas.iter().map(|&n| (kind, n)));
            }
        }
        rows = sweep(&configs, args, workload, chief)?;
    }
    if let Some(job) = &job {
        job.barrier()?;
        let configs: Vec<_> = args
            .replicas
            .iter()
            .map(|&n| (StrategyKind::MultiWorker, n))
            .collect();
        let measured = sweep(&configs, args, workload, chief)?;
        if chief {
            rows.extend(measured);
            println!(
                "multi-worker: {} workers x {:?} replicas",
                job.size(),
                args.replicas
            );
        }
    } else if args.strategies.contains(&StrategyKind::MultiWorker) {
        println!("multi-worker: skipped ({})", job::SKIPPED);
    }
    Ok(rows)
}

/// The 1-minute load average, where the system reports one.
fn load_average() -> Option<String> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next().map(str::to_string)
}

/// The projected points of `model` at 1, 2, 4 and [`PROJECTED_REPLICAS`].
fn projection(model: &ScalingModel, overlap: Overlap) -> Vec<(usize, f64)> {
    [1, 2, 4]
        .into_iter()
        .chain(PROJECTED_REPLICAS)
        .map(|n| (n, model.efficiency(n, overlap)))
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    if args.replicas.is_empty() || args.replicas.contains(&0) {
        bail!("--replicas needs positive replica counts, e.g. 1,2,4");
    }
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let load_before = load_average();
    let workload = Workload {
        batch_size_per_replica: args.batch_size_per_replica,
        warmup_steps: args.warmup,
        timed_steps: args.steps,
    };
    let link = Link::new(args.bandwidth_gbit, args.latency_us)?;
    let gpu_step_ms = args
        .gpu_step_ms
        .unwrap_or_else(scaling_model::tutorial_gpu_step_ms);

    let rows = measure_all(&args, workload)?;
    let Some(baseline) = rows.first().cloned() else {
        return Ok(()); // a worker other than the chief: the chief reports
    };
    if let (Some(before), Some(after)) = (load_before, load_average()) {
        println!("load average (1 min): {before} before the measurements, {after} after");
    }
    let bytes = gradient_bytes(baseline.trainable);
    let where_ = if args.gpus {
        "GPUs".to_string()
    } else {
        // Under `mpirun` each worker may be bound to fewer cores than the machine has.
        match std::thread::available_parallelism().map_or(1, |n| n.get()) {
            1 => "CPU replicas sharing 1 core".to_string(),
            cores => format!("CPU replicas sharing {cores} cores"),
        }
    };

    let mut csv = String::from("series,strategy,replicas,step_ms,images_per_s,efficiency\n");
    println!();
    println!(
        "## Measured: MiniGoogLeNet ({} trainable parameters), {} images per replica, {where_}",
        baseline.trainable, args.batch_size_per_replica
    );
    println!("| strategy | N | step (ms) | images/s | efficiency |");
    println!("|---|---|---|---|---|");
    let mut measured: Vec<Series> = Vec::new();
    for m in &rows {
        let efficiency = m.efficiency(&baseline);
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1}% |",
            m.strategy,
            m.replicas,
            m.step_seconds * 1e3,
            m.images_per_second(),
            efficiency * 100.0
        );
        writeln!(
            csv,
            "measured,{},{},{:.3},{:.3},{:.5}",
            m.strategy,
            m.replicas,
            m.step_seconds * 1e3,
            m.images_per_second(),
            efficiency
        )?;
        let label = format!("measured: {}", m.strategy);
        match measured.iter_mut().find(|s| s.label == label) {
            Some(s) => s.points.push((m.replicas, efficiency)),
            None => measured.push(Series {
                label,
                points: vec![(m.replicas, efficiency)],
                mark: Mark::Points,
            }),
        }
    }

    let cpu = ScalingModel::new(baseline.step_seconds, bytes, link)?;
    let gpu = ScalingModel::new(gpu_step_ms / 1e3, bytes, link)?;
    let projections = [
        (
            "projected_measured_step",
            format!(
                "projected: measured step {:.0} ms, no overlap",
                baseline.step_seconds * 1e3
            ),
            &cpu,
            Overlap::None,
            args.batch_size_per_replica,
        ),
        (
            "projected_gpu_step",
            format!("projected: GPU step {gpu_step_ms:.1} ms, no overlap"),
            &gpu,
            Overlap::None,
            TUTORIAL_BATCH,
        ),
        (
            "projected_gpu_step_overlap",
            format!("projected: GPU step {gpu_step_ms:.1} ms, full overlap (bound)"),
            &gpu,
            Overlap::Full,
            TUTORIAL_BATCH,
        ),
    ];
    println!();
    println!(
        "## Projected: ring all-reduce of {:.2} MB at {} Gbit/s, {} us per message",
        bytes / 1e6,
        args.bandwidth_gbit,
        args.latency_us
    );
    println!(
        "| N | all-reduce (ms) | measured step {:.0} ms | GPU step {gpu_step_ms:.1} ms | GPU, overlapped |",
        baseline.step_seconds * 1e3
    );
    println!("|---|---|---|---|---|");
    for n in PROJECTED_REPLICAS {
        println!(
            "| {n} | {:.2} | {:.1}% | {:.1}% | {:.1}% |",
            gpu.all_reduce_seconds(n) * 1e3,
            cpu.efficiency(n, Overlap::None) * 100.0,
            gpu.efficiency(n, Overlap::None) * 100.0,
            gpu.efficiency(n, Overlap::Full) * 100.0
        );
    }
    let mut series = measured;
    for (name, label, model, overlap, batch) in projections {
        let points = projection(model, overlap);
        for &(n, efficiency) in &points {
            writeln!(
                csv,
                "{name},ring_all_reduce,{n},{:.3},{:.3},{efficiency:.5}",
                model.step_seconds(n, overlap) * 1e3,
                model.images_per_second(n, batch, overlap)
            )?;
        }
        // The overlapped bound sits at 100% wherever the all-reduce is shorter than the step,
        // on top of the other curves: it is in the table and the CSV, not the picture.
        if overlap == Overlap::None {
            series.push(Series {
                label,
                points,
                mark: Mark::Line,
            });
        }
    }

    let tutorial = scaling_model::tutorial_four_gpu_efficiency();
    let tutorial_images_s =
        scaling_model::CIFAR10_TRAIN_IMAGES as f64 / scaling_model::TUTORIAL_FOUR_GPU_EPOCH_S;
    writeln!(
        csv,
        "reference,keras_tutorial,4,{:.3},{tutorial_images_s:.3},{tutorial:.5}",
        4.0 * TUTORIAL_BATCH as f64 / tutorial_images_s * 1e3
    )?;
    writeln!(csv, "reference,horovod,512,,,{HOROVOD_512_EFFICIENCY:.5}")?;
    series.push(Series {
        label: format!(
            "Keras tutorial, 4 GPUs: 63 s → 16 s per epoch ({:.1}%)",
            tutorial * 100.0
        ),
        points: vec![(4, tutorial)],
        mark: Mark::Cross,
    });
    series.push(Series {
        label: "Horovod, 512 GPUs: 90% (Inception V3, ResNet-101)".into(),
        points: vec![(512, HOROVOD_512_EFFICIENCY)],
        mark: Mark::Triangle,
    });

    let csv_path = args
        .csv
        .clone()
        .unwrap_or_else(|| args.output.with_extension("csv"));
    if let Some(dir) = csv_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    kandle::checkpoint::write_atomically(&csv_path, csv.as_bytes())?;
    let caption = format!(
        "measured: {} images per replica on {where_}; projected: ring all-reduce of {:.1} MB \
         at {} Gbit/s, {} µs per message",
        args.batch_size_per_replica,
        bytes / 1e6,
        args.bandwidth_gbit,
        args.latency_us
    );
    scaling_plot::draw(
        &args.output,
        "MiniGoogLeNet data-parallel scaling efficiency",
        &caption,
        &series,
    )?;
    println!();
    println!("wrote {} and {}", args.output.display(), csv_path.display());
    Ok(())
}
