//! `Network`: the recipe a model is compiled from, a [`Sequential`] or a [`Functional`], and
//! how a replica builds it at the top level (its layers named without a prefix).

use crate::functional::{Functional, Packed};
use crate::layers::{BuildContext, FastPath, LayerSpec, Sequential, Summary};
use crate::params::{ParamStore, TrainableRule};
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
    /// A functional model's inputs and outputs (names and shapes); `None` for a `Sequential`.
    parts: Option<Parts>,
    /// Trainability set by layer name after the recipe was written, in the order set.
    trainable_rules: Vec<TrainableRule>,
}

/// The inputs and outputs of a functional model, by name and shape.
#[derive(Debug, Clone)]
pub(crate) struct Parts {
    pub(crate) input_shapes: Vec<Vec<usize>>,
    pub(crate) output_names: Vec<String>,
    pub(crate) output_shapes: Vec<Vec<usize>>,
}

impl Parts {
    /// Whether the model takes several inputs or gives several outputs, so that both are laid
    /// out in one tensor each (see `functional::packed`).
    pub(crate) fn packed(&self) -> bool {
        self.input_shapes.len() > 1 || self.output_shapes.len() > 1
    }
}

impl From<Sequential> for Network {
    fn from(stack: Sequential) -> Self {
        Self {
            input_shape: stack.declared_input_shape().map(<[usize]>::to_vec),
            recipe: Box::new(stack),
            parts: None,
            trainable_rules: Vec::new(),
        }
    }
}

/// A functional model of one input and one output is its own network; one of several inputs
/// or outputs takes them laid out in one tensor each.
impl From<Functional> for Network {
    fn from(graph: Functional) -> Self {
        let parts = Parts {
            input_shapes: graph.input_shapes(),
            output_names: graph.output_names(),
            output_shapes: graph.output_shapes(),
        };
        if parts.packed() {
            let packed = Packed::new(graph);
            Self {
                input_shape: Some(vec![packed.input_size()]),
                recipe: Box::new(packed),
                parts: Some(parts),
                trainable_rules: Vec::new(),
            }
        } else {
            Self {
                input_shape: parts.input_shapes.first().cloned(),
                recipe: Box::new(graph),
                parts: Some(parts),
                trainable_rules: Vec::new(),
            }
        }
    }
}

impl Network {
    /// The input shape the recipe declares (a functional model's input; a `Sequential`'s
    /// [`Sequential::input_shape`]), without the batch dimension.
    pub fn declared_input_shape(&self) -> Option<&[usize]> {
        self.input_shape.as_deref()
    }

    pub(crate) fn parts(&self) -> Option<&Parts> {
        self.parts.as_ref()
    }

    /// A functional model's input shapes, in order (`None` for a `Sequential`).
    pub fn input_shapes(&self) -> Option<&[Vec<usize>]> {
        self.parts.as_ref().map(|p| p.input_shapes.as_slice())
    }

    /// A functional model's output names, in order (`None` for a `Sequential`): the keys of
    /// per-output losses and logs.
    pub fn output_names(&self) -> Option<&[String]> {
        self.parts.as_ref().map(|p| p.output_names.as_slice())
    }

    /// The network with the layers under each of `names` trainable or frozen, overriding the
    /// recipe's `.trainable(...)`: see [`TrainableRule`] for how a name covers layers. Later
    /// calls override earlier ones where they name the same layers.
    ///
    /// ```
    /// use kandle::layers::{Dense, LayerSpecExt, Sequential};
    /// use kandle::Network;
    ///
    /// let stack = Sequential::new()
    ///     .add(Dense::new(4).named("base").trainable(false))
    ///     .add(Dense::new(2).named("head"));
    /// let net = Network::from(stack).with_trainable(&["base"], true);
    /// assert_eq!(net.summary(&[3])?.trainable, 3 * 4 + 4 + 4 * 2 + 2);
    /// let net = net.with_trainable(&[""], false).with_trainable(&["head"], true);
    /// assert_eq!(net.summary(&[3])?.trainable, 4 * 2 + 2);
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn with_trainable(mut self, names: &[&str], trainable: bool) -> Self {
        self.trainable_rules
            .extend(names.iter().map(|n| TrainableRule::new(*n, trainable)));
        self
    }

    /// The rules [`Self::with_trainable`] set, in order.
    pub fn trainable_rules(&self) -> &[TrainableRule] {
        &self.trainable_rules
    }

    /// The layer table for inputs of `input_shape`, built on the CPU.
    pub fn summary(&self, input_shape: &[usize]) -> Result<Summary> {
        let ctx = BuildContext::new(&candle_core::Device::Cpu, 0);
        Ok(self.build(ctx, input_shape)?.2)
    }

    /// Builds the whole network in `ctx` for inputs of `input_shape`.
    pub(crate) fn build(
        &self,
        ctx: BuildContext,
        input_shape: &[usize],
    ) -> Result<(Box<dyn FastPath>, ParamStore, Summary)> {
        let mut ctx = ctx.with_trainable_rules(&self.trainable_rules);
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
