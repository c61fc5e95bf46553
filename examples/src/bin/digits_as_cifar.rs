//! Writes the bundled handwritten digits set (1,797 real 8×8 grey images, see
//! `kandle::data::digits`) in the CIFAR-10 binary format, so that `train_cifar10` can train on
//! real, learnable data where the CIFAR-10 archive cannot be downloaded.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin digits_as_cifar -- --out-dir data/digits-cifar
//! cargo run --release -p kandle-examples --bin train_cifar10 -- --data-dir data/digits-cifar \
//!     --title "MiniGoogLeNet on digits (CIFAR format)" --output plots/train_digits_cifar_format.png
//! ```
//!
//! The digits are split at random into training and test sets (`--test-fraction`, seeded by
//! `--seed`; 1,437 and 360 images by default, the split the quickstart uses). Each 8×8 image is
//! upsampled to 32×32 by repeating every pixel over a 4×4 block (nearest neighbour), its values
//! 0..16 become bytes `round(v * 255 / 16)`, and the grey plane is repeated as the red, green
//! and blue planes. Labels stay the digits 0..9. The training images fill `data_batch_1.bin` to
//! `data_batch_5.bin` in split order, as evenly as possible, and the test images
//! `test_batch.bin` (see `kandle::data::cifar10::save`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use kandle::data::cifar10::{self, Cifar10, Cifar10Dataset};
use kandle::data::{digits, Dataset, InMemoryDataset};

/// Pixels per side of a digit.
const DIGIT_SIDE: usize = digits::SAMPLE_SHAPE[2];

/// Pixels per side of a CIFAR image.
const CIFAR_SIDE: usize = cifar10::SAMPLE_SHAPE[2];

#[derive(Parser, Debug)]
#[command(about = "Write the bundled digits set as CIFAR-10 binary files (32x32, 3 channels)")]
struct Args {
    /// Where the six files go (created if needed).
    #[arg(long, default_value = "data/digits-cifar")]
    out_dir: PathBuf,
    /// Seed of the random train/test split.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Fraction of the digits in the test set.
    #[arg(long, default_value_t = 0.2)]
    test_fraction: f64,
}

/// The digits of `set` as CIFAR images: nearest-neighbour 32×32, grey over three planes.
fn as_cifar(set: &InMemoryDataset) -> Result<Cifar10Dataset> {
    let scale = CIFAR_SIDE / DIGIT_SIDE;
    let mut pixels = Vec::with_capacity(set.len() * cifar10::IMAGE_LEN);
    let mut labels = Vec::with_capacity(set.len());
    let (mut x, mut y) = (vec![0f32; DIGIT_SIDE * DIGIT_SIDE], [0f32; 1]);
    for i in 0..set.len() {
        set.read(i, &mut x, &mut y)?;
        // The loader scales the raw values 0..16 to [0, 1].
        let grey: Vec<u8> = (0..CIFAR_SIDE * CIFAR_SIDE)
            .map(|k| {
                let (row, col) = (k / CIFAR_SIDE / scale, k % CIFAR_SIDE / scale);
                (x[row * DIGIT_SIDE + col] * 255.0).round() as u8
            })
            .collect();
        for _ in 0..3 {
            pixels.extend_from_slice(&grey);
        }
        labels.push(y[0] as u8);
    }
    Ok(Cifar10Dataset::new(pixels, labels)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    let (train, test) = digits::load()?.train_test_split(args.test_fraction, args.seed)?;
    let data = Cifar10 {
        train: as_cifar(&train)?,
        test: as_cifar(&test)?,
    };
    cifar10::save(&args.out_dir, &data)
        .with_context(|| format!("writing the CIFAR files into {}", args.out_dir.display()))?;
    println!(
        "wrote {} training and {} test digits as 32x32x3 CIFAR-10 records into {}",
        data.train.len(),
        data.test.len(),
        args.out_dir.display()
    );
    Ok(())
}
