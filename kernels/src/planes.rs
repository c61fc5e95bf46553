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

/// Lanes of the accumulators in [`PairSums`], wide enough for the compiler to vectorise.
const LANES: usize = 16;

/// Values [`PairSums`] adds in `f32` (about `BLOCK / LANES` per lane) before it moves to `f64`.
const BLOCK: usize = 512;

/// `(images, channels, plane size)` of an `(N, C, ...)` shape; the plane is the product of the
/// dimensions after the channel axis (1 for `(N, C)`).
pub(crate) fn nc_plane(dims: &[usize]) -> (usize, usize, usize) {
    let n = dims.first().copied().unwrap_or(0);
    let c = dims.get(1).copied().unwrap_or(0);
    let s = dims.iter().skip(2).product();
    (n, c, s)
}

#[cfg(feature = "test-support")]
thread_local! {
    /// How many times, on this thread, a kernel has borrowed a tensor's data through
    /// [`f32_data`]: every kernel does, forward and backward, on the thread that runs the op,
    /// so a count that does not move means no kernel ran. Per thread, so that tests running
    /// side by side do not count each other's kernels. Counted with the `test-support` feature only.
    static DATA_READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The current value of [`DATA_READS`] on this thread.
#[cfg(feature = "test-support")]
pub(crate) fn data_reads() -> usize {
    DATA_READS.with(std::cell::Cell::get)
}

/// The contiguous `f32` data that `layout` describes in `storage`, or an error naming `op`.
pub(crate) fn f32_data<'a>(
    op: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [f32]> {
    #[cfg(feature = "test-support")]
    DATA_READS.with(|reads| reads.set(reads.get() + 1));
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

/// Runs `f` on the data of the CPU `f32` tensor `t` of shape `(N, ...)`, from its first image's
/// first value to its last image's last, and the values from one image to the next. Read in
/// place when each image's values are contiguous: a contiguous tensor, or a range of channels
/// of one (`narrow` on axis 1, as a concatenation's branches take their gradient); made
/// contiguous first otherwise.
pub(crate) fn with_f32_images<R>(
    op: &str,
    t: &Tensor,
    f: impl FnOnce(&[f32], usize) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let image_len: usize = t.dims().iter().skip(1).product();
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some(image)) =
            (&*storage, image_stride(layout))
        {
            let (start, n) = (layout.start_offset(), layout.dims()[0]);
            let end = start + (n - 1) * image + image_len;
            if let Some(values) = data.get(start..end) {
                #[cfg(feature = "test-support")]
                DATA_READS.with(|reads| reads.set(reads.get() + 1));
                return f(values, image);
            }
        }
    }
    with_f32(op, t, |values| f(values, image_len))
}

/// The values from one image of `layout` to the next when each image's values are contiguous
/// and images do not overlap; `None` otherwise, or for no image at all.
fn image_stride(layout: &Layout) -> Option<usize> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let (&n, inner) = dims.split_first()?;
    if n == 0 {
        return None;
    }
    let mut expected = 1;
    for (&d, &stride) in inner.iter().zip(&strides[1..]).rev() {
        if d > 1 && stride != expected {
            return None;
        }
        expected *= d;
    }
    let image = if n > 1 { strides[0] } else { expected };
    (image >= expected).then_some(image)
}

/// The smallest number of items a rayon task takes, so that `items` make a few tasks per thread
/// of the current pool.
pub(crate) fn min_len(items: usize) -> usize {
    items
        .div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD)
        .max(1)
}

/// The `s` values of the channel `ch` in each image of `data` (planes of `s` values, the images
/// `image` values apart: `c * s` for a tensor of `c` channels, more for a range of a larger
/// tensor's channels), in image order.
pub(crate) fn channel_planes(
    data: &[f32],
    image: usize,
    s: usize,
    ch: usize,
) -> impl Iterator<Item = &[f32]> + Clone {
    data[ch * s..].chunks(image).map(move |image| &image[..s])
}

/// Fills `out`, `s` values per plane, in parallel: `fill` gets the plane's index, its channel
/// (of `c`; pass 1 when channels do not matter) and its slice.
pub(crate) fn for_each_plane<T: Send>(
    out: &mut [T],
    c: usize,
    s: usize,
    fill: impl Fn(usize, usize, &mut [T]) + Sync + Send,
) {
    for_each_plane_with(out, s, || (), |_, i, plane| fill(i, i % c.max(1), plane));
}

/// Like [`for_each_plane`] with a scratch value made by `init` (one per rayon task, reused
/// across its planes): `fill` gets it, the plane's index and its slice.
pub(crate) fn for_each_plane_with<T: Send, S>(
    out: &mut [T],
    s: usize,
    init: impl Fn() -> S + Sync + Send,
    fill: impl Fn(&mut S, usize, &mut [T]) + Sync + Send,
) {
    if s == 0 {
        return;
    }
    let planes = out.len() / s;
    out.par_chunks_mut(s)
        .enumerate()
        .with_min_len(min_len(planes))
        .for_each_init(init, |scratch, (i, plane)| fill(scratch, i, plane));
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

/// Two running sums of `term(a[i], b[i])`'s parts, fed slice by slice (a channel's planes, one
/// after the other). Values are summed in `f32` over [`LANES`] lanes, so that the loop
/// vectorises, and moved to `f64` every [`BLOCK`] values or so, so that long sums keep their
/// precision; small planes share a block instead of paying a conversion each.
pub(crate) struct PairSums {
    first: [f32; LANES],
    second: [f32; LANES],
    /// The two sums of the values past the last full set of lanes in each slice, kept apart
    /// from the lanes, whose loop then vectorises.
    tail: [f32; 2],
    /// Values in the lanes and the tail since they were last moved to `wide`.
    pending: usize,
    /// The lanes and the tail (in the last lane) in `f64`: adding lane by lane, rather than
    /// summing each block's lanes at once, keeps the additions independent and fast.
    wide: [[f64; LANES]; 2],
}

impl Default for PairSums {
    fn default() -> Self {
        Self {
            first: [0.0; LANES],
            second: [0.0; LANES],
            tail: [0.0; 2],
            pending: 0,
            wide: [[0.0; LANES]; 2],
        }
    }
}

impl PairSums {
    /// Adds `term(a[i], b[i])` over the common length of `a` and `b`.
    #[inline(always)]
    pub(crate) fn add(&mut self, a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> (f32, f32)) {
        let len = a.len().min(b.len());
        for (ba, bb) in a[..len].chunks(BLOCK).zip(b[..len].chunks(BLOCK)) {
            // Local lanes stay in registers.
            let (mut first, mut second) = (self.first, self.second);
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
            (self.first, self.second) = (first, second);
            let [mut t0, mut t1] = self.tail;
            for (&x, &y) in ba[body..].iter().zip(&bb[body..]) {
                let (p, q) = term(x, y);
                t0 += p;
                t1 += q;
            }
            self.tail = [t0, t1];
            self.pending += ba.len();
            if self.pending >= BLOCK {
                self.flush();
            }
        }
    }

    /// Moves the lanes and the tail into `wide`. Never inlined: inlined, its conversions keep
    /// the compiler from vectorising the lanes' loop.
    #[inline(never)]
    fn flush(&mut self) {
        for (wide, (lanes, tail)) in self.wide.iter_mut().zip([
            (&mut self.first, self.tail[0]),
            (&mut self.second, self.tail[1]),
        ]) {
            for (w, v) in wide.iter_mut().zip(lanes.iter()) {
                *w += *v as f64;
            }
            wide[LANES - 1] += tail as f64;
            *lanes = [0.0; LANES];
        }
        self.tail = [0.0; 2];
        self.pending = 0;
    }

    /// The two sums.
    pub(crate) fn total(mut self) -> [f64; 2] {
        self.flush();
        self.wide.map(|lanes| lanes.iter().sum())
    }
}

/// Runs `channel(ch, planes)` for every channel of the `(N, C, s)` buffer `out` in parallel and
/// returns its results in channel order. `planes` gives the channel's `N` planes of `out`, in
/// image order, so that a kernel can make several passes over one channel while its data is
/// still in the core's cache. Channels are split into a few tasks per thread, never smaller than
/// one channel, so small planes do not make tiny tasks.
pub(crate) fn map_channels<T: Send, R: Send>(
    out: &mut [T],
    c: usize,
    s: usize,
    channel: impl Fn(usize, ChannelPlanesMut<'_, '_, T>) -> R + Sync + Send,
) -> Vec<R> {
    if c == 0 || s == 0 {
        return Vec::new();
    }
    let n = out.len() / (c * s);
    let tasks = c.min(rayon::current_num_threads() * TASKS_PER_THREAD);
    // Task `t` takes the channels `first(t)..first(t + 1)`, and from each image the run of
    // their planes: `n` runs per task, in image order.
    let first = |t: usize| t * c / tasks;
    let mut runs: Vec<&mut [T]> = Vec::with_capacity(n * tasks);
    runs.resize_with(n * tasks, Default::default);
    for (i, mut image) in out.chunks_exact_mut(c * s).enumerate() {
        for t in 0..tasks {
            let (run, rest) = image.split_at_mut((first(t + 1) - first(t)) * s);
            runs[t * n + i] = run;
            image = rest;
        }
    }
    let per_task: Vec<Vec<R>> = runs
        .par_chunks_mut(n.max(1))
        .enumerate()
        .map(|(t, runs)| {
            (first(t)..first(t + 1))
                .map(|ch| {
                    let start = (ch - first(t)) * s;
                    channel(ch, ChannelPlanesMut { runs, start, s })
                })
                .collect()
        })
        .collect();
    per_task.into_iter().flatten().collect()
}

/// The planes of one channel of a buffer, one per image: a window of `s` values at `start` in
/// each of the runs of planes that [`map_channels`] cut from the images.
pub(crate) struct ChannelPlanesMut<'a, 'b, T> {
    runs: &'a mut [&'b mut [T]],
    start: usize,
    s: usize,
}

impl<'b, T> ChannelPlanesMut<'_, 'b, T> {
    /// The channel's planes, in image order.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut [T]> + use<'_, 'b, T> {
        let (start, s) = (self.start, self.s);
        self.runs
            .iter_mut()
            .map(move |run| &mut run[start..start + s])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair_sums(slices: &[(&[f32], &[f32])], term: impl Fn(f32, f32) -> (f32, f32)) -> [f64; 2] {
        let mut sums = PairSums::default();
        for (a, b) in slices {
            sums.add(a, b, &term);
        }
        sums.total()
    }

    #[test]
    fn pair_sums_cover_body_and_tail_across_slices() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b = vec![2f32; 19];
        assert_eq!(pair_sums(&[(&a, &b)], |x, y| (x, x * y)), [171.0, 342.0]);
        // The same values in uneven slices, the second one longer than a block.
        let long: Vec<f32> = (0..BLOCK + 100).map(|i| i as f32).collect();
        let twos = vec![2f32; BLOCK + 100];
        let [s, p] = pair_sums(
            &[(&a[..5], &b[..5]), (&long, &twos), (&a[5..], &b[5..])],
            |x, y| (x, x * y),
        );
        let n = (BLOCK + 100) as f64;
        assert_eq!(s, 171.0 + n * (n - 1.0) / 2.0);
        assert_eq!(p, 2.0 * s);
        // Many blocks: 1000 ones in f32 blocks, exact in f64.
        let ones = vec![1f32; 1000];
        assert_eq!(
            pair_sums(&[(&ones, &ones)], |x, y| (x, x + y)),
            [1000.0, 2000.0]
        );
    }

    #[test]
    fn map_channels_hands_each_channel_its_planes_in_image_order() {
        // 3 images x 5 channels x planes of 2: value = 10 * image + channel.
        let mut out = vec![0u32; 30];
        let counts = map_channels(&mut out, 5, 2, |ch, mut planes| {
            let mut count = 0;
            for (i, plane) in planes.iter_mut().enumerate() {
                plane.fill(10 * i as u32 + ch as u32);
                count += 1;
            }
            count * 100 + ch
        });
        assert_eq!(counts, vec![300, 301, 302, 303, 304]);
        let want: Vec<u32> = (0..30).map(|k| 10 * (k / 10) + (k % 10) / 2).collect();
        assert_eq!(out, want);
        let data: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let planes: Vec<&[f32]> = channel_planes(&data, 4, 2, 1).collect();
        assert_eq!(planes, vec![&[2.0, 3.0][..], &[6.0, 7.0], &[10.0, 11.0]]);
        // Images 6 values apart (a range of 2 of 3 channels): the last image ends early.
        let planes: Vec<&[f32]> = channel_planes(&data[..10], 6, 2, 1).collect();
        assert_eq!(planes, vec![&[2.0, 3.0][..], &[8.0, 9.0]]);
    }
}
