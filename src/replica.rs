//! `Replica`: one copy of the model on one device, and the training step written once.
//!
//! Every strategy is made of replicas. A replica builds the network from the recipe, owns its
//! variables and its optimizer, and knows how to turn a batch into gradients and summed
//! statistics ([`Replica::compute_gradients`]) and how to apply gradients
//! ([`Replica::apply_gradients`]). Strategies decide where replicas live and how gradients are
//! combined between those two calls.

use candle_core::{DType, Device, Tensor, Var};

use crate::backprop::Backprop;
use crate::cross_replica::ReplicaHandle;
use crate::layers::{Activation, Layer, ParamGrads, Sequential, SequentialNet};
use crate::metrics::Metric;
use crate::optimizers::{Optimizer, OptimizerConfig};
use crate::params::BuildContext;
use crate::params::ParamStore;
use crate::{Loss, Result};

/// Everything needed to build a replica: the recipe, the input shape and the training setup.
#[derive(Clone)]
pub struct ModelSpec {
    /// The network recipe.
    pub network: Sequential,
    /// Input shape without the batch dimension.
    pub input_shape: Vec<usize>,
    /// The optimizer recipe.
    pub optimizer: Box<dyn OptimizerConfig>,
    /// The loss.
    pub loss: Loss,
    /// Metrics reported besides the loss.
    pub metrics: Vec<Metric>,
    /// Seed for initial values (and dropout masks).
    pub seed: u64,
}

impl std::fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSpec")
            .field("input_shape", &self.input_shape)
            .field("loss", &self.loss)
            .field("metrics", &self.metrics)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl ModelSpec {
    /// Number of statistics a step reports: the loss, then one per metric.
    pub fn num_stats(&self) -> usize {
        1 + self.metrics.len()
    }
}

/// The gradients of one replica's share of a step, and the statistics it summed.
pub struct Gradients {
    /// One detached gradient per trainable variable, in [`Replica::trainable_vars`] order.
    pub grads: Vec<Tensor>,
    /// `[loss_sum, metric_sum...]` over the replica's samples, an `f32` vector on its device.
    pub stats: Tensor,
    /// Samples the replica processed.
    pub samples: usize,
    /// The moving statistics as they were before this forward pass, to undo its updates with
    /// [`Replica::discard`] when the step is not applied.
    pub statistics_before: Vec<Tensor>,
}

/// One copy of the model on one device.
pub struct Replica {
    device: Device,
    net: SequentialNet,
    store: ParamStore,
    trainable: Vec<Var>,
    statistics: Vec<Var>,
    optimizer: Box<dyn Optimizer>,
    loss: Loss,
    metrics: Vec<Metric>,
    backprop: Backprop,
}

impl Replica {
    /// Builds the network on `device` with the spec's seed, and an optimizer over its
    /// trainable variables.
    pub fn new(spec: &ModelSpec, device: &Device) -> Result<Self> {
        Self::build(spec, BuildContext::new(device, spec.seed))
    }

    /// Like [`Replica::new`], as member `handle` of a group whose batch normalisation uses
    /// global batch statistics.
    pub fn in_group(spec: &ModelSpec, device: &Device, handle: ReplicaHandle) -> Result<Self> {
        Self::build(
            spec,
            BuildContext::new(device, spec.seed).with_replica_group(handle),
        )
    }

    fn build(spec: &ModelSpec, ctx: BuildContext) -> Result<Self> {
        let device = ctx.device().clone();
        let (net, store, _) = spec.network.build_in(ctx, &spec.input_shape)?;
        let trainable = store.trainable_vars();
        let statistics = store.statistics();
        let optimizer = spec.optimizer.build(trainable.clone())?;
        Ok(Self {
            device,
            net,
            store,
            trainable,
            statistics,
            optimizer,
            loss: spec.loss,
            metrics: spec.metrics.clone(),
            backprop: Backprop::from_env(),
        })
    }

    /// Chooses how [`Self::compute_gradients`] differentiates (by default from
    /// [`Backprop::from_env`]).
    pub fn set_backprop(&mut self, backprop: Backprop) {
        self.backprop = backprop;
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

    /// The built network.
    pub fn network(&self) -> &SequentialNet {
        &self.net
    }

    /// Forward and backward on `x`, `y` (already on this device). The objective is the sum of
    /// per-sample losses divided by `global_samples`, the number of samples in the whole step
    /// across all replicas, so that summing the replicas' gradients gives exactly the mean
    /// gradient of the global batch, whatever the split.
    pub fn compute_gradients(
        &self,
        x: &Tensor,
        y: &Tensor,
        global_samples: usize,
    ) -> Result<Gradients> {
        let samples = x.dim(0)?;
        if samples == 0 {
            return self.zero_gradients();
        }
        let statistics_before = self.statistics_snapshot()?;
        let (grads, loss_sum, output) = if self.backprop.recorded_on(&self.device) {
            self.recorded_backward(x, y, global_samples)?
        } else {
            self.candle_backward(x, y, global_samples)?
        };
        let stats = self.stats(&loss_sum, &output, y)?;
        Ok(Gradients {
            grads,
            stats,
            samples,
            statistics_before,
        })
    }

    /// The loss summed over the batch, and its objective: the sum over `global_samples`.
    fn objective(
        &self,
        output: &Tensor,
        logits: Option<&Tensor>,
        y: &Tensor,
        global_samples: usize,
    ) -> Result<(Tensor, Tensor)> {
        let loss_sum = self.loss.per_sample(output, logits, y)?.sum_all()?;
        let objective = (&loss_sum / global_samples.max(1) as f64)?;
        Ok((loss_sum, objective))
    }

    /// The gradients (in trainable order), the summed loss and the output, through candle's
    /// autograd over the whole network.
    fn candle_backward(
        &self,
        x: &Tensor,
        y: &Tensor,
        global_samples: usize,
    ) -> Result<(Vec<Tensor>, Tensor, Tensor)> {
        let (output, logits) = self.net.forward_with_logits(x, true)?;
        let (loss_sum, objective) = self.objective(&output, logits.as_ref(), y, global_samples)?;
        let mut store = objective.backward()?;
        let grads = self
            .trainable
            .iter()
            .map(|v| match store.remove(v.as_tensor()) {
                Some(g) => Ok(g.detach()),
                None => Ok(v.as_tensor().zeros_like()?.detach()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((grads, loss_sum, output))
    }

    /// [`Self::candle_backward`] through the network's recorded backward pass: candle's
    /// autograd differentiates only the loss, with respect to the network's output (or its
    /// logits), and the layers' recorded passes take it from there.
    fn recorded_backward(
        &self,
        x: &Tensor,
        y: &Tensor,
        global_samples: usize,
    ) -> Result<(Vec<Tensor>, Tensor, Tensor)> {
        let recorded = self.net.forward_recorded_with_logits(&x.detach())?;
        let head = Var::from_tensor(recorded.logits.as_ref().unwrap_or(&recorded.output))?;
        let (output, logits) = match recorded.logits {
            Some(_) => (
                Activation::Softmax.apply(head.as_tensor())?,
                Some(head.as_tensor()),
            ),
            None => (head.as_tensor().clone(), None),
        };
        let (loss_sum, objective) = self.objective(&output, logits, y, global_samples)?;
        let dhead = match objective.backward()?.remove(head.as_tensor()) {
            Some(g) => g,
            None => head.as_tensor().zeros_like()?,
        };
        let mut store = ParamGrads::new();
        recorded.backward.backward(dhead, &mut store, false)?;
        let grads = self
            .trainable
            .iter()
            .map(|v| match store.take(v.as_tensor()) {
                Some(g) => Ok(g),
                None => Ok(v.as_tensor().zeros_like()?),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((grads, loss_sum, output.detach()))
    }

    fn statistics_snapshot(&self) -> Result<Vec<Tensor>> {
        self.statistics
            .iter()
            .map(|v| Ok(v.as_tensor().detach().copy()?))
            .collect()
    }

    /// Undoes the moving-statistic updates of the forward pass that produced `g`, for a step
    /// that is not applied.
    pub fn discard(&self, g: &Gradients) -> Result<()> {
        for (var, before) in self.statistics.iter().zip(&g.statistics_before) {
            var.set(before)?;
        }
        Ok(())
    }

    /// The moving statistics (batch-norm running means and variances), in creation order.
    pub fn statistics(&self) -> &[Var] {
        &self.statistics
    }

    fn zero_gradients(&self) -> Result<Gradients> {
        let grads = self
            .trainable
            .iter()
            .map(|v| Ok(v.as_tensor().zeros_like()?))
            .collect::<Result<Vec<_>>>()?;
        let stats = Tensor::zeros(1 + self.metrics.len(), DType::F32, &self.device)?;
        Ok(Gradients {
            grads,
            stats,
            samples: 0,
            statistics_before: Vec::new(),
        })
    }

    fn stats(&self, loss_sum: &Tensor, output: &Tensor, y: &Tensor) -> Result<Tensor> {
        let mut parts = vec![loss_sum.detach().to_dtype(DType::F32)?.reshape(1)?];
        for m in &self.metrics {
            parts.push(m.batch_sum(output, y, self.loss)?.reshape(1)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Applies one optimizer step with these gradients (in [`Self::trainable_vars`] order).
    pub fn apply_gradients(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.optimizer.step(grads, lr)
    }

    /// `[loss_sum, metric_sum...]` of `x`, `y` in inference mode, on this device.
    pub fn evaluate(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        if x.dim(0)? == 0 {
            return Ok(Tensor::zeros(
                1 + self.metrics.len(),
                DType::F32,
                &self.device,
            )?);
        }
        let (output, logits) = self.net.forward_with_logits(x, false)?;
        let loss_sum = self
            .loss
            .per_sample(&output, logits.as_ref(), y)?
            .sum_all()?;
        self.stats(&loss_sum, &output, y)
    }

    /// The model's output for `x` in inference mode.
    pub fn predict(&self, x: &Tensor) -> Result<Tensor> {
        self.net.forward_t(x, false)
    }
}

/// A finite-ness probe over the statistics and gradients: one scalar that is finite exactly
/// when all of them are, so a single host read decides whether a step may be applied.
pub fn finite_probe(stats: &Tensor, grads: &[Tensor]) -> Result<Tensor> {
    let mut total = stats.sum_all()?.to_dtype(DType::F32)?;
    for g in grads {
        total = (total + g.sum_all()?.to_dtype(DType::F32)?)?;
    }
    // 0 * x is NaN exactly when x is NaN or infinite.
    Ok((total * 0.0)?)
}
