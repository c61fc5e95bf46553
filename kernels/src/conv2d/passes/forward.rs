//! The forward pass over a batch ([`forward`]): the layer's kernel lowered (or taken from its
//! cache), then each group of images correlated into its part of the output, through Winograd's
//! transforms, several small images to a GEMM, or one image at a time ([`correlate_image`]:
//! row-shift GEMMs over one tile of output rows after another, which the input gradient's
//! correlations run too).

use super::side_by_side::{correlate_group, image_group};
use super::{fill_groups, for_each_tile_gemm, Conv};
use crate::conv2d::cache::KernelCache;
use crate::conv2d::epilogue::Epilogue;
use crate::conv2d::gemm::{matmul, Parallelism, Product, View, ViewMut};
use crate::conv2d::lowered::{Lowered, PackedKernel};
use crate::conv2d::microkernel::{self, Start, Write};
use crate::conv2d::plan::Plan;
use crate::output::PartedOutput;

/// `out = correlate(x, kernel) + bias` for one image, `bias` one value per output channel
/// (none: zero), or `out +=` that when `into`; then the epilogue's ReLU, if any (its scale is
/// the kernel's already).
pub(super) fn correlate_image(
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
        let panels = match (kernel.panels(t.call), parallelism) {
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
                    panels,
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
                        data: kernel.gemm(),
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
