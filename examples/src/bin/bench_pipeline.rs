//! The pipeline's bubble and memory, measured: `PipelineStrategy` with 2 stages on this CPU
//! (a thread and a core each), GPipe and 1F1B, M = 1, 2, 4 and 8 micro-batches, against one
//! device on the same cores. It prints, for every run, the median step, the idle share of each
//! stage's step (measured: the time each stage waited for the other, over the step) beside
//! GPipe's `(S - 1) / (M + S - 1)`, the micro-batches each stage held at once, and the
//! activation memory they came to; then a memory budget per device that the model exceeds on
//! one device and meets on each of two stages, and trains across them. It writes
//! `plots/pipeline_bubble.png` and its CSV.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin bench_pipeline [-- --steps 6 --batch 64]
//! ```
//!
//! The model is a stack of equal convolutions (so two stages of equal cost exist and the
//! balanced split finds them): 8 x [3x3 convolution of 32 channels, ReLU] on 32x32 images,
//! global pooling and a classifier.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use candle_core::{Device, Tensor};
use clap::Parser;
use kandle::prelude::*;
use kandle_examples::scaling_plot::{self, Mark, Series};
use kandle_strategies::pipeline::{ideal_idle_fraction, PipelineStrategy, Schedule};
use kandle_strategies::{ReplicaOptions, ReplicaThreads};

#[derive(Parser, Debug)]
#[command(about = "The pipeline's bubble and activation memory, measured against GPipe's formula")]
struct Args {
    /// Timed steps per configuration (after 2 warm-up steps).
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// The global batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Where the plot and its CSV go.
    #[arg(long, default_value = "plots/pipeline_bubble.png")]
    output: PathBuf,
}

const IMAGE: [usize; 3] = [3, 32, 32];

fn model() -> Sequential {
    let mut net = Sequential::new();
    for _ in 0..8 {
        net.push(Conv2D::new(32, 3).padding(Padding::Same));
        net.push(Activation::Relu);
    }
    net.add(GlobalAveragePooling2D)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

/// One configuration's figures.
struct Run {
    label: String,
    step: Duration,
    idle: Option<f64>,
    held: Vec<usize>,
    activation_bytes: Vec<usize>,
    /// Each stage's memory for weights and SGD's momentum, and its activations for one sample.
    weight_bytes: Vec<usize>,
    per_sample: Vec<usize>,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Trains `steps` steps (after two warm-up steps) under `strategy`; the pipeline, when it is
/// one, reports each step.
fn time_steps<S: Strategy + Clone + 'static>(
    strategy: &S,
    pipeline: Option<&PipelineStrategy>,
    args: &Args,
    label: String,
) -> Result<Run> {
    let mut model = model().compile(
        Sgd::new(0.01).momentum(0.9),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        strategy,
    )?;
    model.build(&IMAGE)?;
    let mut shape = vec![args.batch];
    shape.extend(IMAGE);
    let x = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?;
    let classes: Vec<u32> = (0..args.batch as u32).map(|i| i % 10).collect();
    let y = Tensor::from_vec(classes, args.batch, &Device::Cpu)?;
    let (mut steps, mut idle) = (Vec::new(), Vec::new());
    for step in 0..args.steps + 2 {
        let start = std::time::Instant::now();
        model.train_on_batch(&x, &y, None)?;
        let took = start.elapsed().as_secs_f64();
        if step < 2 {
            continue;
        }
        steps.push(took);
        if let Some(report) = pipeline.and_then(PipelineStrategy::last_step) {
            idle.push(report.idle_fraction());
        }
    }
    let summary = model.summary()?;
    let micro = match pipeline {
        Some(p) => args.batch.div_ceil(p.micro_batches_per_batch()),
        None => args.batch,
    };
    Ok(Run {
        label,
        step: Duration::from_secs_f64(median(steps)),
        idle: (!idle.is_empty()).then(|| median(idle)),
        held: summary
            .stages
            .iter()
            .map(|s| s.micro_batches_held)
            .collect(),
        activation_bytes: summary
            .stages
            .iter()
            .map(|s| s.activation_bytes(micro))
            .collect(),
        weight_bytes: summary.stages.iter().map(|s| s.params * 4 * 2).collect(),
        per_sample: summary
            .stages
            .iter()
            .map(|s| s.activation_bytes_per_sample)
            .collect(),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle::keep_freed_memory();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!(
        "bench_pipeline: 2 stages on {cores} core(s), batch {}, {} timed steps each",
        args.batch, args.steps
    );
    let one = time_steps(
        &kandle::OneDeviceStrategy::cpu(),
        None,
        &args,
        "one device".into(),
    )?;
    println!("one device: {:.1} ms a step", one.step.as_secs_f64() * 1e3);
    println!();
    println!("| schedule | M | step | vs one device | idle (measured) | idle (S-1)/(M+S-1) | micro-batches held per stage | activations held per stage |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut csv = String::from(
        "schedule,micro_batches,step_ms,idle_measured,idle_ideal,held,activation_bytes\n",
    );
    let mut series = Vec::new();
    let mut last = None;
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let mut points = Vec::new();
        for micro in [1, 2, 4, 8] {
            let strategy = PipelineStrategy::cpu(2)?
                .micro_batches(micro)
                .schedule(schedule)
                .with_options(ReplicaOptions::default().threads_per_replica(ReplicaThreads::Auto));
            let run = time_steps(&strategy, Some(&strategy), &args, format!("{schedule}"))?;
            let ideal = ideal_idle_fraction(2, micro);
            let idle = run.idle.unwrap_or(f64::NAN);
            let bytes: Vec<String> = run
                .activation_bytes
                .iter()
                .map(|b| format!("{:.1} MiB", *b as f64 / (1 << 20) as f64))
                .collect();
            println!(
                "| {} | {micro} | {:.1} ms | {:.2}x | {:.1}% | {:.1}% | {:?} | {} |",
                run.label,
                run.step.as_secs_f64() * 1e3,
                one.step.as_secs_f64() / run.step.as_secs_f64(),
                idle * 100.0,
                ideal * 100.0,
                run.held,
                bytes.join(", ")
            );
            csv.push_str(&format!(
                "{schedule},{micro},{:.3},{idle:.4},{ideal:.4},{:?},{:?}\n",
                run.step.as_secs_f64() * 1e3,
                run.held,
                run.activation_bytes
            ));
            points.push((micro, idle));
            last = Some(run);
        }
        series.push(Series {
            label: format!("{schedule}, measured"),
            points,
            mark: Mark::Points,
        });
    }
    series.push(Series {
        label: "(S - 1) / (M + S - 1), S = 2".into(),
        points: [1, 2, 4, 8]
            .iter()
            .map(|&m| (m, ideal_idle_fraction(2, m)))
            .collect(),
        mark: Mark::Line,
    });
    scaling_plot::draw_idle(
        &args.output,
        "The pipeline's bubble: 2 stages on the CPU",
        &format!(
            "8 equal convolutions, batch {}, {cores} cores; idle = time a stage waited / step",
            args.batch
        ),
        &series,
    )?;
    if let Some(run) = last {
        budget(&run, &args);
    }
    let csv_path = args.output.with_extension("csv");
    kandle::checkpoint::write_atomically(&csv_path, csv.as_bytes())?;
    println!(
        "\nwrote {} and {}",
        args.output.display(),
        csv_path.display()
    );
    Ok(())
}

/// A memory budget per device that the model exceeds on one device (its weights and momentum,
/// and every layer's activations for the whole batch) and that each stage of `run` (1F1B, 8
/// micro-batches: the micro-batches it held) meets, as the run that trained it shows.
fn budget(run: &Run, args: &Args) {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let weights: usize = run.weight_bytes.iter().sum();
    let one_device = weights + run.per_sample.iter().sum::<usize>() * args.batch;
    let stages: Vec<usize> = run
        .weight_bytes
        .iter()
        .zip(&run.activation_bytes)
        .map(|(w, a)| w + a)
        .collect();
    let largest = stages.iter().copied().max().unwrap_or(0);
    let budget = (largest + one_device) / 2;
    println!(
        "\nmemory: one device needs {:.1} MiB (weights and momentum {:.2} MiB, activations of {} \
         samples); the stages of {} with 8 micro-batches need {} MiB each: a budget of {:.1} MiB \
         per device holds each stage and not the whole model, which trained across the two",
        mib(one_device),
        mib(weights),
        args.batch,
        run.label,
        stages
            .iter()
            .map(|b| format!("{:.1}", mib(*b)))
            .collect::<Vec<_>>()
            .join(" and "),
        mib(budget)
    );
}
