//! Optimizers' updates of `f32` CPU variables in place, as candle in-place ops: SGD's
//! ([`sgd`]) and Adam's ([`adam`]).
//!
//! Composed of candle's ops, an update allocates a tensor for each of its operations on every
//! variable and dispatches each to candle's thread pool; for a network of a hundred small
//! variables that is hundreds to a thousand operations per step. These ops write into the
//! variable and its state where they lie (as `Var::set` would), one pass each, split over the
//! current rayon pool for large variables. Each value is computed with the operations candle's
//! composition makes, in its order (`x * f64` is candle's affine `x * m + 0`), so the results
//! are the same bit for bit.

use candle_core::{CpuStorage, Layout};
use rayon::prelude::*;

pub mod adam;
pub mod sgd;

/// Values per rayon task: smaller variables are updated in one.
pub(crate) const CHUNK: usize = 1 << 15;

/// A contiguous `f32` slice of `storage` for `layout`, or an error naming `op`.
pub(crate) fn values<'a>(
    op: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((start, end))) => Ok(&v[start..end]),
        _ => candle_core::bail!("{op}: takes contiguous f32 tensors"),
    }
}

/// The mutable counterpart of [`values`].
pub(crate) fn values_mut<'a>(
    op: &str,
    storage: &'a mut CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a mut [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((start, end))) => Ok(&mut v[start..end]),
        _ => candle_core::bail!("{op}: takes contiguous f32 tensors"),
    }
}

/// Runs `f` over matching chunks of `dst` and the two sources, in parallel for large ones.
pub(crate) fn zip3(
    dst: &mut [f32],
    (a, b): (&[f32], &[f32]),
    f: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) {
    if dst.len() <= CHUNK {
        return f(dst, a, b);
    }
    dst.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(d, (a, b))| f(d, a, b));
}

/// Checks that the three operands have one length.
pub(crate) fn same_lengths(op: &str, lens: [usize; 3]) -> candle_core::Result<()> {
    if lens[1] != lens[0] || lens[2] != lens[0] {
        candle_core::bail!(
            "{op}: {} values to update from {} and {}",
            lens[0],
            lens[1],
            lens[2]
        );
    }
    Ok(())
}
