//! Calling a layer recipe on symbolic tensors, the way a functional model is written
//! (Keras's `layer(x)`): each call records a node of the graph, and [`LayerCall::shared`] makes
//! one layer that several calls share.

use super::graph::Op;
use super::symbolic::{GraphLayer, SharedLayer, SymbolicTensor};
use crate::layers::LayerSpec;
use crate::Result;

/// Functional-API methods on every layer recipe (in the prelude).
///
/// ```
/// use kandle::functional::{Functional, Input, LayerCall};
/// use kandle::layers::Dense;
///
/// let x = Input::new(&[4]).tensor();
/// let shared = Dense::new(4).shared();
/// let y = shared.call(&shared.call(&x)?)?;
/// let y = Dense::new(2).call(&y)?;
/// let model = Functional::new([&x], [&y])?;
/// assert_eq!(model.output_shapes(), [vec![2]]);
/// # Ok::<(), kandle::Error>(())
/// ```
pub trait LayerCall: LayerSpec + Clone + Sized {
    /// Calls the layer on a symbolic tensor of a functional model (see
    /// [`crate::functional`]): a shape it cannot take is an error naming it. Each call of a
    /// recipe makes a new layer; [`LayerCall::shared`] makes one that several calls share.
    fn call(self, x: &SymbolicTensor) -> Result<SymbolicTensor> {
        GraphLayer::new(Op::Spec(Box::new(self))).call(&[x])
    }

    /// The layer as one that several calls share, with one set of variables.
    fn shared(self) -> SharedLayer {
        SharedLayer::new(Box::new(self))
    }
}

impl<L: LayerSpec + Clone> LayerCall for L {}
