//! The kernel gradient ([`weight_grad`]), with the bias gradient beside it: each task sums a
//! contiguous run of images into an accumulator of its own, `E dY^T` for each GEMM of each tile
//! (in the micro-kernel, the output gradient transposed into its strips once per image, or in
//! the `gemm` crate), or the transformed kernel's gradient through Winograd's transforms; the
//! accumulators are added in a fixed order (`winograd_kernel_grad` holds the Winograd pass).

use rayon::prelude::*;

use super::winograd_kernel_grad;
use super::{
    at_least, for_each_tile_gemm, gemm_parallelism, split_images, with_scratch, Conv, Scratch,
};
use crate::conv2d::gemm::{matmul, Parallelism, Product, View, ViewMut};
use crate::conv2d::microkernel::{self, Panels, Start, Strips, Write};
use crate::conv2d::plan::Plan;
use crate::conv2d::transpose::{strips_len, transpose, transpose_to_strips};
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
