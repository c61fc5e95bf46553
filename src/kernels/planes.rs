//! What the CPU kernels share: borrowing a tensor's contiguous `f32` data, accurate sums, and
//! splitting work over the `(image, channel)` planes of an NCHW tensor with rayon.
//!
//! Work is split into a few tasks per thread of the *current* rayon pool
//! (`rayon::current_num_threads`), so a replica running in a smaller pool does not
//! oversubscribe the machine; no kernel spawns threads of its own.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Storage, Tensor};
use rayon::prelude::*;

/// Tasks per thread: enough to balance uneven planes, few enough to keep scheduling cheap.
const TASKS_PER_THREAD: usize = 4;

/// Lanes of the accumulators in [`lane_sums`], wide enough for the compiler to vectorise.
const LANES: usize = 16;

/// Values [`lane_sums`] adds in `f32` (`BLOCK / LANES` per lane) before it moves to `f64`.
const BLOCK: usize = 256;

/// `(images, channels, plane size)` of an `(N, C, ...)` shape; the plane is the product of the
/// dimensions after the channel axis (1 for `(N, C)`).
pub(crate) fn nc_plane(dims: &[usize]) -> (usize, usize, usize) {
    let n = dims.first().copied().unwrap_or(0);
    let c = dims.get(1).copied().unwrap_or(0);
    let s = dims.iter().skip(2).product();
    (n, c, s)
}

/// The contiguous `f32` data that `layout` describes in `storage`, or an error naming `op`.
pub(crate) fn f32_data<'a>(
    op: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&data[start..end]),
        (CpuStorage::F32(_), None) => {
            candle_core::bail!("{op}: expected a contiguous tensor, got {layout:?}")
        }
        (other, _) => candle_core::bail!("{op}: expected f32, got {:?}", other.dtype()),
    }
}

/// Runs `f` on the data of the CPU `f32` tensor `t`, made contiguous first when it is not.
pub(crate) fn with_f32<R>(
    op: &str,
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(f32_data(op, cpu, layout)?),
        _ => candle_core::bail!("{op}: expected a CPU tensor, got {:?}", t.device()),
    }
}

/// The smallest number of items a rayon task takes, so that `items` make a few tasks per thread
/// of the current pool.
pub(crate) fn min_len(items: usize) -> usize {
    items
        .div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD)
        .max(1)
}

/// Per-channel totals of `K` values that `plane` computes for each of the `n * c` planes
/// (called with the plane's index in `0..n * c` and its channel), summed in `f64` in image order.
pub(crate) fn channel_sums<const K: usize>(
    n: usize,
    c: usize,
    plane: impl Fn(usize, usize) -> [f64; K] + Sync + Send,
) -> Vec<[f64; K]> {
    let per_plane: Vec<[f64; K]> = (0..n * c)
        .into_par_iter()
        .with_min_len(min_len(n * c))
        .map(|i| plane(i, i % c))
        .collect();
    let mut totals = vec![[0f64; K]; c];
    for (i, sums) in per_plane.iter().enumerate() {
        for (t, v) in totals[i % c].iter_mut().zip(sums) {
            *t += v;
        }
    }
    totals
}

/// Fills `out`, `s` values per plane, in parallel: `fill` gets the plane's index, its channel
/// (of `c`; pass 1 when channels do not matter) and its slice.
pub(crate) fn for_each_plane<T: Send>(
    out: &mut [T],
    c: usize,
    s: usize,
    fill: impl Fn(usize, usize, &mut [T]) + Sync + Send,
) {
    if s == 0 {
        return;
    }
    let planes = out.len() / s;
    out.par_chunks_mut(s)
        .enumerate()
        .with_min_len(min_len(planes))
        .for_each(|(i, plane)| fill(i, i % c.max(1), plane));
}

/// Like [`for_each_plane`] for two outputs with `s` values per plane each: `fill` gets a
/// scratch value made by `init` (one per rayon task, reused across its planes), the plane's
/// index and its slices of `a` and `b`.
pub(crate) fn for_each_plane_pair<A: Send, B: Send, S>(
    a: &mut [A],
    b: &mut [B],
    s: usize,
    init: impl Fn() -> S + Sync + Send,
    fill: impl Fn(&mut S, usize, &mut [A], &mut [B]) + Sync + Send,
) {
    if s == 0 {
        return;
    }
    let planes = a.len() / s;
    a.par_chunks_mut(s)
        .zip(b.par_chunks_mut(s))
        .enumerate()
        .with_min_len(min_len(planes))
        .for_each_init(init, |scratch, (i, (pa, pb))| fill(scratch, i, pa, pb));
}

/// The sums of `term(a[i], b[i])`'s two parts over equally long slices. Blocks of
/// [`BLOCK`] values are summed in `f32` over [`LANES`] lanes, so that the loop vectorises, and
/// the block sums are added in `f64`, so that long sums keep their precision.
#[inline(always)]
pub(crate) fn lane_sums(a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> (f32, f32)) -> [f64; 2] {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut sums = [0f64; 2];
    for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        let mut first = [0f32; LANES];
        let mut second = [0f32; LANES];
        let body = ba.len() / LANES * LANES;
        for (ca, cb) in ba[..body]
            .chunks_exact(LANES)
            .zip(bb[..body].chunks_exact(LANES))
        {
            for k in 0..LANES {
                let (p, q) = term(ca[k], cb[k]);
                first[k] += p;
                second[k] += q;
            }
        }
        for (&x, &y) in ba[body..].iter().zip(&bb[body..]) {
            let (p, q) = term(x, y);
            first[0] += p;
            second[0] += q;
        }
        sums[0] += first.iter().map(|&v| v as f64).sum::<f64>();
        sums[1] += second.iter().map(|&v| v as f64).sum::<f64>();
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_sums_cover_body_and_tail() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b = vec![2f32; 19];
        let [s, p] = lane_sums(&a, &b, |x, y| (x, x * y));
        assert_eq!(s, 171.0);
        assert_eq!(p, 342.0);
        // Many blocks: 1000 ones in f32 blocks, exact in f64.
        let ones = vec![1f32; 1000];
        assert_eq!(lane_sums(&ones, &ones, |x, y| (x, x + y)), [1000.0, 2000.0]);
    }

    #[test]
    fn channel_sums_group_planes_by_channel() {
        // 2 images x 3 channels: plane i contributes i.
        let sums = channel_sums(2, 3, |i, ch| [i as f64, ch as f64]);
        assert_eq!(sums, vec![[3.0, 0.0], [5.0, 2.0], [7.0, 4.0]]);
    }
}
