//! Symbolic tensors: what an [`Input`] and every layer call of a functional model give. Each
//! knows its shape and where it came from (the call that made it and that call's inputs), so
//! [`Functional::new`](super::Functional::new) can walk back from the outputs and record the
//! graph.
//!
//! A call computes its output shape at once, by building the layer for its input shape in a
//! throwaway context whose variables are zeros, so a shape the layer cannot take fails at the
//! call that gives it, naming the layer, as in Keras.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::graph::Functional;
use super::merge::Merge;
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
            Op::Graph(graph) => graph.name(),
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
/// several times does. Made by [`LayerSpecExt::shared`](crate::layers::LayerSpecExt::shared);
/// cloning it gives another handle on the same layer.
///
/// ```
/// use kandle::functional::{Functional, Input};
/// use kandle::layers::{Dense, LayerSpecExt};
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
