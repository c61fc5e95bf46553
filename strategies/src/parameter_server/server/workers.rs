//! What a server knows of each worker: where it is in the call ([`Position`]), when it was
//! last heard from, and what it sent that waits for every other worker's ([`Contribution`]);
//! and from that, which workers the server waits on and which wait on it.

use std::time::{Duration, Instant};

use crate::parameter_server::protocol::{EpochTotals, LoadPart, StepTotals};

/// Where a worker is, as a server sees it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Position {
    /// Not training on this server's weights (evaluating, at an epoch's end, between steps of
    /// another kind).
    Idle,
    /// Computing a step on the weights of version `base`.
    Outstanding {
        /// The version it computes on.
        base: u64,
    },
    /// Its push of a step on version `base` waits to be applied.
    Pending {
        /// The version it computed on.
        base: u64,
    },
    /// Waiting for the other workers to end the epoch (server 0 answers), with its totals of
    /// the epoch.
    AtEpochEnd(EpochTotals),
    /// Ended the call.
    Ended,
}

/// What a worker sent that is answered once every worker in the call sent its own.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Contribution {
    /// The sums of evaluation step `step` (server 0).
    Test {
        /// The worker's evaluation step.
        step: u32,
        /// Its samples and sums.
        totals: StepTotals,
    },
    /// A training state to load `part` of.
    Load {
        /// What to load.
        part: LoadPart,
        /// The training state, as bytes.
        state: Vec<u8>,
    },
    /// Values to gather (server 0).
    Gather(Vec<u64>),
}

/// One worker, as a server sees it.
#[derive(Debug)]
struct Seen {
    position: Position,
    heard: Instant,
    contribution: Option<Contribution>,
}

/// Every worker, as a server sees them.
#[derive(Debug)]
pub(super) struct Workers {
    seen: Vec<Seen>,
    /// When the workers that wait on this server were last told it is alive.
    reassured: Instant,
}

impl Workers {
    /// `count` idle workers, heard from now.
    pub(super) fn new(count: usize) -> Self {
        let now = Instant::now();
        Self {
            seen: (0..count)
                .map(|_| Seen {
                    position: Position::Idle,
                    heard: now,
                    contribution: None,
                })
                .collect(),
            reassured: now,
        }
    }

    /// At the start of a call: every worker is heard from now, and those that ended the last
    /// call are idle.
    pub(super) fn begin_call(&mut self) {
        let now = Instant::now();
        for w in &mut self.seen {
            w.heard = now;
            if w.position == Position::Ended {
                w.position = Position::Idle;
            }
        }
    }

    /// Worker `w` was heard from now.
    pub(super) fn heard(&mut self, w: usize) {
        self.seen[w].heard = Instant::now();
    }

    /// Worker `w` is at `position` now; returns where it was.
    pub(super) fn place(&mut self, w: usize, position: Position) -> Position {
        std::mem::replace(&mut self.seen[w].position, position)
    }

    /// Keeps `contribution` of worker `w` until every worker in the call sent its own.
    pub(super) fn contribute(&mut self, w: usize, contribution: Contribution) {
        self.seen[w].contribution = Some(contribution);
    }

    /// Takes worker `w`'s contribution.
    pub(super) fn take_contribution(&mut self, w: usize) -> Option<Contribution> {
        self.seen[w].contribution.take()
    }

    /// Workers still in the call, in rank order.
    pub(super) fn active(&self) -> Vec<usize> {
        (0..self.seen.len())
            .filter(|&w| self.seen[w].position != Position::Ended)
            .collect()
    }

    /// Whether every worker in the call sent a contribution that `kind` accepts.
    pub(super) fn all_contributed(&self, kind: impl Fn(&Contribution) -> bool) -> bool {
        self.seen
            .iter()
            .filter(|w| w.position != Position::Ended)
            .all(|w| w.contribution.as_ref().is_some_and(&kind))
    }

    /// Whether every worker in the call is where `at` says.
    pub(super) fn all_at(&self, at: impl Fn(&Position) -> bool) -> bool {
        self.seen
            .iter()
            .filter(|w| w.position != Position::Ended)
            .all(|w| at(&w.position))
    }

    /// Whether every worker ended the call.
    pub(super) fn all_ended(&self) -> bool {
        self.seen.iter().all(|w| w.position == Position::Ended)
    }

    /// Whether every worker in the call has a push waiting (a synchronous step may apply).
    pub(super) fn all_pending(&self) -> bool {
        self.all_at(|p| matches!(p, Position::Pending { .. }))
    }

    /// The oldest version a worker computes a step on, if any does.
    pub(super) fn oldest_outstanding(&self) -> Option<u64> {
        self.seen
            .iter()
            .filter_map(|w| match w.position {
                Position::Outstanding { base } => Some(base),
                _ => None,
            })
            .min()
    }

    /// A worker that the server waits on and that has been silent for `timeout`. A worker
    /// computing a step owes a push; the others are waited on only while someone waits for
    /// them (`pushes_wait`, a contribution, a worker at an epoch's or the call's end).
    pub(super) fn silent(&self, timeout: Duration, pushes_wait: bool) -> Option<usize> {
        let now = Instant::now();
        let someone_waits = pushes_wait
            || self.seen.iter().any(|w| {
                w.contribution.is_some()
                    || matches!(w.position, Position::AtEpochEnd(_) | Position::Ended)
            });
        self.seen.iter().position(|w| {
            let owes = match w.position {
                Position::Outstanding { .. } => true,
                Position::Idle => someone_waits,
                Position::Pending { .. } | Position::AtEpochEnd(_) | Position::Ended => false,
            };
            owes && now.duration_since(w.heard) > timeout
        })
    }

    /// The workers to tell that the server is still alive, when a quarter of `timeout` has
    /// passed since they were last told: those waiting for the others at the call's end, and
    /// at an epoch's end on the server that answers it (`answers_epochs`). So a waiting
    /// worker's deadline measures this server's silence, not the others' remaining work.
    pub(super) fn due_reassurance(
        &mut self,
        timeout: Duration,
        answers_epochs: bool,
    ) -> Vec<usize> {
        if self.reassured.elapsed() < timeout / 4 {
            return Vec::new();
        }
        self.reassured = Instant::now();
        (0..self.seen.len())
            .filter(|&w| match self.seen[w].position {
                Position::AtEpochEnd(_) => answers_epochs,
                Position::Ended => true,
                _ => false,
            })
            .collect()
    }
}
