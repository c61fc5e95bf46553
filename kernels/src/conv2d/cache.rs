//! Inference's lowered kernels, kept between calls.
//!
//! Before its first product, a forward pass lowers the kernel for its plan: Winograd's
//! transform of every `3x3` tap matrix, or the direct correlation's packing into the
//! micro-kernel's panels. In training the weights change every step, but in inference the same
//! weights (and folded BatchNorm scales) come back call after call, and the lowering is a few
//! percent of a forward pass. A [`KernelCache`] keeps the last lowering with the exact values it
//! was made from; a call whose plan, weights and scale are bit for bit those reuses it, any
//! other lowers again and takes the cache's place. The comparison reads the weights once,
//! where the lowering reads them and writes four times as much.

use std::sync::{Arc, Mutex, PoisonError};

use super::lowered::Lowered;
use super::plan::Plan;

/// The last lowered kernel of one convolution (a layer keeps one), with the values it was
/// made from. Shared by threads: a call holds the lock only to look or to replace.
#[doc(hidden)]
#[derive(Default)]
pub struct KernelCache {
    last: Mutex<Option<Arc<Entry>>>,
}

impl std::fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelCache").finish_non_exhaustive()
    }
}

/// A lowered kernel and what it was lowered from.
pub(crate) struct Entry {
    plan: Plan,
    weights: Vec<f32>,
    scale: Vec<f32>,
    pub lowered: Lowered,
}

impl KernelCache {
    /// The kernel lowered for `plan` from the weights `w` times the per-output-channel `scale`
    /// (none: one): the cached one when it was made from these very values, otherwise
    /// `lower()`'s, which replaces it.
    pub(crate) fn lowered<E>(
        &self,
        plan: &Plan,
        (w, scale): (&[f32], Option<&[f32]>),
        lower: impl FnOnce() -> Result<Lowered, E>,
    ) -> Result<Arc<Entry>, E> {
        let scale = scale.unwrap_or(&[]);
        let last = self
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(entry) = last {
            if entry.plan == *plan && same_bits(&entry.weights, w) && same_bits(&entry.scale, scale)
            {
                return Ok(entry);
            }
        }
        let entry = Arc::new(Entry {
            plan: *plan,
            weights: w.to_vec(),
            scale: scale.to_vec(),
            lowered: lower()?,
        });
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(entry.clone());
        Ok(entry)
    }
}

/// Whether `a` and `b` hold the same values bit for bit (a NaN equals the same NaN).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    /// Values compared per block, with one branch a block, so the loop vectorises.
    const BLOCK: usize = 64;
    a.len() == b.len()
        && a.chunks(BLOCK).zip(b.chunks(BLOCK)).all(|(x, y)| {
            x.iter()
                .zip(y)
                .fold(0u32, |diff, (p, q)| diff | (p.to_bits() ^ q.to_bits()))
                == 0
        })
}

#[cfg(test)]
mod tests {
    use super::same_bits;

    #[test]
    fn compares_bits() {
        let a: Vec<f32> = (0..200).map(|i| i as f32 * 0.5).collect();
        let mut b = a.clone();
        assert!(same_bits(&a, &b));
        b[150] = -b[150] - 1.0;
        assert!(!same_bits(&a, &b));
        assert!(!same_bits(&a, &a[..199]));
        // Bits, not values: zero's sign counts and a NaN matches itself.
        assert!(!same_bits(&[0.0], &[-0.0]));
        assert!(same_bits(&[f32::NAN], &[f32::NAN]));
    }
}
