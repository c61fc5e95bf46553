//! The transformed kernel `U = G g Gt` of a lowering ([`Winograd::new`]): each output channel's
//! 3x3 taps transformed [`KERNEL_LANES`] input channels at a time, one per lane, and written
//! panel by panel straight into the micro-kernel's stack of 36 packed matrices
//! ([`PackedStack`]), or laid out `[e][o][c]` for the `gemm` crate; and a packed kernel
//! unpacked to that layout when a product goes to `gemm` after all.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::{Winograd, ELEMENTS, SIDE};
use crate::conv2d::microkernel::{self, PackedStack, MR};
use crate::conv2d::plan::Plan;

/// A transformed kernel: packed for [`microkernel::product`], or `[e][o][c]` for the `gemm`
/// crate, or absent (a kernel gradient needs none).
pub(super) enum Kernel {
    Packed(PackedStack),
    Plain(Vec<f32>),
    None,
}

impl Winograd {
    /// The correlation of `plan` with the kernel whose tap `(o, c, ky, kx)` is
    /// `tap(o, c, ky, kx)`, or `None` when the plan is not a 3x3, stride-1 correlation with
    /// enough channels and positions for the transforms to pay.
    pub(crate) fn new(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
    ) -> Option<Self> {
        Self::with_products(plan, tap, microkernel::preferred())
    }

    /// [`Self::new`], with the products in [`microkernel`] when `packed` (and the CPU runs it).
    pub(super) fn with_products(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
        packed: bool,
    ) -> Option<Self> {
        if !Self::suits(plan) {
            return None;
        }
        let (o, c) = (plan.o, plan.c);
        // `U = G g Gt` of output channel `oi` and input channels `ci0 ..` (up to
        // `KERNEL_LANES`, zero past `c`), one lane each, so the arithmetic vectorises.
        let transformed = |oi: usize, ci0: usize| -> [[f32; KERNEL_LANES]; ELEMENTS] {
            let mut g = [[[0f32; KERNEL_LANES]; 3]; 3];
            for (l, ci) in (ci0..c.min(ci0 + KERNEL_LANES)).enumerate() {
                for (ky, row) in g.iter_mut().enumerate() {
                    for (kx, taps) in row.iter_mut().enumerate() {
                        taps[l] = tap(oi, ci, ky, kx);
                    }
                }
            }
            // G g: 6 rows of 3, then (G g) Gt: 6x6.
            let mut gg = [[[0f32; KERNEL_LANES]; 3]; SIDE];
            for kx in 0..3 {
                let col = kernel_columns([g[0][kx], g[1][kx], g[2][kx]]);
                for (row, v) in gg.iter_mut().zip(col) {
                    row[kx] = v;
                }
            }
            let mut u = [[0f32; KERNEL_LANES]; ELEMENTS];
            for (a, row) in gg.iter().enumerate() {
                u[a * SIDE..][..SIDE].copy_from_slice(&kernel_columns(*row));
            }
            u
        };
        let kernel = if packed && microkernel::supported() {
            // Each task transforms a panel's output channels and writes them straight into
            // their panel of every element's packed matrix.
            // The panel's rows are transformed together, then each element's `[k][rows]`
            // run of those input channels is written in order.
            Kernel::Packed(PackedStack::build(ELEMENTS, (o, c), |p, rows, out| {
                let per_element = rows * c;
                let mut panel = [[[0f32; KERNEL_LANES]; ELEMENTS]; MR];
                for ci0 in (0..c).step_by(KERNEL_LANES) {
                    let lanes = KERNEL_LANES.min(c - ci0);
                    for (r, u) in panel.iter_mut().enumerate().take(rows) {
                        *u = transformed(p * MR + r, ci0);
                    }
                    for e in 0..ELEMENTS {
                        let run = &mut out[e * per_element + ci0 * rows..][..lanes * rows];
                        for (l, values) in run.chunks_exact_mut(rows).enumerate() {
                            for (r, v) in values.iter_mut().enumerate() {
                                *v = panel[r][e][l];
                            }
                        }
                    }
                }
            }))
        } else {
            // `[e][o][c]`, each output channel's in parallel.
            let per_channel: Vec<Vec<[[f32; KERNEL_LANES]; ELEMENTS]>> = (0..o)
                .into_par_iter()
                .map(|oi| {
                    (0..c)
                        .step_by(KERNEL_LANES)
                        .map(|ci0| transformed(oi, ci0))
                        .collect()
                })
                .collect();
            let mut kernel = vec![0f32; ELEMENTS * o * c];
            for (oi, channel) in per_channel.iter().enumerate() {
                for (block, u) in channel.iter().enumerate() {
                    let ci0 = block * KERNEL_LANES;
                    let lanes = KERNEL_LANES.min(c - ci0);
                    for (e, values) in u.iter().enumerate() {
                        let at = (e * o + oi) * c + ci0;
                        kernel[at..at + lanes].copy_from_slice(&values[..lanes]);
                    }
                }
            }
            Kernel::Plain(kernel)
        };
        Some(Self {
            plan: *plan,
            kernel,
            unpacked: OnceLock::new(),
            block: Self::block(plan),
        })
    }

    /// `U[e][o][c]`, for the `gemm` crate (empty for a kernel gradient's lowering).
    pub(super) fn plain_kernel(&self) -> &[f32] {
        match &self.kernel {
            Kernel::Plain(kernel) => kernel,
            Kernel::Packed(stack) => self.unpacked.get_or_init(|| stack.unpacked()),
            Kernel::None => &[],
        }
    }
}

/// Input channels [`Winograd::new`] transforms at once, a lane each.
const KERNEL_LANES: usize = 8;

/// [`kernel_column`] of each lane: the taps of [`KERNEL_LANES`] kernels at once.
#[inline(always)]
fn kernel_columns(g: [[f32; KERNEL_LANES]; 3]) -> [[f32; KERNEL_LANES]; SIDE] {
    let mut out = [[0f32; KERNEL_LANES]; SIDE];
    for l in 0..KERNEL_LANES {
        let column = kernel_column([g[0][l], g[1][l], g[2][l]]);
        for (row, v) in out.iter_mut().zip(column) {
            row[l] = v;
        }
    }
    out
}

/// One column of `G g`: the 3 taps `g` to 6 values.
#[inline(always)]
fn kernel_column([g0, g1, g2]: [f32; 3]) -> [f32; SIDE] {
    // Multiplications by the reciprocals: divisions would dominate the kernel's transform.
    const SIXTH: f32 = 1.0 / 6.0;
    let (outer, inner) = (g0 * (SIXTH / 4.0) + g2 * SIXTH, g1 * (SIXTH / 2.0));
    [
        g0 * 0.25,
        -(g0 + g1 + g2) * SIXTH,
        -(g0 - g1 + g2) * SIXTH,
        outer + inner,
        outer - inner,
        g2,
    ]
}
