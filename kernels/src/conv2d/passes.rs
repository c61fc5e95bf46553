//! The three convolution passes over a batch: the forward correlation, the gradient of the
//! input and the gradient of the kernel, each as row-shift GEMMs (see [`super::plan`]).
//!
//! Work is split over images with rayon, sized by the *current* pool
//! (`rayon::current_num_threads`), so a replica running in a smaller pool does not
//! oversubscribe the machine; nothing here spawns threads. With fewer images than threads, the
//! images run one after the other and each GEMM is split across the pool instead. Each thread
//! keeps its expansion buffers between calls.
//!
//! Images of one tile too small for the micro-kernel's blocks (4x4 and 7x7 planes) go several
//! to a GEMM in the forward pass and a unit-stride input gradient: each GEMM's operand is
//! written for all of them side by side, so its columns fill the blocks.

use std::cell::Cell;

use rayon::prelude::*;

use super::super::output::{ImagesMut, PartedOutput};
use super::cache::KernelCache;
use super::epilogue::Epilogue;
use super::gemm::{matmul, Parallelism, Product, View, ViewMut};
use super::lowered::{Lowered, PackedKernel};
use super::microkernel::{self, Panels, Start, Strips, Write};
use super::plan::Plan;
use super::transpose::{strips_len, transpose, transpose_to_strips};
use super::winograd::{self, Winograd};
use crate::SimdLevel;

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
    /// The transformed tiles of a group of images, for [`Winograd`].
    winograd: winograd::Buffers,
    /// The operands of a group of small images side by side, for [`correlate_group`].
    grouped: Vec<f32>,
    /// The products of a group of small images, before they go to each image's output.
    products: Vec<f32>,
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

/// A new output of the 3x3, stride-1 correlation of the `n` images of `x` through
/// [`Winograd`], a group of images per task.
fn winograd_images(
    wino: &Winograd,
    n: usize,
    x: (&[f32], usize),
    out_len: usize,
    bias: Option<&[f32]>,
) -> candle_core::Result<Vec<f32>> {
    let group = wino.group(n, rayon::current_num_threads());
    map_groups(n, group, x, (out_len, None), |x, mut y, s, par| {
        let epilogue = Epilogue {
            bias,
            ..Default::default()
        };
        wino.correlate(x, epilogue, &mut y, &mut s.winograd, par)
    })
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

/// `out = correlate(x, kernel) + bias` for one image, `bias` one value per output channel
/// (none: zero), or `out +=` that when `into`; then the epilogue's ReLU, if any (its scale is
/// the kernel's already).
fn correlate_image(
    plan: &Plan,
    x: &[f32],
    (kernel, epilogue): (&PackedKernel, Epilogue<'_>),
    (out, into): (&mut [f32], bool),
    expanded: &mut Vec<f32>,
    parallelism: Parallelism,
) -> candle_core::Result<()> {
    let positions = plan.ho * plan.wo;
    let depth = plan.depth();
    let bias = epilogue.bias;
    // Whether a product went to `gemm`, whose outputs the ReLU then takes in a pass of its own.
    let mut unfinished = false;
    for_each_tile_gemm(plan, x, expanded, |t| {
        let tile = t.i0 * plan.wo..(t.i0 + t.rows) * plan.wo;
        let panels = match (kernel.panels.get(t.call), parallelism) {
            (Some(panels), Parallelism::None) if microkernel::fills_blocks(tile.len()) => {
                Some(panels)
            }
            _ => None,
        };
        // The micro-kernel starts a tile's first product from the bias in its registers;
        // otherwise the tile's outputs start from it (added to what `out` holds when `into`).
        let bias_in_registers = panels.is_some() && !into;
        if let (Some(bias), 0, false) = (bias, t.call, bias_in_registers) {
            for (plane, b) in out.chunks_exact_mut(positions).zip(bias) {
                if into {
                    plane[tile.clone()].iter_mut().for_each(|v| *v += b);
                } else {
                    plane[tile.clone()].fill(*b);
                }
            }
        }
        let accumulate = t.call > 0 || bias.is_some() || into;
        let relu = epilogue.relu && t.call + 1 == plan.calls();
        let start = match (bias, t.call, bias_in_registers) {
            (Some(bias), 0, true) => Start::Rows(bias),
            _ if accumulate => Start::Dst,
            _ => Start::Zero,
        };
        match panels {
            Some(panels) => {
                microkernel::product(
                    panels.panels(),
                    // The operand read as (depth x positions).
                    View {
                        rs: t.operand.cs,
                        cs: t.operand.rs,
                        ..t.operand
                    },
                    tile.len(),
                    ViewMut {
                        data: out,
                        offset: tile.start,
                        rs: positions,
                        cs: 1,
                    },
                    Write { start, relu },
                )
            }
            _ => {
                unfinished = true;
                matmul(
                    Product {
                        m: tile.len(),
                        n: plan.o,
                        k: depth,
                        accumulate,
                        parallelism,
                    },
                    ViewMut {
                        data: out,
                        offset: tile.start,
                        rs: 1,
                        cs: positions,
                    },
                    t.operand,
                    View {
                        data: &kernel.gemm,
                        offset: t.call * plan.o * depth,
                        rs: 1,
                        cs: depth,
                    },
                )
            }
        }
    })?;
    if unfinished {
        epilogue.finish(out);
    }
    Ok(())
}

/// Columns a GEMM of [`correlate_group`] aims for: enough for the micro-kernel's column blocks
/// to be nearly full.
const GROUP_COLUMNS: usize = 256;

/// Images per GEMM for `plan` out of `n`: one, unless an image's positions would leave much of
/// the micro-kernel's last column block empty (7x7 planes fill 49 of 64 columns), the image is
/// one tile, and the micro-kernel runs the products; then enough images for about
/// [`GROUP_COLUMNS`] columns, with a group per thread at least.
fn image_group(plan: &Plan, kernel: &PackedKernel, n: usize) -> usize {
    let positions = plan.ho * plan.wo;
    if kernel.panels.is_empty()
        || microkernel::fills_blocks(positions)
        || plan.tile_rows() < plan.ho
        || positions == 0
    {
        return 1;
    }
    let threads = rayon::current_num_threads().max(1);
    GROUP_COLUMNS
        .div_ceil(positions)
        .min(n.div_ceil(threads))
        .max(1)
}

/// The GEMM operands of the one-tile images `x` (whole images, back to back) side by side:
/// `[call][depth][image][position]`, so GEMM `call` reads its `depth x (images * positions)`
/// operand at `call * depth * images * positions`, with no column between two images. Each
/// image is expanded in `expanded` (or read in place), then each GEMM's rows are copied out
/// of it: the row shifts of the stride phases are taken as they are copied.
fn side_by_side<'a>(
    plan: &Plan,
    x: &[f32],
    expanded: &mut Vec<f32>,
    grouped: &'a mut Vec<f32>,
) -> &'a [f32] {
    let in_len = plan.input_len().max(1);
    let g = x.len() / in_len;
    let positions = plan.ho * plan.wo;
    let (depth, columns) = (plan.depth(), g * positions);
    let buf = at_least(expanded, plan.expanded_len(plan.ho));
    let out = at_least(grouped, plan.calls() * depth * columns);
    for (i, xi) in x.chunks_exact(in_len).enumerate() {
        let operand = plan.expand(xi, 0, plan.ho, buf);
        let data: &[f32] = if operand.expanded { buf } else { xi };
        for (call, rows) in out.chunks_exact_mut((depth * columns).max(1)).enumerate() {
            let base = plan.call_offset(&operand, call);
            for (q, row) in rows.chunks_exact_mut(columns.max(1)).enumerate() {
                let from = &data[base + q * operand.k_stride..][..positions];
                row[i * positions..][..positions].copy_from_slice(from);
            }
        }
    }
    out
}

/// `out = correlate(x, kernel) + bias` for `g` small images (see [`image_group`]) at once:
/// each GEMM's operand is written for all of them side by side ([`side_by_side`]), so one
/// GEMM per call covers them all, every column a real output position. The products go to a
/// scratch buffer, then to each image's output (added to what it holds when `into`).
fn correlate_group(
    plan: &Plan,
    x: &[f32],
    (kernel, epilogue): (&PackedKernel, Epilogue<'_>),
    (out, into): (&mut ImagesMut<'_>, bool),
    scratch: &mut Scratch,
) -> candle_core::Result<()> {
    let bias = epilogue.bias;
    let g = out.count();
    let positions = plan.ho * plan.wo;
    let columns = g * positions;
    let depth = plan.depth();
    let Scratch {
        expanded,
        grouped,
        products,
        ..
    } = scratch;
    let grouped = side_by_side(plan, &x[..g * plan.input_len()], expanded, grouped);
    let products = at_least(products, plan.o * columns);
    for (call, panels) in kernel.panels.iter().enumerate() {
        // The first product starts from the bias, in the micro-kernel's registers.
        let start = match (call, bias) {
            (0, Some(bias)) => Start::Rows(bias),
            (0, None) => Start::Zero,
            _ => Start::Dst,
        };
        microkernel::product(
            panels.panels(),
            View {
                data: grouped,
                offset: call * depth * columns,
                rs: columns,
                cs: 1,
            },
            columns,
            ViewMut {
                data: products,
                offset: 0,
                rs: columns,
                cs: 1,
            },
            Write {
                start,
                relu: epilogue.relu && call + 1 == kernel.panels.len(),
            },
        )?;
    }
    for (i, image) in out.each().enumerate() {
        for (plane, row) in image
            .chunks_exact_mut(positions)
            .zip(products.chunks_exact(columns))
        {
            let row = &row[i * positions..][..positions];
            if into {
                plane.iter_mut().zip(row).for_each(|(v, p)| *v += p);
            } else {
                plane.copy_from_slice(row);
            }
        }
    }
    Ok(())
}

/// Whether [`input_grad`] adds its `add` as it writes the gradient (its direct correlations
/// do), rather than in a pass of its own after Winograd's correlation.
pub(crate) fn input_grad_adds_in_place(conv: &Conv) -> bool {
    // Winograd's runs only where one phase covers the whole input.
    let winograd = conv.stride == (1, 1)
        && conv
            .phase_plan(0, 0)
            .is_some_and(|(plan, _)| Winograd::suits(&plan));
    !winograd
}

/// The forward pass: `y (n, o, ho, wo)` from `x (n, c, h, w)` and `w (o, c, kh, kw)`, with
/// `epilogue` applied to each output channel, written to values `offset .. offset + o * ho *
/// wo` of each image of `out` (its own output, or its channels of a concatenation's). With a
/// `cache`, the kernel is lowered only when the cache's was made from other values.
pub(crate) fn forward(
    conv: &Conv,
    (x, w): (&[f32], &[f32]),
    epilogue: Epilogue<'_>,
    (out, offset): (&mut PartedOutput, usize),
    cache: Option<&KernelCache>,
) -> candle_core::Result<()> {
    let plan = conv.forward_plan();
    let (c, kh, kw) = (conv.c, conv.kh, conv.kw);
    let scale = |o: usize| epilogue.scale.map_or(1.0, |s| s[o]);
    let tap = |o, ci, ky, kx| w[((o * c + ci) * kh + ky) * kw + kx] * scale(o);
    let lower = || Lowered::new(&plan, tap);
    let cached;
    let fresh;
    let lowered = match cache {
        Some(cache) => {
            cached = cache.lowered(&plan, (w, epilogue.scale), lower)?;
            &cached.lowered
        }
        None => {
            fresh = lower()?;
            &fresh
        }
    };
    let (input, part) = ((x, plan.input_len()), (offset, plan.output_len()));
    match lowered {
        Lowered::Winograd(wino) => {
            let group = wino.group(conv.n, rayon::current_num_threads());
            fill_groups(out, part, group, input, None, |x, mut y, s, par| {
                wino.correlate(x, epilogue, &mut y, &mut s.winograd, par)
            })
        }
        Lowered::Direct(kernel) => {
            let group = image_group(&plan, kernel, conv.n);
            fill_groups(out, part, group, input, None, |x, mut y, s, par| {
                if group > 1 {
                    correlate_group(&plan, x, (kernel, epilogue), (&mut y, false), s)?;
                } else if let Some(image) = y.each().next() {
                    let out = (image, false);
                    correlate_image(&plan, x, (kernel, epilogue), out, &mut s.expanded, par)?;
                }
                Ok(())
            })
        }
    }
}

/// One stride phase `(ry, rx)` of the input gradient: the padded-input positions
/// `(sh * a + ry, sw * b + rx)` that fall inside the image, as a stride-1 correlation of the
/// output gradient with the kernel taps `(ry + sh * u, rx + sw * v)`, flipped and transposed.
struct Phase {
    /// The correlation, over `dy`'s `o` channels into `c` channels.
    plan: Plan,
    /// Its packed kernel (empty when lowered to Winograd's).
    kernel: PackedKernel,
    /// The correlation lowered to [`Winograd`], when it suits.
    winograd: Option<Winograd>,
    /// First input row and column (unpadded) of the phase, and the steps between them.
    y0: usize,
    x0: usize,
}

/// The first index `a >= 0` with `s * a + r >= lo`, and one past the last with
/// `s * a + r < hi`.
fn phase_range(r: usize, s: usize, lo: usize, hi: usize) -> (usize, usize) {
    let first = lo.saturating_sub(r).div_ceil(s);
    let end = hi.saturating_sub(r).div_ceil(s);
    (first, end.max(first))
}

impl Conv {
    /// The stride phases of the input gradient that hold at least one input position.
    /// The correlation of stride phase `(ry, rx)` of the input gradient (see [`Phase`]) and the
    /// first padded-input row and column it covers, or `None` when no input position falls in
    /// the phase.
    fn phase_plan(&self, ry: usize, rx: usize) -> Option<(Plan, (usize, usize))> {
        let (sh, sw) = self.stride;
        let (pt, _, pl, _) = self.pad;
        let (a0, a1) = phase_range(ry, sh, pt, pt + self.h);
        let (b0, b1) = phase_range(rx, sw, pl, pl + self.w);
        if a1 == a0 || b1 == b0 {
            return None;
        }
        // Taps of this phase: ky = ry + sh * u for u < kh', likewise kx.
        let khp = self.kh.saturating_sub(ry).div_ceil(sh);
        let kwp = self.kw.saturating_sub(rx).div_ceil(sw);
        let plan = Plan {
            c: self.o,
            h: self.ho,
            w: self.wo,
            o: self.c,
            kh: khp,
            kw: kwp,
            sh: 1,
            sw: 1,
            top: khp as isize - 1 - a0 as isize,
            left: kwp as isize - 1 - b0 as isize,
            ho: a1 - a0,
            wo: b1 - b0,
        };
        Some((plan, (a0, b0)))
    }

    fn phases(&self, w: &[f32]) -> candle_core::Result<Vec<Phase>> {
        let (sh, sw) = self.stride;
        let (pt, _, pl, _) = self.pad;
        let (o, c, kh, kw) = (self.o, self.c, self.kh, self.kw);
        // The kernel with its two channel axes swapped, so each packed row reads it in order.
        let wt = transpose_channels(w, o, c, kh * kw);
        let mut phases = Vec::new();
        for ry in 0..sh {
            for rx in 0..sw {
                let Some((plan, (a0, b0))) = self.phase_plan(ry, rx) else {
                    continue;
                };
                let (khp, kwp) = (plan.kh, plan.kw);
                let tap = |ci, oi, u, v| {
                    let ky = ry + sh * (khp - 1 - u);
                    let kx = rx + sw * (kwp - 1 - v);
                    wt[((ci * o + oi) * kh + ky) * kw + kx]
                };
                let winograd = Winograd::new(&plan, tap);
                let kernel = match winograd {
                    Some(_) => PackedKernel::none(),
                    None => PackedKernel::new(&plan, tap)?,
                };
                phases.push(Phase {
                    plan,
                    kernel,
                    winograd,
                    y0: sh * a0 + ry - pt,
                    x0: sw * b0 + rx - pl,
                });
            }
        }
        Ok(phases)
    }
}

/// The `(c, o, taps)` kernel of an `(o, c, taps)` one: the channel axes swapped, a block of
/// output channels at a time so that both sides are read and written in runs.
fn transpose_channels(w: &[f32], o: usize, c: usize, taps: usize) -> Vec<f32> {
    const BLOCK: usize = 16;
    let mut wt = vec![0f32; w.len()];
    for o0 in (0..o).step_by(BLOCK) {
        let o1 = (o0 + BLOCK).min(o);
        for ci in 0..c {
            let out = &mut wt[(ci * o + o0) * taps..(ci * o + o1) * taps];
            for (oi, dst) in (o0..o1).zip(out.chunks_exact_mut(taps)) {
                let at = (oi * c + ci) * taps;
                dst.copy_from_slice(&w[at..at + taps]);
            }
        }
    }
    wt
}

/// The gradient of the input, `dx (n, c, h, w)`, from `dy (n, o, ho, wo)` and `w`. At unit
/// strides it is one correlation of `dy` with the flipped, transposed kernel; otherwise each
/// stride phase is one, written into its strided positions of `dx`.
pub(crate) fn input_grad(
    conv: &Conv,
    dy: &[f32],
    w: &[f32],
    add: Option<&[f32]>,
) -> candle_core::Result<Vec<f32>> {
    let phases = conv.phases(w)?;
    let (sh, sw) = conv.stride;
    let in_len = conv.c * conv.h * conv.w;
    if add.is_some_and(|a| a.len() != conv.n * in_len) {
        candle_core::bail!(
            "conv2d_input_grad: {} values to add to {} input-gradient values",
            add.map_or(0, <[f32]>::len),
            conv.n * in_len
        );
    }
    let into = add.is_some();
    let direct = sh == 1 && sw == 1;
    let dy_len = conv.o * conv.ho * conv.wo;
    // Where each phase's result starts in the phase buffer, and the runs of phases that share
    // a row residue (consecutive, since the phases are ordered by row residue first).
    let phase_offsets: Vec<usize> = phases
        .iter()
        .scan(0, |at, p| {
            let start = *at;
            *at += p.plan.output_len();
            Some(start)
        })
        .collect();
    let phase_total = phases.iter().map(|p| p.plan.output_len()).sum();
    let mut row_groups: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, p) in phases.iter().enumerate() {
        match row_groups.last_mut() {
            Some(g) if phases[g.start].y0 == p.y0 => g.end = i + 1,
            _ => row_groups.push(i..i + 1),
        }
    }
    if let [Phase {
        winograd: Some(wino),
        ..
    }] = phases.as_slice()
    {
        // A 3x3 kernel at unit strides: one phase, the whole image, through Winograd's.
        let mut dx = winograd_images(wino, conv.n, (dy, dy_len), in_len, None)?;
        if let Some(add) = add {
            dx.par_chunks_mut(in_len.max(1))
                .zip(add.par_chunks(in_len.max(1)))
                .for_each(|(d, a)| d.iter_mut().zip(a).for_each(|(d, a)| *d += a));
        }
        return Ok(dx);
    }
    let dx_len = (in_len, add);
    if let (true, [phase]) = (direct, phases.as_slice()) {
        let group = image_group(&phase.plan, &phase.kernel, conv.n);
        if group > 1 {
            return map_groups(conv.n, group, (dy, dy_len), dx_len, |dy, mut dx, s, _| {
                let kernel = (&phase.kernel, Epilogue::default());
                correlate_group(&phase.plan, dy, kernel, (&mut dx, into), s)
            });
        }
    }
    map_groups(conv.n, 1, (dy, dy_len), dx_len, |dy, mut dx, s, par| {
        let Some(dx) = dx.each().next() else {
            return Ok(());
        };
        if direct {
            // One phase covering the whole image, in place (phases is never empty here: a
            // stride-1 convolution reads every input position).
            return phases.iter().try_for_each(|p| {
                let dx = (&mut *dx, into);
                let kernel = (&p.kernel, Epilogue::default());
                correlate_image(&p.plan, dy, kernel, dx, &mut s.expanded, par)
            });
        }
        // Every phase into its own part of one buffer, then `dx` a row at a time, each row
        // gathered from the phases of its row residue, so its cache lines are written at once.
        let z = at_least(&mut s.phase, phase_total);
        for (p, &at) in phases.iter().zip(&phase_offsets) {
            let zp = &mut z[at..at + p.plan.output_len()];
            if p.plan.kh == 0 || p.plan.kw == 0 {
                // No kernel tap lands on these positions: their gradient is zero.
                zp.fill(0.0);
            } else {
                let zp = (zp, false);
                let kernel = (&p.kernel, Epilogue::default());
                correlate_image(&p.plan, dy, kernel, zp, &mut s.expanded, par)?;
            }
        }
        let z = &*z;
        let (h, w) = (conv.h, conv.w);
        for (ci, dxc) in dx.chunks_exact_mut(h * w).enumerate() {
            for group in row_groups.iter() {
                let (group, offsets) = (&phases[group.clone()], &phase_offsets[group.clone()]);
                let (first, rows) = (&group[0], group[0].plan.ho);
                for a in 0..rows {
                    let row = &mut dxc[(first.y0 + sh * a) * w..][..w];
                    let z_row = |k: usize| {
                        let wb = group[k].plan.wo;
                        &z[offsets[k] + (ci * rows + a) * wb..][..wb]
                    };
                    match group {
                        // Two column phases at stride 2 side by side: one interleaving pass.
                        [p, q] if sw == 2 && q.x0 == p.x0 + 1 => {
                            interleave(&mut row[p.x0..], (z_row(0), z_row(1)), into);
                        }
                        [p, q] if sw == 2 && p.x0 == q.x0 + 1 => {
                            interleave(&mut row[q.x0..], (z_row(1), z_row(0)), into);
                        }
                        _ => {
                            for (k, p) in group.iter().enumerate() {
                                let columns = row[p.x0..].iter_mut().step_by(sw);
                                write_or_add(columns.zip(z_row(k)), into);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    })
}

/// Writes (or, when `into`, adds) `even[b]` to `row[2 * b]` and `odd[b]` to `row[2 * b + 1]`,
/// pairs of columns at a time.
fn interleave(row: &mut [f32], (even, odd): (&[f32], &[f32]), into: bool) {
    let pairs = even.len().min(odd.len()).min(row.len() / 2);
    let (head, tail) = row.split_at_mut(2 * pairs);
    let slots = head
        .as_chunks_mut::<2>()
        .0
        .iter_mut()
        .zip(even.iter().zip(odd));
    if into {
        slots.for_each(|(pair, (e, o))| *pair = [pair[0] + e, pair[1] + o]);
    } else {
        slots.for_each(|(pair, (e, o))| *pair = [*e, *o]);
    }
    // A last column of an odd width.
    write_or_add(tail.iter_mut().step_by(2).zip(&even[pairs..]), into);
    let odd_tail = tail.get_mut(1..).unwrap_or_default();
    write_or_add(odd_tail.iter_mut().step_by(2).zip(&odd[pairs..]), into);
}

/// Writes (or, when `into`, adds) each value to its slot.
#[inline(always)]
fn write_or_add<'a>(slots: impl Iterator<Item = (&'a mut f32, &'a f32)>, into: bool) {
    if into {
        slots.for_each(|(d, v)| *d += *v);
    } else {
        slots.for_each(|(d, v)| *d = *v);
    }
}

/// The gradient of the kernel, `dw (o, c, kh, kw)`, from `x (n, c, h, w)` and
/// `dy (n, o, ho, wo)`, summed over the images, followed by the bias gradient `(o,)` (the sums
/// of `dy` per output channel) when `with_bias`. Each task sums a contiguous run of images into
/// its own packed accumulator; the accumulators are added in a fixed order.
pub(crate) fn weight_grad(
    conv: &Conv,
    x: &[f32],
    dy: &[f32],
    with_bias: bool,
) -> candle_core::Result<Vec<f32>> {
    let plan = conv.forward_plan();
    if let Some(wino) = Winograd::for_kernel_grad(&plan) {
        return winograd_weight_grad(conv, &wino, x, dy, with_bias);
    }
    let packed_len = plan.calls() * plan.o * plan.depth();
    let acc_len = packed_len + if with_bias { plan.o } else { 0 };
    let tasks = if split_images(conv.n) {
        rayon::current_num_threads().min(conv.n).max(1)
    } else {
        1
    };
    let per_task = conv.n.div_ceil(tasks).max(1);
    let par = gemm_parallelism(conv.n);
    let (in_len, dy_len) = (plan.input_len(), plan.output_len());
    let run = |t: usize| -> candle_core::Result<Vec<f32>> {
        let mut acc = vec![0f32; acc_len];
        let (packed, bias) = acc.split_at_mut(packed_len);
        let images = t * per_task..((t + 1) * per_task).min(conv.n);
        with_scratch(|s| {
            images.into_iter().try_for_each(|i| {
                let xi = &x[i * in_len..(i + 1) * in_len];
                let dyi = &dy[i * dy_len..(i + 1) * dy_len];
                if with_bias {
                    add_channel_sums(dyi, bias);
                }
                weight_grad_image(&plan, xi, dyi, packed, s, par)
            })
        })?;
        Ok(acc)
    };
    let partials = each_task(tasks, run)?;
    let mut dw = vec![0f32; conv.o * plan.taps()];
    unpack_sum(&plan, &partials, &mut dw);
    dw.extend((packed_len..acc_len).map(|i| partials.iter().map(|p| p[i]).sum::<f32>()));
    Ok(dw)
}

/// [`weight_grad`] through Winograd's transforms: each task sums the gradient of the
/// transformed kernel over a contiguous run of images, a group at a time; the sums are added
/// in a fixed order and transformed back into the kernel's gradient.
fn winograd_weight_grad(
    conv: &Conv,
    wino: &Winograd,
    x: &[f32],
    dy: &[f32],
    with_bias: bool,
) -> candle_core::Result<Vec<f32>> {
    let plan = conv.forward_plan();
    let (in_len, dy_len) = (plan.input_len(), plan.output_len());
    let grad_len = wino.kernel_grad_len();
    let bias_len = if with_bias { plan.o } else { 0 };
    let threads = rayon::current_num_threads();
    let tasks = threads.min(conv.n).max(1);
    let per_task = conv.n.div_ceil(tasks).max(1);
    let group = wino.group(per_task, 1);
    let par = gemm_parallelism(tasks);
    let run = |t: usize| -> candle_core::Result<Vec<f32>> {
        // The transformed kernel's gradient, started by the first group's products, then the
        // bias's.
        let mut du = Vec::with_capacity(grad_len + bias_len);
        let mut bias = vec![0f32; bias_len];
        let images = t * per_task..((t + 1) * per_task).min(conv.n);
        with_scratch(|s| -> candle_core::Result<()> {
            for i0 in images.clone().step_by(group) {
                let i1 = (i0 + group).min(images.end);
                let (xs, dys) = (&x[i0 * in_len..i1 * in_len], &dy[i0 * dy_len..i1 * dy_len]);
                if with_bias {
                    for dyi in dys.chunks_exact(dy_len) {
                        add_channel_sums(dyi, &mut bias);
                    }
                }
                wino.accumulate_kernel_grad(xs, dys, &mut du, &mut s.winograd, par)?;
            }
            Ok(())
        })?;
        // A task without images (none: every task gets at least one) would leave it empty.
        du.resize(grad_len, 0.0);
        du.extend_from_slice(&bias);
        Ok(du)
    };
    let mut partials = each_task(tasks, run)?;
    let total = sum_partials(&mut partials);
    let mut dw = wino.kernel_grad(&total[..grad_len]);
    dw.extend_from_slice(&total[grad_len..]);
    Ok(dw)
}

/// The sum of equal-length `partials` in the first one's memory, added in order (so the result
/// does not depend on the thread count's timing), in parallel over chunks.
fn sum_partials(partials: &mut [Vec<f32>]) -> Vec<f32> {
    /// Values per rayon task.
    const CHUNK: usize = 16 * 1024;
    let Some((first, rest)) = partials.split_first_mut() else {
        return Vec::new();
    };
    let mut total = std::mem::take(first);
    total
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            for partial in rest.iter() {
                for (t, p) in chunk.iter_mut().zip(&partial[i * CHUNK..]) {
                    *t += p;
                }
            }
        });
    total
}

/// The results of `run(t)` for each of `tasks` tasks, in order: in parallel when there are
/// several.
fn each_task(
    tasks: usize,
    run: impl Fn(usize) -> candle_core::Result<Vec<f32>> + Sync + Send,
) -> candle_core::Result<Vec<Vec<f32>>> {
    if tasks > 1 {
        (0..tasks).into_par_iter().map(run).collect()
    } else {
        Ok(vec![run(0)?])
    }
}

/// Writes the sum of the packed `[call][depth][o]` kernel gradients `partials` (added in
/// order) into `dw`, laid out `(o, c, kh, kw)`, a group of output channels per task so each
/// task reads whole cache lines.
fn unpack_sum(plan: &Plan, partials: &[Vec<f32>], dw: &mut [f32]) {
    const GROUP: usize = 16;
    let (o, taps, depth) = (plan.o, plan.taps(), plan.depth());
    dw.par_chunks_mut(GROUP * taps)
        .enumerate()
        .for_each(|(g, block)| {
            let o0 = g * GROUP;
            let channels = block.len() / taps;
            for i in 0..plan.calls() * depth {
                let at = plan.unpacked_index(i / depth, i % depth);
                for j in 0..channels {
                    let sum: f32 = partials.iter().map(|p| p[i * o + o0 + j]).sum();
                    block[j * taps + at] = sum;
                }
            }
        });
}

/// Adds the sum of each of `sums.len()` equal planes of `dy` to `sums`, in lanes the compiler
/// vectorises.
fn add_channel_sums(dy: &[f32], sums: &mut [f32]) {
    const LANES: usize = 16;
    let plane = dy.len() / sums.len().max(1);
    for (sum, row) in sums.iter_mut().zip(dy.chunks_exact(plane.max(1))) {
        let mut lanes = [0f32; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().sum();
        for chunk in chunks {
            for (l, v) in lanes.iter_mut().zip(chunk) {
                *l += v;
            }
        }
        *sum += lanes.iter().sum::<f32>() + tail;
    }
}

/// Adds one image's kernel gradient to `acc`, packed as `[call][depth][o]`: `acc (depth x o)
/// += E (depth x positions) * dY^T (positions x o)` for each GEMM of each tile. With the
/// micro-kernel (and the image on one thread), `dY` is transposed into its strips once per
/// image and the expansion read in place; otherwise both go to `gemm`, `dY` transposed once
/// per image so that it is not packed again for every call.
fn weight_grad_image(
    plan: &Plan,
    x: &[f32],
    dy: &[f32],
    acc: &mut [f32],
    scratch: &mut Scratch,
    parallelism: Parallelism,
) -> candle_core::Result<()> {
    let positions = plan.ho * plan.wo;
    let depth = plan.depth();
    let Scratch {
        expanded,
        transposed,
        ..
    } = scratch;
    if matches!(parallelism, Parallelism::None) && microkernel::supported() {
        let nr = microkernel::block_columns(SimdLevel::in_use());
        let dyt = at_least(transposed, strips_len(plan.o, positions, nr));
        transpose_to_strips(dy, plan.o, positions, nr, dyt);
        let dyt = &*dyt;
        return for_each_tile_gemm(plan, x, expanded, |t| {
            // The operand read as (depth x positions).
            let lhs = View {
                rs: t.operand.cs,
                cs: t.operand.rs,
                ..t.operand
            };
            microkernel::product(
                Panels::in_place(lhs, depth, t.rows * plan.wo),
                Strips {
                    data: dyt,
                    offset: t.i0 * plan.wo * nr,
                    stride: positions * nr,
                    nr,
                },
                plan.o,
                ViewMut {
                    data: acc,
                    offset: t.call * plan.o * depth,
                    rs: plan.o,
                    cs: 1,
                },
                Write {
                    start: Start::Dst,
                    relu: false,
                },
            )
        });
    }
    let dyt = at_least(transposed, dy.len());
    transpose(dy, plan.o, positions, dyt);
    let dyt = &*dyt;
    for_each_tile_gemm(plan, x, expanded, |t| {
        matmul(
            Product {
                m: plan.o,
                n: depth,
                k: t.rows * plan.wo,
                accumulate: true,
                parallelism,
            },
            ViewMut {
                data: acc,
                offset: t.call * plan.o * depth,
                rs: 1,
                cs: plan.o,
            },
            View {
                data: dyt,
                offset: t.i0 * plan.wo * plan.o,
                rs: 1,
                cs: plan.o,
            },
            // The operand read as (positions x depth).
            t.operand,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swaps_kernel_channel_axes() {
        let (o, c, taps) = (35, 6, 9);
        let w: Vec<f32> = (0..o * c * taps).map(|v| v as f32).collect();
        let wt = transpose_channels(&w, o, c, taps);
        for oi in 0..o {
            for ci in 0..c {
                for t in 0..taps {
                    assert_eq!(wt[(ci * o + oi) * taps + t], w[(oi * c + ci) * taps + t]);
                }
            }
        }
    }
}
