//! The kernel gradient ([`weight_grad`]), with the bias gradient beside it: each task sums a
//! contiguous run of images into an accumulator of its own, `E dY^T` for each GEMM of each tile
//! (in the micro-kernel, the output gradient transposed into its strips once per image, small
//! images several to a GEMM; or in the `gemm` crate), or the transformed kernel's gradient
//! through Winograd's transforms; the accumulators are added in a fixed order
//! (`winograd_kernel_grad` holds the Winograd pass).

use rayon::prelude::*;

use super::side_by_side::{fits_side_by_side, side_by_side};
use super::winograd_kernel_grad;
use super::{
    at_least, for_each_tile_gemm, gemm_parallelism, split_images, with_scratch, Conv, Scratch,
};
use crate::conv2d::gemm::{matmul, Parallelism, Product, View, ViewMut};
use crate::conv2d::microkernel::{self, Panels, Start, Strips, Write};
use crate::conv2d::plan::Plan;
use crate::conv2d::transpose::{strips_len, transpose, transpose_part, transpose_to_strips};
use crate::conv2d::winograd::Winograd;
use crate::SimdLevel;

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
    weight_grad_in_groups(conv, (x, dy), with_bias, true)
}

/// [`weight_grad`], small images several to a GEMM only when `grouped` (see [`image_group`]).
fn weight_grad_in_groups(
    conv: &Conv,
    (x, dy): (&[f32], &[f32]),
    with_bias: bool,
    grouped: bool,
) -> candle_core::Result<Vec<f32>> {
    let plan = conv.forward_plan();
    if let Some(wino) = Winograd::for_kernel_grad(&plan) {
        return winograd_kernel_grad::weight_grad(conv, &wino, x, dy, with_bias);
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
    let group = if grouped {
        image_group(&plan, per_task, par)
    } else {
        1
    };
    let run = |t: usize| -> candle_core::Result<Vec<f32>> {
        let mut acc = vec![0f32; acc_len];
        let (packed, bias) = acc.split_at_mut(packed_len);
        let end = ((t + 1) * per_task).min(conv.n);
        with_scratch(|s| {
            (t * per_task..end).step_by(group).try_for_each(|first| {
                let images = first..(first + group).min(end);
                let xs = &x[images.start * in_len..images.end * in_len];
                let dys = &dy[images.start * dy_len..images.end * dy_len];
                if with_bias {
                    dys.chunks_exact(dy_len.max(1))
                        .for_each(|dyi| add_channel_sums(dyi, bias));
                }
                if images.len() > 1 {
                    weight_grad_group(&plan, xs, dys, packed, s)
                } else {
                    weight_grad_image(&plan, xs, dys, packed, s, par)
                }
            })
        })?;
        Ok(acc)
    };
    let mut partials = each_task(tasks, run)?;
    let total = sum_partials(&mut partials);
    let mut dw = vec![0f32; conv.o * plan.taps()];
    unpack(&plan, &total[..packed_len], &mut dw);
    dw.extend_from_slice(&total[packed_len..]);
    Ok(dw)
}

/// Positions of the images one kernel-gradient GEMM of the micro-kernel aims to run along its
/// depth: small images go several to a GEMM, so the accumulator (megabytes for the last stages'
/// layers) is read and written once per group rather than once per image of 49 positions.
const GROUP_POSITIONS: usize = 256;

/// Images per kernel-gradient GEMM out of a task's `images`: one, unless the micro-kernel runs
/// the products on one thread and an image of fewer than [`GROUP_POSITIONS`] positions goes to
/// [`side_by_side`] ([`fits_side_by_side`]); then about enough images for that many.
fn image_group(plan: &Plan, images: usize, parallelism: Parallelism) -> usize {
    let positions = plan.ho * plan.wo;
    let microkernel = matches!(parallelism, Parallelism::None) && microkernel::supported();
    if !microkernel || !fits_side_by_side(plan) || positions == 0 || positions >= GROUP_POSITIONS {
        return 1;
    }
    GROUP_POSITIONS.div_ceil(positions).clamp(1, images.max(1))
}

/// The sum of equal-length `partials` in the first one's memory, added in order (so the result
/// does not depend on the thread count's timing), in parallel over chunks.
pub(super) fn sum_partials(partials: &mut [Vec<f32>]) -> Vec<f32> {
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
pub(super) fn each_task(
    tasks: usize,
    run: impl Fn(usize) -> candle_core::Result<Vec<f32>> + Sync + Send,
) -> candle_core::Result<Vec<Vec<f32>>> {
    if tasks > 1 {
        (0..tasks).into_par_iter().map(run).collect()
    } else {
        Ok(vec![run(0)?])
    }
}

/// Writes the packed `[call][depth][o]` kernel gradient `packed` into `dw`, laid out
/// `(o, c, kh, kw)`, a group of output channels per task: each GEMM's `depth x o` block
/// transposed 8x8 blocks at a time (in registers where the kernels use AVX2), straight into
/// `dw` where the packed depth is the kernel's own order (one GEMM of `c * kh * kw`, as a 1x1
/// kernel's), otherwise through a buffer whose rows then go to their taps.
fn unpack(plan: &Plan, packed: &[f32], dw: &mut [f32]) {
    /// Output channels per task: two blocks of the transpose.
    const GROUP: usize = 16;
    let (o, taps, depth, calls) = (plan.o, plan.taps(), plan.depth(), plan.calls());
    let at: Vec<usize> = (0..calls * depth)
        .map(|i| plan.unpacked_index(i / depth, i % depth))
        .collect();
    let in_order = at.iter().enumerate().all(|(i, &a)| i == a);
    dw.par_chunks_mut((GROUP * taps).max(1))
        .enumerate()
        .for_each(|(g, block)| {
            let o0 = g * GROUP;
            let channels = block.len() / taps.max(1);
            let from = |call: usize| &packed[call * depth * o + o0..];
            if in_order {
                transpose_part(from(0), (depth, channels), o, block);
                return;
            }
            let mut rows = vec![0f32; channels * depth];
            for call in 0..calls {
                transpose_part(from(call), (depth, channels), o, &mut rows);
                let at = &at[call * depth..(call + 1) * depth];
                for (dst, row) in block.chunks_exact_mut(taps).zip(rows.chunks_exact(depth)) {
                    at.iter().zip(row).for_each(|(&a, v)| dst[a] = *v);
                }
            }
        });
}

/// Adds the sum of each of `sums.len()` equal planes of `dy` to `sums`, in lanes the compiler
/// vectorises.
pub(super) fn add_channel_sums(dy: &[f32], sums: &mut [f32]) {
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
        transpose_to_strips(dy, 1, (plan.o, positions), nr, dyt);
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

/// Adds the kernel gradient of the small images `x` (several, back to back, and their output
/// gradients `dy`) to `acc`, as [`weight_grad_image`] does one after another, in one product per
/// GEMM: their operands side by side ([`side_by_side`], `depth x (images * positions)`) and
/// their output gradients transposed under one another into strips, so each product's depth
/// runs over every position of the group. The micro-kernel adds along the depth in order, so
/// the sums are those of one image after another, rounding included.
fn weight_grad_group(
    plan: &Plan,
    x: &[f32],
    dy: &[f32],
    acc: &mut [f32],
    scratch: &mut Scratch,
) -> candle_core::Result<()> {
    let positions = plan.ho * plan.wo;
    let images = dy.len() / (plan.o * positions).max(1);
    let (depth, columns) = (plan.depth(), images * positions);
    let nr = microkernel::block_columns(SimdLevel::in_use());
    let Scratch {
        expanded,
        grouped,
        transposed,
        ..
    } = scratch;
    let grouped = side_by_side(plan, x, expanded, grouped);
    let dyt = at_least(transposed, strips_len(plan.o, columns, nr));
    transpose_to_strips(dy, images, (plan.o, positions), nr, dyt);
    let dyt = &*dyt;
    for call in 0..plan.calls() {
        let lhs = View {
            data: grouped,
            offset: call * depth * columns,
            rs: columns,
            cs: 1,
        };
        microkernel::product(
            Panels::in_place(lhs, depth, columns),
            Strips {
                data: dyt,
                offset: 0,
                stride: columns * nr,
                nr,
            },
            plan.o,
            ViewMut {
                data: acc,
                offset: call * plan.o * depth,
                rs: plan.o,
                cs: 1,
            },
            Write {
                start: Start::Dst,
                relu: false,
            },
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small planes go several images to a GEMM, and the gradient is the one of an
    /// image at a time bit for bit: 1x1 and stride-2 3x3 layers into 7x7 and 4x4 planes, a
    /// batch that leaves a last group short, one thread and two.
    #[test]
    fn small_images_several_to_a_gemm_give_the_gradient_of_one_at_a_time() -> anyhow::Result<()> {
        let value = |i: usize| ((i * 7919 % 409) as f32 - 204.0) / 97.0;
        for (n, c, h, o, k, s) in [
            (9, 40, 7, 24, 1, 1),
            (7, 24, 14, 40, 3, 2),
            (6, 16, 8, 20, 3, 2),
            (5, 8, 4, 9, 1, 1),
        ] {
            let ho = (h + 2 * (k / 2) - k) / s + 1;
            let conv = Conv {
                n,
                c,
                h,
                w: h,
                o,
                kh: k,
                kw: k,
                stride: (s, s),
                pad: (k / 2, k / 2, k / 2, k / 2),
                ho,
                wo: ho,
            };
            let plan = conv.forward_plan();
            assert!(
                image_group(&plan, n, Parallelism::None) > 1 || !microkernel::supported(),
                "{conv:?}: one image per GEMM"
            );
            let x: Vec<f32> = (0..n * c * h * h).map(value).collect();
            let dy: Vec<f32> = (0..n * o * ho * ho).map(|i| value(3 * i + 1)).collect();
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()?;
                let (grouped, single) = pool.install(|| -> candle_core::Result<_> {
                    let grouped = weight_grad_in_groups(&conv, (&x, &dy), true, true)?;
                    let single = weight_grad_in_groups(&conv, (&x, &dy), true, false)?;
                    Ok((grouped, single))
                })?;
                assert_eq!(grouped.len(), o * c * k * k + o);
                let differ = grouped
                    .iter()
                    .zip(&single)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differ, 0, "{conv:?} on {threads} threads");
            }
        }
        Ok(())
    }
}
