//! Training throughput measured through the normal `Model::fit` path: MiniGoogLeNet on
//! CIFAR-shaped synthetic images (the tutorial's pipeline: pixel bytes scaled to `[0, 1]`,
//! one-hot labels, SGD with momentum), a few warm-up steps, then timed steps.
//!
//! A step's time is the interval between the ends of consecutive steps, as an
//! `on_train_batch_end` callback sees them (the first step's from its beginning), so it
//! includes waiting for the loader; the reported figure is the median over the timed steps.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kandle::callbacks::{Callback, Logs};
use kandle::data::Cifar10Dataset;
use kandle::prelude::*;

/// What to run for one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Images per replica per step.
    pub batch_size_per_replica: usize,
    /// Untimed steps first (compilation, allocation, caches).
    pub warmup_steps: usize,
    /// Timed steps after the warm-up.
    pub timed_steps: usize,
}

/// One measured configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// The strategy's name, e.g. `mirrored`.
    pub strategy: String,
    /// Replicas in sync, across all workers.
    pub replicas: usize,
    /// Images per step, across all replicas.
    pub global_batch: usize,
    /// The median time of the timed steps, in seconds.
    pub step_seconds: f64,
    /// The model's trainable parameters (the all-reduced gradient has this many `f32`s).
    pub trainable: usize,
}

impl Measurement {
    /// Images per second: the global batch over the step time.
    pub fn images_per_second(&self) -> f64 {
        self.global_batch as f64 / self.step_seconds
    }

    /// Scaling efficiency against the one-replica `baseline`: images/s here over `replicas`
    /// times the baseline's images/s.
    pub fn efficiency(&self, baseline: &Measurement) -> f64 {
        self.images_per_second() / (self.replicas as f64 * baseline.images_per_second())
    }
}

/// The middle value of `xs` (the upper of the two middle ones for an even count); `None` when
/// empty.
pub fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied()
}

/// `images` CIFAR-shaped images of deterministic pseudo-random bytes with labels cycling
/// through the ten classes, read as the tutorial reads them: pixels in `[0, 1]`, one-hot
/// labels.
pub fn synthetic_cifar(images: usize) -> Result<Cifar10Dataset> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let pixels = (0..images * 3 * 32 * 32)
        .map(|_| {
            // xorshift64: cheap, deterministic, and far from constant.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 56) as u8
        })
        .collect();
    let labels = (0..images).map(|i| (i % 10) as u8).collect();
    Ok(Cifar10Dataset::new(pixels, labels)?
        .named("synthetic CIFAR-10")
        .with_scale(1.0 / 255.0)?
        .one_hot())
}

/// Records when the first training step begins and when each step ends.
struct StepClock {
    marks: Arc<Mutex<Vec<Instant>>>,
}

impl StepClock {
    fn mark(&self) {
        if let Ok(mut marks) = self.marks.lock() {
            marks.push(Instant::now());
        }
    }
}

impl Callback for StepClock {
    fn on_train_batch_begin(&mut self, batch: usize, _model: &mut Model) -> kandle::Result<()> {
        if batch == 0 {
            self.mark();
        }
        Ok(())
    }

    fn on_train_batch_end(
        &mut self,
        _batch: usize,
        _logs: &Logs,
        _model: &mut Model,
    ) -> kandle::Result<()> {
        self.mark();
        Ok(())
    }
}

/// Trains `kandle_models::mini_googlenet(10)` under `strategy` for the warm-up and timed steps
/// of `workload` with `Model::fit`, and returns the median timed step.
pub fn measure(strategy: &Arc<dyn Strategy>, workload: Workload) -> Result<Measurement> {
    if workload.timed_steps == 0 || workload.batch_size_per_replica == 0 {
        bail!("at least one timed step of at least one image per replica is needed");
    }
    let replicas = strategy.num_replicas_in_sync();
    let global_batch = workload.batch_size_per_replica * replicas;
    let steps = workload.warmup_steps + workload.timed_steps;
    let data = synthetic_cifar(global_batch * steps)?;
    let mut model = kandle_models::mini_googlenet(10).compile(
        Sgd::new(5e-3).momentum(0.9),
        CategoricalCrossentropy::new(),
        [Accuracy],
        strategy,
    )?;
    model.build(&[3, 32, 32])?;
    let trainable = model.summary()?.trainable;

    let marks = Arc::new(Mutex::new(Vec::with_capacity(steps + 1)));
    let clock = StepClock {
        marks: Arc::clone(&marks),
    };
    model.fit(
        &data,
        FitOptions {
            epochs: 1,
            batch_size_per_replica: workload.batch_size_per_replica,
            shuffle: false,
            steps_per_epoch: Some(steps),
            verbosity: Verbosity::Silent,
            callbacks: vec![Box::new(clock)],
            ..Default::default()
        },
    )?;
    let marks = marks
        .lock()
        .map(|m| m.clone())
        .map_err(|_| anyhow::anyhow!("the step clock was poisoned"))?;
    if marks.len() != steps + 1 {
        bail!(
            "expected {steps} training steps, saw {}",
            marks.len().saturating_sub(1)
        );
    }
    // The first step from its beginning; each later one from the previous step's end.
    let mut seconds: Vec<f64> = marks
        .windows(2)
        .map(|w| w[1].duration_since(w[0]).as_secs_f64())
        .collect();
    let step_seconds =
        median(seconds.split_off(workload.warmup_steps)).context("no timed step was recorded")?;
    Ok(Measurement {
        strategy: strategy.name().to_string(),
        replicas,
        global_batch,
        step_seconds,
        trainable,
    })
}
