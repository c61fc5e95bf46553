//! Optimizers: SGD (momentum, Nesterov, weight decay), Adam and AdamW.
//!
//! `compile` takes an [`OptimizerConfig`], a cheap recipe. Each replica builds its own
//! [`Optimizer`] from it over its own variables, so replicas that apply the same gradients stay
//! identical. The learning rate is passed to every step, so schedules and callbacks change it
//! without touching optimizer state. Update rules follow PyTorch's `torch.optim`, and the tests
//! check them against values PyTorch computed.

use candle_core::{Tensor, Var};

use crate::Result;

/// An optimizer's hyper-parameters: builds the stateful [`Optimizer`] for a set of variables.
pub trait OptimizerConfig: Send + Sync + 'static {
    /// The initial learning rate.
    fn learning_rate(&self) -> f64;

    /// The optimizer for `params`, with fresh state.
    fn build(&self, params: Vec<Var>) -> Result<Box<dyn Optimizer>>;

    /// A boxed copy.
    fn clone_config(&self) -> Box<dyn OptimizerConfig>;
}

impl Clone for Box<dyn OptimizerConfig> {
    fn clone(&self) -> Self {
        self.clone_config()
    }
}

/// An optimizer bound to its variables, holding its state (momentum buffers, moments).
pub trait Optimizer: Send {
    /// Applies one update. `grads[i]` is the gradient of the i-th variable given to
    /// [`OptimizerConfig::build`]; gradients must be detached from the graph.
    fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()>;
}
