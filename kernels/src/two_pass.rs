//! Kernels that make two passes over each channel of an `(N, C, ...)` `f32` tensor: two sums
//! over the channel, then an output value from each input value and the channel's sums.
//! BatchNorm is made of them: its statistics then its normalisation, and in the backward pass
//! the gradient sums then the input gradient.
//!
//! [`run`] walks small planes channel by channel, each channel in one task, so that the second
//! pass finds the channel in the core's cache and memory is read once. Large planes are
//! streamed instead, each pass in parallel over contiguous planes: a channel's large planes
//! lie a whole number of pages apart, many of them on the same cache sets, so the cache would
//! not keep them for the second pass, and long contiguous runs read faster from memory.

use rayon::prelude::*;

use super::output;
use super::planes::{channel_planes, min_len, PairSums};
use super::simd::vectorized;

/// Planes of this many bytes or more are streamed (a page: see the module's documentation).
const LARGE_PLANE_BYTES: usize = 4096;

/// A channel's values of every pass, in bytes, above which its planes are streamed: half a
/// typical per-core L2 cache, so that the second pass still finds them there.
const CHANNEL_CACHE_BYTES: usize = 512 * 1024;

/// What [`run`] computes, for one channel at a time. The methods are called inside loops
/// compiled for the CPU's vector width; implementations mark them `#[inline(always)]` so
/// that their loops are compiled there too.
pub(crate) trait ChannelKernel: Sync {
    /// What the first pass makes of a channel's sums, which the second pass uses.
    type Channel: Send + Sync;

    /// Adds the terms of one plane of channel `ch` (the same plane of the two inputs) to `sums`.
    fn sums(&self, ch: usize, a: &[f32], b: &[f32], sums: &mut PairSums);

    /// Makes the sums of channel `ch` into what the second pass needs.
    fn finish(&self, ch: usize, sums: [f64; 2]) -> Self::Channel;

    /// The output value at the input values `a` and `b` of a channel.
    fn value(&self, channel: &Self::Channel, a: f32, b: f32) -> f32;
}

/// The two inputs of a [`ChannelKernel`], each of `c` channels of planes of `s` values.
#[derive(Clone, Copy)]
pub(crate) struct Inputs<'a> {
    /// The first input (`x` in BatchNorm's passes), contiguous.
    pub a: &'a [f32],
    /// The second input (`x` again in the forward pass, the output gradient in the backward),
    /// its images `b_image` values apart: `c * s` when it is a tensor of its own, more when it
    /// is a range of a larger tensor's channels (a concatenation's gradient), read in place.
    pub b: &'a [f32],
    /// Values from one image of `b` to the next.
    pub b_image: usize,
    /// Channels.
    pub c: usize,
    /// Values per plane.
    pub s: usize,
}

/// Runs `kernel` over `inputs` and returns the output, as long as an input, and what the
/// kernel made of each channel's sums.
pub(crate) fn run<K: ChannelKernel>(kernel: &K, inputs: Inputs<'_>) -> (Vec<f32>, Vec<K::Channel>) {
    let Inputs {
        a,
        b,
        b_image,
        c,
        s,
    } = inputs;
    let len = a.len();
    if c == 0 || s == 0 {
        return (vec![0f32; len], Vec::new());
    }
    let n = len / (c * s);
    if !by_channel(n, c, s) {
        return streamed(kernel, inputs);
    }
    let a_planes = |ch| channel_planes(a, c * s, s, ch);
    let b_planes = |ch| channel_planes(b, b_image, s, ch);
    output::by_channel(len, c, s, |ch, out| {
        vectorized(
            #[inline(always)]
            || {
                let mut sums = PairSums::default();
                for (pa, pb) in a_planes(ch).zip(b_planes(ch)) {
                    kernel.sums(ch, pa, pb, &mut sums);
                }
                let channel = kernel.finish(ch, sums.total());
                let written = out.zip_with(a_planes(ch), b_planes(ch), |x, y| {
                    kernel.value(&channel, x, y)
                });
                (channel, written)
            },
        )
    })
}

/// Whether [`run`] walks channel by channel: the planes are small, a channel fits in the
/// cache, and there are at least two channels per thread to share out.
fn by_channel(n: usize, c: usize, s: usize) -> bool {
    let plane_bytes = s * size_of::<f32>();
    plane_bytes < LARGE_PLANE_BYTES
        && 3 * n * plane_bytes <= CHANNEL_CACHE_BYTES
        && c >= 2 * rayon::current_num_threads()
}

/// [`run`] for large planes: the sums of every plane in parallel, added per channel in image
/// order, then every output plane in parallel.
fn streamed<K: ChannelKernel>(kernel: &K, inputs: Inputs<'_>) -> (Vec<f32>, Vec<K::Channel>) {
    let Inputs {
        a,
        b,
        b_image,
        c,
        s,
    } = inputs;
    let len = a.len();
    let planes = len / s;
    // Plane `k` (image `k / c`, channel `k % c`) of each input.
    let a_plane = |k: usize| &a[k * s..(k + 1) * s];
    let b_plane = |k: usize| &b[(k / c) * b_image + (k % c) * s..][..s];
    let per_plane: Vec<[f64; 2]> = (0..planes)
        .into_par_iter()
        .with_min_len(min_len(planes))
        .map(|k| {
            vectorized(
                #[inline(always)]
                || {
                    let mut sums = PairSums::default();
                    kernel.sums(k % c, a_plane(k), b_plane(k), &mut sums);
                    sums.total()
                },
            )
        })
        .collect();
    let mut totals = vec![[0f64; 2]; c];
    for (k, sums) in per_plane.iter().enumerate() {
        for (t, v) in totals[k % c].iter_mut().zip(sums) {
            *t += v;
        }
    }
    let channels: Vec<K::Channel> = totals
        .into_iter()
        .enumerate()
        .map(|(ch, sums)| kernel.finish(ch, sums))
        .collect();
    let out = output::by_plane(len, c, s, |k, ch, plane| {
        let channel = &channels[ch];
        vectorized(
            #[inline(always)]
            || plane.zip_with(a_plane(k), b_plane(k), |x, y| kernel.value(channel, x, y)),
        )
    });
    (out, channels)
}
