//! Optimizers: SGD (momentum, Nesterov, weight decay), Adam and AdamW.
//!
//! `compile` takes an [`OptimizerConfig`], a cheap recipe. Each replica builds its own
//! [`Optimizer`] from it over its own variables, so replicas that apply the same gradients stay
//! identical. The learning rate is passed to every step, so schedules and callbacks change it
//! without touching optimizer state. Update rules follow PyTorch's `torch.optim`, and the tests
//! check them against values PyTorch computed. An optimizer exports and imports its state
//! ([`Optimizer::state`], [`Optimizer::load_state`]) as an [`OptimizerState`], so training can
//! stop and resume exactly. An optimizer may also make gated updates ([`gated`]), which a
//! CUDA graph of a whole training step replays.

mod adam;
#[cfg(feature = "cuda")]
mod cuda;
pub mod gated;
mod sgd;
mod state;

pub use adam::{Adam, AdamFamily, AdamW, DecoupledDecay, L2Penalty, WeightDecay};
pub use gated::LiveRates;
pub use sgd::Sgd;
pub(crate) use state::{check_slot_name, describe_kind};
pub use state::{NamedOptimizerState, OptimizerState};

use candle_core::{Tensor, Var};

use crate::{ComputePath, Error, Result};

/// Whether an optimizer built for a model on `path` updates its `f32` variables on CUDA devices
/// with kandle's CUDA kernels: with the `cuda` feature, unless `path` is the device-generic one,
/// which keeps candle's ops.
fn cuda_kernels(path: ComputePath) -> bool {
    cfg!(feature = "cuda") && path.uses_kernels()
}

/// An optimizer's hyper-parameters: builds the stateful [`Optimizer`] for a set of variables.
pub trait OptimizerConfig: Send + Sync + 'static {
    /// The initial learning rate.
    fn learning_rate(&self) -> f64;

    /// The optimizer for `params`, with fresh state.
    fn build(&self, params: Vec<Var>) -> Result<Box<dyn Optimizer>>;

    /// [`Self::build`] for a model that runs the code path `path` ([`ComputePath`]; a model
    /// builds its optimizer this way): kandle's optimizers update `f32` variables on a CUDA
    /// device with kandle's fused kernels unless `path` is the device-generic one. `build`
    /// alone takes the path from the environment ([`ComputePath::from_env`]). The default
    /// ignores the path.
    fn build_on_path(&self, params: Vec<Var>, path: ComputePath) -> Result<Box<dyn Optimizer>> {
        let _ = path;
        self.build(params)
    }

    /// A boxed copy.
    fn clone_config(&self) -> Box<dyn OptimizerConfig>;

    /// Keras's `gradient_accumulation_steps`: how many batches' gradients are summed before
    /// one update (1, the default: every batch updates). `fit` and `train_on_batch` then
    /// reduce and apply on every `k`-th batch only (and `fit` on the last batch of an epoch),
    /// the update being that of one batch `k` times larger.
    fn gradient_accumulation_steps(&self) -> usize {
        1
    }
}

impl Clone for Box<dyn OptimizerConfig> {
    fn clone(&self) -> Self {
        self.clone_config()
    }
}

/// An optimizer bound to its variables, holding its state (momentum buffers, moments).
///
/// Only [`step`](Self::step) is required. An optimizer that keeps state between steps also
/// implements [`state`](Self::state) and [`load_state`](Self::load_state), so that its state is
/// saved with the model ([`Model::save`](crate::Model::save)) and training resumes where it
/// stopped; the defaults suit an optimizer without state.
pub trait Optimizer: Send {
    /// Applies one update. `grads[i]` is the gradient of the i-th variable given to
    /// [`OptimizerConfig::build`]; gradients must be detached from the graph.
    fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()>;

    /// The state that the next steps depend on, by variable position. The default, for an
    /// optimizer that keeps none, is the empty [`OptimizerState::default`].
    fn state(&self) -> Result<OptimizerState> {
        Ok(OptimizerState::default())
    }

    /// Replaces the state with `state`, as exported by [`Optimizer::state`] of an optimizer of
    /// the same kind over variables of the same shapes. It checks everything first (kind,
    /// slots, number of variables, shapes) and changes nothing when it fails. The default, for
    /// an optimizer that keeps none, accepts only a state without slots or scalars.
    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "the optimizer state holds slots {:?} and scalars {:?} of {}, but this \
                 optimizer keeps no state (a user optimizer with state implements \
                 Optimizer::state and Optimizer::load_state)",
                state.slots.keys().collect::<Vec<_>>(),
                state.scalars.keys().collect::<Vec<_>>(),
                state::describe_kind(&state.kind)
            )))
        }
    }

    /// Gets ready for gated updates ([`gated`]: the state they update in place is made) and
    /// says whether this optimizer makes them for its variables as they are; the other gated
    /// methods are called only after it said yes. kandle's optimizers make them for `f32`
    /// variables all on the CPU, or all on one CUDA device through kandle's kernels. The
    /// default, for an optimizer without gated updates: no (its steps are host-decided).
    fn prepare_gated(&mut self) -> Result<bool> {
        Ok(false)
    }

    /// The rates the next gated update reads at learning rate `lr`: the values that change
    /// from step to step, given the steps this optimizer has counted.
    fn gated_rates(&self, lr: f64) -> Result<Vec<f64>> {
        let _ = lr;
        Err(gated::not_gated("gated_rates"))
    }

    /// One update, the same as [`Self::step`] at the rates' learning rate when `live`'s gate
    /// is open (0) and nothing when it is not, deciding nothing on the host: no state but the
    /// tensors on the device changes (see [`Self::settle_gated`]).
    fn step_gated(&self, grads: &[Tensor], live: &LiveRates<'_>) -> Result<()> {
        let _ = (grads, live);
        Err(gated::not_gated("step_gated"))
    }

    /// Moves what the host keeps on after a gated update, once the host has read whether it
    /// applied (its gate was open).
    fn settle_gated(&mut self, applied: bool) -> Result<()> {
        let _ = applied;
        Err(gated::not_gated("settle_gated"))
    }
}

/// Checks that `grads` pairs up with `params`: as many gradients as variables, each with its
/// variable's shape and dtype. The error names the first offending index and both shapes.
pub(crate) fn check_grads(optimizer: &str, params: &[Var], grads: &[Tensor]) -> Result<()> {
    if grads.len() != params.len() {
        return Err(Error::invalid(format!(
            "{optimizer}: got {} gradients for {} variables",
            grads.len(),
            params.len()
        )));
    }
    for (i, (param, grad)) in params.iter().zip(grads).enumerate() {
        if grad.shape() != param.shape() {
            return Err(Error::invalid(format!(
                "{optimizer}: gradient {i} has shape {:?} but variable {i} has shape {:?}",
                grad.dims(),
                param.dims()
            )));
        }
        if grad.dtype() != param.dtype() {
            return Err(Error::invalid(format!(
                "{optimizer}: gradient {i} has dtype {:?} but variable {i} has dtype {:?}",
                grad.dtype(),
                param.dtype()
            )));
        }
    }
    Ok(())
}

/// Checks a learning rate passed to [`Optimizer::step`]: finite and not negative.
pub(crate) fn check_lr(optimizer: &str, lr: f64) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{optimizer}: learning rate must be finite and >= 0, got {lr}"
        )))
    }
}

/// Checks that a hyper-parameter lies in `[0, 1)`, as momentum and the betas must.
pub(crate) fn check_unit(optimizer: &str, name: &str, value: f64) -> Result<()> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{optimizer}: {name} must be in [0, 1), got {value}"
        )))
    }
}

/// Checks a number of gradient accumulation steps: at least 1.
pub(crate) fn check_accumulation(optimizer: &str, steps: usize) -> Result<()> {
    if steps >= 1 {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{optimizer}: gradient_accumulation_steps must be at least 1, got {steps}"
        )))
    }
}

/// Checks that a hyper-parameter is finite and not negative, as weight decay must be.
pub(crate) fn check_non_negative(optimizer: &str, name: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{optimizer}: {name} must be finite and >= 0, got {value}"
        )))
    }
}
