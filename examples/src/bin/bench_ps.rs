//! Parameter servers against all-reduce, measured on this machine and projected: the
//! communication time per step of [`ParameterServerStrategy`] (1 and 2 servers) and of
//! [`MultiWorkerMirroredStrategy`]'s all-reduce for 6.6 MB of gradients (MiniGoogLeNet's size),
//! under `mpirun --oversubscribe` with 2 to 8 ranks, and a straggler run (one worker slowed by a
//! factor) in which asynchronous parameter servers keep their images/s and synchronous
//! all-reduce does not. It writes `plots/ps_vs_allreduce.png` (measured points and the analytic
//! model projected to 512 workers) and its CSV, and prints markdown tables.
//!
//! ```text
//! cargo build --release -p kandle-examples --features mpi --bin bench_ps
//! target/release/bench_ps            # the driver: launches every mpirun itself
//! ```
//!
//! **What is timed.** Every run trains the same model, a dense network with 1,656,010
//! parameters (6.62 MB of `f32` gradients, as MiniGoogLeNet's 1,656,250) whose computation is
//! tiny (8 samples per worker), through `Model::fit`: a step's wall time is its communication
//! plus that small compute, which the driver measures alone under `OneDeviceStrategy` and
//! subtracts. The chief's median step over the timed steps is reported. Synchronous PS is the
//! like-for-like comparison with all-reduce (every step waits for every worker); asynchronous PS
//! is shown too.
//!
//! **Straggler.** Each step also sleeps `--compute-ms` (a stand-in for computation that does
//! not compete for the 2 cores), and one worker sleeps `--slow-factor` times as long. Images/s
//! is the sum over the workers of each worker's samples over its own training time. With equal
//! shards an epoch still ends when the slow worker ends its shard (the fast ones wait at the
//! epoch's end), so the gain is in updates per second while training, not in epoch time; a
//! real job gives the fast workers more data (TensorFlow's workers read their own streams).
//!
//! **The analytic model** (per step, gradients of S bytes): each of P servers receives and
//! sends W·S/P bytes (`2·W·S/(P·B)` on its link of bandwidth B); a ring all-reduce over N ranks
//! moves `2(N-1)/N·S` per rank, plus `2(N-1)` latencies. The projection uses a 25 Gbit/s link
//! with 5 µs latency (`--gbit`, `--latency-us`), as the `scaling` binary does.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::{Parser, ValueEnum};
use kandle::callbacks::{Callback, Logs};
use kandle::prelude::*;
use kandle_examples::scaling_model::Link;
use kandle_examples::scaling_plot::{self, Mark, Series};

/// Input width of the benchmark's dense network: 1645·1000 + 1000 + 1000·10 + 10 = 1,656,010
/// parameters.
const INPUTS: usize = 1645;
/// Samples per worker per step.
const BATCH: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// MultiWorkerMirroredStrategy: one all-reduce per step.
    Allreduce,
    /// ParameterServerStrategy, synchronous.
    PsSync,
    /// ParameterServerStrategy, asynchronous.
    PsAsync,
}

#[derive(Parser, Debug, Clone)]
#[command(about = "Parameter servers against all-reduce: measured under mpirun, and projected")]
struct Args {
    /// Run as one rank of an mpirun job (the driver passes it).
    #[arg(long)]
    inner: bool,
    /// With --inner: the strategy.
    #[arg(long, value_enum, default_value_t = Mode::Allreduce)]
    mode: Mode,
    /// With --inner: parameter servers.
    #[arg(long, default_value_t = 1)]
    num_ps: usize,
    /// Timed steps per run (after --warmup untimed ones).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Milliseconds every worker sleeps per step (the straggler runs' stand-in for compute).
    #[arg(long, default_value_t = 0.0)]
    compute_ms: f64,
    /// The worker that is slower.
    #[arg(long)]
    slow_worker: Option<usize>,
    /// How many times slower it is.
    #[arg(long, default_value_t = 2.0)]
    slow_factor: f64,
    /// Largest job to measure (ranks, 2 at least).
    #[arg(long, default_value_t = 8)]
    max_ranks: usize,
    /// Workers in the straggler runs.
    #[arg(long, default_value_t = 4)]
    straggler_workers: usize,
    /// Milliseconds of (sleeping) compute per step in the straggler runs.
    #[arg(long, default_value_t = 40.0)]
    straggler_compute_ms: f64,
    /// Link bandwidth of the projection, Gbit/s.
    #[arg(long, default_value_t = 25.0)]
    gbit: f64,
    /// Link latency of the projection, microseconds.
    #[arg(long, default_value_t = 5.0)]
    latency_us: f64,
    /// Where the picture goes (its CSV beside it).
    #[arg(long, default_value = "plots/ps_vs_allreduce.png")]
    output: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.inner {
        inner(&args)
    } else {
        kandle_examples::init();
        driver(&args)
    }
}

// ---- one rank ----------------------------------------------------------------------------

fn network() -> Sequential {
    Sequential::new()
        .add(Dense::new(1000))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

/// Synthetic data: `n` samples of `INPUTS` values and labels.
fn data(n: usize) -> Result<kandle::data::InMemoryDataset> {
    let x = Tensor::randn(0f32, 1.0, (n, INPUTS), &Device::Cpu)?;
    let labels: Vec<u32> = (0..n).map(|i| (i % 10) as u32).collect();
    let y = Tensor::from_vec(labels, n, &Device::Cpu)?;
    Ok(kandle::data::InMemoryDataset::new(x, y)?.named("synthetic"))
}

/// Times each step on this worker, after `warmup` steps; sleeps before each step.
struct Timer {
    warmup: usize,
    sleep: Duration,
    started: Option<Instant>,
    step_began: Instant,
    steps: Arc<Mutex<Vec<f64>>>,
    span: Arc<Mutex<f64>>,
}

impl Callback for Timer {
    fn on_train_batch_begin(&mut self, batch: usize, _model: &mut Model) -> kandle::Result<()> {
        if batch == self.warmup {
            self.started = Some(Instant::now());
        }
        if !self.sleep.is_zero() {
            std::thread::sleep(self.sleep);
        }
        self.step_began = Instant::now();
        Ok(())
    }

    fn on_train_batch_end(
        &mut self,
        batch: usize,
        _logs: &Logs,
        _model: &mut Model,
    ) -> kandle::Result<()> {
        if batch >= self.warmup {
            let seconds = self.step_began.elapsed().as_secs_f64();
            if let Ok(mut s) = self.steps.lock() {
                s.push(seconds);
            }
            if let (Some(start), Ok(mut span)) = (self.started, self.span.lock()) {
                *span = start.elapsed().as_secs_f64();
            }
        }
        Ok(())
    }
}

/// One epoch of `train` in order, at `BATCH` per replica, timed by `timer`.
fn fit_one_epoch(
    model: &mut Model,
    train: &kandle::data::InMemoryDataset,
    timer: Timer,
) -> Result<()> {
    model.fit(
        train,
        FitOptions {
            epochs: 1,
            batch_size_per_replica: BATCH,
            shuffle: false,
            verbosity: Verbosity::Silent,
            callbacks: vec![timer.boxed()],
            ..Default::default()
        },
    )?;
    Ok(())
}

fn inner(args: &Args) -> Result<()> {
    let strategy: Arc<dyn Strategy> = match args.mode {
        Mode::Allreduce => Arc::new(kandle_strategies::MultiWorkerMirroredStrategy::from_env()?),
        Mode::PsSync | Mode::PsAsync => {
            let s = kandle_strategies::ParameterServerStrategy::from_env()?.num_ps(args.num_ps);
            Arc::new(if args.mode == Mode::PsSync {
                s.synchronous()
            } else {
                s
            })
        }
    };
    let worker = strategy.worker();
    let workers = strategy.num_replicas_in_sync();
    let steps = args.warmup + args.steps;
    let samples = BATCH * workers * steps;
    let train = data(samples)?;
    let slow = args.slow_worker == Some(worker.rank);
    let sleep_ms = args.compute_ms * if slow { args.slow_factor } else { 1.0 };
    let timer = Timer {
        warmup: args.warmup,
        sleep: Duration::from_secs_f64(sleep_ms / 1e3),
        started: None,
        step_began: Instant::now(),
        steps: Arc::new(Mutex::new(Vec::new())),
        span: Arc::new(Mutex::new(0.0)),
    };
    let (times, span) = (Arc::clone(&timer.steps), Arc::clone(&timer.span));
    let mut model = network()
        .compile(
            Sgd::new(0.01),
            SparseCategoricalCrossentropy::new(),
            (),
            &strategy,
        )?
        .with_seed(1)?;
    model.build(&[INPUTS])?;
    fit_one_epoch(&mut model, &train, timer)?;
    let times = times.lock().map(|t| t.clone()).unwrap_or_default();
    if times.is_empty() {
        return Ok(()); // a parameter server
    }
    let span = span.lock().map(|s| *s).unwrap_or(0.0);
    let median = median(&times);
    let images_per_second = (BATCH * times.len()) as f64 / span.max(1e-9);
    println!(
        "RESULT rank {} workers {workers} median_step_ms {:.3} images_per_second {:.1}",
        worker.rank,
        median * 1e3,
        images_per_second
    );
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

// ---- the driver --------------------------------------------------------------------------

/// What one mpirun job measured: the chief's median step, and the workers' images/s summed.
#[derive(Debug, Clone, Copy)]
struct Measured {
    chief_step_ms: f64,
    images_per_second: f64,
}

fn launch(args: &Args, ranks: usize, mode: Mode, extra: &[String]) -> Result<Measured> {
    let me = std::env::current_exe()?;
    let mode_name = mode
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default();
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &ranks.to_string(), "--oversubscribe"])
        .arg(&me)
        .args(["--inner", "--mode", &mode_name])
        .args(["--steps", &args.steps.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(extra)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1");
    let out = cmd
        .output()
        .with_context(|| "running mpirun (is Open MPI installed?)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "mpirun -n {ranks} {mode_name} {extra:?} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut chief = None;
    let mut total = 0.0;
    for line in stdout.lines().filter(|l| l.starts_with("RESULT ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let field = |name: &str| -> Option<f64> {
            let at = words.iter().position(|w| *w == name)?;
            words.get(at + 1)?.parse().ok()
        };
        total += field("images_per_second").unwrap_or(0.0);
        if field("rank") == Some(0.0) {
            chief = field("median_step_ms");
        }
    }
    let chief_step_ms = chief.ok_or_else(|| anyhow::anyhow!("no result from rank 0:\n{stdout}"))?;
    Ok(Measured {
        chief_step_ms,
        images_per_second: total,
    })
}

/// The benchmark step under OneDeviceStrategy in this process: the compute that every
/// distributed step also does.
fn compute_alone(args: &Args) -> Result<f64> {
    let steps = args.warmup + args.steps;
    let train = data(BATCH * steps)?;
    let timer = Timer {
        warmup: args.warmup,
        sleep: Duration::ZERO,
        started: None,
        step_began: Instant::now(),
        steps: Arc::new(Mutex::new(Vec::new())),
        span: Arc::new(Mutex::new(0.0)),
    };
    let times = Arc::clone(&timer.steps);
    let mut model = network().compile(
        Sgd::new(0.01),
        SparseCategoricalCrossentropy::new(),
        (),
        &OneDeviceStrategy::cpu(),
    )?;
    fit_one_epoch(&mut model, &train, timer)?;
    let times = times.lock().map(|t| t.clone()).unwrap_or_default();
    Ok(median(&times) * 1e3)
}

/// One measured configuration of the communication runs.
struct Row {
    label: &'static str,
    ranks: usize,
    workers: usize,
    servers: usize,
    step_ms: f64,
    comm_ms: f64,
}

fn driver(args: &Args) -> Result<()> {
    if args.max_ranks < 2 {
        bail!("--max-ranks must be at least 2");
    }
    let bytes = 1_656_010.0 * 4.0;
    let compute_ms = compute_alone(args)?;
    println!("one device, same model and batch: {compute_ms:.2} ms per step (compute only)\n");
    let configs: [(&'static str, Mode, usize); 4] = [
        ("all-reduce", Mode::Allreduce, 0),
        ("PS sync, 1 server", Mode::PsSync, 1),
        ("PS sync, 2 servers", Mode::PsSync, 2),
        ("PS async, 1 server", Mode::PsAsync, 1),
    ];
    let mut rows = Vec::new();
    println!("| strategy | ranks | workers | servers | step (ms) | communication (ms) |");
    println!("|---|---|---|---|---|---|");
    for ranks in 2..=args.max_ranks {
        for (label, mode, servers) in configs {
            if ranks <= servers {
                continue;
            }
            let extra = vec!["--num-ps".to_string(), servers.max(1).to_string()];
            let m = launch(args, ranks, mode, &extra)?;
            let row = Row {
                label,
                ranks,
                workers: ranks - servers,
                servers,
                step_ms: m.chief_step_ms,
                comm_ms: (m.chief_step_ms - compute_ms).max(0.0),
            };
            println!(
                "| {} | {} | {} | {} | {:.2} | {:.2} |",
                row.label, row.ranks, row.workers, row.servers, row.step_ms, row.comm_ms
            );
            rows.push(row);
        }
    }

    // The straggler runs.
    let w = args.straggler_workers;
    println!(
        "\nstraggler: {w} workers, {:.0} ms of compute per step, worker 1 {}x slower\n",
        args.straggler_compute_ms, args.slow_factor
    );
    println!("| strategy | images/s, no straggler | images/s, one straggler | kept |");
    println!("|---|---|---|---|");
    let mut straggler = Vec::new();
    for (label, mode, servers) in [
        ("all-reduce (sync)", Mode::Allreduce, 0usize),
        ("PS sync, 1 server", Mode::PsSync, 1),
        ("PS async, 1 server", Mode::PsAsync, 1),
    ] {
        let mut extra = vec![
            "--num-ps".to_string(),
            servers.max(1).to_string(),
            "--compute-ms".to_string(),
            args.straggler_compute_ms.to_string(),
        ];
        let even = launch(args, w + servers, mode, &extra)?;
        extra.extend([
            "--slow-worker".to_string(),
            "1".to_string(),
            "--slow-factor".to_string(),
            args.slow_factor.to_string(),
        ]);
        let slowed = launch(args, w + servers, mode, &extra)?;
        let kept = slowed.images_per_second / even.images_per_second;
        println!(
            "| {label} | {:.0} | {:.0} | {:.0}% |",
            even.images_per_second,
            slowed.images_per_second,
            100.0 * kept
        );
        straggler.push((label, even.images_per_second, slowed.images_per_second));
    }

    // The projection and the picture.
    let link = Link::new(args.gbit, args.latency_us)?;
    let seconds_per_byte = 8.0 / (args.gbit * 1e9);
    let ps_ms = |workers: usize, servers: usize| {
        1e3 * (2.0 * workers as f64 * bytes / servers as f64 * seconds_per_byte
            + 2.0 * args.latency_us * 1e-6)
    };
    let workers_axis: Vec<usize> = (0..=9).map(|i| 1usize << i).collect();
    let mut series = Vec::new();
    for label in [
        "PS sync, 1 server",
        "PS sync, 2 servers",
        "PS async, 1 server",
    ] {
        let points: Vec<(usize, f64)> = rows
            .iter()
            .filter(|r| r.label == label)
            .map(|r| (r.workers, r.comm_ms.max(1e-3)))
            .collect();
        series.push(Series {
            label: format!("measured here: {label}"),
            points,
            mark: Mark::Points,
        });
    }
    series.push(Series {
        label: "measured here: all-reduce".into(),
        points: rows
            .iter()
            .filter(|r| r.label == "all-reduce")
            .map(|r| (r.workers, r.comm_ms.max(1e-3)))
            .collect(),
        mark: Mark::Points,
    });
    // This machine's bandwidth, from the 2-rank all-reduce: each rank moves S in t.
    let here = rows
        .iter()
        .find(|r| r.label == "all-reduce" && r.ranks == 2)
        .map(|r| bytes / (r.comm_ms.max(1e-3) / 1e3));
    if let Some(bytes_per_second) = here {
        let gbit_here = bytes_per_second * 8.0 / 1e9;
        let link_here = Link::new(gbit_here, 0.0)?;
        series.push(Series {
            label: format!("model, this machine ({gbit_here:.1} Gbit/s): 1 server"),
            points: workers_axis
                .iter()
                .map(|&w| (w, 1e3 * 2.0 * w as f64 * bytes / bytes_per_second))
                .collect(),
            mark: Mark::Line,
        });
        series.push(Series {
            label: format!("model, this machine ({gbit_here:.1} Gbit/s): ring"),
            points: workers_axis
                .iter()
                .filter(|&&w| w > 1)
                .map(|&w| (w, 1e3 * link_here.ring_all_reduce_seconds(w, bytes)))
                .collect(),
            mark: Mark::Line,
        });
        println!("this machine's all-reduce bandwidth: {gbit_here:.2} Gbit/s per rank");
    }
    for servers in [1usize, 8, 64] {
        series.push(Series {
            label: format!("model, {} Gbit/s: P = {servers}, 2·W·S/(P·B)", args.gbit),
            points: workers_axis
                .iter()
                .map(|&w| (w, ps_ms(w, servers)))
                .collect(),
            mark: Mark::Line,
        });
    }
    series.push(Series {
        label: format!("model, {} Gbit/s: ring, 2(N-1)/N·S/B", args.gbit),
        points: workers_axis
            .iter()
            .filter(|&&w| w > 1)
            .map(|&w| (w, 1e3 * link.ring_all_reduce_seconds(w, bytes)))
            .collect(),
        mark: Mark::Line,
    });
    scaling_plot::draw_log_time(
        &args.output,
        "Parameter servers against ring all-reduce: communication per step, 6.6 MB of gradients",
        &format!(
            "points: this machine, mpirun --oversubscribe, 2-{} ranks on shared memory \
             (step minus {compute_ms:.1} ms of compute); lines: the model on a {} Gbit/s link",
            args.max_ranks, args.gbit
        ),
        &series,
    )?;
    let csv = args.output.with_extension("csv");
    let mut text = String::from("kind,label,ranks,workers,servers,step_ms,communication_ms\n");
    for r in &rows {
        text.push_str(&format!(
            "measured,{},{},{},{},{:.4},{:.4}\n",
            r.label, r.ranks, r.workers, r.servers, r.step_ms, r.comm_ms
        ));
    }
    for (label, even, slowed) in &straggler {
        text.push_str(&format!(
            "straggler,{label},{w},{w},,{even:.2},{slowed:.2}\n"
        ));
    }
    kandle::checkpoint::write_atomically(&csv, text.as_bytes())?;
    println!(
        "\nwrote {} and {}\n\nmodel at {} Gbit/s (per step):",
        args.output.display(),
        csv.display(),
        args.gbit
    );
    println!("| workers | PS, 1 server (ms) | PS, 8 servers (ms) | ring all-reduce (ms) |");
    println!("|---|---|---|---|");
    for &w in &workers_axis {
        println!(
            "| {w} | {:.1} | {:.1} | {:.1} |",
            ps_ms(w, 1),
            ps_ms(w, 8),
            1e3 * link.ring_all_reduce_seconds(w, bytes)
        );
    }
    Ok(())
}
