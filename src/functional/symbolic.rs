//! Symbolic tensors: what an [`Input`] and every layer call of a functional model give, and
//! the recording of a model from them. Each knows its shape and where it came from (the call
//! that made it and that call's inputs).
//!
//! A call computes its output shape at once, by building the layer for its input shape in a
//! throwaway context whose variables are zeros, so a shape the layer cannot take fails at the
//! call that gives it, naming the layer, as in Keras. Merges ([`add`] ... [`concatenate`]) are
//! calls of several tensors.
//!
//! [`Functional::new`] walks back from the outputs over the calls that made them, checks the
//! graph (every layer it needs is reached from the given inputs, every input is used, names are
//! unique), names the layers (the user's names, or the kind numbered per model in the order of
//! their first call: `conv2d_1`, `conv2d_2`, ...) and keeps the calls in an order where each
//! comes after its inputs: the recorded graph of `graph`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::graph::{Functional, GraphCall, GraphInput, GraphLayerSpec, Op, Source};
use super::merge::{Merge, MergeKind};
use crate::error::shape_with_batch;
use crate::layers::{BuildContext, LayerSpec};
use crate::{ComputePath, Error, Result};

/// A model input of a given shape (without the batch dimension): the start of a functional
/// model, as Keras's `keras.Input`.
///
/// ```
/// use kandle::functional::Input;
///
/// let image = Input::new(&[3, 32, 32]).named("image").tensor();
/// assert_eq!(image.shape(), [3, 32, 32]);
/// ```
#[derive(Debug, Clone)]
pub struct Input {
    shape: Vec<usize>,
    name: Option<String>,
}

impl Input {
    /// An input of `shape`, without the batch dimension.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            name: None,
        }
    }

    /// Names the input (the default is `input_1`, `input_2`, ... in the model).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The symbolic tensor that stands for this input.
    pub fn tensor(self) -> SymbolicTensor {
        let node = Node {
            id: next_id(),
            call: Call::Input { name: self.name },
            inputs: Vec::new(),
            output_shapes: vec![self.shape],
        };
        SymbolicTensor {
            node: Arc::new(node),
            output: 0,
        }
    }
}

impl From<Input> for SymbolicTensor {
    fn from(input: Input) -> Self {
        input.tensor()
    }
}

/// A tensor of a functional model under construction: a shape (without the batch dimension)
/// and the calls that lead to it from the model's inputs. Cloning it is cheap.
#[derive(Clone)]
pub struct SymbolicTensor {
    node: Arc<Node>,
    /// Which of its call's outputs it is (a nested model may give several).
    output: usize,
}

impl std::fmt::Debug for SymbolicTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SymbolicTensor({}, {})",
            self.describe(),
            shape_with_batch(self.shape())
        )
    }
}

impl SymbolicTensor {
    /// The shape, without the batch dimension.
    pub fn shape(&self) -> &[usize] {
        &self.node.output_shapes[self.output]
    }

    pub(crate) fn node(&self) -> &Arc<Node> {
        &self.node
    }

    /// Which of its call's outputs it is.
    pub(crate) fn output(&self) -> usize {
        self.output
    }

    /// The layer (or input) that gives it, as errors name it: [`Node::describe`], with the
    /// output's number when the call gives several.
    pub(crate) fn describe(&self) -> String {
        match self.node.output_shapes.len() {
            1 => self.node.describe(),
            _ => format!("{} output {}", self.node.describe(), self.output + 1),
        }
    }
}

/// One call in the graph: an input, a layer called on one tensor, a merge of several, or a
/// functional model called on its inputs.
pub(crate) struct Node {
    /// Unique in the process: what the graph's walk keys nodes by.
    pub(crate) id: u64,
    pub(crate) call: Call,
    pub(crate) inputs: Vec<SymbolicTensor>,
    /// One shape per output: several only for a functional model of several outputs.
    pub(crate) output_shapes: Vec<Vec<usize>>,
}

impl Node {
    /// The layer (or input) as an error names it before the model names it: the user's name,
    /// or the kind.
    pub(crate) fn describe(&self) -> String {
        match &self.call {
            Call::Input { name } => format!("`{}`", name.as_deref().unwrap_or("input")),
            Call::Layer(layer) => format!("`{}`", layer.display_name()),
        }
    }
}

/// What a node does.
pub(crate) enum Call {
    /// A model input, with the user's name, if any.
    Input { name: Option<String> },
    /// A call of a layer, which other calls may share.
    Layer(Arc<GraphLayer>),
}

/// A layer of a graph: a recipe, a merge or a functional model, with the input shapes it takes
/// once called.
pub(crate) struct GraphLayer {
    /// Unique in the process: calls of one shared layer have the same id.
    pub(crate) id: u64,
    pub(crate) op: Op,
    /// The input shapes of its first call, and the output shapes: every later call must give
    /// the same input shapes.
    shapes: OnceLock<(Shapes, Shapes)>,
}

/// Several shapes, each without the batch dimension.
type Shapes = Vec<Vec<usize>>;

impl GraphLayer {
    pub(crate) fn new(op: Op) -> Arc<Self> {
        Arc::new(Self {
            id: next_id(),
            op,
            shapes: OnceLock::new(),
        })
    }

    /// The user's name, or the kind.
    pub(crate) fn display_name(&self) -> &str {
        self.op.name().unwrap_or(self.op.kind())
    }

    /// Calls the layer on `inputs`: checks their shapes, computes the output's, and records
    /// the call. The layer must give one output.
    pub(crate) fn call(self: &Arc<Self>, inputs: &[&SymbolicTensor]) -> Result<SymbolicTensor> {
        let mut outputs = self.call_all(inputs)?;
        match outputs.len() {
            1 => Ok(outputs.remove(0)),
            n => Err(Error::invalid(format!(
                "layer `{}` gives {n} outputs where one is expected",
                self.display_name()
            ))),
        }
    }

    /// Calls the layer on `inputs`: checks their shapes, computes the outputs', and records
    /// the call as one node; returns one symbolic tensor per output.
    pub(crate) fn call_all(
        self: &Arc<Self>,
        inputs: &[&SymbolicTensor],
    ) -> Result<Vec<SymbolicTensor>> {
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape().to_vec()).collect();
        let output_shapes = match self.shapes.get() {
            Some((first, output)) if *first == shapes => output.clone(),
            Some((first, _)) => {
                let show = |shapes: &[Vec<usize>]| -> String {
                    let each: Vec<String> = shapes.iter().map(|s| shape_with_batch(s)).collect();
                    each.join(" and ")
                };
                return Err(Error::invalid(format!(
                    "shared layer `{}` was called on {} and is now called on {}: a shared \
                     layer has one set of variables, so every call takes the same shapes",
                    self.display_name(),
                    show(first),
                    show(&shapes)
                )));
            }
            None => {
                let output = self.output_shapes(inputs)?;
                let _ = self.shapes.set((shapes, output.clone()));
                output
            }
        };
        let node = Arc::new(Node {
            id: next_id(),
            call: Call::Layer(Arc::clone(self)),
            inputs: inputs.iter().map(|&t| t.clone()).collect(),
            output_shapes,
        });
        Ok((0..node.output_shapes.len())
            .map(|output| SymbolicTensor {
                node: Arc::clone(&node),
                output,
            })
            .collect())
    }

    /// The output shapes for `inputs`, or the error that building the layer for them gives.
    fn output_shapes(&self, inputs: &[&SymbolicTensor]) -> Result<Vec<Vec<usize>>> {
        match &self.op {
            Op::Spec(spec) => {
                let [input] = inputs else {
                    return Err(Error::invalid(format!(
                        "layer `{}` takes one input, not {}",
                        self.display_name(),
                        inputs.len()
                    )));
                };
                let mut ctx = BuildContext::for_shapes();
                let built =
                    ctx.scoped(self.display_name(), |ctx| spec.build(ctx, input.shape()))?;
                Ok(vec![built.output_shape])
            }
            Op::Merge(merge) => {
                let parts: Vec<(String, &[usize])> =
                    inputs.iter().map(|t| (t.describe(), t.shape())).collect();
                Ok(vec![merge.output_shape(self.display_name(), &parts)?])
            }
            Op::Graph(graph) => {
                let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
                graph.check_call(self.display_name(), &shapes)?;
                Ok(graph.output_shapes())
            }
        }
    }
}

/// A layer that keeps one set of variables over every call, as calling one Keras layer object
/// several times does. Made by [`LayerCall::shared`](crate::functional::LayerCall::shared);
/// cloning it gives another handle on the same layer.
///
/// ```
/// use kandle::functional::{Functional, Input, LayerCall};
/// use kandle::layers::Dense;
///
/// let left = Input::new(&[8]).named("left").tensor();
/// let right = Input::new(&[8]).named("right").tensor();
/// let encoder = Dense::new(4).shared();
/// let a = encoder.call(&left)?;
/// let b = encoder.call(&right)?;
/// let distance = kandle::functional::subtract(&a, &b)?;
/// let model = Functional::new([&left, &right], [&distance])?;
/// assert_eq!(model.summary()?.trainable, 8 * 4 + 4);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Clone)]
pub struct SharedLayer {
    layer: Arc<GraphLayer>,
}

impl SharedLayer {
    pub(crate) fn new(spec: Box<dyn LayerSpec>) -> Self {
        Self {
            layer: GraphLayer::new(Op::Spec(spec)),
        }
    }

    /// A functional model that several calls share ([`Functional::shared`]).
    pub(crate) fn of_graph(graph: Functional) -> Self {
        Self {
            layer: GraphLayer::new(Op::Graph(Box::new(graph))),
        }
    }

    /// Calls the layer on `x`. Every call must take the shape of the first.
    pub fn call(&self, x: &SymbolicTensor) -> Result<SymbolicTensor> {
        self.layer.call(&[x])
    }

    /// Calls a shared functional model on `inputs`, one per model input in order; returns one
    /// symbolic tensor per model output (as [`Functional::call_on`], with the variables of
    /// every call shared). A shared layer takes one input, as [`Self::call`].
    pub fn call_on(&self, inputs: &[&SymbolicTensor]) -> Result<Vec<SymbolicTensor>> {
        self.layer.call_all(inputs)
    }
}

impl std::fmt::Debug for SharedLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedLayer({})", self.layer.display_name())
    }
}

/// A fresh id for a node or a layer.
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl BuildContext {
    /// A CPU context whose variables are zeros, for working out shapes only.
    pub(crate) fn for_shapes() -> Self {
        BuildContext::new(&candle_core::Device::Cpu, 0)
            .with_compute_path(ComputePath::DeviceGeneric)
            .zero_initialised()
    }
}

impl Functional {
    /// The model from `inputs` to `outputs`. A graph that needs an input not among `inputs`,
    /// an input that no output uses, a tensor given as an input that is not an
    /// [`Input`]'s, and two layers with one name are errors naming the layers.
    pub fn new<'a>(
        inputs: impl IntoIterator<Item = &'a SymbolicTensor>,
        outputs: impl IntoIterator<Item = &'a SymbolicTensor>,
    ) -> Result<Self> {
        let inputs: Vec<&SymbolicTensor> = inputs.into_iter().collect();
        let outputs: Vec<&SymbolicTensor> = outputs.into_iter().collect();
        if inputs.is_empty() || outputs.is_empty() {
            return Err(Error::invalid(
                "a functional model needs at least one input and one output",
            ));
        }
        let order = walk(&outputs);
        let graph_inputs = check_inputs(&inputs, &order)?;
        let mut input_index: HashMap<u64, usize> = HashMap::new();
        for (i, t) in inputs.iter().enumerate() {
            input_index.insert(t.node().id, i);
        }
        let mut layers: Vec<GraphLayerSpec> = Vec::new();
        let mut layer_index: HashMap<u64, usize> = HashMap::new();
        let mut call_index: HashMap<u64, usize> = HashMap::new();
        let mut calls = Vec::new();
        let mut kinds: HashMap<&'static str, usize> = HashMap::new();
        let source = |t: &SymbolicTensor, call_index: &HashMap<u64, usize>| match input_index
            .get(&t.node().id)
        {
            Some(&i) => Source::Input(i),
            None => Source::Call(call_index[&t.node().id], t.output()),
        };
        for node in &order {
            let Call::Layer(layer) = &node.call else {
                continue;
            };
            let l = *layer_index.entry(layer.id).or_insert_with(|| {
                let name = match layer.op.name() {
                    Some(name) => name.to_string(),
                    None => {
                        let n = kinds.entry(layer.op.kind()).or_insert(0);
                        *n += 1;
                        format!("{}_{n}", layer.op.kind())
                    }
                };
                layers.push(GraphLayerSpec {
                    name,
                    op: layer.op.clone(),
                    calls: 0,
                });
                layers.len() - 1
            });
            let inputs = node.inputs.iter().map(|t| source(t, &call_index)).collect();
            calls.push(GraphCall {
                layer: l,
                inputs,
                output_shapes: node.output_shapes.clone(),
                index: layers[l].calls,
            });
            layers[l].calls += 1;
            call_index.insert(node.id, calls.len() - 1);
        }
        let outputs = outputs.iter().map(|t| source(t, &call_index)).collect();
        Self::from_parts(graph_inputs, layers, calls, outputs)
    }

    /// Calls the model like a layer on `inputs`, one symbolic tensor per model input in order,
    /// inside another functional model, as calling a Keras model on a list of tensors does;
    /// returns one symbolic tensor per model output, in order. The outer model builds the
    /// model's layers once per call, with their variables under the model's name
    /// ([`Self::named`]; by default `functional_1`, ... numbered in the outer model), so they
    /// are trained, saved and loaded with the outer model's. Each call makes a new layer with
    /// its own variables; [`Self::shared`] gives one that several calls share, as calling one
    /// Keras model object twice does.
    ///
    /// A number of inputs other than the model's, or an input whose shape is not the model's,
    /// is an error naming the model (and the input, with both shapes). A model of one input
    /// and one output may also be called with
    /// [`LayerCall::call`](crate::functional::LayerCall::call).
    ///
    /// ```
    /// use kandle::functional::{add, Functional, Input, LayerCall};
    /// use kandle::layers::Dense;
    ///
    /// // An encoder of two inputs and two outputs...
    /// let a = Input::new(&[4]).named("a").tensor();
    /// let b = Input::new(&[3]).named("b").tensor();
    /// let h = add(&[&Dense::new(8).call(&a)?, &Dense::new(8).call(&b)?])?;
    /// let (mean, scale) = (Dense::new(2).call(&h)?, Dense::new(2).call(&h)?);
    /// let encoder = Functional::new([&a, &b], [&mean, &scale])?.named("encoder");
    ///
    /// // ... called on two tensors of another model.
    /// let x = Input::new(&[4]).tensor();
    /// let y = Input::new(&[3]).tensor();
    /// let outputs = encoder.call_on(&[&x, &y])?;
    /// assert_eq!(outputs.len(), 2);
    /// let sum = add(&[&outputs[0], &outputs[1]])?;
    /// let model = Functional::new([&x, &y], [&sum])?;
    /// assert_eq!(model.summary()?.trainable, 4 * 8 + 8 + 3 * 8 + 8 + 2 * (8 * 2 + 2));
    ///
    /// let err = encoder.call_on(&[&x]).unwrap_err().to_string();
    /// assert!(err.contains("`encoder` takes 2 inputs"), "{err}");
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn call_on(&self, inputs: &[&SymbolicTensor]) -> Result<Vec<SymbolicTensor>> {
        GraphLayer::new(Op::Graph(Box::new(self.clone()))).call_all(inputs)
    }

    /// The model as a layer that several calls share: one set of variables, whose gradient is
    /// the sum over the calls (a Siamese network's twin towers).
    /// [`SharedLayer::call_on`] calls it on the model's inputs; [`SharedLayer::call`] when it
    /// has one input and one output. Every call takes the shapes of the first.
    ///
    /// ```
    /// use kandle::functional::{concatenate, Functional, Input, LayerCall};
    /// use kandle::layers::Dense;
    ///
    /// // A tower of two inputs and two outputs...
    /// let a = Input::new(&[4]).named("a").tensor();
    /// let b = Input::new(&[3]).named("b").tensor();
    /// let h = concatenate(&[&a, &b])?;
    /// let (u, v) = (Dense::new(2).call(&h)?, Dense::new(5).call(&h)?);
    /// let tower = Functional::new([&a, &b], [&u, &v])?.named("tower").shared();
    ///
    /// // ... called on two pairs of inputs, with one set of variables.
    /// let (x1, y1) = (Input::new(&[4]).tensor(), Input::new(&[3]).tensor());
    /// let (x2, y2) = (Input::new(&[4]).tensor(), Input::new(&[3]).tensor());
    /// let first = tower.call_on(&[&x1, &y1])?;
    /// let second = tower.call_on(&[&x2, &y2])?;
    /// let out = concatenate(&[&first[0], &second[0], &first[1], &second[1]])?;
    /// let model = Functional::new([&x1, &y1, &x2, &y2], [&out])?;
    /// assert_eq!(model.summary()?.trainable, 7 * 2 + 2 + 7 * 5 + 5);
    ///
    /// let wrong = Input::new(&[5]).tensor();
    /// let err = tower.call_on(&[&wrong, &y1]).unwrap_err().to_string();
    /// assert!(err.contains("(batch, 5)"), "{err}");
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn shared(self) -> SharedLayer {
        SharedLayer::of_graph(self)
    }
}

/// The nodes the outputs depend on, in the order they were made, so each comes after the
/// nodes it takes (a node is made after its inputs) and layers are numbered in the order the
/// calls were written.
fn walk(outputs: &[&SymbolicTensor]) -> Vec<Arc<Node>> {
    let mut seen: HashMap<u64, Arc<Node>> = HashMap::new();
    // Without recursion: deep networks have hundreds of calls.
    let mut pending: Vec<Arc<Node>> = outputs.iter().map(|t| Arc::clone(t.node())).collect();
    while let Some(node) = pending.pop() {
        if seen.contains_key(&node.id) {
            continue;
        }
        pending.extend(node.inputs.iter().map(|t| Arc::clone(t.node())));
        seen.insert(node.id, node);
    }
    let mut order: Vec<Arc<Node>> = seen.into_values().collect();
    order.sort_by_key(|node| node.id);
    order
}

/// Checks `inputs` against the inputs the walk reached, and names them.
fn check_inputs(inputs: &[&SymbolicTensor], order: &[Arc<Node>]) -> Result<Vec<GraphInput>> {
    let mut named = Vec::with_capacity(inputs.len());
    for (i, t) in inputs.iter().enumerate() {
        let node = t.node();
        let Call::Input { name } = &node.call else {
            return Err(Error::invalid(format!(
                "input {} of the functional model is the output of layer {}, not an Input: a \
                 model's inputs are `Input` tensors",
                i + 1,
                node.describe()
            )));
        };
        if inputs[..i].iter().any(|u| u.node().id == node.id) {
            return Err(Error::invalid(format!(
                "input {} of the functional model ({}) is given twice",
                i + 1,
                node.describe()
            )));
        }
        if !order.iter().any(|n| n.id == node.id) {
            return Err(Error::invalid(format!(
                "input {} of the functional model (`{}`, {}) is not used by any output",
                i + 1,
                name.as_deref().unwrap_or("unnamed"),
                shape_with_batch(t.shape())
            )));
        }
        named.push(GraphInput {
            name: name.clone().unwrap_or_else(|| format!("input_{}", i + 1)),
            shape: t.shape().to_vec(),
        });
    }
    for node in order {
        if !matches!(node.call, Call::Input { .. }) || inputs.iter().any(|t| t.node().id == node.id)
        {
            continue;
        }
        let user = order
            .iter()
            .find(|n| n.inputs.iter().any(|t| t.node().id == node.id))
            .map(|n| n.describe())
            .unwrap_or_else(|| "an output".to_string());
        return Err(Error::invalid(format!(
            "the functional model's graph is disconnected: layer {user} is called on input {} \
             ({}), which is not among the model's inputs",
            node.describe(),
            shape_with_batch(&node.output_shapes[0])
        )));
    }
    Ok(named)
}

impl Merge {
    /// Merges `inputs`; shapes that do not merge are an error naming the layer, the inputs
    /// and their shapes.
    pub fn call(self, inputs: &[&SymbolicTensor]) -> Result<SymbolicTensor> {
        GraphLayer::new(Op::Merge(self)).call(inputs)
    }
}

/// The sum of `inputs`, as Keras's `keras.layers.add`.
///
/// ```
/// use kandle::functional::{add, Functional, Input, LayerCall};
/// use kandle::layers::{Activation, BatchNormalization, Conv2D, Padding};
///
/// // A residual block: relu(x + bn(conv(x))).
/// let x = Input::new(&[8, 6, 6]).tensor();
/// let y = Conv2D::new(8, 3).padding(Padding::Same).use_bias(false).call(&x)?;
/// let y = BatchNormalization::new().call(&y)?;
/// let y = Activation::Relu.call(&add(&[&x, &y])?)?;
/// let block = Functional::new([&x], [&y])?;
/// assert_eq!(block.summary()?.trainable, 8 * 8 * 9 + 2 * 8);
/// # Ok::<(), kandle::Error>(())
/// ```
pub fn add(inputs: &[&SymbolicTensor]) -> Result<SymbolicTensor> {
    Merge::new(MergeKind::Add).call(inputs)
}

/// `a - b`, as Keras's `keras.layers.subtract`.
pub fn subtract(a: &SymbolicTensor, b: &SymbolicTensor) -> Result<SymbolicTensor> {
    Merge::new(MergeKind::Subtract).call(&[a, b])
}

/// The element-wise product of `inputs`, as Keras's `keras.layers.multiply`.
pub fn multiply(inputs: &[&SymbolicTensor]) -> Result<SymbolicTensor> {
    Merge::new(MergeKind::Multiply).call(inputs)
}

/// The mean of `inputs`, as Keras's `keras.layers.average`.
pub fn average(inputs: &[&SymbolicTensor]) -> Result<SymbolicTensor> {
    Merge::new(MergeKind::Average).call(inputs)
}

/// `inputs` joined along channels, as Keras's `keras.layers.concatenate` on the channel axis.
pub fn concatenate(inputs: &[&SymbolicTensor]) -> Result<SymbolicTensor> {
    Merge::new(MergeKind::Concatenate).call(inputs)
}
