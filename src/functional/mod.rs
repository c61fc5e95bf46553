//! The functional API: models as graphs of layer calls, as Keras's functional `keras.Model`.
//!
//! An [`Input`] gives a [`SymbolicTensor`]; calling a layer recipe on symbolic tensors
//! ([`LayerCall::call`]) gives new ones and records the call; [`Functional::new`] makes a model
//! recipe from the inputs and outputs. Merges ([`add`], [`subtract`], [`multiply`],
//! [`average`], [`concatenate`]) join several tensors, so residual blocks, several inputs and
//! several outputs are written as in Keras; a layer made [`shared`](LayerCall::shared) keeps one
//! set of variables over its calls, and their gradients add up. A functional model is itself
//! called inside another, on one tensor per input and giving one per output
//! ([`Functional::call_on`]).
//!
//! ```
//! use kandle::functional::{add, Functional, Input, LayerCall};
//! use kandle::layers::{Activation, Dense};
//!
//! let x = Input::new(&[16]).tensor();
//! let h = Dense::new(16).call(&x)?;
//! let h = Activation::Relu.call(&add(&[&x, &h])?)?;
//! let y = Dense::new(3).call(&h)?;
//! let model = Functional::new([&x], [&y])?;
//! assert_eq!(model.output_shapes(), [vec![3]]);
//! # Ok::<(), kandle::Error>(())
//! ```

mod backward;
mod call;
mod graph;
mod layout;
mod merge;
mod outputs;
mod run;
mod stages;
mod symbolic;
#[cfg(test)]
mod tests;

pub use call::LayerCall;
pub use graph::Functional;
pub(crate) use layout::GraphNet;
pub use merge::{Merge, MergeKind};
pub use outputs::PerOutput;
pub use symbolic::{
    add, average, concatenate, multiply, subtract, Input, SharedLayer, SymbolicTensor,
};
