//! The cache of decoded samples: one slot per file, filled by the first read of the sample (or
//! at build time when verifying), so that later epochs only copy it.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use super::ImageFolder;
use crate::Result;

/// The cache slots of the samples in `order` (indices into `samples`, the build's file list),
/// filled with the samples decoded at build time, which are taken out of `samples`.
pub(super) fn slots(
    order: &[usize],
    samples: &mut [Option<Arc<[f32]>>],
) -> Vec<OnceLock<Arc<[f32]>>> {
    order
        .iter()
        .map(|&i| {
            let slot = OnceLock::new();
            if let Some(sample) = samples.get_mut(i).and_then(Option::take) {
                let _ = slot.set(sample);
            }
            slot
        })
        .collect()
}

impl ImageFolder {
    /// Sample `index` as [`read`](crate::data::Dataset::read) writes it: decoded, or from the
    /// cache.
    pub(super) fn sample(&self, index: usize, path: &Path) -> Result<Arc<[f32]>> {
        let slot = self.cache.as_ref().and_then(|c| c.get(index));
        if let Some(hit) = slot.and_then(OnceLock::get) {
            return Ok(hit.clone());
        }
        let decoded: Arc<[f32]> = self.decode.sample(path)?.into();
        if let Some(slot) = slot {
            // Another worker may have filled it meanwhile: both hold the same values.
            let _ = slot.set(decoded.clone());
        }
        Ok(decoded)
    }
}
