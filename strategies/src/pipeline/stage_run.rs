//! One stage's part of a call, the same whether its neighbours are threads of this process
//! ([`super::channels`]) or other MPI ranks (`super::ranks`): its passes in its schedule's
//! order, each micro-batch's input taken from the stage before (or the batch), its output sent
//! on, its gradients taken from the stage after and its input's gradient sent back.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use kandle::data::Batch;
use kandle::strategy::{Replica, StepBuffer};
use kandle::Error;

use super::schedule::Pass;

/// How a stage reaches its neighbours: micro-batch `m`'s tensors in and out.
pub(crate) trait Links {
    /// Whether a stage comes before this one (else this stage takes the batch's inputs).
    fn has_previous(&self) -> bool;
    /// Whether a stage comes after this one (else this stage computes the loss).
    fn has_next(&self) -> bool;
    /// Micro-batch `m`'s input, from the stage before.
    fn activation(&mut self, m: usize) -> Result<Tensor, StageError>;
    /// Sends micro-batch `m`'s output to the stage after.
    fn send_activation(&mut self, m: usize, y: Tensor) -> Result<(), StageError>;
    /// The gradient of micro-batch `m`'s output, from the stage after.
    fn gradient(&mut self, m: usize) -> Result<Tensor, StageError>;
    /// Sends the gradient of micro-batch `m`'s input to the stage before.
    fn send_gradient(&mut self, m: usize, dx: Tensor) -> Result<(), StageError>;
    /// Time spent waiting for the neighbours so far.
    fn waited(&self) -> Duration;
}

/// What one stage's job is: the passes of a call's micro-batches.
pub(crate) struct StageJob {
    pub(crate) passes: Vec<Pass>,
    /// The micro-batches: inputs for the first stage, targets for the last (the others may
    /// get none).
    pub(crate) parts: Vec<Batch>,
    /// The samples of the batch the micro-batches split.
    pub(crate) samples: usize,
    pub(crate) work: Work,
}

/// What a job is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Work {
    /// A training step's gradients, as a step buffer.
    Step,
    /// Gradient accumulation: gradients kept for the next step.
    Accumulate,
    /// The loss and metric sums in inference mode.
    Evaluate,
    /// The outputs in inference mode.
    Predict,
}

impl Work {
    pub(crate) fn is_inference(self) -> bool {
        matches!(self, Work::Evaluate | Work::Predict)
    }
}

/// What one stage's job gives back.
pub(crate) enum Done {
    /// A step's buffer (every stage).
    Step(StepBuffer),
    /// Loss and metric sums (the last stage; zeros or nothing elsewhere).
    Sums(Vec<f64>),
    /// Each micro-batch's outputs, on the CPU (the last stage).
    Outputs(Vec<Vec<Tensor>>),
    Nothing,
}

/// A stage's result and how it spent its time.
pub(crate) struct StageDone {
    pub(crate) done: Done,
    pub(crate) busy: Duration,
    pub(crate) waiting: Duration,
    pub(crate) peak_in_flight: usize,
}

/// A stage's own error, or the end of a stage that stopped because a neighbour did.
pub(crate) enum StageError {
    Own(Error),
    NeighbourStopped,
}

impl From<Error> for StageError {
    fn from(e: Error) -> Self {
        StageError::Own(e)
    }
}

impl From<candle_core::Error> for StageError {
    fn from(e: candle_core::Error) -> Self {
        StageError::Own(e.into())
    }
}

/// Runs `job` on the stage `replica` holds, reaching its neighbours through `links`.
pub(crate) fn run_stage(
    replica: &Replica,
    job: StageJob,
    links: &mut dyn Links,
) -> Result<StageDone, StageError> {
    let start = Instant::now();
    let first = !links.has_previous();
    let last = !links.has_next();
    let input = |m: usize, links: &mut dyn Links| -> Result<Tensor, StageError> {
        match first {
            true => Ok(job.parts[m].inputs[0].clone()),
            false => links.activation(m),
        }
    };
    if job.work.is_inference() {
        let mut sums: Option<Vec<f64>> = None;
        let mut outputs = Vec::new();
        for pass in &job.passes {
            let Pass::Forward(m) = *pass else { continue };
            let x = input(m, links)?;
            if !last {
                links.send_activation(m, replica.stage_infer(&x)?)?;
                continue;
            }
            if job.work == Work::Predict {
                let ys = replica.predict(&[x])?;
                let on_cpu = ys.iter().map(|y| y.to_device(&Device::Cpu));
                outputs.push(on_cpu.collect::<candle_core::Result<Vec<_>>>()?);
                continue;
            }
            let part = &job.parts[m];
            let with_input = Batch {
                inputs: vec![x],
                targets: part.targets.clone(),
                weights: part.weights.clone(),
            };
            let stats = replica.evaluate(&with_input)?.to_dtype(DType::F64)?;
            let stats = stats.to_vec1::<f64>()?;
            sums = Some(match sums {
                Some(before) => before.iter().zip(&stats).map(|(a, b)| a + b).collect(),
                None => stats,
            });
        }
        let done = match (last, job.work) {
            (false, _) => Done::Nothing,
            (true, Work::Predict) => Done::Outputs(outputs),
            (true, _) => Done::Sums(sums.unwrap_or_default()),
        };
        return Ok(finished(done, start, links.waited(), 0));
    }
    let mut step = replica.begin_stage_step()?;
    for pass in &job.passes {
        match *pass {
            Pass::Forward(m) => {
                let x = input(m, links)?;
                match last {
                    true => {
                        if let Some(dx) = step.forward_loss_backward(&x, &job.parts[m])? {
                            links.send_gradient(m, dx)?;
                        }
                    }
                    false => {
                        let y = step.forward(m, &x)?;
                        links.send_activation(m, y)?;
                    }
                }
            }
            Pass::Backward(m) => {
                let dy = links.gradient(m)?;
                if let Some(dx) = step.backward(m, &dy)? {
                    links.send_gradient(m, dx)?;
                }
            }
        }
    }
    let peak = step.peak_in_flight();
    let done = match job.work {
        Work::Accumulate => Done::Sums(step.keep(job.samples)?),
        _ => Done::Step(step.finish(job.samples)?),
    };
    Ok(finished(done, start, links.waited(), peak))
}

fn finished(done: Done, start: Instant, waiting: Duration, peak_in_flight: usize) -> StageDone {
    StageDone {
        done,
        busy: start.elapsed().saturating_sub(waiting),
        waiting,
        peak_in_flight,
    }
}
