//! When a server applies the workers' pushes:
//!
//! - **synchronous**: once every worker still in the call has pushed its step, the sum of their
//!   buffers is applied as one update, and every worker gets the new weights (a barrier per
//!   step: pushes of different steps fail naming the worker out of step);
//! - **asynchronous**: each push is applied as it comes, and the worker gets the weights as
//!   they are then. With a staleness bound `k`, an update is held back while applying it would
//!   leave a worker still computing on weights more than `k` updates old; pushes held back
//!   together whose owners would otherwise make each other stale are applied as one update. So
//!   no applied update is more than `k` updates older than the weights it lands on, and the
//!   wait never closes a cycle: the oldest outstanding worker is always free to push.

use std::collections::VecDeque;

use kandle::{Error, Result};

use super::workers::Workers;
use crate::mpi::worker_label;

/// How a server applies the workers' gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// One update per step from every worker's gradients.
    Synchronous,
    /// Each worker's gradients as they come, with an optional staleness bound.
    Asynchronous(Option<u64>),
}

/// A push waiting to be applied.
pub(super) struct Push {
    /// The worker's rank.
    pub(super) worker: usize,
    /// The version of the server's weights its step was computed on.
    pub(super) base: u64,
    /// The worker's step in the call.
    pub(super) step: u32,
    /// The learning rate it trains with.
    pub(super) lr: f64,
    /// The server's part of its step buffer.
    pub(super) buffer: Vec<f32>,
}

/// The pushes a server holds, and when it applies them.
pub(super) struct Schedule {
    mode: Mode,
    pushes: VecDeque<Push>,
}

impl Schedule {
    /// No push yet, applied by `mode`.
    pub(super) fn new(mode: Mode) -> Self {
        Self {
            mode,
            pushes: VecDeque::new(),
        }
    }

    /// Whether no push waits.
    pub(super) fn is_empty(&self) -> bool {
        self.pushes.is_empty()
    }

    /// Holds `push` until it may be applied.
    pub(super) fn hold(&mut self, push: Push) {
        self.pushes.push_back(push);
    }

    /// The pushes to apply as the next update, in rank order, if any may be applied now, with
    /// `version` updates applied so far and the workers where `workers` says. In synchronous
    /// mode, pushes of different steps are an error naming the worker out of step.
    pub(super) fn next_group(
        &mut self,
        version: u64,
        workers: &Workers,
    ) -> Result<Option<Vec<Push>>> {
        let Some(mut group) = self.take_group(version, workers) else {
            return Ok(None);
        };
        group.sort_by_key(|p| p.worker);
        if self.mode == Mode::Synchronous {
            if let Some(p) = group.iter().find(|p| p.step != group[0].step) {
                return Err(Error::Replica {
                    replica: worker_label(p.worker),
                    reason: format!(
                        "pushed step {} while worker {} pushed step {}: the workers ran \
                         different steps",
                        p.step, group[0].worker, group[0].step
                    ),
                });
            }
        }
        Ok(Some(group))
    }

    /// The pushes that make the next update, if any may be applied now (see the module
    /// documentation).
    fn take_group(&mut self, version: u64, workers: &Workers) -> Option<Vec<Push>> {
        if self.pushes.is_empty() {
            return None;
        }
        match self.mode {
            Mode::Synchronous => workers
                .all_pending()
                .then(|| self.pushes.drain(..).collect()),
            Mode::Asynchronous(None) => self.pushes.pop_front().map(|p| vec![p]),
            Mode::Asynchronous(Some(k)) => {
                let next = version + 1;
                if workers
                    .oldest_outstanding()
                    .is_some_and(|b| next.saturating_sub(b) > k)
                {
                    return None;
                }
                let others_fine = self
                    .pushes
                    .iter()
                    .skip(1)
                    .all(|p| next.saturating_sub(p.base) <= k);
                if others_fine {
                    self.pushes.pop_front().map(|p| vec![p])
                } else {
                    Some(self.pushes.drain(..).collect())
                }
            }
        }
    }
}
