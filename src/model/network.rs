//! `Network`: the recipe a model is compiled from, a [`Sequential`] or a [`Functional`], and
//! how a replica builds it at the top level (its layers named without a prefix).

use crate::functional::Functional;
use crate::layers::{BuildContext, FastPath, LayerSpec, Sequential, Summary};
use crate::params::ParamStore;
use crate::Result;

/// A model's recipe: a [`Sequential`] stack or a [`Functional`] graph. Both convert into it
/// (`.into()`), and it is what [`ModelSpec`](crate::strategy::ModelSpec) holds.
///
/// ```
/// use kandle::layers::{Dense, LayerSpecExt, Sequential};
/// use kandle::functional::{Functional, Input};
/// use kandle::Network;
///
/// let stack: Network = Sequential::new().add(Dense::new(2)).into();
/// let x = Input::new(&[3]).tensor();
/// let graph: Network = Functional::new([&x], [&Dense::new(2).call(&x)?])?.into();
/// assert_eq!(stack.declared_input_shape(), None);
/// assert_eq!(graph.declared_input_shape(), Some(&[3][..]));
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Network {
    recipe: Box<dyn LayerSpec>,
    input_shape: Option<Vec<usize>>,
}

impl From<Sequential> for Network {
    fn from(stack: Sequential) -> Self {
        Self {
            input_shape: stack.declared_input_shape().map(<[usize]>::to_vec),
            recipe: Box::new(stack),
        }
    }
}

impl From<Functional> for Network {
    fn from(graph: Functional) -> Self {
        Self {
            input_shape: graph.input_shapes().first().cloned(),
            recipe: Box::new(graph),
        }
    }
}

impl Network {
    /// The input shape the recipe declares (a functional model's input; a `Sequential`'s
    /// [`Sequential::input_shape`]), without the batch dimension.
    pub fn declared_input_shape(&self) -> Option<&[usize]> {
        self.input_shape.as_deref()
    }

    /// The layer table for inputs of `input_shape`, built on the CPU.
    pub fn summary(&self, input_shape: &[usize]) -> Result<Summary> {
        let ctx = BuildContext::new(&candle_core::Device::Cpu, 0);
        Ok(self.build(ctx, input_shape)?.2)
    }

    /// Builds the whole network in `ctx` for inputs of `input_shape`.
    pub(crate) fn build(
        &self,
        mut ctx: BuildContext,
        input_shape: &[usize],
    ) -> Result<(Box<dyn FastPath>, ParamStore, Summary)> {
        let built = self.recipe.build(&mut ctx, input_shape)?;
        let store = ctx.into_store();
        let (trainable, non_trainable) = store.count("");
        let summary = Summary {
            input_shape: input_shape.to_vec(),
            rows: built.children.clone(),
            trainable,
            non_trainable,
        };
        Ok((built.into_fast_path(), store, summary))
    }
}
