//! `Replica`: one copy of the model on one device, and the training step written once.
//!
//! Every strategy is made of replicas. A replica builds the network from the recipe, owns its
//! variables and its optimizer, turns its part of a batch into a step buffer
//! ([`Replica::step_buffer`]) and runs the step's final phase on the buffers' sum
//! ([`Replica::finish_step`]). Strategies decide only where replicas live and how their buffers
//! are summed between those two calls (see [`crate::strategy::step`]). A replica that alone
//! holds its steps (one device) runs both at once ([`Replica::train_alone`]), with CUDA graphs
//! as one replayed launch ([`whole_step`]).

pub mod buckets;
pub mod fused;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(any(test, feature = "cuda"))]
mod graph_schedule;
mod stage;
pub mod step;
#[cfg(test)]
mod tests;
mod whole_step;

use stage::StagePosition;
pub use stage::StageStep;

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor, Var};

use crate::cross_replica::ReplicaHandle;
use crate::data::Batch;
use crate::layers::{Activation, Layer, ParamGrads, Summary};
use crate::metrics::Metrics;
use crate::mixed_precision::{DTypePolicy, LossScale};
use crate::network::{BuiltNetwork, Network};
use crate::objective::Objective;
use crate::optimizers::{NamedOptimizerState, Optimizer, OptimizerConfig};
use crate::params::BuildContext;
use crate::params::ParamStore;
use crate::timeline;
use crate::{ComputePath, Result};
use buckets::{BucketPlan, BucketReducer, BucketWatch, ReplicaBuckets};
use fused::{fuse, FusedLayout};
use step::{StepLayout, StepTotals};

/// Everything needed to build a replica: the recipe, the input shape and the training setup.
#[derive(Clone)]
pub struct ModelSpec {
    /// The network recipe (`Sequential::new()....into()`, or a functional model's).
    pub network: Network,
    /// The shape of each input, without the batch dimension, in the network's order.
    pub input_shapes: Vec<Vec<usize>>,
    /// The optimizer recipe.
    pub optimizer: Box<dyn OptimizerConfig>,
    /// The loss of each output (`Objective::new(loss)` for a model of one output).
    pub loss: Objective,
    /// Metrics reported besides the loss.
    pub metrics: Metrics,
    /// Seed for initial values (and dropout masks).
    pub seed: u64,
    /// Which code the network runs and which backward pass differentiates it.
    pub compute_path: ComputePath,
    /// The dtypes the network computes in, and the loss scale (mixed precision).
    pub dtype_policy: DTypePolicy,
}

impl std::fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSpec")
            .field("input_shapes", &self.input_shapes)
            .field("loss", &self.loss)
            .field("metrics", &self.metrics)
            .field("seed", &self.seed)
            .field("compute_path", &self.compute_path)
            .field("dtype_policy", &self.dtype_policy)
            .finish_non_exhaustive()
    }
}

impl ModelSpec {
    /// Number of sums a step reports: the loss sum, then every metric's state.
    pub fn num_stats(&self) -> usize {
        1 + self.metrics.state_size()
    }
}

/// The gradients of one replica's share of a step, and the statistics it summed, before
/// [`Replica::step_buffer`] fuses them.
struct Gradients {
    /// One detached gradient of the (weighted) loss *sum* per trainable variable, in
    /// [`Replica::trainable_vars`] order.
    grads: Vec<Tensor>,
    /// `[loss_sum, metric states...]` over the replica's samples, an `f32` vector on its device.
    stats: Tensor,
    /// Samples the replica processed.
    samples: usize,
    /// The moving statistics as they were before this forward pass, to undo its updates when
    /// the step is not applied.
    statistics_before: Vec<Tensor>,
}

impl Gradients {
    /// The sum of two micro-batches' gradients and sums, computed with the same weights; the
    /// moving statistics to restore are those from before the earlier one's forward pass.
    fn plus(self, later: Gradients) -> Result<Gradients> {
        let grads = self
            .grads
            .iter()
            .zip(&later.grads)
            .map(|(a, b)| Ok((a + b)?))
            .collect::<Result<Vec<_>>>()?;
        let statistics_before = match self.statistics_before.is_empty() {
            true => later.statistics_before,
            false => self.statistics_before,
        };
        Ok(Gradients {
            grads,
            stats: (self.stats + later.stats)?,
            samples: self.samples + later.samples,
            statistics_before,
        })
    }
}

/// The recorded backward pass's gradients (in trainable order), the summed loss, the outputs
/// and the bucket watch that followed the gradients.
type RecordedGradients = (Vec<Tensor>, Tensor, Vec<Tensor>, Option<BucketWatch>);

/// A loss computed from a recorded forward's heads (its outputs, or its only output's logits),
/// each head a variable of its own so that candle's autograd differentiates the loss alone.
struct LossHeads {
    heads: Vec<Var>,
    /// The dtype each head had in the network, which its gradient is given in.
    dtypes: Vec<DType>,
    /// The loss summed over the batch.
    loss_sum: Tensor,
    /// The outputs in `float32`, detached, for the metrics.
    outputs: Vec<Tensor>,
}

impl LossHeads {
    /// The gradient of `replica`'s objective (the loss sum, scaled under a loss scale) with
    /// respect to each head, in the head's dtype.
    fn gradients(&self, replica: &Replica) -> Result<Vec<Tensor>> {
        let mut grads = replica.objective(&self.loss_sum)?.backward()?;
        self.heads
            .iter()
            .zip(&self.dtypes)
            .map(|(h, &dtype)| {
                let grad = match grads.remove(h.as_tensor()) {
                    Some(g) => g,
                    None => h.as_tensor().zeros_like()?,
                };
                Ok(grad.to_dtype(dtype)?)
            })
            .collect()
    }
}

/// A replica's share of a step as one buffer laid out by [`StepLayout`], ready to be summed
/// with the other replicas'.
pub struct StepBuffer {
    /// `[gradients..., sums..., sample count, statistics x samples...]` on the replica's device.
    pub fused: Tensor,
    /// Whether the gradients in `fused` are already summed over the replicas (by gradient
    /// buckets, [`Replica::set_buckets`]): then only the rest of the buffer is to be summed.
    pub grads_reduced: bool,
    /// The moving statistics before the forward pass, for [`Replica::finish_step`].
    pub statistics_before: Vec<Tensor>,
}

/// One copy of the model on one device.
pub struct Replica {
    device: Device,
    net: BuiltNetwork,
    store: ParamStore,
    trainable: Vec<Var>,
    /// The canonical names of `trainable`, in the same order.
    trainable_names: Vec<String>,
    statistics: Vec<Var>,
    optimizer: Box<dyn Optimizer>,
    loss: Objective,
    metrics: Metrics,
    layout: Arc<StepLayout>,
    summary: Summary,
    records_backward: bool,
    /// The code path the model runs, for the loss ([`crate::losses::Loss::call_on_path`]).
    compute_path: ComputePath,
    /// Mixed precision's dynamic loss scale and the variable holding its state.
    loss_scale: Option<(LossScale, Var)>,
    /// The micro-batches accumulated since the last step buffer (gradient accumulation): their
    /// gradients and sums, which the next [`Replica::step_buffer`] adds to its own.
    accumulated: Mutex<Option<Gradients>>,
    /// Which part of the network it holds: the whole, or a pipeline's stage.
    position: StagePosition,
    /// The gradient buckets its step buffers sum with the other replicas', when set.
    buckets: Option<ReplicaBuckets>,
    /// Its steps (training, evaluation, prediction) as CUDA graphs, when asked for on a CUDA
    /// device.
    #[cfg(feature = "cuda")]
    graphs: Option<graph::Graphs>,
    /// Whether [`Replica::train_alone`] runs whole steps (gated updates, see [`whole_step`])
    /// where it can: with CUDA graphs, whose replays then hold the update too.
    whole_steps: bool,
    /// The buffers of whole steps, made by the first.
    whole: Option<whole_step::WholeBuffers>,
}

impl Replica {
    /// Builds the network on `device` with the spec's seed, and an optimizer over its
    /// trainable variables.
    pub fn new(spec: &ModelSpec, device: &Device) -> Result<Self> {
        Self::build(spec, Self::context(spec, device))
    }

    fn context(spec: &ModelSpec, device: &Device) -> BuildContext {
        let dtype = spec
            .dtype_policy
            .compute_dtype_on(spec.compute_path, device);
        BuildContext::new(device, spec.seed)
            .with_compute_path(spec.compute_path)
            .with_compute_dtype(dtype)
    }

    /// Like [`Replica::new`], as member `handle` of a group whose batch normalisation uses
    /// global batch statistics.
    ///
    /// Its steps are never captured as CUDA graphs: the group's exchanges in the forward and
    /// backward passes wait for the other replicas.
    pub fn in_group(spec: &ModelSpec, device: &Device, handle: ReplicaHandle) -> Result<Self> {
        let replica = Self::build(spec, Self::context(spec, device).with_replica_group(handle))?;
        #[cfg(feature = "cuda")]
        let replica = Self {
            graphs: None,
            whole_steps: false,
            ..replica
        };
        Ok(replica)
    }

    fn build(spec: &ModelSpec, ctx: BuildContext) -> Result<Self> {
        let device = ctx.device().clone();
        spec.dtype_policy.check_on(spec.compute_path, &device)?;
        let (net, store, summary) = spec.network.build(ctx, &spec.input_shapes)?;
        Self::assemble(spec, device, (net, store, summary), StagePosition::WHOLE)
    }

    /// A replica of the built network `built` (or of one stage of it) on `device`: its
    /// optimizer, step layout and loss scale.
    fn assemble(
        spec: &ModelSpec,
        device: Device,
        built: (BuiltNetwork, ParamStore, Summary),
        position: StagePosition,
    ) -> Result<Self> {
        let (net, mut store, summary) = built;
        // Mixed precision's loss scale moves with the weights where both models keep one, and
        // is left out or ignored where one of them does not.
        store.mark_bookkeeping(crate::mixed_precision::LOSS_SCALE);
        let loss_scale = match spec.dtype_policy.loss_scale() {
            Some(scale) => {
                let param = scale.param(&device)?;
                let var = param.var.clone();
                store.insert_param(param)?;
                Some((scale, var))
            }
            None => None,
        };
        let trainable = store.trainable_vars();
        let trainable_names = store
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.name.clone())
            .collect();
        let statistics = store.statistics();
        let optimizer = spec
            .optimizer
            .build_on_path(trainable.clone(), spec.compute_path)?;
        let layout = Arc::new(StepLayout {
            grads: FusedLayout::from_shapes(trainable.iter().map(|v| v.shape().clone())),
            num_stats: spec.num_stats(),
            statistics: FusedLayout::from_shapes(statistics.iter().map(|v| v.shape().clone())),
        });
        #[cfg(feature = "cuda")]
        let graphs = match &device {
            candle_core::Device::Cuda(cuda)
                if crate::devices::cuda_graphs() && position == StagePosition::WHOLE =>
            {
                Some(graph::Graphs::new(cuda))
            }
            _ => None,
        };
        #[cfg(feature = "cuda")]
        let whole_steps = graphs.is_some();
        #[cfg(not(feature = "cuda"))]
        let whole_steps = false;
        Ok(Self {
            #[cfg(feature = "cuda")]
            graphs,
            whole_steps,
            whole: None,
            net,
            store,
            trainable,
            trainable_names,
            statistics,
            optimizer,
            loss: spec.loss.clone(),
            metrics: spec.metrics.clone(),
            layout,
            summary,
            records_backward: spec.compute_path.records_backward(&device),
            compute_path: spec.compute_path,
            loss_scale,
            device,
            accumulated: Mutex::new(None),
            position,
            buckets: None,
        })
    }

    /// This replica, training through the recorded backward pass when `on` and candle's
    /// autograd otherwise, whatever its compute path chose. Built for
    /// [`ComputePath::DeviceGeneric`] and recording, its layers record their backward passes as
    /// they do on a device without a kandle kernel for them: in candle's ops, or under candle's
    /// autograd one layer at a time.
    #[cfg(test)]
    pub(crate) fn recording_backward(mut self, on: bool) -> Self {
        self.records_backward = on;
        self
    }

    /// This replica, its steps captured as CUDA graphs when `on` (on a CUDA device),
    /// whatever [`crate::devices::cuda_graphs`] says.
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn with_cuda_graphs(mut self, on: bool) -> Self {
        self.graphs = match (&self.device, on) {
            (Device::Cuda(cuda), true) => Some(graph::Graphs::new(cuda)),
            _ => None,
        };
        self.whole_steps = self.graphs.is_some();
        self
    }

    /// This replica, [`Self::train_alone`] running whole steps (gated updates) when `on`,
    /// whether or not it has CUDA graphs.
    #[cfg(test)]
    pub(crate) fn with_whole_steps(mut self, on: bool) -> Self {
        self.whole_steps = on;
        self
    }

    /// Where its CUDA graphs stand, if it has them.
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn cuda_graphs(&self) -> Option<String> {
        self.graphs.as_ref().map(|g| g.train.describe())
    }

    /// Sums this replica's gradients with the other replicas' in the buckets of `plan`
    /// through `reducer`, as replica `index` (see [`buckets`]): each bucket is handed in as
    /// soon as the backward pass has finished its gradients, and every step buffer then holds
    /// the gradients summed over the replicas ([`StepBuffer::grads_reduced`]). Every replica
    /// of the strategy must get the same plan and reducer. Fails when `plan` does not cover
    /// exactly the trainable variables.
    pub fn set_buckets(
        &mut self,
        reducer: Arc<dyn BucketReducer>,
        index: usize,
        plan: Arc<BucketPlan>,
    ) -> Result<()> {
        self.buckets = Some(ReplicaBuckets::new(reducer, index, plan, &self.trainable)?);
        Ok(())
    }

    /// The device this replica runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// All variables, by name.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The variables the optimizer updates, in gradient order.
    pub fn trainable_vars(&self) -> &[Var] {
        &self.trainable
    }

    /// The canonical names of [`Self::trainable_vars`], in the same order.
    pub fn trainable_names(&self) -> &[String] {
        &self.trainable_names
    }

    /// The optimizer's state with each slot keyed by the variables' canonical names, on this
    /// replica's device: the same names whatever the strategy.
    pub fn optimizer_state(&self) -> Result<NamedOptimizerState> {
        self.optimizer.state()?.into_named(&self.trainable_names)
    }

    /// Replaces the optimizer's state with `state` (tensors on any device). Every slot must
    /// name exactly this replica's trainable variables, with their shapes, and the kind must be
    /// the optimizer's; otherwise nothing changes and the error says what differs.
    pub fn load_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        let positional = state.to_positional(&self.trainable_names, &self.trainable)?;
        self.optimizer.load_state(&positional)?;
        // The optimizer's state is in new tensors, which a captured whole step does not update.
        #[cfg(feature = "cuda")]
        if let Some(graphs) = &mut self.graphs {
            graphs.restart_whole_steps();
        }
        Ok(())
    }

    /// The moving statistics (batch-norm running means and variances), in creation order.
    pub fn statistics(&self) -> &[Var] {
        &self.statistics
    }

    /// The layer table of the built network.
    pub fn summary(&self) -> &Summary {
        &self.summary
    }

    /// The built network as a layer, for a model of one input and one output.
    pub fn network(&self) -> Option<&dyn Layer> {
        self.net.as_layer()
    }

    /// How this replica's step buffers are laid out (the same for every replica of a spec).
    pub fn layout(&self) -> &Arc<StepLayout> {
        &self.layout
    }

    /// Forward and backward on `part` (already on this device), each sample's loss weighted
    /// by its weight when given. The gradients are those of the weighted loss *sum*; the final
    /// phase of the step divides them by the global batch's sample count.
    fn compute_gradients(&self, part: &Batch) -> Result<Gradients> {
        Ok(self.compute_watched(part, None)?.0)
    }

    /// [`Self::compute_gradients`], the recorded backward pass's gradients followed by `watch`
    /// as they arrive; returns the watch after the pass (none when the pass did not run).
    fn compute_watched(
        &self,
        part: &Batch,
        watch: Option<BucketWatch>,
    ) -> Result<(Gradients, Option<BucketWatch>)> {
        let samples = part.len();
        if samples == 0 {
            return Ok((self.zero_gradients()?, None));
        }
        let statistics_before = self.statistics_snapshot()?;
        let (grads, loss_sum, outputs, watch) = if self.records_backward {
            self.recorded_backward(part, watch)?
        } else {
            let (grads, loss_sum, outputs) = self.candle_backward(part)?;
            (grads, loss_sum, outputs, None)
        };
        let stats = self.stats(&loss_sum, &outputs, &part.targets)?;
        let gradients = Gradients {
            grads,
            stats,
            samples,
            statistics_before,
        };
        Ok((gradients, watch))
    }

    /// This replica's share of a step on `part` (on the CPU): its gradients and sums, fused
    /// into one buffer laid out by [`Self::layout`] that adds up with the other replicas'.
    ///
    /// The micro-batches [`Self::accumulate`] took since the last buffer are part of it: their
    /// gradients and sums are added to this part's, and the buffer's moving statistics, those
    /// after the last forward pass, are weighted by the sample count of them all.
    ///
    /// With gradient buckets ([`Self::set_buckets`]) the buffer's gradients are already summed
    /// over the replicas.
    pub fn step_buffer(&self, part: &Batch) -> Result<StepBuffer> {
        let result = self.reporting_oom(part.len(), || {
            let part = part.to_device(&self.device)?;
            match &self.buckets {
                Some(buckets) => self.bucketed_buffer(&part, buckets),
                None => self.whole_buffer(&part),
            }
        });
        if let (Err(error), Some(buckets)) = (&result, &self.buckets) {
            buckets.abort(error);
        }
        result
    }

    /// [`Self::step_buffer`] without gradient buckets: through a CUDA graph of the step where
    /// the replica has one ([`graph`]) and no micro-batch was accumulated before.
    fn whole_buffer(&self, part: &Batch) -> Result<StepBuffer> {
        let eager = |p: &Batch| self.buffer_of(self.compute_gradients(p)?);
        #[cfg(feature = "cuda")]
        if let Some(graphs) = &self.graphs {
            if self.accumulated_slot()?.is_none() {
                return graphs.train.step(part, &eager);
            }
        }
        eager(part)
    }

    /// `f`'s result, a device's memory running out as [`crate::Error::OutOfMemory`] naming this
    /// device and the `samples` of the batch on it.
    fn reporting_oom<T>(&self, samples: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
        f().map_err(|e| match self.device.is_cpu() {
            true => e,
            false => e.out_of_memory_on(&crate::devices::label(&self.device), samples),
        })
    }

    /// [`Self::step_buffer`] through gradient buckets: handed in during the recorded backward
    /// pass when it runs alone (no micro-batch accumulated before), after it otherwise.
    fn bucketed_buffer(&self, part: &Batch, buckets: &ReplicaBuckets) -> Result<StepBuffer> {
        let watch = match self.records_backward && self.accumulated_slot()?.is_none() {
            true => Some(buckets.watch(&self.trainable, self.loss_scale_value()?)?),
            false => None,
        };
        let (g, watch) = self.compute_watched(part, watch)?;
        let g = self.with_accumulated(g)?;
        let summed = {
            let _reduce = timeline::span("gradient buckets");
            buckets.finish(watch, &g.grads)?
        };
        let tail = self.buffer_tail(&g)?;
        let mut parts = vec![&summed];
        parts.extend(tail.iter());
        Ok(StepBuffer {
            fused: fuse(&parts)?,
            grads_reduced: true,
            statistics_before: g.statistics_before,
        })
    }

    /// `g` plus the gradients accumulated since the last buffer.
    fn with_accumulated(&self, g: Gradients) -> Result<Gradients> {
        match self.take_accumulated()? {
            Some(earlier) => earlier.plus(g),
            None => Ok(g),
        }
    }

    /// The step buffer of `g` plus the gradients accumulated since the last buffer.
    fn buffer_of(&self, g: Gradients) -> Result<StepBuffer> {
        let g = self.with_accumulated(g)?;
        let tail = self.buffer_tail(&g)?;
        let mut parts: Vec<&Tensor> = g.grads.iter().collect();
        parts.extend(tail.iter());
        Ok(StepBuffer {
            fused: fuse(&parts)?,
            grads_reduced: false,
            statistics_before: g.statistics_before,
        })
    }

    /// What a step buffer holds after the gradients: the sums, the sample count, and the
    /// moving statistics multiplied by it.
    fn buffer_tail(&self, g: &Gradients) -> Result<Vec<Tensor>> {
        let mut tail = vec![
            g.stats.clone(),
            Tensor::new(&[g.samples as f32], &self.device)?,
        ];
        for v in &self.statistics {
            tail.push((v.as_tensor() * g.samples as f64)?);
        }
        Ok(tail)
    }

    /// Gradient accumulation: computes the gradients and sums of `part` (on the CPU) and keeps
    /// them, added to those of the micro-batches accumulated before, for the next
    /// [`Self::step_buffer`]. No variable changes but the moving statistics, which the forward
    /// pass updates as in any training step (each micro-batch normalises with its own batch
    /// statistics). Returns the part's sample count and its `[loss_sum, metric states...]`.
    pub fn accumulate(&self, part: &Batch) -> Result<(usize, Vec<f64>)> {
        self.reporting_oom(part.len(), || {
            let g = self.compute_gradients(&part.to_device(&self.device)?)?;
            self.keep(g)
        })
    }

    /// Keeps `g`, added to the gradients accumulated before, for the next step buffer; returns
    /// its sample count and its `[loss_sum, metric states...]`.
    fn keep(&self, g: Gradients) -> Result<(usize, Vec<f64>)> {
        let own = (g.samples, g.stats.to_dtype(DType::F64)?.to_vec1::<f64>()?);
        let mut slot = self.accumulated_slot()?;
        *slot = Some(match slot.take() {
            Some(earlier) => earlier.plus(g)?,
            None => g,
        });
        Ok(own)
    }

    fn accumulated_slot(&self) -> Result<std::sync::MutexGuard<'_, Option<Gradients>>> {
        self.accumulated.lock().map_err(|_| {
            crate::Error::invalid("a replica's accumulated gradients were poisoned by a panic")
        })
    }

    fn take_accumulated(&self) -> Result<Option<Gradients>> {
        Ok(self.accumulated_slot()?.take())
    }

    /// The final phase of a step, the same for every strategy: with `total`, the sum of every
    /// replica's [`StepBuffer`] (on any device), and `totals`, what [`StepLayout::read`] read
    /// from it. An applied step ([`StepTotals::applies`]) divides the gradients by the global
    /// sample count, runs the optimizer at `lr`, and sets the moving statistics to their mean
    /// weighted by sample count; a step that does not apply puts back `statistics_before`
    /// (those of this replica's forward pass, or none for a replica that ran no forward pass).
    pub fn finish_step(
        &mut self,
        total: &Tensor,
        totals: &StepTotals,
        statistics_before: &[Tensor],
        lr: f64,
    ) -> Result<()> {
        let _update = timeline::span("optimizer update");
        let total = total.to_device(&self.device)?;
        let layout = Arc::clone(&self.layout);
        step::finish(
            self.optimizer.as_mut(),
            &self.statistics,
            &layout,
            &total,
            totals,
            statistics_before,
            lr,
        )?;
        self.update_loss_scale(totals)
    }

    /// Moves mixed precision's loss scale on after a step with `totals` (halved when the step
    /// was not applied): what [`Self::finish_step`] does last, and what a replica that does not
    /// finish steps itself (a parameter server's worker) runs with the step's totals.
    pub fn update_loss_scale(&self, totals: &StepTotals) -> Result<()> {
        match &self.loss_scale {
            Some((scale, var)) => scale.update(var, totals.samples, totals.applies()),
            None => Ok(()),
        }
    }

    /// The loss summed over the batch, multiplied by the loss scale when there is one: what the
    /// backward pass differentiates.
    fn objective(&self, loss_sum: &Tensor) -> Result<Tensor> {
        match &self.loss_scale {
            Some((_, var)) => Ok(loss_sum.broadcast_mul(&self.scale_of(var)?)?),
            None => Ok(loss_sum.clone()),
        }
    }

    /// The scale itself, a scalar tensor on this device (no host read).
    fn scale_of(&self, var: &Var) -> Result<Tensor> {
        Ok(var.as_tensor().narrow(0, 0, 1)?.squeeze(0)?.detach())
    }

    /// The loss scale's value, when there is one.
    fn loss_scale_value(&self) -> Result<Option<Tensor>> {
        self.loss_scale
            .as_ref()
            .map(|(_, var)| self.scale_of(var))
            .transpose()
    }

    /// Gradients of the scaled objective divided back by the scale.
    fn unscaled(&self, grads: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let Some(scale) = self.loss_scale_value()? else {
            return Ok(grads);
        };
        grads
            .into_iter()
            .map(|g| Ok(g.broadcast_div(&scale)?))
            .collect()
    }

    /// The network's outputs and logits in `float32`, for the loss and the metrics: under
    /// mixed precision, a final softmax is computed again in `float32` from the logits.
    fn in_f32(
        mut outputs: Vec<Tensor>,
        logits: Option<Tensor>,
    ) -> Result<(Vec<Tensor>, Option<Tensor>)> {
        if outputs.iter().all(|y| y.dtype() == DType::F32) {
            return Ok((outputs, logits));
        }
        match (logits, &mut outputs[..]) {
            (Some(logits), [only]) => {
                let logits = logits.to_dtype(DType::F32)?;
                *only = Activation::Softmax.apply_t(&logits, true)?;
                Ok((outputs, Some(logits)))
            }
            _ => Ok((
                outputs
                    .into_iter()
                    .map(|y| Ok(y.to_dtype(DType::F32)?))
                    .collect::<Result<Vec<_>>>()?,
                None,
            )),
        }
    }

    /// The loss summed over the batch (each sample's loss weighted by `weights` when given);
    /// it is also the objective that is differentiated.
    fn loss_sum(
        &self,
        outputs: &[Tensor],
        logits: Option<&Tensor>,
        part: &Batch,
    ) -> Result<Tensor> {
        let per_sample = self
            .loss
            .per_sample(&part.targets, outputs, logits, self.compute_path)?;
        let per_sample = match &part.weights {
            Some(w) => (per_sample.broadcast_mul(&w.to_dtype(per_sample.dtype())?))?,
            None => per_sample,
        };
        Ok(per_sample.sum_all()?)
    }

    /// The network's `f32` outputs for `part` (on this device) and their loss summed over the
    /// batch, through candle's ops (training mode when `train`).
    fn forward_loss(&self, part: &Batch, train: bool) -> Result<(Vec<Tensor>, Tensor)> {
        let (outputs, logits) = self.net.forward_with_logits(&part.inputs, train)?;
        let (outputs, logits) = Self::in_f32(outputs, logits)?;
        let loss_sum = self.loss_sum(&outputs, logits.as_ref(), part)?;
        Ok((outputs, loss_sum))
    }

    /// The gradients (in trainable order), the summed loss and the outputs, through candle's
    /// autograd over the whole network.
    fn candle_backward(&self, part: &Batch) -> Result<(Vec<Tensor>, Tensor, Vec<Tensor>)> {
        let forward = timeline::span("forward");
        let (outputs, loss_sum) = self.forward_loss(part, true)?;
        drop(forward);
        let _backward = timeline::span("backward");
        let mut store = self.objective(&loss_sum)?.backward()?;
        let grads = self
            .trainable
            .iter()
            .map(|v| match store.remove(v.as_tensor()) {
                Some(g) => Ok(g.detach()),
                None => Ok(v.as_tensor().zeros_like()?.detach()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((self.unscaled(grads)?, loss_sum, outputs))
    }

    /// [`Self::candle_backward`] through the network's recorded backward pass: candle's
    /// autograd differentiates only the loss, with respect to the network's outputs (or the
    /// only output's logits), and the layers' recorded passes take it from there.
    fn recorded_backward(
        &self,
        part: &Batch,
        watch: Option<BucketWatch>,
    ) -> Result<RecordedGradients> {
        let forward = timeline::span("forward");
        let recorded = self.net.record(&part.inputs)?;
        let heads = self.loss_heads(recorded.outputs, recorded.logits, part)?;
        drop(forward);
        let _backward = timeline::span("backward");
        let dheads = heads.gradients(self)?;
        let mut store = match watch {
            Some(watch) => ParamGrads::watched(watch),
            None => ParamGrads::new(),
        };
        (recorded.backward)(dheads, &mut store)?;
        let watch = store.take_watch();
        let grads = self.gradients_from(&mut store)?;
        Ok((grads, heads.loss_sum, heads.outputs, watch))
    }

    /// The loss of a recorded forward's `outputs` (or its only output's `logits`) on `part`'s
    /// targets, ready to be differentiated with respect to them. The loss is computed in
    /// `float32` (from logits, the softmax again), whatever the layers computed in.
    fn loss_heads(
        &self,
        outputs: Vec<Tensor>,
        logits: Option<Tensor>,
        part: &Batch,
    ) -> Result<LossHeads> {
        let from_logits = logits.is_some();
        let differentiated = match logits {
            Some(logits) => vec![logits],
            None => outputs,
        };
        let dtypes = differentiated.iter().map(Tensor::dtype).collect();
        let heads = differentiated
            .iter()
            .map(|h| Ok(Var::from_tensor(&h.to_dtype(DType::F32)?)?))
            .collect::<Result<Vec<_>>>()?;
        let logits = from_logits.then(|| heads[0].as_tensor().clone());
        let outputs = match &logits {
            Some(logits) => vec![Activation::Softmax.apply(logits)?],
            None => heads.iter().map(|h| h.as_tensor().clone()).collect(),
        };
        let loss_sum = self.loss_sum(&outputs, logits.as_ref(), part)?;
        Ok(LossHeads {
            outputs: outputs.iter().map(Tensor::detach).collect(),
            heads,
            dtypes,
            loss_sum,
        })
    }

    /// The trainable variables' gradients from `store` (zero for those it lacks), in trainable
    /// order, divided back by the loss scale.
    fn gradients_from(&self, store: &mut ParamGrads) -> Result<Vec<Tensor>> {
        let grads = self
            .trainable
            .iter()
            .map(|v| match store.take(v.as_tensor()) {
                Some(g) => Ok(g),
                None => Ok(v.as_tensor().zeros_like()?),
            })
            .collect::<Result<Vec<_>>>()?;
        self.unscaled(grads)
    }

    fn statistics_snapshot(&self) -> Result<Vec<Tensor>> {
        self.statistics
            .iter()
            .map(|v| Ok(v.as_tensor().detach().copy()?))
            .collect()
    }

    fn zero_stats(&self) -> Result<Tensor> {
        Ok(Tensor::zeros(
            self.layout.num_stats,
            DType::F32,
            &self.device,
        )?)
    }

    fn zero_gradients(&self) -> Result<Gradients> {
        let grads = self
            .trainable
            .iter()
            .map(|v| Ok(v.as_tensor().zeros_like()?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gradients {
            grads,
            stats: self.zero_stats()?,
            samples: 0,
            statistics_before: Vec::new(),
        })
    }

    /// `[loss_sum, metric states...]` as one `f32` vector.
    fn stats(&self, loss_sum: &Tensor, outputs: &[Tensor], targets: &[Tensor]) -> Result<Tensor> {
        let mut parts = vec![loss_sum.detach().to_dtype(DType::F32)?.reshape(1)?];
        parts.extend(self.metrics.output_states(targets, outputs)?);
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// `[loss_sum, metric states...]` of `part` (on the CPU) in inference mode, on this
    /// device.
    pub fn evaluate(&self, part: &Batch) -> Result<Tensor> {
        if part.is_empty() {
            return self.zero_stats();
        }
        self.reporting_oom(part.len(), || {
            let part = part.to_device(&self.device)?;
            let eager = |p: &Batch| {
                let (outputs, loss_sum) = self.forward_loss(p, false)?;
                self.stats(&loss_sum, &outputs, &p.targets)
            };
            #[cfg(feature = "cuda")]
            if let Some(graphs) = &self.graphs {
                return graphs.evaluate.step(&part, &eager);
            }
            eager(&part)
        })
    }

    /// The model's outputs for `inputs` (one tensor per input, any device) in inference mode,
    /// one `f32` tensor per output on this device.
    pub fn predict(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let samples = inputs.first().map_or(Ok(0), |x| x.dim(0))?;
        self.reporting_oom(samples, || {
            let inputs = inputs
                .iter()
                .map(|x| Ok(x.to_device(&self.device)?))
                .collect::<Result<Vec<_>>>()?;
            #[cfg(feature = "cuda")]
            if let Some(graphs) = &self.graphs {
                let batch = Batch {
                    inputs,
                    targets: Vec::new(),
                    weights: None,
                };
                return graphs
                    .predict
                    .step(&batch, &|b| self.net.predict(&b.inputs));
            }
            self.net.predict(&inputs)
        })
    }
}
