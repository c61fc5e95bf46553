//! Laying a functional model out: what a replica runs.
//!
//! Every layer of the recorded graph is built once (a shared layer too, its calls holding one
//! layer; a called functional model as a nested net in its own scope). The calls become steps
//! over numbered slots (the inputs first, then one slot per step's output). Calls that follow
//! one another with nothing else taking the value between them run as one chain, a
//! [`SequentialNet`], so inside a graph a BatchNorm still absorbs its ReLU, a convolution still
//! folds the BatchNorm after it in inference, and the chain's recorded backward pass hands each
//! gradient straight down. A sum or an average absorbs the ReLU that alone takes its output.
//! Each slot knows whether a layer that trains computes it, and in inference on the CPU a
//! concatenation whose inputs are chains' outputs has them written straight into its own.

use std::sync::Arc;

use candle_core::Tensor;

use super::graph::{Functional, Op, Source};
use super::merge::{Merge, MergeLayer};
use crate::error::shape_with_batch;
use crate::layers::{
    build_child, BuildContext, Built, ChannelAffine, ChannelSlot, FastPath, Identity, Layer,
    LayerSpec, RecordRequest, Recorded, SequentialNet, Summary, SummaryRow,
};
use crate::{Error, Result};

/// A built functional model.
pub(crate) struct GraphNet {
    pub(super) path: String,
    pub(super) inputs: Vec<(String, Vec<usize>)>,
    pub(super) steps: Vec<Step>,
    /// The slots of the outputs, in order.
    pub(super) outputs: Vec<usize>,
    /// For each slot, how many steps take it (once per time they take it) and how many outputs
    /// it is.
    pub(super) uses: Vec<usize>,
    /// In inference on the CPU, the concatenations whose every input is a chain's output that
    /// nothing else takes: each such chain writes its output straight into the
    /// concatenation's, so no input is copied (as `Concat` does).
    pub(super) in_place: Vec<InPlace>,
    /// For each slot, whether a layer that trains computes it, itself or through the values it
    /// takes: without the inputs' gradients, only those slots need one.
    pub(super) trained_below: Vec<bool>,
}

/// Where a step writes in inference when its output goes straight into a concatenation's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum InPlace {
    /// It gives its output as a value.
    No,
    /// It writes `channels` channels from `offset` of the output of concatenation `merge`.
    Into {
        merge: usize,
        offset: usize,
        channels: usize,
    },
    /// A concatenation whose inputs were written into its output.
    Joined,
}

/// A step: a chain of layers, a merge or a functional model, from its input slots to its
/// output slots (one, or a functional model's outputs).
pub(super) struct Step {
    pub(super) run: StepRun,
    pub(super) inputs: Vec<usize>,
    pub(super) outputs: Vec<usize>,
    /// The first output's shape, without the batch axis.
    pub(super) output_shape: Vec<usize>,
}

pub(super) enum StepRun {
    Chain(SequentialNet),
    Merge(MergeLayer),
    /// A functional model called in this one, built in its own scope (one net for every call
    /// of a shared model).
    Graph(Arc<GraphNet>),
}

impl Functional {
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
            stages: Vec::new(),
        })
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
        if input_shapes.len() != self.inputs().len() {
            return Err(Error::invalid(format!(
                "`{path}` has {} inputs but was given {}",
                self.inputs().len(),
                input_shapes.len()
            )));
        }
        for (input, shape) in self.inputs().iter().zip(input_shapes) {
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

impl LayerSpec for Functional {
    fn kind(&self) -> &'static str {
        "functional"
    }

    fn class_name(&self) -> &'static str {
        "Functional"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        if self.inputs().len() != 1 || self.outputs().len() != 1 {
            return Err(Error::invalid(format!(
                "layer `{}`: a functional model with {} inputs and {} outputs is used where \
                 a layer of one input and one output is expected",
                ctx.path(),
                self.inputs().len(),
                self.outputs().len()
            )));
        }
        let (net, rows) = self.build_graph(ctx, &[input_shape.to_vec()])?;
        let output_shape = self.shape_of(self.outputs()[0]).to_vec();
        Ok(Built::fast(net, output_shape, rows))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }

    fn name(&self) -> Option<&str> {
        self.given_name()
    }
}

impl GraphNet {
    /// Builds every layer of `graph` once in `ctx` (a shared layer too) and lays out the steps;
    /// returns the net and the summary rows.
    fn build(
        graph: &Functional,
        ctx: &mut BuildContext,
        path: String,
    ) -> Result<(Self, Vec<SummaryRow>)> {
        let kernels = ctx.compute_path().uses_kernels();
        let mut built = Vec::with_capacity(graph.layers().len());
        let mut trains = vec![false; graph.layers().len()];
        let mut rows = Vec::with_capacity(graph.layers().len());
        for (l, layer) in graph.layers().iter().enumerate() {
            let first =
                graph.calls().iter().find(|c| c.layer == l).ok_or_else(|| {
                    Error::invalid(format!("layer `{}` is never called", layer.name))
                })?;
            match &layer.op {
                Op::Spec(spec) => {
                    let shape = graph.shape_of(first.inputs[0]);
                    let child = build_child(ctx, spec.as_ref(), &layer.name, shape)?;
                    if first.output_shapes[..] != *std::slice::from_ref(&child.output_shape) {
                        return Err(Error::invalid(format!(
                            "layer `{}` gives {} when built but {} when called",
                            layer.name,
                            shape_with_batch(&child.output_shape),
                            shape_with_batch(&first.output_shapes[0])
                        )));
                    }
                    rows.push(child.row);
                    trains[l] = child.trains;
                    built.push(match layer.calls {
                        1 => BuiltLayer::Unique(Some(child.layer)),
                        _ => BuiltLayer::Shared(Arc::from(child.layer)),
                    });
                }
                Op::Merge(merge) => {
                    rows.push(SummaryRow {
                        name: layer.name.clone(),
                        kind: layer.op.kind().to_string(),
                        class_name: layer.op.class_name().to_string(),
                        output_shape: first.output_shapes[0].clone(),
                        trainable: 0,
                        non_trainable: 0,
                        children: Vec::new(),
                        connected_to: Vec::new(),
                        more_output_shapes: Vec::new(),
                    });
                    built.push(BuiltLayer::Merge(merge.clone()));
                }
                Op::Graph(inner) => {
                    let shapes = graph.shapes_of(&first.inputs);
                    let (net, children) =
                        ctx.scoped(&layer.name, |ctx| inner.build_graph(ctx, &shapes))?;
                    let (trainable, non_trainable) = ctx.count_in(&layer.name);
                    trains[l] = trainable > 0;
                    rows.push(SummaryRow {
                        name: layer.name.clone(),
                        kind: layer.op.kind().to_string(),
                        class_name: layer.op.class_name().to_string(),
                        output_shape: first.output_shapes[0].clone(),
                        trainable,
                        non_trainable,
                        children,
                        connected_to: Vec::new(),
                        more_output_shapes: first.output_shapes[1..].to_vec(),
                    });
                    built.push(BuiltLayer::Graph(Arc::new(net)));
                }
            }
        }
        let net = Self::lay_out(graph, built, &trains, &path, ctx.path(), kernels)?;
        Ok((net, graph.rows(rows)))
    }

    /// Turns the calls into steps, joining calls into chains where nothing else takes the
    /// value between them. `trains` says which layers have a trainable variable.
    fn lay_out(
        graph: &Functional,
        mut built: Vec<BuiltLayer>,
        trains: &[bool],
        path: &str,
        scope: String,
        kernels: bool,
    ) -> Result<Self> {
        let takers = count_takers(graph);
        let groups = join_chains(graph, &built, &takers);
        let slots = assign_slots(graph, &groups);
        let mut parts = make_parts(graph, &groups, &slots, &mut built, trains, &scope, kernels)?;
        let outputs: Vec<usize> = graph.outputs().iter().map(|&s| slots.of(s)).collect();
        let uses = count_uses(&parts, &outputs, slots.count);
        absorb_relus_after_merges(&mut parts, &uses);
        let trained_below = mark_trained(&parts, slots.count);
        let steps = build_steps(parts);
        let in_place = in_place_concatenations(&steps, &uses);
        let inputs = graph
            .inputs()
            .iter()
            .map(|i| (i.name.clone(), i.shape.clone()))
            .collect();
        Ok(Self {
            path: path.to_string(),
            inputs,
            steps,
            outputs,
            uses,
            in_place,
            trained_below,
        })
    }
}

/// A chain while the graph is laid out: its layers with their full names (and whether each
/// trains), and its input shape.
struct ChainParts {
    layers: Vec<(String, Box<dyn FastPath>)>,
    trains: Vec<bool>,
    input_shape: Vec<usize>,
}

enum PartsRun {
    Chain(ChainParts),
    Merge(MergeLayer),
    Graph(Arc<GraphNet>),
}

/// A step while the graph is laid out: what it runs, its input slots, its output slots and
/// the first output's shape.
struct Part {
    run: PartsRun,
    inputs: Vec<usize>,
    outputs: Vec<usize>,
    output_shape: Vec<usize>,
}

/// A layer once built: owned by its one call, shared by several, a merge to make per call, or
/// a functional model (its calls share its variables).
enum BuiltLayer {
    Unique(Option<Box<dyn FastPath>>),
    Shared(Arc<dyn FastPath>),
    Merge(Merge),
    Graph(Arc<GraphNet>),
}

impl BuiltLayer {
    /// Whether a call of the layer runs as (the start of) a chain: a layer's only call, or a
    /// call of a shared layer.
    fn chains(&self) -> bool {
        matches!(self, BuiltLayer::Unique(_) | BuiltLayer::Shared(_))
    }

    /// The layer as a chain runs it, for its call named `full`: the layer itself from its one
    /// call, a [`SharedCall`] from each call of a shared one.
    fn chain_layer(&mut self, full: &str) -> Result<Box<dyn FastPath>> {
        match self {
            BuiltLayer::Unique(layer) => layer
                .take()
                .ok_or_else(|| Error::invalid(format!("layer `{full}` called twice"))),
            BuiltLayer::Shared(layer) => Ok(Box::new(SharedCall(Arc::clone(layer)))),
            BuiltLayer::Merge(_) | BuiltLayer::Graph(_) => Err(Error::invalid(format!(
                "layer `{full}` is not one a chain runs"
            ))),
        }
    }
}

/// Where each call writes: the slot of its first output, after the model's inputs' slots. A
/// call's outputs have consecutive slots; the calls of one chain share the chain's.
struct Slots {
    of_call: Vec<usize>,
    count: usize,
}

impl Slots {
    /// The slot a source is read from.
    fn of(&self, source: Source) -> usize {
        match source {
            Source::Input(i) => i,
            Source::Call(c, k) => self.of_call[c] + k,
        }
    }
}

/// How many calls take each call's output, and whether it is an output.
fn count_takers(graph: &Functional) -> Vec<usize> {
    let mut takers = vec![0usize; graph.calls().len()];
    for source in graph
        .calls()
        .iter()
        .flat_map(|call| &call.inputs)
        .chain(graph.outputs())
    {
        if let Source::Call(p, _) = source {
            takers[*p] += 1;
        }
    }
    takers
}

/// The calls grouped into steps, in the order of each step's first call. A layer's only call
/// joins the chain that gives its input when nothing else takes that value; every other call
/// (a merge, a functional model, a shared layer's call, or a call on a value that several take)
/// starts a step of its own.
fn join_chains(graph: &Functional, built: &[BuiltLayer], takers: &[usize]) -> Vec<Vec<usize>> {
    let calls = graph.calls();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of_call = Vec::with_capacity(calls.len());
    for (c, call) in calls.iter().enumerate() {
        let only_call = matches!(built[call.layer], BuiltLayer::Unique(_));
        let joins = |p: usize| only_call && takers[p] == 1 && built[calls[p].layer].chains();
        let group = match call.inputs[..] {
            [Source::Call(p, 0)] if joins(p) => group_of_call[p],
            _ => {
                groups.push(Vec::new());
                groups.len() - 1
            }
        };
        groups[group].push(c);
        group_of_call.push(group);
    }
    groups
}

/// Numbers the slots: the model's inputs first, then each step's outputs in step order.
fn assign_slots(graph: &Functional, groups: &[Vec<usize>]) -> Slots {
    let calls = graph.calls();
    let mut of_call = vec![0usize; calls.len()];
    let mut count = graph.inputs().len();
    for group in groups {
        for &c in group {
            of_call[c] = count;
        }
        count += calls[group[0]].output_shapes.len();
    }
    Slots { of_call, count }
}

/// Each step's layers, taken from `built` (with whether each trains, from `trains`): a chain
/// of the calls of a group, each named under `scope`, or a merge (with kandle's channel
/// kernels where `kernels`) or a functional model.
fn make_parts(
    graph: &Functional,
    groups: &[Vec<usize>],
    slots: &Slots,
    built: &mut [BuiltLayer],
    trains: &[bool],
    scope: &str,
    kernels: bool,
) -> Result<Vec<Part>> {
    let calls = graph.calls();
    let mut parts = Vec::with_capacity(groups.len());
    for group in groups {
        let (first, last) = (&calls[group[0]], &calls[group[group.len() - 1]]);
        let run = match &built[first.layer] {
            BuiltLayer::Merge(merge) => {
                let shapes = graph.shapes_of(&first.inputs);
                PartsRun::Merge(MergeLayer::new(merge, &shapes, kernels))
            }
            BuiltLayer::Graph(net) => PartsRun::Graph(Arc::clone(net)),
            BuiltLayer::Unique(_) | BuiltLayer::Shared(_) => {
                let mut chain = ChainParts {
                    layers: Vec::with_capacity(group.len()),
                    trains: Vec::with_capacity(group.len()),
                    input_shape: graph.shape_of(first.inputs[0]).to_vec(),
                };
                for &c in group {
                    let layer = calls[c].layer;
                    let name = &graph.layers()[layer].name;
                    let full = match scope.is_empty() {
                        true => name.clone(),
                        false => format!("{scope}.{name}"),
                    };
                    let fast = built[layer].chain_layer(&full)?;
                    chain.layers.push((full, fast));
                    chain.trains.push(trains[layer]);
                }
                PartsRun::Chain(chain)
            }
        };
        let start = slots.of_call[group[0]];
        parts.push(Part {
            run,
            inputs: first.inputs.iter().map(|&s| slots.of(s)).collect(),
            outputs: (start..start + first.output_shapes.len()).collect(),
            output_shape: last.output_shapes[0].clone(),
        });
    }
    Ok(parts)
}

/// For each of `count` slots, how many steps take it (once per time they take it) and how
/// many of `outputs` it is.
fn count_uses(parts: &[Part], outputs: &[usize], count: usize) -> Vec<usize> {
    let mut uses = vec![0usize; count];
    for &s in parts.iter().flat_map(|p| &p.inputs).chain(outputs) {
        uses[s] += 1;
    }
    uses
}

/// For each of `count` slots, whether a layer that trains computes it, itself or through the
/// values it takes.
fn mark_trained(parts: &[Part], count: usize) -> Vec<bool> {
    let mut trained_below = vec![false; count];
    for part in parts {
        let trains = match &part.run {
            PartsRun::Chain(chain) => chain.trains.contains(&true),
            PartsRun::Graph(net) => net.trained_below.iter().any(|&t| t),
            PartsRun::Merge(_) => false,
        };
        let below = trains || part.inputs.iter().any(|&s| trained_below[s]);
        for &o in &part.outputs {
            trained_below[o] = below;
        }
    }
    trained_below
}

/// The steps the parts make: each chain's layers become one [`SequentialNet`], named after its
/// first layer.
fn build_steps(parts: Vec<Part>) -> Vec<Step> {
    parts
        .into_iter()
        .map(|part| {
            let run = match part.run {
                PartsRun::Merge(merge) => StepRun::Merge(merge),
                PartsRun::Graph(net) => StepRun::Graph(net),
                PartsRun::Chain(chain) => StepRun::Chain(SequentialNet::chain(
                    chain.layers[0].0.clone(),
                    chain.input_shape,
                    part.output_shape.clone(),
                    chain.layers,
                    chain.trains,
                )),
            };
            Step {
                run,
                inputs: part.inputs,
                outputs: part.outputs,
                output_shape: part.output_shape,
            }
        })
        .collect()
}

/// Which steps write straight into a concatenation's output in inference: the chains whose
/// output only a concatenation takes, where every input of that concatenation is such a chain's.
fn in_place_concatenations(steps: &[Step], uses: &[usize]) -> Vec<InPlace> {
    let mut in_place = vec![InPlace::No; steps.len()];
    for (m, step) in steps.iter().enumerate() {
        let StepRun::Merge(merge) = &step.run else {
            continue;
        };
        let mut writers = Vec::with_capacity(step.inputs.len());
        for (i, &slot) in step.inputs.iter().enumerate() {
            let writer = steps.iter().position(|s| s.outputs == [slot]);
            match (writer, merge.channel_slot(i)) {
                (Some(w), Some((offset, channels)))
                    if uses[slot] == 1 && matches!(steps[w].run, StepRun::Chain(_)) =>
                {
                    writers.push((w, offset, channels));
                }
                _ => break,
            }
        }
        if writers.len() != step.inputs.len() {
            continue;
        }
        for (w, offset, channels) in writers {
            in_place[w] = InPlace::Into {
                merge: m,
                offset,
                channels,
            };
        }
        in_place[m] = InPlace::Joined;
    }
    in_place
}

/// Lets a sum or an average absorb the ReLU that alone takes its output: the chain that takes
/// it then starts with an [`Identity`].
fn absorb_relus_after_merges(parts: &mut [Part], uses: &[usize]) {
    for m in 0..parts.len() {
        let (PartsRun::Merge(_), &[out]) = (&parts[m].run, &parts[m].outputs[..]) else {
            continue;
        };
        if uses[out] != 1 {
            continue;
        }
        let Some(t) = parts.iter().position(|p| p.inputs.contains(&out)) else {
            continue;
        };
        let starts_with_relu = match &parts[t].run {
            PartsRun::Chain(chain) => chain.layers[0].1.is_relu(),
            PartsRun::Merge(_) | PartsRun::Graph(_) => false,
        };
        if !starts_with_relu {
            continue;
        }
        let fused = match &mut parts[m].run {
            PartsRun::Merge(merge) => merge.fuse_relu(),
            PartsRun::Chain(_) | PartsRun::Graph(_) => false,
        };
        if let (true, PartsRun::Chain(chain)) = (fused, &mut parts[t].run) {
            chain.layers[0].1 = Box::new(Identity);
        }
    }
}

/// One call of a layer that several calls share: the layer's fast path, without fusing a ReLU
/// into it (another call may not be followed by one).
struct SharedCall(Arc<dyn FastPath>);

impl Layer for SharedCall {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.0.forward_t(x, train)
    }

    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        self.0.forward_with_logits(x, train)
    }
}

impl FastPath for SharedCall {
    /// Records the shared layer with its input's gradient, whatever the request says.
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        let request = RecordRequest {
            input_grad: true,
            ..request
        };
        self.0.forward_recorded(x, request)
    }

    fn is_relu(&self) -> bool {
        self.0.is_relu()
    }

    fn inference_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        self.0.inference_affine(like)
    }

    fn frozen_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        self.0.frozen_affine(like)
    }

    fn forward_frozen(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward_frozen(x)
    }

    fn forward_then_affine(&self, x: &Tensor, affine: &ChannelAffine) -> Result<Option<Tensor>> {
        self.0.forward_then_affine(x, affine)
    }

    fn forward_into(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
        slot: &mut ChannelSlot<'_>,
    ) -> Result<bool> {
        self.0.forward_into(x, affine, slot)
    }

    fn passes_through(&self) -> bool {
        self.0.passes_through()
    }
}
