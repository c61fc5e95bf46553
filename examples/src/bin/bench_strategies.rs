//! Measures the distribution machinery side by side in one run and prints ratios:
//! - the in-process reduction of a fused gradient buffer (each `CrossDeviceOps`) against
//!   `memcpy` of the same bytes;
//! - training-step time for 1, 2 and 4 replicas under each strategy (Mirrored with its
//!   gradients in buckets during the backward passes, and as one sum after them), as images/s
//!   and scaling efficiency against one replica.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin bench_strategies -- --model digits-cnn
//! ```
//!
//! Timings are medians over repeated runs; these are measurements, never pass/fail tests.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use clap::{Parser, ValueEnum};
use kandle::data::Batch;
use kandle::prelude::*;
use kandle::strategy::ModelSpec;
use kandle_examples::throughput::median;
use kandle_strategies::{CentralStorageStrategy, CrossDeviceOps, MirroredStrategy, ReplicaOptions};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelKind {
    /// The small digits CNN on 1x8x8 inputs.
    DigitsCnn,
    /// MiniGoogLeNet on 3x32x32 inputs.
    MiniGooglenet,
}

#[derive(Parser, Debug)]
#[command(about = "Benchmark cross-device reduction and strategy step times")]
struct Args {
    /// The model whose steps are timed.
    #[arg(long, value_enum, default_value_t = ModelKind::DigitsCnn)]
    model: ModelKind,
    /// Samples per replica per step.
    #[arg(long, default_value_t = 32, value_parser = kandle_examples::at_least_one())]
    batch_size_per_replica: usize,
    /// Timed steps per configuration (after one warm-up step).
    #[arg(long, default_value_t = 10, value_parser = kandle_examples::at_least_one())]
    steps: usize,
    /// Elements in the fused buffer for the reduction benchmark (MiniGoogLeNet's gradients are
    /// 1,652,826).
    #[arg(long, default_value_t = 1_652_826, value_parser = kandle_examples::at_least_one())]
    buffer_len: usize,
    /// Repetitions of each reduction.
    #[arg(long, default_value_t = 20, value_parser = kandle_examples::at_least_one())]
    reps: usize,
}

fn time<F: FnMut() -> Result<()>>(reps: usize, mut f: F) -> Result<f64> {
    f()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        samples.push(start.elapsed().as_secs_f64());
    }
    median(samples).context("at least one repetition is needed")
}

fn reduction_benchmark(args: &Args) -> Result<()> {
    let bytes = args.buffer_len * 4;
    println!(
        "## In-process reduction of one fused buffer ({} floats, {:.1} MB)",
        args.buffer_len,
        bytes as f64 / 1e6
    );
    println!("| replicas | ops | time (ms) | memcpy of the same bytes (ms) | ops / memcpy |");
    println!("|---|---|---|---|---|");
    for n in [2usize, 4] {
        let devices = vec![Device::Cpu; n];
        let buffers: Vec<Tensor> = (0..n)
            .map(|i| Tensor::full(i as f32, args.buffer_len, &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        // The least any reduction must move: every replica's buffer read once and the total
        // written back to every replica.
        let src: Vec<Vec<f32>> = (0..n).map(|i| vec![i as f32; args.buffer_len]).collect();
        let mut dst: Vec<Vec<f32>> = vec![vec![0f32; args.buffer_len]; n];
        let memcpy = time(args.reps, || {
            for (d, s) in dst.iter_mut().zip(&src) {
                d.copy_from_slice(s);
            }
            for d in dst.iter_mut() {
                d.copy_from_slice(&src[0]);
            }
            std::hint::black_box(&dst);
            Ok(())
        })?;
        for ops in [
            CrossDeviceOps::ReductionToOneDevice,
            CrossDeviceOps::HierarchicalCopy,
        ] {
            let t = time(args.reps, || {
                let out = ops.all_reduce(buffers.clone(), &devices)?;
                std::hint::black_box(out);
                Ok(())
            })?;
            println!(
                "| {n} | {ops:?} | {:.2} | {:.2} | {:.2} |",
                t * 1e3,
                memcpy * 1e3,
                t / memcpy
            );
        }
    }
    println!();
    Ok(())
}

fn spec(args: &Args) -> ModelSpec {
    let (network, input_shape) = match args.model {
        ModelKind::DigitsCnn => (kandle_models::digits_cnn(10), vec![1, 8, 8]),
        ModelKind::MiniGooglenet => (kandle_models::mini_googlenet(10), vec![3, 32, 32]),
    };
    ModelSpec {
        network: network.into(),
        input_shapes: vec![input_shape],
        optimizer: Box::new(Sgd::new(1e-3).momentum(0.9)),
        loss: kandle::Objective::new(SparseCategoricalCrossentropy::new()),
        metrics: [Accuracy].into(),
        seed: 0,
        compute_path: kandle::ComputePath::Auto,
        dtype_policy: kandle::DTypePolicy::default(),
    }
}

fn step_time(strategy: &dyn Strategy, args: &Args) -> Result<f64> {
    let spec = spec(args);
    let mut model = strategy.distribute(&spec)?;
    let n = args.batch_size_per_replica * strategy.num_replicas_in_sync();
    let mut dims = vec![n];
    dims.extend(&spec.input_shapes[0]);
    let labels: Vec<u32> = (0..n as u32).map(|i| i % 10).collect();
    let batch = Batch::new(
        Tensor::randn(0f32, 1., dims, &Device::Cpu)?,
        Tensor::from_vec(labels, n, &Device::Cpu)?,
    );
    time(args.steps, || {
        model.train_step(&batch, 1e-3)?;
        Ok(())
    })
}

fn step_benchmark(args: &Args) -> Result<()> {
    println!(
        "## Training step, {:?}, {} samples per replica, CPU replicas",
        args.model, args.batch_size_per_replica
    );
    println!("| strategy | replicas | step (ms) | images/s | efficiency vs 1 replica |");
    println!("|---|---|---|---|---|");
    let one = step_time(&OneDeviceStrategy::cpu(), args)?;
    let per_replica = args.batch_size_per_replica as f64;
    println!(
        "| one_device | 1 | {:.1} | {:.0} | 1.00 |",
        one * 1e3,
        per_replica / one
    );
    for n in [1usize, 2, 4] {
        let whole_buffer = ReplicaOptions::default().gradient_buckets(None);
        let strategies: Vec<(&str, Box<dyn Strategy>)> = vec![
            ("mirrored", Box::new(MirroredStrategy::cpu(n)?)),
            (
                "mirrored, one sum after backward",
                Box::new(MirroredStrategy::cpu(n)?.with_options(whole_buffer)),
            ),
            ("central_storage", Box::new(CentralStorageStrategy::cpu(n)?)),
        ];
        for (name, strategy) in strategies {
            let t = step_time(strategy.as_ref(), args)?;
            let images = per_replica * n as f64 / t;
            println!(
                "| {name} | {n} | {:.1} | {images:.0} | {:.2} |",
                t * 1e3,
                images / (per_replica / one) / n as f64
            );
        }
    }
    println!();
    println!(
        "CPU replicas share this machine's {} cores, so efficiency below 1 on the CPU",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("measures the strategies' overhead, not device scaling.");
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    reduction_benchmark(&args)?;
    step_benchmark(&args)
}
