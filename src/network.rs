//! `Network`: the recipe a model is compiled from, a [`Sequential`] or a [`Functional`], and
//! what a replica builds from it at the top level (its layers named without a prefix): a
//! [`BuiltNetwork`] that takes one tensor per input and gives one per output.
//!
//! A model of one input and one output runs as a layer, with every fusion the layers have; a
//! functional model of several inputs or outputs runs as its graph, each input and output a
//! tensor of its own.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::error::shape_with_batch;
use crate::functional::{Functional, GraphNet};
use crate::layers::{
    BuildContext, FastPath, Layer, LayerSpec, ParamGrads, Sequential, StagePlacement, Summary,
    SummaryRow,
};
use crate::params::{ParamStore, TrainableRule};
use crate::{Error, Result};

/// A model's recipe: a [`Sequential`] stack or a [`Functional`] graph. Both convert into it
/// (`.into()`), and it is what [`ModelSpec`](crate::strategy::ModelSpec) holds.
///
/// ```
/// use kandle::layers::{Dense, Sequential};
/// use kandle::functional::{Functional, Input, LayerCall};
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
    recipe: Recipe,
    /// Trainability set by layer name after the recipe was written, in the order set.
    trainable_rules: Vec<TrainableRule>,
}

#[derive(Debug, Clone)]
enum Recipe {
    Stack(Sequential),
    Graph(Functional),
    /// A functional model of one image input traced for one size, and how to trace it again
    /// for another (a convolutional base with global pooling takes any size).
    AnySize(Functional, Retrace),
}

/// Traces a functional model again for an input of another shape.
#[derive(Clone)]
struct Retrace(Arc<TraceFn>);

/// A function giving a functional model for an input shape.
type TraceFn = dyn Fn(&[usize]) -> Result<Functional> + Send + Sync;

impl std::fmt::Debug for Retrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Retrace")
    }
}

/// One input of a network: its name and its shape without the batch dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NetworkInput {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    /// Whether it takes images of any height and width (the shape's first dimension, the
    /// channels, still holds).
    pub(crate) any_size: bool,
}

impl NetworkInput {
    /// Whether a part of `shape` fits this input.
    pub(crate) fn takes(&self, shape: &[usize]) -> bool {
        match self.any_size {
            true => shape.len() == self.shape.len() && shape.first() == self.shape.first(),
            false => shape == self.shape,
        }
    }
}

impl From<Sequential> for Network {
    fn from(stack: Sequential) -> Self {
        Self {
            recipe: Recipe::Stack(stack),
            trainable_rules: Vec::new(),
        }
    }
}

impl From<Functional> for Network {
    fn from(graph: Functional) -> Self {
        Self {
            recipe: Recipe::Graph(graph),
            trainable_rules: Vec::new(),
        }
    }
}

impl Network {
    /// A network of one image input that takes images of any height and width, as Keras's
    /// convolutional bases with `input_shape=None` and torchvision's models do: `trace` gives
    /// the functional model for an input shape `(channels, height, width)`, and is called for
    /// `shape` now and for every other size the model meets (`fit`, `evaluate`, `predict`, or
    /// `Model::build`), which rebuilds the model with the same variables. `trace` must give
    /// the same variables (names and shapes) whatever the size, as a network that ends in
    /// global pooling does.
    ///
    /// ```
    /// use kandle::functional::{Functional, Input, LayerCall};
    /// use kandle::layers::{Conv2D, Dense, GlobalAveragePooling2D};
    /// use kandle::Network;
    ///
    /// let trace = |shape: &[usize]| {
    ///     let image = Input::new(shape).named("image").tensor();
    ///     let x = Conv2D::new(4, 3).call(&image)?;
    ///     let y = Dense::new(2).call(&GlobalAveragePooling2D.call(&x)?)?;
    ///     Functional::new([&image], [&y])
    /// };
    /// let net = Network::any_size(&[3, 32, 32], trace)?;
    /// assert_eq!(net.summary(&[3, 64, 48])?.trainable, 3 * 3 * 3 * 4 + 4 + 4 * 2 + 2);
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn any_size(
        shape: &[usize],
        trace: impl Fn(&[usize]) -> Result<Functional> + Send + Sync + 'static,
    ) -> Result<Self> {
        let graph = trace(shape)?;
        if graph.inputs().len() != 1 || shape.len() != 3 {
            return Err(Error::invalid(format!(
                "Network::any_size takes a model of one image input (channels, height, width); \
                 this one has {} input(s) of shape {}",
                graph.inputs().len(),
                shape_with_batch(shape)
            )));
        }
        Ok(Self {
            recipe: Recipe::AnySize(graph, Retrace(Arc::new(trace))),
            trainable_rules: Vec::new(),
        })
    }

    /// Whether the network takes images of any size ([`Self::any_size`]).
    pub fn takes_any_size(&self) -> bool {
        matches!(self.recipe, Recipe::AnySize(..))
    }

    /// The functional model, traced for `input_shapes` where it takes any size.
    fn graph_for(&self, input_shapes: &[Vec<usize>]) -> Result<Option<Functional>> {
        Ok(match &self.recipe {
            Recipe::Stack(_) => None,
            Recipe::Graph(graph) => Some(graph.clone()),
            Recipe::AnySize(graph, retrace) => match input_shapes {
                [shape] if *shape != graph.input_shapes()[0] => Some((retrace.0)(shape)?),
                _ => Some(graph.clone()),
            },
        })
    }

    /// The outputs' shapes for inputs of `input_shapes`: a functional model's (traced again
    /// for another size where it takes any size); `None` for a `Sequential`.
    pub(crate) fn output_shapes_for(
        &self,
        input_shapes: &[Vec<usize>],
    ) -> Result<Option<Vec<Vec<usize>>>> {
        Ok(self.graph_for(input_shapes)?.map(|g| g.output_shapes()))
    }

    /// The input shape the recipe declares (a functional model's first input; a
    /// `Sequential`'s [`Sequential::input_shape`]), without the batch dimension.
    pub fn declared_input_shape(&self) -> Option<&[usize]> {
        match &self.recipe {
            Recipe::Stack(stack) => stack.declared_input_shape(),
            Recipe::Graph(graph) | Recipe::AnySize(graph, _) => {
                graph.inputs().first().map(|i| i.shape.as_slice())
            }
        }
    }

    /// The inputs the recipe declares, by name and shape: every input of a functional model,
    /// a `Sequential`'s one input (named `input`) when it declares its shape, else none.
    pub(crate) fn declared_inputs(&self) -> Vec<NetworkInput> {
        match &self.recipe {
            Recipe::Stack(stack) => stack
                .declared_input_shape()
                .map(|shape| NetworkInput {
                    name: "input".into(),
                    shape: shape.to_vec(),
                    any_size: false,
                })
                .into_iter()
                .collect(),
            Recipe::Graph(graph) | Recipe::AnySize(graph, _) => graph
                .inputs()
                .iter()
                .map(|i| NetworkInput {
                    name: i.name.clone(),
                    shape: i.shape.clone(),
                    any_size: self.takes_any_size(),
                })
                .collect(),
        }
    }

    /// A functional model's input shapes, in order (`None` for a `Sequential`).
    pub fn input_shapes(&self) -> Option<Vec<Vec<usize>>> {
        match &self.recipe {
            Recipe::Stack(_) => None,
            Recipe::Graph(graph) | Recipe::AnySize(graph, _) => Some(graph.input_shapes()),
        }
    }

    /// A functional model's input names, in order (`None` for a `Sequential`): the names a
    /// dataset's parts are matched by.
    pub fn input_names(&self) -> Option<Vec<String>> {
        match &self.recipe {
            Recipe::Stack(_) => None,
            Recipe::Graph(graph) | Recipe::AnySize(graph, _) => Some(graph.input_names()),
        }
    }

    /// A functional model's output names, in order (`None` for a `Sequential`): the keys of
    /// per-output losses and logs.
    pub fn output_names(&self) -> Option<Vec<String>> {
        match &self.recipe {
            Recipe::Stack(_) => None,
            Recipe::Graph(graph) | Recipe::AnySize(graph, _) => Some(graph.output_names()),
        }
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

    /// The layer table for inputs of `input_shape` (the first input's, for a functional model
    /// whose other inputs are declared), built on the CPU.
    pub fn summary(&self, input_shape: &[usize]) -> Result<Summary> {
        let ctx = BuildContext::new(&candle_core::Device::Cpu, 0);
        let mut shapes = self.input_shapes().unwrap_or_default();
        match shapes.first_mut() {
            Some(first) => *first = input_shape.to_vec(),
            None => shapes.push(input_shape.to_vec()),
        }
        Ok(self.build(ctx, &shapes)?.2)
    }

    /// Builds the whole network in `ctx` for inputs of `input_shapes` (one per input).
    pub(crate) fn build(
        &self,
        ctx: BuildContext,
        input_shapes: &[Vec<usize>],
    ) -> Result<(BuiltNetwork, ParamStore, Summary)> {
        let mut ctx = ctx.with_trainable_rules(&self.trainable_rules);
        let graph = self.graph_for(input_shapes)?;
        let (net, rows, names) = match (&self.recipe, &graph) {
            (_, Some(graph)) if graph.inputs().len() > 1 || graph.outputs().len() > 1 => {
                let (net, rows) = graph.build_graph(&mut ctx, input_shapes)?;
                (BuiltNetwork::Graph(net), rows, graph.input_names())
            }
            (recipe, graph) => {
                let [shape] = input_shapes else {
                    return Err(Error::invalid(format!(
                        "the model has one input but was given {}",
                        input_shapes.len()
                    )));
                };
                let (spec, name): (&dyn LayerSpec, String) = match (recipe, graph) {
                    (_, Some(graph)) => (graph, graph.input_names().remove(0)),
                    (Recipe::Stack(stack), None) => (stack, "input".into()),
                    (_, None) => {
                        return Err(Error::invalid("a functional model without its graph"))
                    }
                };
                let built = spec.build(&mut ctx, shape)?;
                let rows = built.children.clone();
                (
                    BuiltNetwork::Layer(built.into_fast_path()),
                    rows,
                    vec![name],
                )
            }
        };
        let store = ctx.into_store();
        let (trainable, non_trainable) = store.count("");
        let summary = Summary {
            inputs: names
                .into_iter()
                .zip(input_shapes.iter().cloned())
                .collect(),
            rows,
            trainable,
            non_trainable,
            stages: Vec::new(),
        };
        Ok((net, store, summary))
    }
}

impl Network {
    /// For each top-level layer (the summary's rows, in order), whether a pipeline stage may
    /// start at it: every layer of a `Sequential`; in a functional model the first layer and
    /// those past which one tensor flows (not inside a residual block, say), for inputs of
    /// `input_shapes`.
    pub fn stage_starts_allowed(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<bool>> {
        match (&self.recipe, self.graph_for(input_shapes)?) {
            (_, Some(graph)) => Ok(graph.stage_starts_allowed()),
            (Recipe::Stack(stack), None) => Ok(vec![true; stack.len()]),
            (_, None) => Err(Error::invalid("a functional model without its graph")),
        }
    }

    /// The summary rows of the layers a pipeline's stages are cut between, in order (the
    /// indices of [`StagePlacement::first_layer`] and [`Self::stage_starts_allowed`]): a
    /// `Sequential`'s layers; a functional model's, without its input rows.
    pub fn stage_layers(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<SummaryRow>> {
        let ctx = BuildContext::new(&candle_core::Device::Cpu, 0).zero_initialised();
        let summary = self.build(ctx, input_shapes)?.2;
        let inputs = match self.graph_for(input_shapes)? {
            Some(graph) => graph.inputs().len(),
            None => 0,
        };
        Ok(summary.rows[inputs..].to_vec())
    }

    /// Builds the network in `ctx` as consecutive stages, each on its placement's device:
    /// a `Sequential` as [`Sequential::build_stages`] does, a functional model of one input and
    /// one output cut where one tensor flows between its layers. Returns each stage as a
    /// network of one input and one output, its variables and its summary (its layers' rows
    /// and counts). The stages are built in the order of the whole model's layers, with their
    /// names, so each variable starts as it would on one device.
    pub(crate) fn build_stages(
        &self,
        ctx: BuildContext,
        input_shapes: &[Vec<usize>],
        placements: &[StagePlacement],
    ) -> Result<Vec<(BuiltNetwork, ParamStore, Summary)>> {
        let [shape] = input_shapes else {
            return Err(Error::invalid(format!(
                "a pipeline cuts a model of one input into stages, and this one was given {}",
                input_shapes.len()
            )));
        };
        let mut ctx = ctx.with_trainable_rules(&self.trainable_rules);
        let built: Vec<(BuiltNetwork, ParamStore, Vec<SummaryRow>, Vec<usize>)> =
            match (&self.recipe, self.graph_for(input_shapes)?) {
                (_, Some(graph)) => {
                    crate::layers::check_stage_starts(placements, graph.layers().len())?;
                    let starts: Vec<usize> = placements.iter().map(|p| p.first_layer).collect();
                    let stages = graph.split_at(&starts)?;
                    let mut input = shape.clone();
                    let mut built = Vec::with_capacity(stages.len());
                    for (stage, placement) in stages.iter().zip(placements) {
                        ctx.move_to(&placement.device);
                        let layer = stage.build(&mut ctx, &input)?;
                        let stage_input = std::mem::replace(&mut input, layer.output_shape.clone());
                        // A functional stage's rows start with its input's.
                        let rows = layer.children[stage.inputs().len()..].to_vec();
                        let net = BuiltNetwork::Layer(layer.into_fast_path());
                        built.push((net, ctx.take_store(), rows, stage_input));
                    }
                    built
                }
                (Recipe::Stack(stack), None) => stack
                    .build_stages(ctx, shape, placements)?
                    .into_iter()
                    .map(|stage| {
                        let input = stage.net.input_shape().to_vec();
                        (
                            BuiltNetwork::Layer(Box::new(stage.net)),
                            stage.store,
                            stage.rows,
                            input,
                        )
                    })
                    .collect(),
                (_, None) => return Err(Error::invalid("a functional model without its graph")),
            };
        Ok(built
            .into_iter()
            .map(|(net, store, rows, input)| {
                let (trainable, non_trainable) = store.count("");
                let summary = Summary {
                    inputs: vec![("input".into(), input)],
                    rows,
                    trainable,
                    non_trainable,
                    stages: Vec::new(),
                };
                (net, store, summary)
            })
            .collect())
    }
}

/// A built network: one tensor per input in, one per output out.
pub(crate) enum BuiltNetwork {
    /// One input and one output: a layer (a `Sequential`'s stack, or a functional model's
    /// graph run as a layer).
    Layer(Box<dyn FastPath>),
    /// A functional model of several inputs or outputs.
    Graph(GraphNet),
}

/// A recorded training forward of a whole network: its outputs, the logits of its only
/// output's softmax when it gives them, and the backward pass from the outputs' gradients (or
/// the logits').
pub(crate) struct RecordedNetwork {
    pub(crate) outputs: Vec<Tensor>,
    pub(crate) logits: Option<Tensor>,
    pub(crate) backward: NetworkBackward,
}

/// The backward pass of a whole network: from the outputs' gradients, in order, into the
/// variables' gradients.
pub(crate) type NetworkBackward = Box<dyn FnOnce(Vec<Tensor>, &mut ParamGrads) -> Result<()>>;

impl BuiltNetwork {
    /// The outputs for `inputs`, with the logits of the only output's softmax where the last
    /// layer gives them.
    pub(crate) fn forward_with_logits(
        &self,
        inputs: &[Tensor],
        train: bool,
    ) -> Result<(Vec<Tensor>, Option<Tensor>)> {
        let inputs = &as_computed(inputs)?;
        match self {
            BuiltNetwork::Layer(layer) => {
                let (y, logits) = layer.forward_with_logits(only(inputs)?, train)?;
                Ok((vec![y], logits))
            }
            BuiltNetwork::Graph(net) => net.run(inputs, train, true),
        }
    }

    /// The outputs for `inputs` in inference mode, as `f32`.
    pub(crate) fn predict(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let inputs = &as_computed(inputs)?;
        let outputs = match self {
            BuiltNetwork::Layer(layer) => vec![layer.forward_t(only(inputs)?, false)?],
            BuiltNetwork::Graph(net) => net.run(inputs, false, false)?.0,
        };
        outputs
            .into_iter()
            .map(|y| Ok(y.to_dtype(DType::F32)?))
            .collect()
    }

    /// The recorded training forward for `inputs`, whose gradients nothing asks for.
    pub(crate) fn record(&self, inputs: &[Tensor]) -> Result<RecordedNetwork> {
        let inputs = &as_computed(inputs)?;
        match self {
            BuiltNetwork::Layer(layer) => {
                let request = crate::layers::RecordRequest::with_logits().without_input_grad();
                let recorded = layer.forward_recorded(&only(inputs)?.detach(), request)?;
                let backward = recorded.backward;
                Ok(RecordedNetwork {
                    outputs: vec![recorded.output],
                    logits: recorded.logits,
                    backward: Box::new(move |mut dys: Vec<Tensor>, grads: &mut ParamGrads| {
                        let dy = dys.pop().ok_or_else(|| {
                            Error::invalid("the network's backward pass got no gradient")
                        })?;
                        backward.backward(dy, grads, false).map(|_| ())
                    }),
                })
            }
            BuiltNetwork::Graph(net) => {
                let detached: Vec<Tensor> = inputs.iter().map(Tensor::detach).collect();
                let (outputs, logits, backward) = net.record(&detached, true, false)?;
                Ok(RecordedNetwork {
                    outputs,
                    logits,
                    backward: Box::new(move |dys: Vec<Tensor>, grads: &mut ParamGrads| {
                        backward.backward(dys, grads, false).map(|_| ())
                    }),
                })
            }
        }
    }

    /// The recorded training forward of a pipeline stage (a network of one input and one
    /// output) for `x`, as `request` asks: through the layers' recorded backward passes when
    /// `recorded_backward`, else under candle's autograd as one piece.
    pub(crate) fn record_stage(
        &self,
        x: &Tensor,
        request: crate::layers::RecordRequest,
        recorded_backward: bool,
    ) -> Result<crate::layers::Recorded> {
        let BuiltNetwork::Layer(layer) = self else {
            return Err(Error::invalid("a pipeline stage is a chain of layers"));
        };
        match recorded_backward {
            true => layer.forward_recorded(x, request),
            false => crate::layers::record_with_candle(layer.as_layer(), x, request.logits),
        }
    }

    /// The network as a layer, when it has one input and one output.
    pub(crate) fn as_layer(&self) -> Option<&dyn Layer> {
        match self {
            BuiltNetwork::Layer(layer) => Some(layer.as_layer()),
            BuiltNetwork::Graph(_) => None,
        }
    }
}

/// The inputs as the layers take them: float parts (float16 or bfloat16 images, say) as
/// `f32`, which the layers cast to their policy's compute dtype; integer ids as they are.
/// A part already in `f32` is not copied.
fn as_computed(inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    inputs
        .iter()
        .map(|x| match x.dtype().is_float() {
            true => Ok(x.to_dtype(DType::F32)?),
            false => Ok(x.clone()),
        })
        .collect()
}

/// The only input of a network of one input.
fn only(inputs: &[Tensor]) -> Result<&Tensor> {
    match inputs {
        [x] => Ok(x),
        _ => Err(Error::invalid(format!(
            "the model takes one input but was given {}",
            inputs.len()
        ))),
    }
}

/// The error for a part of `shape`, from `source`, given for the input `input`, which takes
/// `expected`.
pub(crate) fn input_shape_error(
    input: &str,
    expected: &[usize],
    shape: &[usize],
    source: &str,
) -> Error {
    Error::invalid(format!(
        "model input `{input}` takes {} but `{source}` gives {}",
        shape_with_batch(expected),
        shape_with_batch(shape)
    ))
}
