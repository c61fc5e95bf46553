//! When a replica's step (a training step, an evaluation, a prediction) runs eagerly, is
//! captured as a graph, or replays one ([`GraphSchedule`]), whatever captures it (`graph.rs`'s
//! CUDA graphs): the first [`WARMUP_STEPS`] steps of a batch shape run eagerly as warm-up, the
//! next one of the same shape is captured, and later steps of that shape replay the capture; a
//! step of another shape (an epoch's short last batch) runs eagerly, as does every step once a
//! capture has failed.

use std::marker::PhantomData;
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use crate::data::Batch;
use crate::{Error, Result};

/// Eager steps of a shape before its capture.
pub(crate) const WARMUP_STEPS: usize = 2;

/// What captures a step making an `O` and replays it.
pub(crate) trait StepCapture<O> {
    /// A captured step.
    type Captured;

    /// A warm-up step: `eager` on `batch`, with whatever the capture needs prepared meanwhile.
    fn warm_up(&self, batch: &Batch, eager: &dyn Fn(&Batch) -> Result<O>) -> Result<O>;

    /// The step `eager` makes on `batch`, captured and run once; on failure, why, with nothing
    /// run.
    fn capture(
        &self,
        batch: &Batch,
        eager: &dyn Fn(&Batch) -> Result<O>,
    ) -> std::result::Result<(Self::Captured, O), String>;

    /// The captured step on `batch`, of the shapes it was captured for.
    fn replay(&self, captured: &Self::Captured, batch: &Batch) -> Result<O>;

    /// Says that the step could not be captured and why; steps run eagerly from now on.
    fn fell_back(&self, reason: &str);
}

/// A replica's steps making an `O` through `C`: warmed up, captured, replayed, or eager.
pub(crate) struct GraphSchedule<O, C: StepCapture<O>> {
    capture: C,
    state: Mutex<State<C::Captured>>,
    output: PhantomData<fn() -> O>,
}

enum State<G> {
    /// Eager steps of `shapes`, `steps` of them so far.
    WarmingUp { shapes: BatchShapes, steps: usize },
    /// A step captured for batches of `shapes`.
    Captured { shapes: BatchShapes, step: G },
    /// Eager from now on: a capture failed, for this reason.
    Eager(String),
}

/// The shapes and dtypes of a batch's tensors (inputs, targets, weights), and whether it has
/// weights.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct BatchShapes(Vec<(Vec<usize>, DType)>, bool);

impl BatchShapes {
    fn of(batch: &Batch) -> Self {
        let tensors = tensors(batch).map(|t| (t.dims().to_vec(), t.dtype()));
        Self(tensors.collect(), batch.weights.is_some())
    }
}

/// A batch's tensors in order: inputs, targets, then the weights if any.
pub(crate) fn tensors(batch: &Batch) -> impl Iterator<Item = &Tensor> {
    batch
        .inputs
        .iter()
        .chain(&batch.targets)
        .chain(&batch.weights)
}

/// A batch of `tensors` laid out as `like`'s: its inputs, targets and weights, in that order.
pub(crate) fn batch_like(like: &Batch, tensors: Vec<Tensor>) -> Batch {
    let mut tensors = tensors.into_iter();
    Batch {
        inputs: tensors.by_ref().take(like.inputs.len()).collect(),
        targets: tensors.by_ref().take(like.targets.len()).collect(),
        weights: tensors.next(),
    }
}

impl<O, C: StepCapture<O>> GraphSchedule<O, C> {
    /// Steps captured by `capture`, none warmed up yet.
    pub(crate) fn new(capture: C) -> Self {
        Self {
            capture,
            state: Mutex::new(State::WarmingUp {
                shapes: BatchShapes::default(),
                steps: 0,
            }),
            output: PhantomData,
        }
    }

    /// The step's output for `batch`: a replay where a step of its shapes was captured, a
    /// warm-up or the capture itself while its shapes repeat, `eager` otherwise.
    pub(crate) fn step(&self, batch: &Batch, eager: &dyn Fn(&Batch) -> Result<O>) -> Result<O> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| Error::invalid("a replica's captured step was poisoned by a panic"))?;
        let shapes = BatchShapes::of(batch);
        match &mut *state {
            State::Eager(_) => eager(batch),
            State::Captured { shapes: s, step } if *s == shapes => self.capture.replay(step, batch),
            State::Captured { .. } => eager(batch),
            State::WarmingUp { shapes: s, steps } if *s != shapes || *steps < WARMUP_STEPS => {
                if *s != shapes {
                    *s = shapes;
                    *steps = 0;
                }
                *steps += 1;
                self.capture.warm_up(batch, eager)
            }
            State::WarmingUp { .. } => match self.capture.capture(batch, eager) {
                Ok((step, buffer)) => {
                    *state = State::Captured { shapes, step };
                    Ok(buffer)
                }
                Err(reason) => {
                    self.capture.fell_back(&reason);
                    *state = State::Eager(reason);
                    eager(batch)
                }
            },
        }
    }

    /// Where the steps stand: warming up, captured, or eager and why.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn describe(&self) -> String {
        match self.state.lock().as_deref() {
            Ok(State::WarmingUp { steps, .. }) => format!("warming up ({steps} eager steps)"),
            Ok(State::Captured { shapes, .. }) => format!("captured for {:?}", shapes.0),
            Ok(State::Eager(reason)) => format!("eager: {reason}"),
            Err(_) => "poisoned".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use candle_core::Device;

    use super::*;

    /// What the schedule asked for, in order.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Call {
        WarmUp(usize),
        Capture(usize),
        Replay(usize),
        Eager(usize),
        FellBack,
    }

    /// Records the schedule's calls; captures fail when `fail` says so.
    struct Recorder {
        calls: RefCell<Vec<Call>>,
        fail: bool,
    }

    impl StepCapture<Tensor> for Recorder {
        type Captured = usize;

        fn warm_up(
            &self,
            batch: &Batch,
            eager: &dyn Fn(&Batch) -> Result<Tensor>,
        ) -> Result<Tensor> {
            self.calls.borrow_mut().push(Call::WarmUp(batch.len()));
            eager(batch)
        }

        fn capture(
            &self,
            batch: &Batch,
            eager: &dyn Fn(&Batch) -> Result<Tensor>,
        ) -> std::result::Result<(usize, Tensor), String> {
            self.calls.borrow_mut().push(Call::Capture(batch.len()));
            if self.fail {
                return Err("a value read back".to_string());
            }
            Ok((batch.len(), eager(batch).map_err(|e| e.to_string())?))
        }

        fn replay(&self, captured: &usize, batch: &Batch) -> Result<Tensor> {
            assert_eq!(*captured, batch.len(), "a replay of another shape");
            self.calls.borrow_mut().push(Call::Replay(batch.len()));
            buffer(batch)
        }

        fn fell_back(&self, _: &str) {
            self.calls.borrow_mut().push(Call::FellBack);
        }
    }

    fn batch(n: usize) -> Result<Batch> {
        Ok(Batch::new(
            Tensor::zeros((n, 3), DType::F32, &Device::Cpu)?,
            Tensor::zeros(n, DType::U32, &Device::Cpu)?,
        ))
    }

    /// A step's output: the batch's size.
    fn buffer(batch: &Batch) -> Result<Tensor> {
        Ok(Tensor::new(&[batch.len() as f32], &Device::Cpu)?)
    }

    /// Runs steps of `sizes` and returns the calls the schedule made, the eager steps noted.
    fn run(sizes: &[usize], fail: bool) -> Result<(Vec<Call>, String)> {
        let schedule = GraphSchedule::new(Recorder {
            calls: RefCell::new(Vec::new()),
            fail,
        });
        for &n in sizes {
            let recorder = &schedule.capture;
            let eager = |b: &Batch| {
                recorder.calls.borrow_mut().push(Call::Eager(b.len()));
                buffer(b)
            };
            let out = schedule.step(&batch(n)?, &eager)?;
            assert_eq!(out.to_vec1::<f32>()?, [n as f32], "the step of {n}");
        }
        let calls = schedule.capture.calls.borrow().clone();
        Ok((calls, schedule.describe()))
    }

    /// The calls of the first steps of batches of `n`: two eager warm-ups, then the capture.
    fn warm_ups_and_capture(n: usize) -> [Call; 5] {
        use Call::*;
        [WarmUp(n), Eager(n), WarmUp(n), Eager(n), Capture(n)]
    }

    #[test]
    fn two_warm_ups_then_a_capture_then_replays_and_other_shapes_eager() -> Result<()> {
        use Call::*;
        let (calls, state) = run(&[8, 8, 8, 8, 5, 8], false)?;
        let after = [Eager(8), Replay(8), Eager(5), Replay(8)];
        assert_eq!(calls, [&warm_ups_and_capture(8)[..], &after].concat());
        assert!(
            state.starts_with("captured for [([8, 3], F32), ([8], U32)]"),
            "{state}"
        );
        Ok(())
    }

    #[test]
    fn a_new_shape_while_warming_up_starts_the_warm_up_again() -> Result<()> {
        use Call::*;
        let (calls, _) = run(&[8, 5, 5, 5, 5], false)?;
        let captured = calls.iter().position(|c| *c == Capture(5));
        assert_eq!(captured, Some(6), "{calls:?}");
        assert_eq!(calls.last(), Some(&Replay(5)));
        Ok(())
    }

    #[test]
    fn a_batch_of_copies_is_laid_out_as_the_batch_it_copies() -> Result<()> {
        let t = |n: usize| Tensor::zeros(n, DType::F32, &Device::Cpu);
        let like = Batch::from_parts(vec![t(4)?, t(4)?], vec![t(4)?])?.with_weights(t(4)?);
        let copies: Vec<Tensor> = (1..=4).map(t).collect::<candle_core::Result<_>>()?;
        let laid = batch_like(&like, copies);
        let dims = |ts: &[Tensor]| ts.iter().map(|t| t.dims()[0]).collect::<Vec<_>>();
        assert_eq!(dims(&laid.inputs), [1, 2]);
        assert_eq!(dims(&laid.targets), [3]);
        assert_eq!(laid.weights.map(|w| w.dims()[0]), Some(4));
        let shapes = BatchShapes::of(&like);
        assert_eq!(shapes.0.len(), 4);
        assert!(shapes.1);
        Ok(())
    }

    #[test]
    fn a_failed_capture_runs_the_step_and_every_later_one_eagerly() -> Result<()> {
        use Call::*;
        let (calls, state) = run(&[8, 8, 8, 8, 8], true)?;
        let after = [FellBack, Eager(8), Eager(8), Eager(8)];
        assert_eq!(calls, [&warm_ups_and_capture(8)[..], &after].concat());
        assert_eq!(state, "eager: a value read back");
        Ok(())
    }
}
