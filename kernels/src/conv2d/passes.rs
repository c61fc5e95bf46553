//! The three convolution passes over a batch: the forward correlation, the gradient of the
//! input and the gradient of the kernel, each as row-shift GEMMs (see [`super::plan`]).
//!
//! Work is split over images with rayon, sized by the *current* pool
//! (`rayon::current_num_threads`), so a replica running in a smaller pool does not
//! oversubscribe the machine; nothing here spawns threads. With fewer images than threads, the
//! images run one after the other and each GEMM is split across the pool instead. Each thread
//! keeps its expansion buffers between calls.
//!
//! Images too small for the micro-kernel's blocks (4x4 and 7x7 planes) go several
//! to a GEMM in the forward pass and a unit-stride input gradient: each GEMM's operand is
//! written for all of them side by side, so its columns fill the blocks. The kernel gradient
//! reads the same operands along its depth, so its accumulator is read and written once per
//! group rather than once per image.
//!
//! The forward pass (`forward`), the input gradient (`input_grad`) and the kernel gradient
//! (`kernel_grad`, its Winograd pass in `winograd_kernel_grad`) each have a module, and
//! `side_by_side` writes small images' operands side by side; this one holds what they share:
//! the sizes of a convolution, each thread's buffers, the split of a batch into groups of
//! images over the pool, and the walk over a row-shift expansion's GEMMs.

use std::cell::Cell;

use super::super::output::{ImagesMut, PartedOutput};
use super::gemm::{Parallelism, View};
use super::plan::Plan;
use super::winograd;

mod forward;
mod input_grad;
mod kernel_grad;
mod side_by_side;
mod winograd_kernel_grad;

pub(crate) use forward::forward;
pub(crate) use input_grad::{input_grad, input_grad_adds_in_place};
pub(crate) use kernel_grad::weight_grad;

/// The sizes of a convolution: input `(n, c, h, w)`, kernel `(o, c, kh, kw)`, strides, padding
/// `(top, bottom, left, right)` and output `(ho, wo)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Conv {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub pad: (usize, usize, usize, usize),
    pub ho: usize,
    pub wo: usize,
}

impl Conv {
    /// The forward correlation of one image.
    fn forward_plan(&self) -> Plan {
        Plan {
            c: self.c,
            h: self.h,
            w: self.w,
            o: self.o,
            kh: self.kh,
            kw: self.kw,
            sh: self.stride.0,
            sw: self.stride.1,
            top: self.pad.0 as isize,
            left: self.pad.2 as isize,
            ho: self.ho,
            wo: self.wo,
        }
    }
}

/// Per-thread buffers, kept between calls so the hot path does not allocate.
#[derive(Default)]
struct Scratch {
    /// The expanded input tile.
    expanded: Vec<f32>,
    /// One stride phase of the input gradient.
    phase: Vec<f32>,
    /// An output gradient image, positions-major.
    transposed: Vec<f32>,
    /// The transformed tiles of a group of images, for [`Winograd`](winograd::Winograd).
    winograd: winograd::Buffers,
    /// The operands of a group of small images side by side, for
    /// [`correlate_group`](side_by_side::correlate_group).
    grouped: Vec<f32>,
    /// The products of a group of small images, before they go to each image's output.
    products: Vec<f32>,
    /// The gradient of Winograd's transformed kernel for a run of input channels, summed over
    /// the images (`winograd_kernel_grad`'s split by channels).
    kernel_grad_sum: Vec<f32>,
}

thread_local! {
    static SCRATCH: Cell<Scratch> = Cell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch buffers. They are taken out for the call, so a nested
/// call (from a task rayon runs while this one waits) gets fresh buffers instead of aliasing.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let mut scratch = SCRATCH.with(Cell::take);
    let result = f(&mut scratch);
    SCRATCH.with(|s| s.set(scratch));
    result
}

/// A slice of `buf` at least `len` long, growing `buf` when needed.
fn at_least(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// Whether `images` images keep the pool busy one per task; otherwise each GEMM is split.
fn split_images(images: usize) -> bool {
    images >= rayon::current_num_threads()
}

/// How a GEMM may split its work when the images are not split.
fn gemm_parallelism(images: usize) -> Parallelism {
    if split_images(images) {
        Parallelism::None
    } else {
        Parallelism::Rayon(rayon::current_num_threads())
    }
}

/// The signature of a task of [`fill_groups`]: `f(input, output, scratch, parallelism)`.
trait ImageTask:
    Fn(&[f32], ImagesMut<'_>, &mut Scratch, Parallelism) -> candle_core::Result<()> + Sync
{
}

impl<F> ImageTask for F where
    F: Fn(&[f32], ImagesMut<'_>, &mut Scratch, Parallelism) -> candle_core::Result<()> + Sync
{
}

/// Writes a part of `out`, values `offset .. offset + out_len` of each of its images, from
/// the images of `x` (`in_len` values each) in groups of `group` consecutive images (the last
/// may be short): `f(input, output, scratch, parallelism)` for each group's inputs and
/// outputs, in parallel when there are enough groups. Where no part of `out` was written
/// yet, its images are first zeroed (or, with `start`, set to `start`'s values).
fn fill_groups(
    out: &mut PartedOutput,
    (offset, out_len): (usize, usize),
    group: usize,
    (x, in_len): (&[f32], usize),
    start: Option<&[f32]>,
    f: impl ImageTask,
) -> candle_core::Result<()> {
    let n = out.images();
    if offset + out_len > out.image_len() || x.len() < n * in_len {
        candle_core::bail!(
            "conv2d: {n} images of {out_len} values at {offset} do not fit an output of images \
             of {}, or {} input values hold fewer than {n} images of {in_len}",
            out.image_len(),
            x.len()
        );
    }
    let group = group.max(1);
    let groups = n.div_ceil(group);
    let par = gemm_parallelism(groups);
    let in_chunk = group * in_len;
    let input = |i: usize| x.get(i * in_chunk..((i + 1) * in_chunk).min(n * in_len));
    out.try_fill(
        (group, split_images(groups)),
        (offset, out_len),
        start,
        |i, y| with_scratch(|s| f(input(i).unwrap_or(&[]), y, s, par)),
    )
}

/// A new output of `n` images of `out_len` values each, written by [`fill_groups`].
fn map_groups(
    n: usize,
    group: usize,
    x: (&[f32], usize),
    (out_len, start): (usize, Option<&[f32]>),
    f: impl ImageTask,
) -> candle_core::Result<Vec<f32>> {
    let mut out = PartedOutput::new(n, out_len);
    fill_groups(&mut out, (0, out_len), group, x, start, f)?;
    Ok(out.into_vec())
}

/// One GEMM of a tile: output rows `i0 .. i0 + rows`, GEMM `call` of the tile, and its
/// expanded operand `(positions x depth)`, with unit stride along the positions.
struct TileGemm<'a> {
    i0: usize,
    rows: usize,
    call: usize,
    operand: View<'a>,
}

/// Expands `x` one tile of output rows at a time and calls `f` for each GEMM of each tile.
fn for_each_tile_gemm(
    plan: &Plan,
    x: &[f32],
    expanded: &mut Vec<f32>,
    mut f: impl FnMut(TileGemm<'_>) -> candle_core::Result<()>,
) -> candle_core::Result<()> {
    let tile = plan.tile_rows();
    let buf = at_least(expanded, plan.expanded_len(tile));
    for i0 in (0..plan.ho).step_by(tile) {
        let rows = tile.min(plan.ho - i0);
        let operand = plan.expand(x, i0, rows, buf);
        let data: &[f32] = if operand.expanded { buf } else { x };
        for call in 0..plan.calls() {
            f(TileGemm {
                i0,
                rows,
                call,
                operand: View {
                    data,
                    offset: plan.call_offset(&operand, call),
                    rs: 1,
                    cs: operand.k_stride,
                },
            })?;
        }
    }
    Ok(())
}
