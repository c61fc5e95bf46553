//! The backward pass of a laid-out functional model.
//!
//! It walks the recorded steps last first: a value taken by several steps gets the first
//! gradient as it is and adds the others to it (a 1x1 convolution's kernel adds it while
//! writing its own, where it is the last to give one), so no gradient is zero-filled and then
//! added to; a step that ran unrecorded gets none, an output nothing took gets zeros, and an
//! input of the model gets no gradient unless the caller asks for one, so the first layer does
//! not compute it.

use candle_core::{DType, Device, Tensor};

use super::merge::MergeBackward;
use crate::layers::{missing_input_grad, Backward, ParamGrads};
use crate::{Error, Result};

/// A step's recorded backward pass.
pub(super) enum StepBackward {
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
    pub(super) path: String,
    pub(super) inputs: usize,
    pub(super) slots: usize,
    pub(super) outputs: Vec<usize>,
    /// Each step's input slots, output slots and backward pass, in the forward order.
    pub(super) steps: Vec<(Vec<usize>, Vec<usize>, StepBackward)>,
    /// Recorded without the inputs' gradients: the slots that need a gradient.
    pub(super) trained_below: Option<Vec<bool>>,
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
