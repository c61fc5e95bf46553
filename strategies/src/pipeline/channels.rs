//! A stage's links to its neighbours in this process: channels between the stages' threads.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::stage_run::{Links, StageError};

/// A tensor of one micro-batch, sent between stages.
type Message = (usize, Tensor);

/// One stage's ends of the channels to the stage before and the stage after.
pub(crate) struct ChannelLinks {
    activations_in: Inbox,
    activations_out: Option<Sender<Message>>,
    gradients_in: Inbox,
    gradients_out: Option<Sender<Message>>,
}

impl ChannelLinks {
    /// The links of a chain of `stages` stages, in order.
    pub(crate) fn chain(stages: usize) -> Vec<ChannelLinks> {
        let mut links: Vec<ChannelLinks> = (0..stages)
            .map(|_| ChannelLinks {
                activations_in: Inbox::new(None),
                activations_out: None,
                gradients_in: Inbox::new(None),
                gradients_out: None,
            })
            .collect();
        for s in 1..stages {
            let (tx, rx) = mpsc::channel();
            links[s - 1].activations_out = Some(tx);
            links[s].activations_in = Inbox::new(Some(rx));
            let (tx, rx) = mpsc::channel();
            links[s].gradients_out = Some(tx);
            links[s - 1].gradients_in = Inbox::new(Some(rx));
        }
        links
    }
}

impl Links for ChannelLinks {
    fn has_previous(&self) -> bool {
        self.activations_in.receiver.is_some()
    }

    fn has_next(&self) -> bool {
        self.activations_out.is_some()
    }

    fn activation(&mut self, m: usize) -> Result<Tensor, StageError> {
        self.activations_in.take(m)
    }

    fn send_activation(&mut self, m: usize, y: Tensor) -> Result<(), StageError> {
        send(&self.activations_out, m, y)
    }

    fn gradient(&mut self, m: usize) -> Result<Tensor, StageError> {
        self.gradients_in.take(m)
    }

    fn send_gradient(&mut self, m: usize, dx: Tensor) -> Result<(), StageError> {
        send(&self.gradients_out, m, dx)
    }

    fn waited(&self) -> Duration {
        self.activations_in.waited + self.gradients_in.waited
    }
}

/// Sends micro-batch `m`'s tensor to a neighbour; a neighbour that has stopped stops this
/// stage too.
fn send(to: &Option<Sender<Message>>, m: usize, tensor: Tensor) -> Result<(), StageError> {
    match to {
        Some(tx) => tx
            .send((m, tensor))
            .map_err(|_| StageError::NeighbourStopped),
        None => Ok(()),
    }
}

/// The tensors a stage receives from one neighbour, taken by micro-batch.
struct Inbox {
    receiver: Option<Receiver<Message>>,
    early: HashMap<usize, Tensor>,
    waited: Duration,
}

impl Inbox {
    fn new(receiver: Option<Receiver<Message>>) -> Self {
        Self {
            receiver,
            early: HashMap::new(),
            waited: Duration::ZERO,
        }
    }

    /// Micro-batch `m`'s tensor, waiting for it (the time counted as waiting).
    fn take(&mut self, m: usize) -> Result<Tensor, StageError> {
        if let Some(t) = self.early.remove(&m) {
            return Ok(t);
        }
        let receiver = self.receiver.as_ref().ok_or(StageError::NeighbourStopped)?;
        let start = Instant::now();
        let found = loop {
            match receiver.recv() {
                Ok((got, t)) if got == m => break Ok(t),
                Ok((got, t)) => {
                    self.early.insert(got, t);
                }
                Err(_) => break Err(StageError::NeighbourStopped),
            }
        };
        self.waited += start.elapsed();
        found
    }
}
