//! A small, learnable CIFAR-10 set in the official binary format, for tests and benchmarks,
//! built on the public API alone (`Cifar10Dataset::new` and `cifar10::save`). Not part of
//! kandle's API: kandle's unit tests (`data::cifar10`) and integration tests include this
//! file, and so does `kandle-examples`, whose benchmark and tests need CIFAR-format files
//! where the real set is not available.

use std::path::Path;

use kandle::data::cifar10::{self, Cifar10, Cifar10Dataset, IMAGE_LEN, NUM_CLASSES, TRAIN_FILES};
use rand::{Rng, RngCore, SeedableRng};

/// Writes a small CIFAR-10 set into `dir` (created if needed): the five training files with
/// `train_per_batch` records each and `test_batch.bin` with `test_records`, directly in `dir`,
/// so `cifar10::load(dir)` reads them.
///
/// The same `seed` writes the same bytes. Labels are uniform over the 10 classes. Each image is
/// noise (bytes 0..127) plus 100 on one band of 8 rows of one colour plane that depends on the
/// label (plane `label % 3`, rows `8 * (label / 3)..` onwards), so a small model can learn the
/// classes.
///
/// Errors when a count is 0 (the reader rejects empty files) or a file cannot be written.
pub fn write_fixture(
    dir: impl AsRef<Path>,
    train_per_batch: usize,
    test_records: usize,
    seed: u64,
) -> kandle::Result<()> {
    if train_per_batch == 0 || test_records == 0 {
        return Err(kandle::Error::invalid(format!(
            "a CIFAR-10 fixture needs at least one record per file, got {train_per_batch} per \
             training file and {test_records} test records"
        )));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut images = |n: usize| {
        let mut labels = Vec::with_capacity(n);
        let mut pixels = vec![0u8; n * IMAGE_LEN];
        for image in pixels.chunks_exact_mut(IMAGE_LEN) {
            let label: u8 = rng.random_range(0..NUM_CLASSES as u8);
            labels.push(label);
            rng.fill_bytes(image);
            let plane = usize::from(label % 3) * 32 * 32;
            let rows = usize::from(label / 3) * 8 * 32;
            for (k, p) in image.iter_mut().enumerate() {
                *p >>= 1;
                if (plane + rows..plane + rows + 8 * 32).contains(&k) {
                    *p += 100;
                }
            }
        }
        Cifar10Dataset::new(pixels, labels)
    };
    let train = images(TRAIN_FILES.len() * train_per_batch)?;
    let test = images(test_records)?;
    cifar10::save(dir, &Cifar10 { train, test })
}
