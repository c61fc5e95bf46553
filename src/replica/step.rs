//! The training step's buffer and its final phase, written once for every strategy.
//!
//! Each replica turns its part of a global batch into one **step buffer**
//! ([`Replica::step_buffer`](super::Replica::step_buffer)): the gradients of its loss *sum*,
//! its loss and metric sums, its sample count, and its moving statistics multiplied by that
//! count. Buffers add up: a strategy sums them across replicas, devices and workers however it
//! likes (that is all a strategy decides), and every replica that holds the variables then runs
//! the **final phase** on the total ([`Replica::finish_step`](super::Replica::finish_step)):
//!
//! 1. [`StepLayout::read`] reads the sums, the sample count and a finite-ness probe to the host
//!    in one transfer;
//! 2. the step applies only when it has samples and every value is finite
//!    ([`StepTotals::applies`]); otherwise the replica puts back the moving statistics its
//!    forward pass changed, and the last good weights survive;
//! 3. an applied step divides the gradients by the global sample count (the mean gradient of
//!    the global batch, whatever the split) and sets the moving statistics to their mean
//!    weighted by sample count (a replica without samples drops out), then runs the optimizer.

use candle_core::{DType, Tensor, Var};

use super::fused::FusedLayout;
use crate::optimizers::{LiveRates, Optimizer};
use crate::Result;

/// How a step buffer is laid out: `[gradients..., sums..., sample count, statistics...]`.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLayout {
    /// The trainable variables' gradients, first.
    pub grads: FusedLayout,
    /// Number of loss and metric sums, next, followed by the sample count.
    pub num_stats: usize,
    /// The moving statistics (each multiplied by the sample count), last.
    pub statistics: FusedLayout,
}

impl StepLayout {
    /// Offset of the loss and metric sums.
    pub fn stats_offset(&self) -> usize {
        self.grads.len()
    }

    /// Offset of the sample count.
    pub fn samples_offset(&self) -> usize {
        self.grads.len() + self.num_stats
    }

    /// Offset of the moving statistics.
    pub fn statistics_offset(&self) -> usize {
        self.samples_offset() + 1
    }

    /// The buffer's length, never 0: a buffer holds at least the sample count.
    #[expect(
        clippy::len_without_is_empty,
        reason = "a layout is not a collection and no buffer it lays out is empty"
    )]
    pub fn len(&self) -> usize {
        self.statistics_offset() + self.statistics.len()
    }

    /// Reads a (summed) step buffer's loss and metric sums and its sample count to the host
    /// with one transfer, and whether every gradient and sum in it is finite.
    pub fn read(&self, buffer: &Tensor) -> Result<StepTotals> {
        self.read_summary(&self.summary(buffer)?)
    }

    /// What [`Self::read`] reads of `buffer`, on its device: `[sums..., sample count, probe]`,
    /// the probe 0 when every gradient and sum is finite and NaN otherwise (the gate of a
    /// gated update, [`crate::optimizers::gated`]).
    pub fn summary(&self, buffer: &Tensor) -> Result<Tensor> {
        let stats = buffer.narrow(0, self.stats_offset(), self.num_stats + 1)?;
        let grads = buffer.narrow(0, 0, self.grads.len())?;
        let probe = finite_probe(&stats, &[grads])?;
        Ok(Tensor::cat(
            &[&stats.to_dtype(DType::F32)?, &probe.reshape(1)?],
            0,
        )?)
    }

    /// The probe of a [`Self::summary`], on its device.
    pub fn gate(&self, summary: &Tensor) -> Result<Tensor> {
        Ok(summary.narrow(0, self.num_stats + 1, 1)?)
    }

    /// Reads a [`Self::summary`] to the host.
    pub fn read_summary(&self, summary: &Tensor) -> Result<StepTotals> {
        let host = summary.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let finite = host.last().is_some_and(|p| p.is_finite());
        Ok(StepTotals {
            sums: host[..self.num_stats].to_vec(),
            samples: host[self.num_stats].round().max(0.0) as usize,
            finite,
        })
    }
}

/// The sums a step produced, over all replicas and workers.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// Samples in the step.
    pub samples: usize,
    /// `[loss_sum, metric_sum...]`: divide by `samples` for means.
    pub sums: Vec<f64>,
    /// Whether the update was applied (false when the loss or a gradient was not finite).
    pub applied: bool,
}

/// What a summed step buffer says, read on the host; every replica and worker reads the same
/// and so decides alike.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTotals {
    /// Loss and metric sums over the global batch.
    pub sums: Vec<f64>,
    /// Samples in the global batch.
    pub samples: usize,
    /// Whether every gradient and sum is finite.
    pub finite: bool,
}

impl StepTotals {
    /// Whether the update is applied: the step had samples and nothing in it is NaN or
    /// infinite.
    pub fn applies(&self) -> bool {
        self.finite && self.samples > 0
    }

    /// The step's statistics for `fit`.
    pub fn into_stats(self) -> StepStats {
        StepStats {
            applied: self.applies(),
            samples: self.samples,
            sums: self.sums,
        }
    }
}

/// The step's final phase on a set of variables: `optimizer` over the trainable variables of
/// `layout.grads` and the moving `statistics` of `layout.statistics`, with `total`, a summed
/// buffer laid out by `layout` (on the variables' device), and `totals`, what
/// [`StepLayout::read`] read from it.
///
/// An applied step ([`StepTotals::applies`]) divides the gradients by the global sample count,
/// runs the optimizer at `lr`, and sets the moving statistics to their mean weighted by sample
/// count; a step that does not apply puts back `statistics_before` (empty when no forward pass
/// changed them) and changes nothing else.
///
/// [`Replica::finish_step`](super::Replica::finish_step) runs it on a whole model; a strategy
/// whose variables are split between processes (parameter servers) runs it on each part, with
/// the part's layout.
pub fn finish(
    optimizer: &mut dyn Optimizer,
    statistics: &[Var],
    layout: &StepLayout,
    total: &Tensor,
    totals: &StepTotals,
    statistics_before: &[Tensor],
    lr: f64,
) -> Result<()> {
    if !totals.applies() {
        for (var, before) in statistics.iter().zip(statistics_before) {
            var.set(before)?;
        }
        return Ok(());
    }
    let per_sample = 1.0 / totals.samples as f64;
    let grads = (total.narrow(0, 0, layout.grads.len())? * per_sample)?;
    optimizer.step(&layout.grads.split(&grads, 0)?, lr)?;
    if !statistics.is_empty() {
        let summed = total.narrow(0, layout.statistics_offset(), layout.statistics.len())?;
        let means = layout.statistics.split(&(summed * per_sample)?, 0)?;
        for (var, mean) in statistics.iter().zip(means) {
            var.set(&mean)?;
        }
    }
    Ok(())
}

/// The final phase of one replica's step decided on its device, for a whole step
/// ([`Replica::train_alone`](super::Replica::train_alone)): what [`finish`] does with the
/// buffer `total` of `samples` samples (not 0) and its [`StepLayout::summary`], the update
/// gated by the summary's probe and reading its rates from `rates`
/// ([`Optimizer::step_gated`]), the moving statistics set to their means or put back to
/// `statistics_before` by the same probe. Nothing is read to the host. The gradients go through
/// `grads`, a buffer kept across steps, so that the update lists the same tensors each time.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish_gated(
    optimizer: &dyn Optimizer,
    statistics: &[Var],
    layout: &StepLayout,
    (total, summary): (&Tensor, &Tensor),
    statistics_before: &[Tensor],
    samples: usize,
    grads: &Var,
    rates: &Tensor,
) -> Result<()> {
    let per_sample = 1.0 / samples as f64;
    grads.set(&(total.narrow(0, 0, layout.grads.len())? * per_sample)?)?;
    let gate = layout.gate(summary)?;
    let live = LiveRates { rates, gate: &gate };
    optimizer.step_gated(&layout.grads.split(grads.as_tensor(), 0)?, &live)?;
    if !statistics.is_empty() {
        let summed = total.narrow(0, layout.statistics_offset(), layout.statistics.len())?;
        let means = layout.statistics.split(&(summed * per_sample)?, 0)?;
        let open = gate.eq(0f32)?.reshape(())?;
        for ((var, mean), before) in statistics.iter().zip(means).zip(statistics_before) {
            let keep = open.broadcast_as(mean.shape())?;
            var.set(&keep.where_cond(&mean, before)?)?;
        }
    }
    Ok(())
}

/// A finite-ness probe over the statistics and gradients: one scalar that is finite exactly
/// when all of them are, so a single host read decides whether a step may be applied.
pub(crate) fn finite_probe(stats: &Tensor, grads: &[Tensor]) -> Result<Tensor> {
    let mut total = stats.sum_all()?.to_dtype(DType::F32)?;
    for g in grads {
        total = (total + g.sum_all()?.to_dtype(DType::F32)?)?;
    }
    // 0 * x is NaN exactly when x is NaN or infinite.
    Ok((total * 0.0)?)
}
