//! `Functional`: a model recipe made from inputs and outputs, as Keras's functional
//! `keras.Model(inputs, outputs)`.
//!
//! [`Functional::new`] walks back from the outputs over the calls that made them, checks the
//! graph (every layer it needs is reached from the given inputs, every input is used, names are
//! unique), names the layers (the user's names, or the kind numbered per model in the order of
//! their first call: `conv2d_1`, `conv2d_2`, ...) and keeps the calls in an order where each
//! comes after its inputs. The recipe holds no symbolic tensor: it is `Clone`, device-free and
//! built like any other recipe, once per replica.

use std::collections::HashMap;
use std::sync::Arc;

use super::net::GraphNet;
use super::symbolic::{Call, GraphLayer, Node, Op, SharedLayer, SymbolicTensor};
use crate::error::shape_with_batch;
use crate::layers::{BuildContext, Built, LayerSpec, Summary, SummaryRow};
use crate::{Error, Result};

/// A model recipe made of layer calls on symbolic tensors, from its inputs to its outputs: the
/// functional API. Residual connections, several inputs or outputs and shared layers are
/// written as Keras writes them; with one input and one output the recipe is also a layer,
/// which a `Sequential` or another functional model can hold, and any functional model is
/// called on several tensors inside another with [`Functional::call_on`].
///
/// ```
/// use kandle::functional::{add, Functional, Input};
/// use kandle::layers::{Activation, Conv2D, Dense, GlobalAveragePooling2D, LayerSpecExt, Padding};
///
/// let image = Input::new(&[3, 16, 16]).named("image").tensor();
/// let stem = Conv2D::new(8, 3).padding(Padding::Same).call(&image)?;
/// let branch = Conv2D::new(8, 3).padding(Padding::Same).call(&stem)?;
/// let merged = Activation::Relu.call(&add(&[&stem, &branch])?)?;
/// let pooled = GlobalAveragePooling2D.call(&merged)?;
/// let logits = Dense::new(10).call(&pooled)?;
/// let model = Functional::new([&image], [&logits])?;
/// let summary = model.summary()?;
/// assert_eq!(summary.trainable, (3 * 9 + 1) * 8 + (8 * 9 + 1) * 8 + (8 + 1) * 10);
/// println!("{summary}"); // with Keras's "Connected to" column
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Functional {
    name: Option<String>,
    inputs: Vec<GraphInput>,
    layers: Vec<GraphLayerSpec>,
    /// Every call, each after the calls whose outputs it takes.
    calls: Vec<GraphCall>,
    outputs: Vec<Source>,
}

/// A model input: its name and shape.
#[derive(Debug, Clone)]
pub(crate) struct GraphInput {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
}

/// A layer of the graph, named.
#[derive(Debug, Clone)]
pub(crate) struct GraphLayerSpec {
    pub(crate) name: String,
    pub(crate) op: Op,
    /// How many times the graph calls it (more than once: a shared layer).
    pub(crate) calls: usize,
}

/// One call: which layer, on what, giving which shapes (several for a functional model of
/// several outputs).
#[derive(Debug, Clone)]
pub(crate) struct GraphCall {
    pub(crate) layer: usize,
    pub(crate) inputs: Vec<Source>,
    pub(crate) output_shapes: Vec<Vec<usize>>,
    /// Which call of its layer it is, from 0.
    pub(crate) index: usize,
}

/// Where a call's input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The model's input `i`.
    Input(usize),
    /// Output `k` of call `i`: `Call(i, k)`.
    Call(usize, usize),
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Spec(spec) => write!(f, "{spec:?}"),
            Op::Merge(merge) => write!(f, "{merge:?}"),
            Op::Graph(graph) => write!(f, "{graph:?}"),
        }
    }
}

impl Functional {
    /// The model from `inputs` to `outputs`. A graph that needs an input not among `inputs`,
    /// an input that no output uses, a tensor given as an input that is not an
    /// [`Input`](super::Input)'s, and two layers with one name are errors naming the layers.
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
        let graph = Self {
            name: None,
            inputs: graph_inputs,
            layers,
            calls,
            outputs,
        };
        graph.check_names()?;
        Ok(graph)
    }

    /// Names the model (its variables' prefix when it is a layer of another model).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
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
    /// [`LayerSpecExt::call`](crate::layers::LayerSpecExt::call).
    ///
    /// ```
    /// use kandle::functional::{add, Functional, Input};
    /// use kandle::layers::{Dense, LayerSpecExt};
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
    /// use kandle::functional::{concatenate, Functional, Input};
    /// use kandle::layers::{Dense, LayerSpecExt};
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

    /// Checks that `shapes` are this model's input shapes, for a call named `layer`.
    pub(crate) fn check_call(&self, layer: &str, shapes: &[&[usize]]) -> Result<()> {
        if shapes.len() != self.inputs.len() {
            let each: Vec<String> = self
                .inputs
                .iter()
                .map(|i| format!("`{}` {}", i.name, shape_with_batch(&i.shape)))
                .collect();
            return Err(Error::invalid(format!(
                "functional model `{layer}` takes {} inputs ({}), but was called on {}",
                self.inputs.len(),
                each.join(", "),
                shapes.len()
            )));
        }
        for (input, shape) in self.inputs.iter().zip(shapes) {
            if input.shape != *shape {
                return Err(Error::Shape {
                    layer: format!("functional model `{layer}`: input `{}`", input.name),
                    expected: shape_with_batch(&input.shape),
                    got: shape_with_batch(shape),
                });
            }
        }
        Ok(())
    }

    /// The inputs' shapes, without the batch dimension, in order.
    pub fn input_shapes(&self) -> Vec<Vec<usize>> {
        self.inputs.iter().map(|i| i.shape.clone()).collect()
    }

    /// The inputs' names, in order.
    pub fn input_names(&self) -> Vec<String> {
        self.inputs.iter().map(|i| i.name.clone()).collect()
    }

    /// The names of the layers that give the outputs (an input's name for an output that is
    /// an input; `<model>.<output>` for an output of a functional model called in this one),
    /// in order: what per-output losses and logs are keyed by.
    pub fn output_names(&self) -> Vec<String> {
        self.outputs
            .iter()
            .map(|&s| match s {
                Source::Call(c, k) => match &self.layers[self.calls[c].layer].op {
                    Op::Graph(graph) => {
                        let inner = graph.output_names().swap_remove(k);
                        format!("{}.{inner}", self.source_name(s))
                    }
                    _ => self.source_name(s),
                },
                Source::Input(_) => self.source_name(s),
            })
            .collect()
    }

    /// The outputs' shapes, without the batch dimension, in order.
    pub fn output_shapes(&self) -> Vec<Vec<usize>> {
        self.outputs
            .iter()
            .map(|&s| self.shape_of(s).to_vec())
            .collect()
    }

    /// The layer table, built on the CPU, with Keras's "Connected to" column when the graph is
    /// not a chain.
    pub fn summary(&self) -> Result<Summary> {
        let mut ctx = BuildContext::new(&candle_core::Device::Cpu, 0);
        let shapes = self.input_shapes();
        let (_, rows) = self.build_graph(&mut ctx, &shapes)?;
        let store = ctx.into_store();
        let (trainable, non_trainable) = store.count("");
        Ok(Summary {
            inputs: self.input_names().into_iter().zip(shapes).collect(),
            rows,
            trainable,
            non_trainable,
        })
    }

    pub(crate) fn inputs(&self) -> &[GraphInput] {
        &self.inputs
    }

    pub(crate) fn layers(&self) -> &[GraphLayerSpec] {
        &self.layers
    }

    pub(crate) fn calls(&self) -> &[GraphCall] {
        &self.calls
    }

    pub(crate) fn outputs(&self) -> &[Source] {
        &self.outputs
    }

    /// The shape a source gives.
    pub(crate) fn shape_of(&self, source: Source) -> &[usize] {
        match source {
            Source::Input(i) => &self.inputs[i].shape,
            Source::Call(c, k) => &self.calls[c].output_shapes[k],
        }
    }

    /// The name of the layer (or input) a source comes from.
    pub(crate) fn source_name(&self, source: Source) -> String {
        match source {
            Source::Input(i) => self.inputs[i].name.clone(),
            Source::Call(c, _) => self.layers[self.calls[c].layer].name.clone(),
        }
    }

    /// Keras's reference to a source in the "Connected to" column: `conv2d_1[0][0]`, the
    /// layer, which of its calls, which of that call's outputs.
    fn connection(&self, source: Source) -> String {
        let (call, output) = match source {
            Source::Input(_) => (0, 0),
            Source::Call(c, k) => (self.calls[c].index, k),
        };
        format!("{}[{call}][{output}]", self.source_name(source))
    }

    /// Whether the graph is a chain: one input, one output, every layer called once on what
    /// the call before it gave.
    fn is_chain(&self) -> bool {
        let follows = self.calls.iter().enumerate().all(|(c, call)| {
            let before = if c == 0 {
                Source::Input(0)
            } else {
                Source::Call(c - 1, 0)
            };
            call.inputs == [before]
        });
        self.inputs.len() == 1 && self.outputs.len() == 1 && follows
    }

    /// The summary rows: one per input, then one per layer in the order of first calls, with
    /// what each is connected to when the graph is not a chain.
    pub(crate) fn rows(&self, mut built: Vec<SummaryRow>) -> Vec<SummaryRow> {
        let chain = self.is_chain();
        let mut rows: Vec<SummaryRow> = self
            .inputs
            .iter()
            .map(|input| SummaryRow {
                name: input.name.clone(),
                kind: "input".into(),
                class_name: "InputLayer".into(),
                output_shape: input.shape.clone(),
                trainable: 0,
                non_trainable: 0,
                children: Vec::new(),
                connected_to: Vec::new(),
                more_output_shapes: Vec::new(),
            })
            .collect();
        if !chain {
            for call in &self.calls {
                let row = &mut built[call.layer];
                for &source in &call.inputs {
                    row.connected_to.push(self.connection(source));
                }
            }
        }
        rows.extend(built);
        rows
    }

    /// Two layers (or inputs) with one name are an error naming both.
    fn check_names(&self) -> Result<()> {
        let mut seen: HashMap<&str, String> = HashMap::new();
        let described = self
            .inputs
            .iter()
            .map(|i| (i.name.as_str(), "an Input".to_string()))
            .chain(
                self.layers
                    .iter()
                    .map(|l| (l.name.as_str(), format!("a {}", l.op.class_name()))),
            );
        for (name, what) in described {
            if let Some(before) = seen.insert(name, what.clone()) {
                return Err(Error::invalid(format!(
                    "two layers of the functional model are named `{name}` ({before} and \
                     {what}): names must be unique, since they name the variables; to call \
                     one layer or model several times with one set of variables, call it \
                     through `.shared()`"
                )));
            }
        }
        Ok(())
    }

    /// Builds the layers in `ctx` for inputs of `input_shapes`: the runnable graph and the
    /// summary rows.
    pub(crate) fn build_graph(
        &self,
        ctx: &mut BuildContext,
        input_shapes: &[Vec<usize>],
    ) -> Result<(GraphNet, Vec<SummaryRow>)> {
        let path = if ctx.path().is_empty() {
            "model".to_string()
        } else {
            ctx.path()
        };
        if input_shapes.len() != self.inputs.len() {
            return Err(Error::invalid(format!(
                "`{path}` has {} inputs but was given {}",
                self.inputs.len(),
                input_shapes.len()
            )));
        }
        for (input, shape) in self.inputs.iter().zip(input_shapes) {
            if input.shape != *shape {
                return Err(Error::Shape {
                    layer: format!("{path}: input `{}`", input.name),
                    expected: shape_with_batch(&input.shape),
                    got: shape_with_batch(shape),
                });
            }
        }
        GraphNet::build(self, ctx, path)
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

impl LayerSpec for Functional {
    fn kind(&self) -> &'static str {
        "functional"
    }

    fn class_name(&self) -> &'static str {
        "Functional"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        if self.inputs.len() != 1 || self.outputs.len() != 1 {
            return Err(Error::invalid(format!(
                "layer `{}`: a functional model with {} inputs and {} outputs is used where \
                 a layer of one input and one output is expected",
                ctx.path(),
                self.inputs.len(),
                self.outputs.len()
            )));
        }
        let (net, rows) = self.build_graph(ctx, &[input_shape.to_vec()])?;
        let output_shape = self.shape_of(self.outputs[0]).to_vec();
        Ok(Built::fast(net, output_shape, rows))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }

    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
}
