//! Running a laid-out functional model: its forward pass, and its recorded training forward.
//!
//! The forward pass drops each value once its last taker has run; in inference on the CPU, the
//! chains that feed a concatenation write straight into its output. The recorded pass keeps
//! each step's backward pass for [`GraphBackward`]; the steps that no trainable layer computes
//! run unrecorded, where no one asks for the inputs' gradients. A graph of one input and one
//! output is also a layer.

use candle_core::{DType, Tensor};

use super::backward::{GraphBackward, StepBackward};
use super::layout::{GraphNet, InPlace, Step, StepRun};
use crate::kernels::concat::ConcatOutput;
use crate::layers::{
    check_input, missing_input_grad, Backward, FastPath, Layer, ParamGrads, RecordRequest, Recorded,
};
use crate::{Error, Result};

impl GraphNet {
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
                    StepRun::Chain(chain) => vec![chain.forward_frozen(&xs[0])?],
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
                    let request = RecordRequest {
                        logits: logits_step == Some(i),
                        input_grad: inputs_need,
                    };
                    let recorded = chain.forward_recorded(&xs[0], request)?;
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

    fn record_as_layer(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        let (mut outputs, logits, backward) =
            self.record(std::slice::from_ref(x), request.logits, request.input_grad)?;
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
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        self.record_as_layer(x, request)
    }
}
