//! The validation split: where the validation side of the shuffled file list starts, and the
//! dataset cut there into its training and validation sides.

use super::ImageFolder;
use crate::{Error, Result};

/// Checks a [`validation_split`](super::ImageFolderBuilder::validation_split) fraction: strictly
/// between 0 and 1.
pub(super) fn check_fraction(fraction: Option<f64>) -> Result<()> {
    if let Some(f) = fraction {
        if !(f > 0.0 && f < 1.0) {
            return Err(Error::invalid(format!(
                "the validation split must be strictly between 0 and 1, got {f}"
            )));
        }
    }
    Ok(())
}

/// Where the validation side of the `n` images of `origin` starts, holding out the last
/// `floor(fraction × n)`; both sides must keep an image. `n` when there is no split.
pub(super) fn validation_start(fraction: Option<f64>, n: usize, origin: &str) -> Result<usize> {
    Ok(match fraction {
        Some(f) => {
            let val = (f * n as f64).floor() as usize;
            if val == 0 || val >= n {
                return Err(Error::invalid(format!(
                    "a validation split of {f} of the {n} images of {origin} leaves {} for \
                     training and {val} for validation; both need at least one",
                    n.saturating_sub(val)
                )));
            }
            n - val
        }
        None => n,
    })
}

impl ImageFolder {
    /// The samples before `at` (the training side) and from `at` on (the validation side), each
    /// with its cache slots.
    pub(super) fn split_at(mut self, at: usize) -> (Self, Self) {
        let at = at.min(self.files.len());
        let validation = Self {
            name: format!("{} (validation)", self.name),
            files: self.files.split_off(at),
            labels: self.labels.split_off(at),
            class_names: self.class_names.clone(),
            sample_shape: self.sample_shape,
            decode: self.decode,
            one_hot: self.one_hot,
            cache: self.cache.as_mut().map(|c| c.split_off(at)),
        };
        self.name = format!("{} (training)", self.name);
        (self, validation)
    }
}
