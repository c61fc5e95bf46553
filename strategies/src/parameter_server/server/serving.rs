//! The loop that serves one call: it takes every message as it comes, answers it (at once, or
//! once every worker in the call sent its own: an evaluation step's sums, an epoch's end, a
//! training state to load, values to gather), applies the pushes the schedule allows, keeps the
//! workers that wait on the server reassured, and fails naming a worker it waits on that stays
//! silent for the timeout.

use mpi::point_to_point::Destination;
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::training_state::TrainingState;
use kandle::{Error, Result};

use super::schedule::Push;
use super::workers::{Contribution, Position};
use super::Server;
use crate::mpi::poll::Backoff;
use crate::mpi::{seconds, worker_label};
use crate::parameter_server::protocol::{EpochTotals, Message, StepTotals};
use crate::parameter_server::transport::{self, Incoming};

impl Server {
    pub(super) fn serve_call(&mut self, comm: &SimpleCommunicator) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            if self.workers.all_ended() {
                let last = self.variables.snapshot(None, None)?;
                let workers: Vec<usize> = (0..self.roles.workers).collect();
                self.send_to(comm, &workers, &Message::Weights(last.clone()));
                return self.share_shards(comm, last);
            }
            let mut progressed = false;
            while let Some(m) = transport::try_receive(comm, &self.roles, None)? {
                if matches!(m.message, Message::Shard(_))
                    && self.roles.server_index(m.source).is_some()
                {
                    self.keep_shard(m)?;
                } else {
                    self.handle(comm, m)?;
                }
                progressed = true;
            }
            progressed |= self.apply_ready(comm)?;
            if progressed {
                backoff = Backoff::default();
                continue;
            }
            self.check_silence()?;
            self.reassure(comm);
            backoff.wait();
        }
    }

    /// Answers `m`, a message from a worker, or keeps it until it can be answered.
    fn handle(&mut self, comm: &SimpleCommunicator, m: Incoming) -> Result<()> {
        let worker = self.expect_worker(&m)?;
        if m.message == Message::Alive {
            self.workers.heard(worker);
            return Ok(());
        }
        if m.call != self.call {
            return Err(Error::Replica {
                replica: worker_label(worker),
                reason: format!(
                    "is in call {} of fit/evaluate/predict while {} serves call {}: the ranks \
                     ran different sequences of them",
                    m.call,
                    self.label(),
                    self.call
                ),
            });
        }
        self.workers.heard(worker);
        let kind = m.message.kind();
        match m.message {
            Message::Pull => {
                let base = self.variables.version();
                self.workers.place(worker, Position::Outstanding { base });
                self.send_weights(comm, &[worker])?;
            }
            Message::Fetch => {
                self.workers.place(worker, Position::Idle);
                self.send_weights(comm, &[worker])?;
            }
            Message::Push {
                base,
                step,
                lr,
                buffer,
            } => {
                let expected = self.variables.buffer_len();
                if buffer.len() != expected {
                    return Err(Error::Replica {
                        replica: worker_label(worker),
                        reason: format!(
                            "pushed {} values to {}, which expects {expected}",
                            buffer.len(),
                            self.label(),
                        ),
                    });
                }
                self.workers.place(worker, Position::Pending { base });
                self.schedule.hold(Push {
                    worker,
                    base,
                    step,
                    lr,
                    buffer,
                });
            }
            Message::Test { step, totals } => {
                self.workers
                    .contribute(worker, Contribution::Test { step, totals });
                self.answer_tests(comm)?;
            }
            Message::Epoch { totals, .. } => {
                self.workers.place(worker, Position::AtEpochEnd(totals));
                self.answer_epoch(comm);
            }
            Message::End => {
                self.workers.place(worker, Position::Ended);
            }
            Message::StateRequest => {
                let state = Message::State {
                    version: self.variables.version(),
                    state: self.variables.state()?.to_bytes()?,
                };
                self.send_to(comm, &[worker], &state);
            }
            Message::Load { part, state } => {
                self.workers
                    .contribute(worker, Contribution::Load { part, state });
                self.answer_loads(comm)?;
            }
            Message::Gather { values } => {
                self.workers
                    .contribute(worker, Contribution::Gather(values));
                self.answer_gathers(comm);
            }
            _ => return Err(self.unexpected(worker, kind, "serving the workers")),
        }
        Ok(())
    }

    /// Server 0 answers an evaluation step once every worker in the call sent its sums.
    fn answer_tests(&mut self, comm: &SimpleCommunicator) -> Result<()> {
        if !self
            .workers
            .all_contributed(|c| matches!(c, Contribution::Test { .. }))
        {
            return Ok(());
        }
        let workers = self.workers.active();
        let mut total = StepTotals::default();
        let mut step = None;
        for &w in &workers {
            let Some(Contribution::Test { step: s, totals }) = self.workers.take_contribution(w)
            else {
                continue;
            };
            if *step.get_or_insert(s) != s {
                return Err(Error::Replica {
                    replica: worker_label(w),
                    reason: format!(
                        "sent evaluation step {s} while the others are at step {}: the workers \
                         ran different evaluations",
                        step.unwrap_or(0)
                    ),
                });
            }
            total.add(&totals);
        }
        self.send_to(comm, &workers, &Message::TestTotals(total));
        Ok(())
    }

    /// Once every worker in the call sent a `Load`, loads the chief's (the first worker's) and
    /// answers each with the weights after it. The workers load what they read from one file,
    /// so their messages agree; waiting for all keeps any from training on the weights before.
    fn answer_loads(&mut self, comm: &SimpleCommunicator) -> Result<()> {
        if !self
            .workers
            .all_contributed(|c| matches!(c, Contribution::Load { .. }))
        {
            return Ok(());
        }
        let workers = self.workers.active();
        let mut loads = Vec::with_capacity(workers.len());
        for &w in &workers {
            if let Some(Contribution::Load { part, state }) = self.workers.take_contribution(w) {
                loads.push((w, part, state));
            }
        }
        let Some((_, part, state)) = loads.first() else {
            return Ok(());
        };
        if let Some(&(w, _, _)) = loads.iter().find(|(_, p, _)| p != part) {
            return Err(Error::Replica {
                replica: worker_label(w),
                reason: "loaded other parts of a training state than the chief: the workers \
                         ran different programs"
                    .into(),
            });
        }
        self.variables
            .load(*part, &TrainingState::from_bytes(state)?)?;
        for &w in &workers {
            self.workers.place(w, Position::Idle);
        }
        self.send_weights(comm, &workers)
    }

    /// Server 0 answers a gather once every worker in the call sent its values: all of them,
    /// in rank order.
    fn answer_gathers(&mut self, comm: &SimpleCommunicator) {
        if !self
            .workers
            .all_contributed(|c| matches!(c, Contribution::Gather(_)))
        {
            return;
        }
        let workers = self.workers.active();
        let mut values = Vec::new();
        for &w in &workers {
            if let Some(Contribution::Gather(v)) = self.workers.take_contribution(w) {
                values.extend(v);
            }
        }
        self.send_to(comm, &workers, &Message::Gathered { values });
    }

    /// Every server marks a worker at an epoch's end as idle once every worker in the call got
    /// there; server 0 then answers, with the staleness and the training totals over all of
    /// them.
    fn answer_epoch(&mut self, comm: &SimpleCommunicator) {
        if !self
            .workers
            .all_at(|p| matches!(p, Position::AtEpochEnd(_)))
        {
            return;
        }
        let workers = self.workers.active();
        let mut total = EpochTotals::default();
        for &w in &workers {
            if let Position::AtEpochEnd(totals) = self.workers.place(w, Position::Idle) {
                total.add(&totals);
            }
        }
        if self.index == 0 {
            self.send_to(comm, &workers, &Message::EpochTotals(total));
        }
    }

    /// Applies the pushes the schedule allows now, each group as one update, and answers each
    /// pusher with the weights after it; whether any was applied.
    fn apply_ready(&mut self, comm: &SimpleCommunicator) -> Result<bool> {
        let mut any = false;
        while let Some(group) = self
            .schedule
            .next_group(self.variables.version(), &self.workers)?
        {
            let Some(lr) = group.first().map(|p| p.lr) else {
                break;
            };
            let before = self.variables.version();
            let pushers: Vec<(usize, u64)> = group.iter().map(|p| (p.worker, p.base)).collect();
            let totals = self
                .variables
                .apply(group.into_iter().map(|p| p.buffer).collect(), lr)?;
            let mut replies = Vec::with_capacity(pushers.len());
            for &(worker, base) in &pushers {
                let staleness = totals.applies().then(|| before.saturating_sub(base));
                let reply = Message::Weights(self.variables.snapshot(staleness, Some(&totals))?);
                replies.push((worker, reply.encode(self.call)));
            }
            let base = self.variables.version();
            for &(worker, _) in &pushers {
                self.workers.place(worker, Position::Outstanding { base });
            }
            let to: Vec<(usize, _)> = replies.iter().map(|(w, r)| (*w, r)).collect();
            transport::send_all(comm, &self.roles, &to, self.timeout);
            any = true;
        }
        Ok(any)
    }

    /// Tells the workers that wait for the others at an epoch's end (server 0) or at the
    /// call's end that this server is alive, a few times per timeout.
    fn reassure(&mut self, comm: &SimpleCommunicator) {
        let waiting = self.workers.due_reassurance(self.timeout, self.index == 0);
        if waiting.is_empty() {
            return;
        }
        let note = Message::Waiting.encode(self.call);
        for w in waiting {
            comm.process_at_rank(w as i32)
                .buffered_send_with_tag(&note.words[..], note.tag);
        }
    }

    /// Fails naming a worker that this server waits on and that has been silent for the
    /// timeout.
    fn check_silence(&self) -> Result<()> {
        match self.workers.silent(self.timeout, !self.schedule.is_empty()) {
            None => Ok(()),
            Some(w) => Err(Error::Replica {
                replica: worker_label(w),
                reason: format!(
                    "sent nothing to {} for {} (it died or stalls)",
                    self.label(),
                    seconds(self.timeout)
                ),
            }),
        }
    }
}
