//! Whole training steps: a replica that alone holds its step (one device, nothing to sum with
//! other replicas) runs the forward pass, the backward pass and the final phase as one piece
//! that decides nothing on the host ([`Replica::train_alone`]).
//!
//! The final phase is gated ([`crate::optimizers::gated`]): the optimizer's update applies
//! when the step's finite-ness probe, computed on the device, says so, and reads the learning
//! rate (and what the step count makes of it) from a small buffer on the device, written before
//! the step. The moving statistics take their means or go back by the same probe. The host
//! reads the step's sums once the step has run, and only then counts the step (Adam's step
//! count) and moves the loss scale on. The values are those of the host-decided final phase
//! bit for bit.
//!
//! With CUDA graphs ([`crate::devices::set_cuda_graphs`]) the whole step is captured and
//! replayed as one launch, the optimizer's update included: PyTorch's
//! `torch.compile(mode="reduce-overhead")` over a training step with a capturable optimizer.
//! Without graphs, a replica runs the host-decided final phase ([`Replica::finish_step`]), as
//! it does for gradient accumulation, gradient buckets, an empty batch, and an optimizer
//! without gated updates ([`crate::optimizers::Optimizer::prepare_gated`]).

use candle_core::{DType, Tensor, Var};

use super::step::{self, StepTotals};
use super::Replica;
use crate::data::Batch;
use crate::{timeline, Result};

/// What whole steps keep on the device across steps.
pub(super) struct WholeBuffers {
    /// The mean gradients of the step, which the gated update reads.
    grads: Var,
    /// The rates of the next update ([`crate::optimizers::Optimizer::gated_rates`]).
    rates: Var,
}

impl Replica {
    /// One training step on `part` at learning rate `lr` for a replica that alone holds the
    /// step: [`Self::step_buffer`], [`StepLayout::read`](super::step::StepLayout::read) and
    /// [`Self::finish_step`] in one call, with the same results; returns what the step read.
    /// With CUDA graphs ([`crate::devices::set_cuda_graphs`]) the step is whole where it can
    /// be: its update gated by a finite-ness probe on the device and reading its learning rate
    /// there, the forward pass, backward pass and update replayed as one launch.
    pub fn train_alone(&mut self, part: &Batch, lr: f64) -> Result<StepTotals> {
        if !self.takes_whole_step(part)? {
            let step = self.step_buffer(part)?;
            let totals = self.layout.read(&step.fused)?;
            self.finish_step(&step.fused, &totals, &step.statistics_before, lr)?;
            return Ok(totals);
        }
        let rates = self.optimizer.gated_rates(lr)?;
        self.make_whole_buffers(rates.len())?;
        let Some(whole) = self.whole.as_ref() else {
            return Err(crate::Error::invalid(
                "the whole step's buffers were not made",
            ));
        };
        whole
            .rates
            .set(&Tensor::from_vec(rates, whole.rates.dims(), &self.device)?)?;
        let summary = self.reporting_oom(part.len(), || {
            let part = part.to_device(&self.device)?;
            let eager = |p: &Batch| self.whole_step(p, whole);
            #[cfg(feature = "cuda")]
            if let Some(graphs) = &self.graphs {
                return graphs.whole.step(&part, &eager);
            }
            eager(&part)
        })?;
        let totals = self.layout.read_summary(&summary)?;
        self.optimizer.settle_gated(totals.applies())?;
        self.update_loss_scale(&totals)?;
        Ok(totals)
    }

    /// Whether [`Self::train_alone`] runs a whole step on `part`: when asked for, with no
    /// buckets nor accumulated micro-batches, on samples, and with an optimizer that makes
    /// gated updates of its variables.
    fn takes_whole_step(&mut self, part: &Batch) -> Result<bool> {
        Ok(self.whole_steps
            && self.buckets.is_none()
            && !part.is_empty()
            && self.accumulated_slot()?.is_none()
            && self.optimizer.prepare_gated()?)
    }

    /// Makes the buffers of whole steps, for `rates` rates, unless they are made.
    fn make_whole_buffers(&mut self, rates: usize) -> Result<()> {
        let made = self
            .whole
            .as_ref()
            .is_some_and(|w| w.rates.elem_count() == rates);
        if !made {
            self.whole = Some(WholeBuffers {
                grads: Var::zeros(self.layout.grads.len(), DType::F32, &self.device)?,
                rates: Var::zeros(rates, DType::F64, &self.device)?,
            });
        }
        Ok(())
    }

    /// A whole step on `part` (on this device): its [`StepLayout::summary`](super::step::StepLayout::summary).
    fn whole_step(&self, part: &Batch, whole: &WholeBuffers) -> Result<Tensor> {
        let buffer = self.buffer_of(self.compute_gradients(part)?)?;
        let summary = self.layout.summary(&buffer.fused)?;
        let _update = timeline::span("optimizer update");
        step::finish_gated(
            self.optimizer.as_ref(),
            &self.statistics,
            &self.layout,
            (&buffer.fused, &summary),
            &buffer.statistics_before,
            part.len(),
            &whole.grads,
            whole.rates.as_tensor(),
        )?;
        Ok(summary)
    }
}
