//! The built functional model: what a replica runs.
//!
//! The calls become steps over numbered slots (the inputs first, then one slot per step's
//! output). Calls that follow one another with nothing else taking the value between them run
//! as one chain, a [`SequentialNet`], so inside a graph a BatchNorm still absorbs its ReLU, a
//! convolution still folds the BatchNorm after it in inference, and the chain's recorded
//! backward pass hands each gradient straight down. A sum or an average absorbs the ReLU that
//! alone takes its output.
//!
//! The forward pass drops each value once its last taker has run. The backward pass walks the
//! steps last first: a value taken by several steps gets the first gradient as it is and adds
//! the others to it (a 1x1 convolution's kernel adds it while writing its own, where it is the
//! last to give one), so no gradient is zero-filled and then added to; an input of the model
//! gets no gradient unless the caller asks for one, so the first layer does not compute it.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::graph::{Functional, Source};
use super::merge::{MergeBackward, MergeLayer};
use super::symbolic::Op;
use crate::error::shape_with_batch;
use crate::kernels::concat::ConcatOutput;
use crate::layers::{
    build_child, check_input, missing_input_grad, Backward, BuildContext, ChannelAffine,
    ChannelSlot, FastPath, Identity, Layer, ParamGrads, Recorded, SequentialNet, SummaryRow,
};
use crate::{Error, Result};

/// A built functional model.
pub(crate) struct GraphNet {
    path: String,
    inputs: Vec<(String, Vec<usize>)>,
    steps: Vec<Step>,
    /// The slots of the outputs, in order.
    outputs: Vec<usize>,
    /// For each slot, how many steps take it (once per time they take it) and how many outputs
    /// it is.
    uses: Vec<usize>,
    /// In inference on the CPU, the concatenations whose every input is a chain's output that
    /// nothing else takes: each such chain writes its output straight into the
    /// concatenation's, so no input is copied (as `Concat` does).
    in_place: Vec<InPlace>,
    /// For each slot, whether a layer that trains computes it, itself or through the values it
    /// takes: without the inputs' gradients, only those slots need one.
    trained_below: Vec<bool>,
}

/// Where a step writes in inference when its output goes straight into a concatenation's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InPlace {
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
struct Step {
    run: StepRun,
    inputs: Vec<usize>,
    outputs: Vec<usize>,
    /// The first output's shape, without the batch axis.
    output_shape: Vec<usize>,
}

enum StepRun {
    Chain(SequentialNet),
    Merge(MergeLayer),
    /// A functional model called in this one, built in its own scope (one net for every call
    /// of a shared model).
    Graph(Arc<GraphNet>),
}

/// A chain while the graph is laid out: its layers with their full names (and whether each
/// trains), and its shapes.
struct ChainParts {
    layers: Vec<(String, Box<dyn FastPath>)>,
    trains: Vec<bool>,
    input_shape: Vec<usize>,
    output_shape: Vec<usize>,
}

enum PartsRun {
    Chain(ChainParts),
    Merge(MergeLayer),
    Graph(Arc<GraphNet>),
}

/// A step while the graph is laid out: what it runs, its input slots and its output slots.
struct Part {
    run: PartsRun,
    inputs: Vec<usize>,
    outputs: Vec<usize>,
}

/// A layer once built: owned by its one call, shared by several, a merge to make per call, or
/// a functional model (its calls share its variables).
enum BuiltLayer {
    Unique(Option<Box<dyn FastPath>>),
    Shared(Arc<dyn FastPath>),
    Merge(super::merge::Merge),
    Graph(Arc<GraphNet>),
}

impl GraphNet {
    /// Builds every layer of `graph` once in `ctx` (a shared layer too) and lays out the steps;
    /// returns the net and the summary rows.
    pub(crate) fn build(
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
                    let shapes: Vec<Vec<usize>> = first
                        .inputs
                        .iter()
                        .map(|&s| graph.shape_of(s).to_vec())
                        .collect();
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
        let net = Self::lay_out(graph, (built, &trains), &path, ctx.path(), kernels)?;
        Ok((net, graph.rows(rows)))
    }

    /// Turns the calls into steps, joining calls into chains where nothing else takes the
    /// value between them. `trains` says which layers have a trainable variable.
    fn lay_out(
        graph: &Functional,
        (mut built, trains): (Vec<BuiltLayer>, &[bool]),
        path: &str,
        scope: String,
        kernels: bool,
    ) -> Result<Self> {
        let calls = graph.calls();
        // How many calls take each call's output, and whether it is an output.
        let mut takers = vec![0usize; calls.len()];
        for source in calls
            .iter()
            .flat_map(|call| &call.inputs)
            .chain(graph.outputs())
        {
            if let Source::Call(p, _) = source {
                takers[*p] += 1;
            }
        }
        let inputs = graph.inputs().len();
        // The slot of each call's first output; a call's outputs have consecutive slots.
        let mut slot_of_call = vec![0usize; calls.len()];
        let mut step_of_slot: Vec<Option<usize>> = vec![None; inputs];
        let mut parts: Vec<Part> = Vec::new();
        let slot = |source: Source, slot_of_call: &[usize]| match source {
            Source::Input(i) => i,
            Source::Call(c, k) => slot_of_call[c] + k,
        };
        for (c, call) in calls.iter().enumerate() {
            let layer = &graph.layers()[call.layer];
            let full = match scope.is_empty() {
                true => layer.name.clone(),
                false => format!("{scope}.{}", layer.name),
            };
            let input_slots: Vec<usize> = call
                .inputs
                .iter()
                .map(|&s| slot(s, &slot_of_call))
                .collect();
            let run = match &mut built[call.layer] {
                BuiltLayer::Merge(merge) => {
                    let shapes: Vec<Vec<usize>> = call
                        .inputs
                        .iter()
                        .map(|&s| graph.shape_of(s).to_vec())
                        .collect();
                    PartsRun::Merge(MergeLayer::new(merge, &shapes, kernels))
                }
                BuiltLayer::Graph(net) => PartsRun::Graph(Arc::clone(net)),
                BuiltLayer::Unique(layer) => {
                    let layer = layer
                        .take()
                        .ok_or_else(|| Error::invalid(format!("layer `{full}` called twice")))?;
                    // The call extends the chain that gives its input when nothing else takes
                    // that value.
                    if let [Source::Call(p, 0)] = call.inputs[..] {
                        let step = step_of_slot[slot_of_call[p]];
                        if let (1, Some(step)) = (takers[p], step) {
                            if let PartsRun::Chain(chain) = &mut parts[step].run {
                                chain.layers.push((full, layer));
                                chain.trains.push(trains[call.layer]);
                                chain.output_shape = call.output_shapes[0].clone();
                                slot_of_call[c] = slot_of_call[p];
                                continue;
                            }
                        }
                    }
                    PartsRun::Chain(ChainParts {
                        layers: vec![(full, layer)],
                        trains: vec![trains[call.layer]],
                        input_shape: graph.shape_of(call.inputs[0]).to_vec(),
                        output_shape: call.output_shapes[0].clone(),
                    })
                }
                BuiltLayer::Shared(layer) => PartsRun::Chain(ChainParts {
                    layers: vec![(full, Box::new(SharedCall(Arc::clone(layer))))],
                    trains: vec![trains[call.layer]],
                    input_shape: graph.shape_of(call.inputs[0]).to_vec(),
                    output_shape: call.output_shapes[0].clone(),
                }),
            };
            let first = step_of_slot.len();
            let outputs: Vec<usize> = (first..first + call.output_shapes.len()).collect();
            step_of_slot.extend(outputs.iter().map(|_| Some(parts.len())));
            slot_of_call[c] = first;
            parts.push(Part {
                run,
                inputs: input_slots,
                outputs,
            });
        }
        let outputs: Vec<usize> = graph
            .outputs()
            .iter()
            .map(|&s| slot(s, &slot_of_call))
            .collect();
        let mut uses = vec![0usize; step_of_slot.len()];
        for &s in parts.iter().flat_map(|p| &p.inputs).chain(&outputs) {
            uses[s] += 1;
        }
        absorb_relus_after_merges(&mut parts, &uses);
        let mut shape_of_slot: Vec<Vec<usize>> = vec![Vec::new(); uses.len()];
        for (c, call) in calls.iter().enumerate() {
            for (k, shape) in call.output_shapes.iter().enumerate() {
                shape_of_slot[slot_of_call[c] + k] = shape.clone();
            }
        }
        let mut trained_below = vec![false; uses.len()];
        for part in &parts {
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
        let steps = parts
            .into_iter()
            .map(|part| {
                let run = match part.run {
                    PartsRun::Merge(merge) => StepRun::Merge(merge),
                    PartsRun::Graph(net) => StepRun::Graph(net),
                    PartsRun::Chain(chain) => StepRun::Chain(SequentialNet::chain(
                        chain.layers[0].0.clone(),
                        chain.input_shape,
                        chain.output_shape,
                        chain.layers,
                        chain.trains,
                    )),
                };
                Step {
                    run,
                    inputs: part.inputs,
                    output_shape: shape_of_slot[part.outputs[0]].clone(),
                    outputs: part.outputs,
                }
            })
            .collect::<Vec<_>>();
        let inputs = graph
            .inputs()
            .iter()
            .map(|i| (i.name.clone(), i.shape.clone()))
            .collect();
        let in_place = in_place_concatenations(&steps, &uses);
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

    /// Checks the inputs' number and shapes, naming the input that does not fit.
    fn check_inputs(&self, xs: &[Tensor]) -> Result<()> {
        if xs.len() != self.inputs.len() {
            return Err(Error::invalid(format!(
                "`{}` takes {} inputs, not {}",
                self.path,
                self.inputs.len(),
                xs.len()
            )));
        }
        for (x, (name, shape)) in xs.iter().zip(&self.inputs) {
            check_input(&format!("{}: input `{name}`", self.path), x, shape)?;
        }
        Ok(())
    }

    /// The step whose output is the only output and that nothing else takes, when it is a
    /// chain: the one that may give logits.
    fn logits_step(&self) -> Option<usize> {
        let [out] = self.outputs[..] else {
            return None;
        };
        if self.uses[out] != 1 {
            return None;
        }
        self.steps
            .iter()
            .rposition(|s| s.outputs == [out] && matches!(s.run, StepRun::Chain(_)))
    }

    /// Every step's inputs, taken from `slots`; a slot is dropped once its last taker has it.
    fn take_inputs(
        &self,
        step: &Step,
        slots: &mut [Option<Tensor>],
        left: &mut [usize],
    ) -> Result<Vec<Tensor>> {
        let mut xs = Vec::with_capacity(step.inputs.len());
        for &s in &step.inputs {
            let x = slots[s]
                .clone()
                .ok_or_else(|| Error::invalid(format!("`{}`: a value was used up", self.path)))?;
            xs.push(x);
        }
        for &s in &step.inputs {
            left[s] -= 1;
            if left[s] == 0 {
                slots[s] = None;
            }
        }
        Ok(xs)
    }

    fn start(&self, xs: &[Tensor]) -> Result<(Vec<Option<Tensor>>, Vec<usize>)> {
        self.check_inputs(xs)?;
        let mut slots: Vec<Option<Tensor>> = vec![None; self.uses.len()];
        for (slot, x) in slots.iter_mut().zip(xs) {
            *slot = Some(x.clone());
        }
        Ok((slots, self.uses.clone()))
    }

    /// The outputs, from the slots after the last step.
    fn finish(&self, slots: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        self.outputs
            .iter()
            .map(|&o| {
                slots[o]
                    .clone()
                    .ok_or_else(|| Error::invalid(format!("`{}`: an output is missing", self.path)))
            })
            .collect()
    }

    /// The outputs for the inputs `xs`, and with `with_logits` the logits of the only output
    /// where its last layer gives them.
    pub(crate) fn run(
        &self,
        xs: &[Tensor],
        train: bool,
        with_logits: bool,
    ) -> Result<(Vec<Tensor>, Option<Tensor>)> {
        let (mut slots, mut left) = self.start(xs)?;
        let logits_step = with_logits.then(|| self.logits_step()).flatten();
        let mut logits = None;
        let in_place = !train
            && xs
                .iter()
                .all(|x| x.device().is_cpu() && x.dtype() == DType::F32);
        let mut joined: Vec<Option<ConcatOutput>> = Vec::new();
        joined.resize_with(self.steps.len(), || None);
        for (i, step) in self.steps.iter().enumerate() {
            if in_place && self.in_place[i] == InPlace::Joined {
                let out = joined[i].take().ok_or_else(|| {
                    Error::invalid(format!("`{}`: a concatenation lost its output", self.path))
                })?;
                slots[step.outputs[0]] = Some(out.into_tensor()?);
                continue;
            }
            let xs = self.take_inputs(step, &mut slots, &mut left)?;
            if let (
                true,
                InPlace::Into {
                    merge,
                    offset,
                    channels,
                },
                StepRun::Chain(chain),
            ) = (in_place, self.in_place[i], &step.run)
            {
                let out = match &mut joined[merge] {
                    Some(out) => out,
                    empty => {
                        let mut dims = vec![xs[0].dim(0)?];
                        dims.extend(&self.steps[merge].output_shape);
                        empty.insert(ConcatOutput::new(&dims)?)
                    }
                };
                let mut slot = out.part(offset, channels)?;
                if !chain.forward_into(&xs[0], None, &mut slot)? {
                    slot.copy_from(&chain.forward_t(&xs[0], false)?)?;
                }
                continue;
            }
            let ys = match &step.run {
                StepRun::Chain(chain) if logits_step == Some(i) => {
                    let (y, l) = chain.forward_with_logits(&xs[0], train)?;
                    logits = l;
                    vec![y]
                }
                StepRun::Chain(chain) => vec![chain.forward_t(&xs[0], train)?],
                StepRun::Merge(merge) => vec![merge.forward(&xs)?],
                StepRun::Graph(net) => net.run(&xs, train, false)?.0,
            };
            for (&o, y) in step.outputs.iter().zip(ys) {
                slots[o] = Some(y);
            }
        }
        Ok((self.finish(&slots)?, logits))
    }

    /// The recorded training forward for the inputs `xs`: the outputs, the logits of the only
    /// output when asked for and given, and the backward pass. Without `input_grad` (the
    /// backward pass will not be asked for the inputs' gradients), the steps that no trainable
    /// layer computes run unrecorded and those whose input none computes record without their
    /// input's gradient.
    pub(crate) fn record(
        &self,
        xs: &[Tensor],
        with_logits: bool,
        input_grad: bool,
    ) -> Result<(Vec<Tensor>, Option<Tensor>, GraphBackward)> {
        let (mut slots, mut left) = self.start(xs)?;
        let logits_step = with_logits.then(|| self.logits_step()).flatten();
        let mut logits = None;
        let mut backwards = Vec::with_capacity(self.steps.len());
        for (i, step) in self.steps.iter().enumerate() {
            let xs = self.take_inputs(step, &mut slots, &mut left)?;
            let trained = step.outputs.iter().any(|&o| self.trained_below[o]);
            if !input_grad && !trained && logits_step != Some(i) {
                let ys = match &step.run {
                    StepRun::Chain(chain) => vec![chain.forward_t(&xs[0], true)?],
                    StepRun::Merge(merge) => vec![merge.forward(&xs)?],
                    StepRun::Graph(net) => net.run(&xs, true, false)?.0,
                };
                for (&o, y) in step.outputs.iter().zip(ys) {
                    slots[o] = Some(y);
                }
                let unrecorded = StepBackward::Unrecorded;
                backwards.push((step.inputs.clone(), step.outputs.clone(), unrecorded));
                continue;
            }
            let inputs_need = input_grad || step.inputs.iter().any(|&s| self.trained_below[s]);
            let (ys, backward) = match &step.run {
                StepRun::Chain(chain) => {
                    let logits_too = logits_step == Some(i);
                    let recorded = if !inputs_need {
                        chain.forward_recorded_without_input_grad(&xs[0], logits_too)?
                    } else if logits_too {
                        chain.forward_recorded_with_logits(&xs[0])?
                    } else {
                        chain.forward_recorded(&xs[0])?
                    };
                    logits = recorded.logits;
                    let name = chain.path().to_string();
                    (
                        vec![recorded.output],
                        StepBackward::Chain(name, recorded.backward),
                    )
                }
                StepRun::Merge(merge) => {
                    let (y, backward) = merge.record(&xs)?;
                    (vec![y], StepBackward::Merge(backward))
                }
                StepRun::Graph(net) => {
                    let (ys, _, backward) = net.record(&xs, false, inputs_need)?;
                    // An output nothing takes gets a zero gradient of its shape.
                    let shapes = ys
                        .iter()
                        .map(|y| (y.dims().to_vec(), y.dtype(), y.device().clone()))
                        .collect();
                    (ys, StepBackward::Graph(backward, shapes))
                }
            };
            for (&o, y) in step.outputs.iter().zip(ys) {
                slots[o] = Some(y);
            }
            backwards.push((step.inputs.clone(), step.outputs.clone(), backward));
        }
        let backward = GraphBackward {
            path: self.path.clone(),
            inputs: self.inputs.len(),
            slots: self.uses.len(),
            outputs: self.outputs.clone(),
            steps: backwards,
            trained_below: (!input_grad).then(|| self.trained_below.clone()),
        };
        let logits = if logits_step.is_some() { logits } else { None };
        Ok((self.finish(&slots)?, logits, backward))
    }
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

/// A step's recorded backward pass.
enum StepBackward {
    /// A chain's, with the chain's name for errors.
    Chain(String, Box<dyn Backward>),
    Merge(MergeBackward),
    /// A functional model's, with each output's dims, dtype and device (for a zero gradient
    /// where nothing took the output).
    Graph(GraphBackward, Vec<(Vec<usize>, DType, Device)>),
    /// A step that ran unrecorded: nothing it takes needs a gradient.
    Unrecorded,
}

/// A functional model's recorded backward pass.
pub(crate) struct GraphBackward {
    path: String,
    inputs: usize,
    slots: usize,
    outputs: Vec<usize>,
    /// Each step's input slots, output slots and backward pass, in the forward order.
    steps: Vec<(Vec<usize>, Vec<usize>, StepBackward)>,
    /// Recorded without the inputs' gradients: the slots that need a gradient.
    trained_below: Option<Vec<bool>>,
}

/// Adds `grad` to a slot's gradient: the first is taken as it is.
fn accumulate(slot: &mut Option<Tensor>, grad: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => grad,
        Some(sum) => sum.add(&grad)?,
    });
    Ok(())
}

impl GraphBackward {
    /// From the outputs' gradients `dys`, adds the variables' gradients to `grads` and, when
    /// `input_grad`, returns each input's gradient.
    pub(crate) fn backward(
        self,
        dys: Vec<Tensor>,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut g: Vec<Option<Tensor>> = vec![None; self.slots];
        for (&o, dy) in self.outputs.iter().zip(dys) {
            accumulate(&mut g[o], dy)?;
        }
        if let (true, Some(_)) = (input_grad, &self.trained_below) {
            return Err(Error::invalid(format!(
                "`{}` was recorded without its inputs' gradients, which its backward pass was \
                 then asked for",
                self.path
            )));
        }
        let trained_below = self.trained_below;
        let needs = |slot: usize| match &trained_below {
            Some(below) => below[slot],
            None => slot >= self.inputs || input_grad,
        };
        let no_gradient = || Error::invalid(format!("`{}`: a value got no gradient", self.path));
        // The values whose producer reads its output gradient as a range of a larger tensor's
        // channels in place: a concatenation hands them views of its gradient.
        let mut takes_view = vec![false; self.slots];
        for (_, outputs, backward) in &self.steps {
            if let (StepBackward::Chain(_, backward), &[o]) = (backward, &outputs[..]) {
                takes_view[o] = backward.takes_channel_views();
            }
        }
        for (inputs, outputs, backward) in self.steps.into_iter().rev() {
            if let StepBackward::Unrecorded = backward {
                for &o in &outputs {
                    g[o] = None;
                }
                continue;
            }
            if let StepBackward::Graph(backward, shapes) = backward {
                let dys = outputs
                    .iter()
                    .zip(shapes)
                    .map(|(&o, (dims, dtype, device))| match g[o].take() {
                        Some(dy) => Ok(dy),
                        None => Ok(Tensor::zeros(dims, dtype, &device)?),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let wanted = inputs.iter().any(|&s| needs(s));
                let dxs = backward.backward(dys, grads, wanted)?;
                for (&s, dx) in inputs.iter().zip(dxs) {
                    if let (true, Some(dx)) = (needs(s), dx) {
                        accumulate(&mut g[s], dx)?;
                    }
                }
                continue;
            }
            let dy = g[outputs[0]].take().ok_or_else(no_gradient)?;
            match backward {
                StepBackward::Chain(name, backward) => {
                    let s = inputs[0];
                    if !needs(s) {
                        backward.backward(dy, grads, false)?;
                    } else if g[s].is_some() && backward.adds_in_place() {
                        let sum = g[s].take().ok_or_else(|| missing_input_grad(&name))?;
                        g[s] = Some(backward.backward_adding(dy, grads, sum)?);
                    } else {
                        let dx = backward
                            .backward(dy, grads, true)?
                            .ok_or_else(|| missing_input_grad(&name))?;
                        accumulate(&mut g[s], dx)?;
                    }
                }
                StepBackward::Merge(backward) => {
                    let views = |i: usize| inputs.get(i).is_some_and(|&s| takes_view[s]);
                    for (s, dx) in inputs.iter().copied().zip(backward.backward(dy, views)?) {
                        if needs(s) {
                            accumulate(&mut g[s], dx)?;
                        }
                    }
                }
                StepBackward::Graph(..) | StepBackward::Unrecorded => return Err(no_gradient()),
            }
        }
        Ok(g.into_iter()
            .take(self.inputs)
            .map(|d| if input_grad { d } else { None })
            .collect())
    }
}

impl GraphNet {
    /// The only input's gradient from the only output's: the backward pass of the graph as a
    /// layer.
    fn layer_backward(backward: GraphBackward) -> impl Backward {
        move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
            let path = backward.path.clone();
            let mut dxs = backward.backward(vec![dy], grads, input_grad)?;
            match dxs.pop().flatten() {
                None if input_grad => Err(missing_input_grad(&path)),
                dx => Ok(dx),
            }
        }
    }

    fn record_as_layer(&self, x: &Tensor, with_logits: bool, input_grad: bool) -> Result<Recorded> {
        let (mut outputs, logits, backward) =
            self.record(std::slice::from_ref(x), with_logits, input_grad)?;
        let output = outputs
            .pop()
            .ok_or_else(|| Error::invalid(format!("`{}` has no output", self.path)))?;
        Ok(Recorded {
            output,
            logits,
            backward: Box::new(Self::layer_backward(backward)),
        })
    }

    fn only_output(&self, outputs: Vec<Tensor>) -> Result<Tensor> {
        outputs
            .into_iter()
            .next()
            .ok_or_else(|| Error::invalid(format!("`{}` has no output", self.path)))
    }
}

/// A graph with one input and one output is a layer.
impl Layer for GraphNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let (outputs, _) = self.run(std::slice::from_ref(x), train, false)?;
        self.only_output(outputs)
    }

    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        let (outputs, logits) = self.run(std::slice::from_ref(x), train, true)?;
        Ok((self.only_output(outputs)?, logits))
    }
}

impl FastPath for GraphNet {
    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
        self.record_as_layer(x, false, true)
    }

    fn forward_recorded_with_logits(&self, x: &Tensor) -> Result<Recorded> {
        self.record_as_layer(x, true, true)
    }

    fn forward_recorded_without_input_grad(
        &self,
        x: &Tensor,
        with_logits: bool,
    ) -> Result<Recorded> {
        self.record_as_layer(x, with_logits, false)
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
    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
        self.0.forward_recorded(x)
    }

    fn forward_recorded_with_logits(&self, x: &Tensor) -> Result<Recorded> {
        self.0.forward_recorded_with_logits(x)
    }

    fn is_relu(&self) -> bool {
        self.0.is_relu()
    }

    fn inference_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        self.0.inference_affine(like)
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
