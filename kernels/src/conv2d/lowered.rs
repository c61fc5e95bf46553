//! A forward kernel lowered for its plan before its first product: Winograd's transformed
//! taps, or the direct correlation's packed ones. The passes run it; a layer's `KernelCache`
//! keeps it between inference calls.

use std::sync::OnceLock;

use super::microkernel::{self, PackedStack, Panels, MR};
use super::plan::Plan;
use super::winograd::Winograd;

/// A forward kernel lowered for its plan: Winograd's transformed taps, or the direct
/// correlation's packed ones.
pub(crate) enum Lowered {
    Winograd(Winograd),
    Direct(PackedKernel),
}

impl Lowered {
    /// The kernel whose tap `(o, c, ky, kx)` is `tap(o, c, ky, kx)`, lowered for `plan`.
    pub(super) fn new(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
    ) -> candle_core::Result<Self> {
        Ok(match Winograd::new(plan, &tap) {
            Some(wino) => Self::Winograd(wino),
            None => Self::Direct(PackedKernel::new(plan, tap)),
        })
    }
}

/// A kernel packed for the GEMMs of a plan: on CPUs where [`microkernel`] runs the products,
/// its panels, one matrix per call, packed straight from the taps in parallel; and
/// [`Plan::pack`]'s `[call][o][depth]`, as the `gemm` crate reads it, made on first use (from
/// the panels) or at once where there are none. The micro-kernel runs on one thread, so a GEMM
/// split over the pool (fewer images than threads) goes to `gemm`, as does a tile of positions
/// that would leave much of the micro-kernel's last block of columns empty.
pub(crate) struct PackedKernel {
    /// The micro-kernel's panels, one matrix per call; `None` where it does not run.
    panels: Option<PackedStack>,
    /// `[call][o][depth]`, for the `gemm` crate.
    gemm: OnceLock<Vec<f32>>,
}

impl PackedKernel {
    /// The kernel whose tap `(o, c, ky, kx)` is `tap(o, c, ky, kx)`, packed for `plan`.
    pub(super) fn new(plan: &Plan, tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync) -> Self {
        let (o, depth) = (plan.o, plan.depth());
        if !microkernel::preferred() || o * depth == 0 {
            return Self {
                panels: None,
                gemm: OnceLock::from(plan.pack(tap)),
            };
        }
        // Each panel's rows packed one at a time, then laid out `[k][rows]` for every call.
        let stack = PackedStack::build(plan.calls(), (o, depth), |p, rows, out| {
            let mut row = vec![0f32; depth];
            for (call, panel) in out.chunks_exact_mut(rows * depth).enumerate() {
                for r in 0..rows {
                    plan.pack_row((call, MR * p + r), &tap, &mut row);
                    for (column, v) in panel.chunks_exact_mut(rows).zip(&row) {
                        column[r] = *v;
                    }
                }
            }
        });
        Self {
            panels: Some(stack),
            gemm: OnceLock::new(),
        }
    }

    /// A placeholder for a plan lowered otherwise (to Winograd's).
    pub(super) fn none() -> Self {
        Self {
            panels: None,
            gemm: OnceLock::from(Vec::new()),
        }
    }

    /// Whether the micro-kernel's panels are there.
    pub(super) fn has_panels(&self) -> bool {
        self.panels.is_some()
    }

    /// The panels of GEMM `call`, where the micro-kernel runs.
    pub(super) fn panels(&self, call: usize) -> Option<Panels<'_>> {
        let stack = self.panels.as_ref()?;
        (call < stack.count()).then(|| stack.panels(call))
    }

    /// The kernel as the `gemm` crate reads it, `[call][o][depth]`.
    pub(super) fn gemm(&self) -> &[f32] {
        self.gemm.get_or_init(|| {
            self.panels
                .as_ref()
                .map(PackedStack::unpacked)
                .unwrap_or_default()
        })
    }
}
