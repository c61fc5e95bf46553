//! Data augmentation: the [`Augment`] trait, a per-sample transform that the [`Loader`] applies
//! while it assembles a batch, and [`RandomShiftFlip`], the random shifts and horizontal flips
//! of Keras's `ImageDataGenerator(width_shift_range=0.1, height_shift_range=0.1,
//! horizontal_flip=True, fill_mode="nearest")`.
//!
//! The loader calls [`Augment::apply`] on each sample right after reading it, inside its
//! parallel batch assembly (so augmentation runs on every core, on the prefetch thread's side of
//! the channel). Each call gets its own [`StdRng`] seeded from the loader's seed, the epoch and
//! the sample's position in the epoch, so a batch is the same whatever the thread scheduling,
//! the same seed repeats a run, and each epoch draws new transforms. Augmentation is for
//! training only: set it on the training loader, never on an evaluation one.
//!
//! ```
//! use std::sync::Arc;
//! use kandle::data::{Augment, LoaderOptions, RandomShiftFlip};
//!
//! let options = LoaderOptions {
//!     batch_size: 64,
//!     shuffle: true,
//!     augment: Some(Arc::new(RandomShiftFlip::default())),
//!     ..Default::default()
//! };
//! # let _ = options;
//! ```
//!
//! [`Loader`]: super::Loader

use rand::rngs::StdRng;
use rand::Rng;

use crate::{Error, Result};

/// A random transform of one sample, in place.
///
/// Implemented by [`RandomShiftFlip`], and by any
/// `Fn(&mut [f32], &[usize], &mut StdRng) + Send + Sync` closure. The loader holds it as an
/// `Arc<dyn Augment>`.
pub trait Augment: Send + Sync {
    /// Transforms `sample`, whose shape is `shape` (the dataset's sample shape, e.g.
    /// `[3, 32, 32]`), drawing any randomness from `rng`.
    ///
    /// `sample` always holds `shape.iter().product()` values and `shape` has passed
    /// [`check_shape`](Self::check_shape).
    fn apply(&self, sample: &mut [f32], shape: &[usize], rng: &mut StdRng);

    /// Checks, once when the loader is built, that this transform can take samples of `shape`.
    /// The default accepts every shape.
    fn check_shape(&self, shape: &[usize]) -> Result<()> {
        let _ = shape;
        Ok(())
    }
}

impl<F> Augment for F
where
    F: Fn(&mut [f32], &[usize], &mut StdRng) + Send + Sync,
{
    fn apply(&self, sample: &mut [f32], shape: &[usize], rng: &mut StdRng) {
        self(sample, shape, rng)
    }
}

impl std::fmt::Debug for dyn Augment + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Augment")
    }
}

/// Random integer shifts with nearest-edge fill, then a random horizontal flip, of images laid
/// out as `(..., height, width)` (every leading dimension, such as the channels, is shifted
/// and flipped alike).
///
/// For each sample it draws a vertical shift `dy` uniformly from `-max..=max` with
/// `max = floor(height_shift_range * height)` (and `dx` likewise from the width), moves the
/// content down by `dy` and right by `dx` rows and columns, and fills the uncovered border with
/// the nearest edge pixel (Keras's `fill_mode="nearest"`). Then, with probability 0.5 when
/// [`horizontal_flip`](Self::horizontal_flip) is set, it mirrors every row. Output pixel
/// `(y, x)` is input pixel `(clamp(y - dy), clamp(x' - dx))` with `x' = width - 1 - x` when
/// flipped and `x` otherwise.
///
/// The default is the CIFAR-10 tutorial's generator: ranges 0.1 and 0.1 (shifts of -3..=3
/// pixels at 32×32) and flips on. Keras draws a real-valued shift and interpolates; this draws
/// whole pixels, so no value is ever blended.
///
/// ```
/// use kandle::data::{Augment, RandomShiftFlip};
/// use rand::SeedableRng;
///
/// let aug = RandomShiftFlip::default();
/// assert_eq!(aug.max_shifts(32, 32), (3, 3));
/// let mut image = vec![0.5f32; 3 * 32 * 32];
/// aug.apply(&mut image, &[3, 32, 32], &mut rand::rngs::StdRng::seed_from_u64(0));
/// assert!(image.iter().all(|&v| v == 0.5)); // a flat image stays flat
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomShiftFlip {
    /// Largest horizontal shift, as a fraction of the width, in `0..=1`. Default 0.1.
    pub width_shift_range: f32,
    /// Largest vertical shift, as a fraction of the height, in `0..=1`. Default 0.1.
    pub height_shift_range: f32,
    /// Whether to mirror each row with probability 0.5. Default `true`.
    pub horizontal_flip: bool,
}

impl Default for RandomShiftFlip {
    fn default() -> Self {
        Self {
            width_shift_range: 0.1,
            height_shift_range: 0.1,
            horizontal_flip: true,
        }
    }
}

impl RandomShiftFlip {
    /// The largest shifts in pixels, `(vertical, horizontal)`, for an image of
    /// `height × width`.
    pub fn max_shifts(&self, height: usize, width: usize) -> (usize, usize) {
        let max = |range: f32, size: usize| (range.clamp(0.0, 1.0) * size as f32) as usize;
        (
            max(self.height_shift_range, height),
            max(self.width_shift_range, width),
        )
    }

    /// Applies a given transform: shift down by `dy` and right by `dx` (negative: up, left),
    /// fill with the nearest edge, then mirror the rows if `flip`. This is what
    /// [`apply`](Augment::apply) does with the values it draws; `shape` must end in
    /// `(height, width)` and `sample` hold `shape.iter().product()` values, or nothing happens.
    pub fn transform(sample: &mut [f32], shape: &[usize], dy: isize, dx: isize, flip: bool) {
        let Some((h, w)) = plane(shape) else {
            return;
        };
        if h == 0 || w == 0 || sample.len() != shape.iter().product::<usize>() {
            return;
        }
        for plane in sample.chunks_exact_mut(h * w) {
            shift_rows(plane, w, dy);
            for row in plane.chunks_exact_mut(w) {
                shift_row(row, dx);
                if flip {
                    row.reverse();
                }
            }
        }
    }
}

impl Augment for RandomShiftFlip {
    fn apply(&self, sample: &mut [f32], shape: &[usize], rng: &mut StdRng) {
        let Some((h, w)) = plane(shape) else {
            return;
        };
        let (max_dy, max_dx) = self.max_shifts(h, w);
        let draw = |rng: &mut StdRng, max: usize| -> isize {
            let max = i64::try_from(max).unwrap_or(i64::MAX);
            if max == 0 {
                0
            } else {
                rng.random_range(-max..=max) as isize
            }
        };
        let dy = draw(rng, max_dy);
        let dx = draw(rng, max_dx);
        let flip = self.horizontal_flip && rng.random_bool(0.5);
        Self::transform(sample, shape, dy, dx, flip);
    }

    fn check_shape(&self, shape: &[usize]) -> Result<()> {
        for (name, range) in [
            ("width_shift_range", self.width_shift_range),
            ("height_shift_range", self.height_shift_range),
        ] {
            if !(0.0..=1.0).contains(&range) {
                return Err(Error::invalid(format!(
                    "RandomShiftFlip: {name} must be a fraction in 0..=1, got {range}"
                )));
            }
        }
        match plane(shape) {
            Some(_) => Ok(()),
            None => Err(Error::invalid(format!(
                "RandomShiftFlip needs samples of shape (..., height, width), got {shape:?}"
            ))),
        }
    }
}

/// The `(height, width)` of a shape with at least two dimensions.
fn plane(shape: &[usize]) -> Option<(usize, usize)> {
    match shape {
        [.., h, w] => Some((*h, *w)),
        _ => None,
    }
}

/// Moves the rows of a `rows × w` plane down by `dy` (up when negative), repeating the edge row
/// into the uncovered rows.
fn shift_rows(plane: &mut [f32], w: usize, dy: isize) {
    let h = plane.len() / w;
    let d = dy.unsigned_abs().min(h.saturating_sub(1));
    if d == 0 {
        return;
    }
    if dy > 0 {
        plane.copy_within(0..(h - d) * w, d * w);
        for r in 0..d {
            plane.copy_within(d * w..(d + 1) * w, r * w);
        }
    } else {
        plane.copy_within(d * w.., 0);
        let last = h - d - 1;
        for r in h - d..h {
            plane.copy_within(last * w..(last + 1) * w, r * w);
        }
    }
}

/// Moves a row right by `dx` (left when negative), repeating the edge value.
fn shift_row(row: &mut [f32], dx: isize) {
    let w = row.len();
    let d = dx.unsigned_abs().min(w.saturating_sub(1));
    if d == 0 {
        return;
    }
    if dx > 0 {
        row.copy_within(0..w - d, d);
        let edge = row[d];
        row[..d].fill(edge);
    } else {
        row.copy_within(d.., 0);
        let edge = row[w - d - 1];
        row[w - d..].fill(edge);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// A 4×4 single-channel image holding 0..16 in row-major order.
    fn grid() -> Vec<f32> {
        (0..16).map(|v| v as f32).collect()
    }

    const SHAPE: [usize; 3] = [1, 4, 4];

    fn shifted(dy: isize, dx: isize, flip: bool) -> Vec<f32> {
        let mut x = grid();
        RandomShiftFlip::transform(&mut x, &SHAPE, dy, dx, flip);
        x
    }

    #[test]
    fn shift_right_and_down_fills_with_the_nearest_edge() {
        #[rustfmt::skip]
        let expected = vec![
            0., 0., 1., 2.,
            0., 0., 1., 2.,
            4., 4., 5., 6.,
            8., 8., 9., 10.,
        ];
        assert_eq!(shifted(1, 1, false), expected);
    }

    #[test]
    fn shift_left_and_up_fills_with_the_nearest_edge() {
        #[rustfmt::skip]
        let expected = vec![
            10., 11., 11., 11.,
            14., 15., 15., 15.,
            14., 15., 15., 15.,
            14., 15., 15., 15.,
        ];
        assert_eq!(shifted(-2, -2, false), expected);
    }

    #[test]
    fn shift_then_flip_and_oversized_shifts() {
        #[rustfmt::skip]
        let expected = vec![
            2., 1., 0., 0.,
            2., 1., 0., 0.,
            6., 5., 4., 4.,
            10., 9., 8., 8.,
        ];
        assert_eq!(shifted(1, 1, true), expected);
        // A shift past the size repeats the edge everywhere.
        let all_first_row_col = shifted(9, 9, false);
        assert!(all_first_row_col.iter().all(|&v| v == 0.0));
        assert_eq!(shifted(0, 0, false), grid());
    }

    #[test]
    fn every_pixel_moves_by_exactly_the_shift() {
        let (h, w) = (7usize, 5usize);
        let image: Vec<f32> = (0..2 * h * w).map(|v| v as f32).collect();
        for dy in -3..=3isize {
            for dx in -3..=3isize {
                let mut x = image.clone();
                RandomShiftFlip::transform(&mut x, &[2, h, w], dy, dx, false);
                for c in 0..2 {
                    for y in 0..h {
                        for xx in 0..w {
                            let sy = (y as isize - dy).clamp(0, h as isize - 1) as usize;
                            let sx = (xx as isize - dx).clamp(0, w as isize - 1) as usize;
                            assert_eq!(
                                x[(c * h + y) * w + xx],
                                image[(c * h + sy) * w + sx],
                                "dy {dy} dx {dx} at ({c}, {y}, {xx})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn flipping_twice_is_the_identity() {
        let image: Vec<f32> = (0..3 * 32 * 32).map(|v| v as f32).collect();
        let mut x = image.clone();
        RandomShiftFlip::transform(&mut x, &[3, 32, 32], 0, 0, true);
        assert_ne!(x, image);
        assert_eq!(x[0], 31.0);
        RandomShiftFlip::transform(&mut x, &[3, 32, 32], 0, 0, true);
        assert_eq!(x, image);
    }

    /// The `(dy, dx, flip)` that turns `image` into `out`, among all shifts up to 3.
    fn which_transform(
        image: &[f32],
        out: &[f32],
        shape: &[usize],
    ) -> Option<(isize, isize, bool)> {
        let mut found = None;
        for dy in -3..=3 {
            for dx in -3..=3 {
                for flip in [false, true] {
                    let mut x = image.to_vec();
                    RandomShiftFlip::transform(&mut x, shape, dy, dx, flip);
                    if x == out {
                        assert!(found.is_none(), "two transforms give the same image");
                        found = Some((dy, dx, flip));
                    }
                }
            }
        }
        found
    }

    #[test]
    fn random_draws_cover_the_range_and_repeat_with_the_seed() {
        let aug = RandomShiftFlip::default();
        let shape = [1, 32, 32];
        let image: Vec<f32> = (0..32 * 32).map(|v| v as f32).collect();
        let mut seen = std::collections::BTreeSet::new();
        let mut flips = 0;
        for seed in 0..300u64 {
            let mut x = image.clone();
            aug.apply(&mut x, &shape, &mut StdRng::seed_from_u64(seed));
            let (dy, dx, flip) = which_transform(&image, &x, &shape)
                .unwrap_or_else(|| panic!("seed {seed}: not a shift of at most 3 and a flip"));
            seen.insert((dy, dx));
            flips += usize::from(flip);
            let mut again = image.clone();
            aug.apply(&mut again, &shape, &mut StdRng::seed_from_u64(seed));
            assert_eq!(again, x, "seed {seed} repeats");
        }
        assert!(seen.len() > 40, "only {} of 49 shifts drawn", seen.len());
        assert!((100..200).contains(&flips), "{flips} flips in 300");
        let no_flip = RandomShiftFlip {
            horizontal_flip: false,
            height_shift_range: 0.0,
            ..Default::default()
        };
        for seed in 0..50u64 {
            let mut x = image.clone();
            no_flip.apply(&mut x, &shape, &mut StdRng::seed_from_u64(seed));
            let (dy, _, flip) = which_transform(&image, &x, &shape).unwrap();
            assert_eq!((dy, flip), (0, false));
        }
    }

    #[test]
    fn bad_settings_and_shapes_are_errors() {
        let aug = RandomShiftFlip::default();
        assert!(aug.check_shape(&[3, 32, 32]).is_ok());
        assert!(aug.check_shape(&[32, 32]).is_ok());
        assert!(aug.check_shape(&[10]).is_err());
        let bad = RandomShiftFlip {
            width_shift_range: 1.5,
            ..Default::default()
        };
        let err = bad.check_shape(&[3, 32, 32]).unwrap_err().to_string();
        assert!(err.contains("width_shift_range"), "{err}");
        // A mismatched buffer is left alone rather than panicking.
        let mut short = vec![1.0f32; 5];
        aug.apply(&mut short, &[3, 32, 32], &mut StdRng::seed_from_u64(1));
        assert_eq!(short, vec![1.0; 5]);
    }

    #[test]
    fn closures_and_pointers_are_augments() {
        let negate =
            |x: &mut [f32], _: &[usize], _: &mut StdRng| x.iter_mut().for_each(|v| *v = -*v);
        let boxed: Box<dyn Augment> = Box::new(negate);
        let shared: std::sync::Arc<dyn Augment> = std::sync::Arc::new(RandomShiftFlip::default());
        let mut x = vec![1.0f32, 2.0];
        boxed.apply(&mut x, &[2], &mut StdRng::seed_from_u64(0));
        assert_eq!(x, vec![-1.0, -2.0]);
        assert!(shared.check_shape(&[2]).is_err());
        assert_eq!(format!("{boxed:?}"), "Augment");
    }
}
