//! A forward kernel lowered for its plan before its first product: Winograd's transformed
//! taps, or the direct correlation's packed ones. The passes run it; a layer's `KernelCache`
//! keeps it between inference calls.

use super::microkernel::{self, PackedLhs};
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
            None => Self::Direct(PackedKernel::new(plan, tap)?),
        })
    }
}

/// A kernel packed for the GEMMs of a plan: [`Plan::pack`]'s `[call][o][depth]`, as the `gemm`
/// crate reads it, and on CPUs where [`microkernel`] runs the products, the same in its
/// panels, one per call. The micro-kernel runs on one thread, so a GEMM split over the pool
/// (fewer images than threads) goes to `gemm`, as does a tile of positions that would leave
/// much of the micro-kernel's last block of columns empty.
pub(crate) struct PackedKernel {
    /// `[call][o][depth]`, for the `gemm` crate.
    pub gemm: Vec<f32>,
    /// The same in the micro-kernel's panels, one per call; empty where it does not run.
    pub panels: Vec<PackedLhs>,
}

impl PackedKernel {
    /// The kernel whose tap `(o, c, ky, kx)` is `tap(o, c, ky, kx)`, packed for `plan`.
    pub(super) fn new(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
    ) -> candle_core::Result<Self> {
        let gemm = plan.pack(tap);
        let per_call = plan.o * plan.depth();
        let panels = if microkernel::preferred() && per_call > 0 {
            let calls = gemm.chunks_exact(per_call);
            calls
                .map(|w| PackedLhs::new(w, plan.o, plan.depth()))
                .collect::<candle_core::Result<_>>()?
        } else {
            Vec::new()
        };
        Ok(Self { gemm, panels })
    }

    /// A placeholder for a plan lowered otherwise (to Winograd's).
    pub(super) fn none() -> Self {
        Self {
            gemm: Vec::new(),
            panels: Vec::new(),
        }
    }
}
