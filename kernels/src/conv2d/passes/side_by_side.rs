//! Small images several to a GEMM: where an image's positions would leave much of the
//! micro-kernel's last column block empty and its whole expansion fits a budget
//! ([`image_group`]), each GEMM's operand is copied for a group of images side by side, with no
//! column between two images and the row shifts of the stride phases taken as they are copied
//! ([`side_by_side`]), so one product per GEMM covers the group ([`correlate_group`]). The
//! forward pass and the input gradient (each stride phase) run it; the kernel gradient reads
//! the same operands along its depth.

use super::{at_least, Scratch};
use crate::conv2d::epilogue::Epilogue;
use crate::conv2d::gemm::{View, ViewMut};
use crate::conv2d::groups::balanced_group;
use crate::conv2d::lowered::PackedKernel;
use crate::conv2d::microkernel::{self, Start, Write};
use crate::conv2d::plan::Plan;
use crate::output::ImagesMut;

/// Columns a GEMM of [`correlate_group`] aims for: enough for the micro-kernel's column blocks
/// to be nearly full.
const GROUP_COLUMNS: usize = 256;

/// Images per GEMM for `plan` out of `n`: one, unless an image's positions would leave much of
/// the micro-kernel's last column block empty (7x7 planes fill 49 of 64 columns), its whole
/// expansion fits [`fits_side_by_side`], and the micro-kernel runs the products; then about enough images for
/// [`GROUP_COLUMNS`] columns, in groups that keep every thread busy ([`balanced_group`]).
pub(super) fn image_group(plan: &Plan, kernel: &PackedKernel, n: usize) -> usize {
    let positions = plan.ho * plan.wo;
    if !kernel.has_panels()
        || microkernel::fills_blocks(positions)
        || !fits_side_by_side(plan)
        || positions == 0
    {
        return 1;
    }
    let threads = rayon::current_num_threads();
    balanced_group(n, GROUP_COLUMNS.div_ceil(positions), threads)
}

/// The most `f32`s one image's whole expansion may take for [`side_by_side`] (2 MiB): more
/// than a tile's budget ([`Plan::tile_rows`]), so a deep layer's small images (ResNet-50's
/// 512-channel 3x3 stride-2 layer into 7x7 planes, 688 KiB) still go several to a GEMM.
const IMAGE_EXPANSION_BUDGET: usize = 512 * 1024;

/// Whether an image of `plan` goes to [`side_by_side`]: its whole expansion within
/// [`IMAGE_EXPANSION_BUDGET`].
pub(super) fn fits_side_by_side(plan: &Plan) -> bool {
    plan.expanded_len(plan.ho) <= IMAGE_EXPANSION_BUDGET
}

/// The GEMM operands of the small images `x` (whole images, back to back) side by side:
/// `[call][depth][image][position]`, so GEMM `call` reads its `depth x (images * positions)`
/// operand at `call * depth * images * positions`, with no column between two images. Each
/// image is expanded in `expanded` (or read in place), then each GEMM's rows are copied out
/// of it: the row shifts of the stride phases are taken as they are copied.
pub(super) fn side_by_side<'a>(
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
pub(super) fn correlate_group(
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
    for call in 0..plan.calls() {
        let Some(panels) = kernel.panels(call) else {
            candle_core::bail!("conv2d: no micro-kernel panels for GEMM {call} of a group");
        };
        // The first product starts from the bias, in the micro-kernel's registers.
        let start = match (call, bias) {
            (0, Some(bias)) => Start::Rows(bias),
            (0, None) => Start::Zero,
            _ => Start::Dst,
        };
        microkernel::product(
            panels,
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
                relu: epilogue.relu && call + 1 == plan.calls(),
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
