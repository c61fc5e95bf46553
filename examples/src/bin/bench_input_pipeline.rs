//! Measures the CIFAR-10 input pipeline of the MiniGoogLeNet tutorial and compares it with the
//! rate at which a training step consumes images: the pipeline must never be the bottleneck
//! (the goal is at least 10x the training rate).
//!
//! The pipeline is the tutorial's: 50,000 training images read from files in the official
//! binary format, the training set's mean image subtracted, one-hot labels, a shuffle, random
//! shifts of up to 10% with nearest fill and random horizontal flips, batches of 64 assembled in
//! parallel and prefetched by a background thread. Without `--data-dir`, the files are a
//! synthetic set of the real size written to a temporary directory.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin bench_input_pipeline
//! cargo run --release -p kandle-examples --bin bench_input_pipeline -- --data-dir ~/data/cifar10
//! ```
//!
//! It also times real MiniGoogLeNet training steps on the CPU fed by the same loader, and how
//! long each step waited for its batch.
//!
//! The second part is ImageNet's pipeline: JPEG files (`--jpeg-images` of 500x375, the size of
//! a typical photo, written to a temporary folder) decoded and resized to 224x224 by
//! `ImageFolder`, on one core and through the loader on every core, against what a ResNet-50
//! training step consumes: measured here on the CPU, and the 2,500 to 3,000 images/s an H100
//! trains ResNet-50 at in mixed precision. These are measurements, never pass/fail tests.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use kandle::data::{
    cifar10, Batch, Dataset, Loader, LoaderOptions, MeanImage, MeanSubtracted, RandomShiftFlip,
};
use kandle::prelude::*;
use kandle::strategy::ModelSpec;

/// MiniGoogLeNet training throughput on this kind of CPU with PyTorch, measured elsewhere.
const PYTORCH_CPU_IMAGES_PER_S: f64 = 125.0;
/// MiniGoogLeNet training throughput on this kind of CPU with kandle, measured elsewhere.
const KANDLE_CPU_IMAGES_PER_S: f64 = 12.0;

#[derive(Parser, Debug)]
#[command(about = "Benchmark the CIFAR-10 input pipeline against the training step")]
struct Args {
    /// A directory with the real CIFAR-10 binary files; default: a synthetic set of the same
    /// size in a temporary directory.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Records per synthetic training file (the real files hold 10,000), 5 at least: the test
    /// file holds a fifth as many.
    #[arg(long, default_value_t = 10_000, value_parser = at_least_five())]
    records_per_file: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 64, value_parser = kandle_examples::at_least_one())]
    batch_size: usize,
    /// Timed epochs of the loader per configuration.
    #[arg(long, default_value_t = 2, value_parser = kandle_examples::at_least_one())]
    epochs: usize,
    /// Batches the prefetch thread may hold ready.
    #[arg(long, default_value_t = 2)]
    prefetch: usize,
    /// Timed MiniGoogLeNet training steps (after one warm-up step); 0 skips them.
    #[arg(long, default_value_t = 3)]
    train_steps: usize,
    /// JPEG files for the ImageNet-sized part (0 skips it).
    #[arg(long, default_value_t = 256)]
    jpeg_images: usize,
    /// Batch of the timed ResNet-50 training step on the CPU (224x224, one warm-up step and
    /// one timed); 0 skips it.
    #[arg(long, default_value_t = 8)]
    resnet50_batch: usize,
}

/// ResNet-50 training throughput of an H100 in mixed precision, images/s (the range quoted
/// for well-tuned PyTorch and JAX pipelines).
const H100_RESNET50_IMAGES_PER_S: (f64, f64) = (2500.0, 3000.0);

/// Writes `n` JPEG photos of 500x375 (smooth gradients and noise, quality 90) into two class
/// folders under `dir`.
fn write_jpegs(dir: &std::path::Path, n: usize) -> Result<()> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    for class in ["a", "b"] {
        std::fs::create_dir_all(dir.join(class))?;
    }
    for i in 0..n {
        let (fx, fy) = (rng.random_range(0.5..2.0f32), rng.random_range(0.5..2.0f32));
        let image = image::RgbImage::from_fn(500, 375, |x, y| {
            let base = |f: f32, v: u32, k: f32| ((v as f32 * f * k).sin() * 100.0 + 128.0) as i32;
            let noise = rng.random_range(-20..=20);
            let channel = |f, v, k| (base(f, v, k) + noise).clamp(0, 255) as u8;
            image::Rgb([
                channel(fx, x, 0.02),
                channel(fy, y, 0.03),
                channel(fx + fy, x + y, 0.01),
            ])
        });
        let path = dir.join(["a", "b"][i % 2]).join(format!("{i}.jpg"));
        let file = std::io::BufWriter::new(std::fs::File::create(&path)?);
        image::codecs::jpeg::JpegEncoder::new_with_quality(file, 90).encode_image(&image)?;
    }
    Ok(())
}

/// The ImageNet-sized part: JPEG decoding and resizing to 224x224 against ResNet-50's step.
fn jpeg_pipeline(args: &Args) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("kandle-bench-jpeg-{}", std::process::id()));
    let _cleanup = TempDir(dir.clone());
    write_jpegs(&dir, args.jpeg_images)?;
    let folder = kandle::data::ImageFolder::from_dir(&dir)
        .image_size(224, 224)
        .build()?;
    let mut x = vec![0f32; 3 * 224 * 224];
    let mut y = [0f32; 1];
    let start = Instant::now();
    for i in 0..folder.len() {
        folder.read(i, &mut x, &mut y)?;
    }
    let one_core = folder.len() as f64 / start.elapsed().as_secs_f64();
    let options = LoaderOptions {
        batch_size: args.batch_size,
        shuffle: true,
        seed: 0,
        prefetch: args.prefetch,
        ..Default::default()
    };
    let all_cores = loader_rate(&Loader::new(&folder, options)?, args.epochs)?;
    println!(
        "## ImageNet-sized: {} JPEGs of 500x375 decoded and resized to 224x224",
        folder.len()
    );
    println!("| pipeline | images/s |");
    println!("|---|---|");
    println!("| ImageFolder::read, one core | {one_core:.0} |");
    println!(
        "| the loader, batch {}, prefetch {}, every core | {all_cores:.0} |",
        args.batch_size, args.prefetch
    );
    let (low, high) = H100_RESNET50_IMAGES_PER_S;
    println!(
        "An H100 trains ResNet-50 at ~{low:.0}-{high:.0} images/s (mixed precision): this \
         machine's pipeline feeds {:.1}% to {:.1}% of it; {:.0} to {:.0} cores like these would \
         keep up.",
        100.0 * all_cores / high,
        100.0 * all_cores / low,
        (low / one_core).ceil(),
        (high / one_core).ceil()
    );
    if args.resnet50_batch > 0 {
        let step = resnet50_step(args.resnet50_batch)?;
        let rate = args.resnet50_batch as f64 / step;
        println!(
            "A kandle ResNet-50 training step on this CPU (batch {}, 224x224): {:.2} s, {rate:.1} \
             images/s; the pipeline delivers {:.0}x that.",
            args.resnet50_batch,
            step,
            all_cores / rate
        );
    }
    println!();
    Ok(())
}

/// Seconds of one ResNet-50 training step (SGD) at batch `batch` on the CPU, after a warm-up
/// step.
fn resnet50_step(batch: usize) -> Result<f64> {
    let spec = ModelSpec {
        network: kandle_models::resnet50(1000)?.into(),
        input_shapes: vec![vec![3, 224, 224]],
        optimizer: Box::new(Sgd::new(1e-2).momentum(0.9)),
        loss: kandle::Objective::new(SparseCategoricalCrossentropy::new()),
        metrics: [Accuracy].into(),
        seed: 0,
        compute_path: kandle::ComputePath::Auto,
        dtype_policy: kandle::DTypePolicy::default(),
    };
    let mut model = OneDeviceStrategy::cpu().distribute(&spec)?;
    let labels: Vec<u32> = (0..batch as u32).collect();
    let batch = Batch::new(
        candle_core::Tensor::randn(0f32, 1., (batch, 3, 224, 224), &candle_core::Device::Cpu)?,
        candle_core::Tensor::from_vec(labels, batch, &candle_core::Device::Cpu)?,
    );
    model.train_step(&batch, 1e-2)?;
    let start = Instant::now();
    model.train_step(&batch, 1e-2)?;
    Ok(start.elapsed().as_secs_f64())
}

/// Removes the synthetic data when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The value parser of `--records-per-file`: 0 to 4 are refused, naming the flag.
fn at_least_five() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(5..)
}

/// Runs `epochs` epochs through the prefetching loader, taking every batch; returns images/s.
fn loader_rate(loader: &Loader, epochs: usize) -> Result<f64> {
    let start = Instant::now();
    let mut images = 0usize;
    for epoch in 0..epochs {
        std::thread::scope(|s| -> Result<()> {
            for batch in loader.spawn(s, epoch) {
                images += batch?.len();
            }
            Ok(())
        })?;
    }
    Ok(images as f64 / start.elapsed().as_secs_f64())
}

/// Trains MiniGoogLeNet on batches from `loader`: one warm-up step, then `steps` timed ones.
/// Returns (images/s of the timed steps, mean time a timed step waited for its batch).
fn train_rate(loader: &Loader, steps: usize) -> Result<(f64, Duration)> {
    let spec = ModelSpec {
        network: kandle_models::mini_googlenet(10).into(),
        input_shapes: vec![vec![3, 32, 32]],
        optimizer: Box::new(Sgd::new(1e-2).momentum(0.9)),
        loss: kandle::Objective::new(CategoricalCrossentropy::new()),
        metrics: [Accuracy].into(),
        seed: 0,
        compute_path: kandle::ComputePath::Auto,
        dtype_policy: kandle::DTypePolicy::default(),
    };
    let mut model = OneDeviceStrategy::cpu().distribute(&spec)?;
    std::thread::scope(|s| -> Result<(f64, Duration)> {
        let mut batches = loader.spawn(s, 0);
        let mut next = |waited: &mut Duration| -> Result<Batch> {
            let t = Instant::now();
            let batch = batches
                .next()
                .ok_or_else(|| anyhow::anyhow!("the epoch ended before the timed steps"))??;
            *waited += t.elapsed();
            Ok(batch)
        };
        let mut ignored = Duration::ZERO;
        model.train_step(&next(&mut ignored)?, 1e-2)?;
        let (mut waited, mut images) = (Duration::ZERO, 0usize);
        let start = Instant::now();
        for _ in 0..steps {
            let batch = next(&mut waited)?;
            model.train_step(&batch, 1e-2)?;
            images += batch.len();
        }
        let rate = images as f64 / start.elapsed().as_secs_f64();
        Ok((rate, waited / steps as u32))
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Other work on the machine skews every figure: say how busy it was.
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        let load: Vec<&str> = load.split_whitespace().take(3).collect();
        println!(
            "{cores} cores; load average before the run: {}",
            load.join(" ")
        );
    }
    let (dir, _cleanup) = match &args.data_dir {
        Some(dir) => (dir.clone(), None),
        None => {
            let dir =
                std::env::temp_dir().join(format!("kandle-bench-cifar-{}", std::process::id()));
            let t = Instant::now();
            kandle_examples::cifar10_fixture::write_fixture(
                &dir,
                args.records_per_file,
                args.records_per_file / 5,
                0,
            )?;
            println!(
                "Wrote a synthetic CIFAR-10 set ({} training records) to `{}` in {:.1} s",
                5 * args.records_per_file,
                dir.display(),
                t.elapsed().as_secs_f64()
            );
            (dir.clone(), Some(TempDir(dir)))
        }
    };

    let t = Instant::now();
    let data = cifar10::load(&dir)?.one_hot();
    let load_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mean = MeanImage::compute(&data.train)?;
    let mean_s = t.elapsed().as_secs_f64();
    let train: MeanSubtracted<_> = mean.subtract_from(data.train)?;
    println!(
        "Loaded {} training images in {load_s:.2} s; mean image in {mean_s:.2} s",
        train.len()
    );
    println!();

    let base = LoaderOptions {
        batch_size: args.batch_size,
        shuffle: true,
        seed: 0,
        prefetch: args.prefetch,
        ..Default::default()
    };
    let augmented = LoaderOptions {
        augment: Some(Arc::new(RandomShiftFlip::default())),
        ..base.clone()
    };
    let full = Loader::new(&train, augmented)?;
    let no_augment = Loader::new(&train, base)?;

    println!(
        "## Input pipeline alone, batch {}, {} epochs",
        args.batch_size, args.epochs
    );
    println!("| pipeline | images/s |");
    println!("|---|---|");
    let rate_plain = loader_rate(&no_augment, args.epochs)?;
    println!("| mean subtraction, one-hot, shuffle, prefetch | {rate_plain:.0} |");
    let rate = loader_rate(&full, args.epochs)?;
    println!("| the same + shifts and flips (the tutorial's) | {rate:.0} |");
    println!();

    println!(
        "## Against the training step (MiniGoogLeNet, batch {})",
        args.batch_size
    );
    println!(
        "Training consumes ~{PYTORCH_CPU_IMAGES_PER_S:.0} img/s (PyTorch CPU) / \
         ~{KANDLE_CPU_IMAGES_PER_S:.0} img/s (kandle CPU today), reference figures measured \
         elsewhere on this kind of machine."
    );
    println!(
        "Pipeline / PyTorch CPU step: {:.0}x; pipeline / kandle CPU step: {:.0}x (goal: >= 10x)",
        rate / PYTORCH_CPU_IMAGES_PER_S,
        rate / KANDLE_CPU_IMAGES_PER_S
    );
    if args.train_steps > 0 {
        let (train_rate, waited) = train_rate(&full, args.train_steps)?;
        println!(
            "Measured here: {} kandle MiniGoogLeNet steps on the CPU fed by this loader: \
             {train_rate:.1} img/s; pipeline / measured step: {:.0}x",
            args.train_steps,
            rate / train_rate
        );
        println!(
            "Each step waited {:.2} ms for its prefetched batch ({:.4}% of a {:.0} ms step).",
            waited.as_secs_f64() * 1e3,
            100.0 * waited.as_secs_f64() * train_rate / args.batch_size as f64,
            1e3 * args.batch_size as f64 / train_rate
        );
    }
    println!();
    if args.jpeg_images > 0 {
        jpeg_pipeline(&args)?;
    }
    Ok(())
}
