//! A replica that holds one stage of a pipeline (model parallelism), and a step's passes
//! through it.
//!
//! [`Replica::stages`] builds a recipe cut into consecutive stages, each on its device, with the variables (names and initial values) the whole model has on one device.
//! A pipeline strategy then runs each stage's part of a step as a [`StageStep`]: forward
//! passes of micro-batches, recorded, whose outputs go to the next stage; backward passes,
//! from the gradients of those outputs that the next stage sends back, whose input gradients go
//! to the stage before; on the last stage, each micro-batch's loss and its backward pass at
//! once. Each stage sums its variables' gradients over the micro-batches into one step buffer
//! laid out as any replica's ([`StageStep::finish`]), so the step's final phase
//! ([`Replica::finish_step`]) is the one every strategy runs. Each micro-batch's forward pass
//! updates the moving statistics in turn, as gradient accumulation does.

use candle_core::{DType, Tensor};

use super::{Gradients, Replica, StepBuffer};
use crate::data::Batch;
use crate::layers::{Backward, ParamGrads, RecordRequest, StagePlacement};
use crate::strategy::ModelSpec;
use crate::{timeline, Error, Result};

/// Which part of a network a replica holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagePosition {
    /// It takes the network's inputs.
    pub(crate) first: bool,
    /// It gives the network's outputs, and computes the loss.
    pub(crate) last: bool,
}

impl StagePosition {
    /// The whole network.
    pub(crate) const WHOLE: StagePosition = StagePosition {
        first: true,
        last: true,
    };
}

impl Replica {
    /// Builds `spec`'s network cut into stages: stage `s` holds the top-level layers (those of
    /// [`Network::stage_layers`](crate::Network::stage_layers)) from
    /// `placements[s].first_layer` to the next stage's first, its variables on
    /// `placements[s].device`; a functional model is cut only where one tensor flows
    /// ([`Network::stage_starts_allowed`](crate::Network::stage_starts_allowed)). Each stage is a replica of its own (its optimizer over its
    /// variables, its step layout); every variable has the name and the initial value it has
    /// in the whole model built on one device. Under a loss scale every stage keeps the scale,
    /// and every stage moves it on alike.
    ///
    /// Fails, saying why, when the stages do not start at layer 0 at rising indices, there are
    /// more stages than layers, a functional model would be cut where more than one tensor
    /// flows, or it has several inputs or outputs. A stage may hold no
    /// variables (a pooling layer alone, say): a strategy that cannot use one says so.
    pub fn stages(spec: &ModelSpec, placements: &[StagePlacement]) -> Result<Vec<Replica>> {
        let Some(first) = placements.first() else {
            return Err(Error::invalid("a pipeline needs at least one stage"));
        };
        for p in placements {
            spec.dtype_policy.check_on(spec.compute_path, &p.device)?;
        }
        let ctx = Self::context(spec, &first.device);
        let built = spec
            .network
            .build_stages(ctx, &spec.input_shapes, placements)?;
        let count = built.len();
        built
            .into_iter()
            .zip(placements)
            .enumerate()
            .map(|(s, (built, placement))| {
                let position = StagePosition {
                    first: s == 0,
                    last: s + 1 == count,
                };
                Self::assemble(spec, placement.device.clone(), built, position)
            })
            .collect()
    }

    /// Whether this replica holds the network's last layers (the whole network, or a
    /// pipeline's last stage): the one that computes the loss.
    pub fn is_last_stage(&self) -> bool {
        self.position.last
    }

    /// Starts this stage's part of a training step: the moving statistics as they are now
    /// are kept, to be put back if the step is not applied.
    pub fn begin_stage_step(&self) -> Result<StageStep<'_>> {
        Ok(StageStep {
            replica: self,
            grads: ParamGrads::new(),
            stats: self.zero_stats()?,
            samples: 0,
            statistics_before: self.statistics_snapshot()?,
            in_flight: Vec::new(),
            peak_in_flight: 0,
        })
    }

    /// This stage's output for `x` (its input, on any device; the network's input for the
    /// first stage) in inference mode, on this stage's device, in the dtype its last layer
    /// computes in. The last stage's outputs come from [`Replica::predict`] (and its loss
    /// from [`Replica::evaluate`]), with `x` as the input.
    pub fn stage_infer(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.stage_input(x)?;
        let layer = self
            .net
            .as_layer()
            .ok_or_else(|| Error::invalid("a pipeline stage is a chain of layers"))?;
        layer.forward_t(&x, false)
    }

    /// `x` on this device, as the stage's layers take it: the first stage casts float inputs
    /// to `float32`, as a whole network does.
    fn stage_input(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_device(&self.device)?.detach();
        match self.position.first && x.dtype().is_float() {
            true => Ok(x.to_dtype(DType::F32)?),
            false => Ok(x),
        }
    }
}

/// One stage's part of a training step: its micro-batches' recorded forward passes still
/// waiting for their backward passes, and the gradients and sums so far.
///
/// A stage runs [`forward`](Self::forward) and [`backward`](Self::backward) for each
/// micro-batch in the order its schedule says (the last stage
/// [`forward_loss_backward`](Self::forward_loss_backward)), then
/// [`finish`](Self::finish) (or [`keep`](Self::keep) for gradient accumulation).
pub struct StageStep<'a> {
    replica: &'a Replica,
    grads: ParamGrads,
    /// `[loss_sum, metric states...]` so far (the last stage's; zeros elsewhere).
    stats: Tensor,
    samples: usize,
    statistics_before: Vec<Tensor>,
    /// The micro-batches forwarded and not yet backwarded, by index, with their output's
    /// dtype (the gradient's, whatever dtype it arrives in).
    in_flight: Vec<(usize, Box<dyn Backward>, DType)>,
    peak_in_flight: usize,
}

impl StageStep<'_> {
    /// The recorded training forward of micro-batch `micro` through this stage: `x` is the
    /// previous stage's output (the network's input for the first stage), on any device. Returns
    /// the stage's output, on its device; the backward pass waits for
    /// [`backward`](Self::backward) with the same `micro`.
    pub fn forward(&mut self, micro: usize, x: &Tensor) -> Result<Tensor> {
        let _forward = timeline::span("forward");
        let request = self.request(false);
        let recorded = self.record(x, request)?;
        let dtype = recorded.output.dtype();
        self.in_flight.push((micro, recorded.backward, dtype));
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight.len());
        Ok(recorded.output)
    }

    /// The backward pass of micro-batch `micro`, from `dy`, the gradient of the loss with
    /// respect to this stage's output (on any device): adds the variables' gradients to the
    /// step's, and returns the gradient with respect to the stage's input (on this stage's
    /// device), or `None` on the first stage.
    pub fn backward(&mut self, micro: usize, dy: &Tensor) -> Result<Option<Tensor>> {
        let _backward = timeline::span("backward");
        let at = self
            .in_flight
            .iter()
            .position(|(m, _, _)| *m == micro)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "pipeline stage: micro-batch {micro} was not forwarded, or was already \
                     backwarded"
                ))
            })?;
        let (_, backward, dtype) = self.in_flight.remove(at);
        let dy = dy.to_device(&self.replica.device)?.to_dtype(dtype)?;
        let first = self.replica.position.first;
        backward.backward(dy, &mut self.grads, !first)
    }

    /// The last stage's work for micro-batch `part` (inputs ignored; its targets and sample
    /// weights, on any device), whose input, the previous stage's output, is `x`: the forward
    /// pass, the loss and the metrics, and the backward pass. Returns the gradient with respect
    /// to `x` (on this stage's device), or `None` when this stage is also the first.
    pub fn forward_loss_backward(&mut self, x: &Tensor, part: &Batch) -> Result<Option<Tensor>> {
        let replica = self.replica;
        if !replica.position.last {
            return Err(Error::invalid(
                "only a pipeline's last stage computes the loss",
            ));
        }
        let part = part.to_device(&replica.device)?;
        let forward = timeline::span("forward");
        let recorded = self.record(x, self.request(true))?;
        let heads = replica.loss_heads(vec![recorded.output], recorded.logits, &part)?;
        drop(forward);
        let _backward = timeline::span("backward");
        let dheads = heads.gradients(replica)?;
        let [dy] = <[Tensor; 1]>::try_from(dheads)
            .map_err(|_| Error::invalid("a pipeline's last stage has one output"))?;
        let dx = recorded
            .backward
            .backward(dy, &mut self.grads, !replica.position.first)?;
        let stats = replica.stats(&heads.loss_sum, &heads.outputs, &part.targets)?;
        self.stats = (&self.stats + stats)?;
        // It held this micro-batch's activations from its forward pass to its backward pass.
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight.len() + 1);
        self.samples += part.len();
        Ok(dx)
    }

    /// Micro-batches forwarded and not yet backwarded.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The most micro-batches this step had forwarded and not yet backwarded at once: how
    /// many micro-batches' activations the stage held.
    pub fn peak_in_flight(&self) -> usize {
        self.peak_in_flight
    }

    /// Ends the stage's part of a step of `samples` samples (the global batch's, every stage
    /// alike): its gradients summed over the micro-batches (and those kept by
    /// [`keep`](Self::keep) before), its sums (the last stage's), and its moving statistics,
    /// as one step buffer for [`Replica::finish_step`]. Fails if a micro-batch is still in
    /// flight.
    pub fn finish(self, samples: usize) -> Result<StepBuffer> {
        let replica = self.replica;
        let g = self.into_gradients(samples)?;
        replica.buffer_of(g)
    }

    /// Gradient accumulation: keeps the stage's gradients and sums of a micro-batch of
    /// `samples` samples for the next step's [`finish`](Self::finish), applying nothing.
    /// Returns the stage's sums (the last stage's loss and metric sums; zeros elsewhere).
    pub fn keep(self, samples: usize) -> Result<Vec<f64>> {
        let replica = self.replica;
        let g = self.into_gradients(samples)?;
        Ok(replica.keep(g)?.1)
    }

    fn into_gradients(mut self, samples: usize) -> Result<Gradients> {
        if let Some((micro, _, _)) = self.in_flight.first() {
            return Err(Error::invalid(format!(
                "pipeline stage: micro-batch {micro} was forwarded but never backwarded"
            )));
        }
        if self.replica.position.last && self.samples != samples {
            return Err(Error::invalid(format!(
                "pipeline's last stage: the micro-batches held {} samples, the step {samples}",
                self.samples
            )));
        }
        Ok(Gradients {
            grads: self.replica.gradients_from(&mut self.grads)?,
            stats: self.stats,
            samples,
            statistics_before: self.statistics_before,
        })
    }

    /// What this stage's recorded forward is asked: the logits on the last stage (`loss`),
    /// the input's gradient on all but the first.
    fn request(&self, loss: bool) -> RecordRequest {
        let request = match loss {
            true => RecordRequest::with_logits(),
            false => RecordRequest::output(),
        };
        match self.replica.position.first {
            true => request.without_input_grad(),
            false => request,
        }
    }

    fn record(&self, x: &Tensor, request: RecordRequest) -> Result<crate::layers::Recorded> {
        let x = self.replica.stage_input(x)?;
        self.replica
            .net
            .record_stage(&x, request, self.replica.records_backward)
    }
}
