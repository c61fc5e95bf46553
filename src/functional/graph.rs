//! The recorded graph: a functional model's recipe, as Keras's functional
//! `keras.Model(inputs, outputs)` keeps it.
//!
//! [`Functional`] holds the model's inputs, its layers (each named, and each a recipe, a merge or
//! a functional model: an [`Op`]), its calls in an order where each comes after the calls whose
//! outputs it takes, and its outputs; it answers what the shapes and names are and what the
//! summary's "Connected to" column says. It holds no symbolic tensor: it is `Clone`,
//! device-free and built like any other recipe, once per replica. `symbolic` records it from
//! symbolic tensors ([`Functional::new`]); `layout` builds it into the net a replica runs.

use std::collections::HashMap;

use super::merge::Merge;
use crate::error::shape_with_batch;
use crate::layers::{LayerSpec, SummaryRow};
use crate::{Error, Result};

/// A model recipe made of layer calls on symbolic tensors, from its inputs to its outputs: the
/// functional API. Residual connections, several inputs or outputs and shared layers are
/// written as Keras writes them; with one input and one output the recipe is also a layer,
/// which a `Sequential` or another functional model can hold, and any functional model is
/// called on several tensors inside another with [`Functional::call_on`].
///
/// ```
/// use kandle::functional::{add, Functional, Input, LayerCall};
/// use kandle::layers::{Activation, Conv2D, Dense, GlobalAveragePooling2D, Padding};
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Source {
    /// The model's input `i`.
    Input(usize),
    /// Output `k` of call `i`: `Call(i, k)`.
    Call(usize, usize),
}

/// A graph layer's operation.
#[derive(Clone)]
pub(crate) enum Op {
    /// A recipe called on one tensor.
    Spec(Box<dyn LayerSpec>),
    /// A merge of several tensors.
    Merge(Merge),
    /// A functional model called on its inputs, giving its outputs.
    Graph(Box<Functional>),
}

impl Op {
    pub(crate) fn name(&self) -> Option<&str> {
        match self {
            Op::Spec(spec) => spec.name(),
            Op::Merge(merge) => merge.name(),
            Op::Graph(graph) => graph.given_name(),
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Op::Spec(spec) => spec.kind(),
            Op::Merge(merge) => merge.kind(),
            Op::Graph(graph) => graph.kind(),
        }
    }

    pub(crate) fn class_name(&self) -> &'static str {
        match self {
            Op::Spec(spec) => spec.class_name(),
            Op::Merge(merge) => merge.class_name(),
            Op::Graph(graph) => graph.class_name(),
        }
    }
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
    /// The graph of `inputs`, `layers`, `calls` (each after the calls whose outputs it takes)
    /// and `outputs`, unnamed. Two layers (or inputs) with one name are an error naming both.
    pub(super) fn from_parts(
        inputs: Vec<GraphInput>,
        layers: Vec<GraphLayerSpec>,
        calls: Vec<GraphCall>,
        outputs: Vec<Source>,
    ) -> Result<Self> {
        let graph = Self {
            name: None,
            inputs,
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
        self.shapes_of(&self.outputs)
    }

    /// The name given with [`Self::named`], if any.
    pub(super) fn given_name(&self) -> Option<&str> {
        self.name.as_deref()
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

    /// The shapes `sources` give, in order.
    pub(crate) fn shapes_of(&self, sources: &[Source]) -> Vec<Vec<usize>> {
        sources.iter().map(|&s| self.shape_of(s).to_vec()).collect()
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
}
