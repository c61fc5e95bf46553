//! `Worker`: a worker's copy of the model and its side of the conversation with the parameter
//! servers.
//!
//! A worker computes its part of every step with [`Replica::step_buffer`] on weights it got
//! from the servers, cuts the buffer into one message per server ([`Sharding::cut`]), and gets
//! each server's variables back in the answer: one message each way per server and step. A
//! step whose gradients or loss are not finite on this worker carries a NaN loss sum to every
//! server, so that every server leaves the step out, as every other strategy does.
//!
//! It waits for a server's answer for twice the timeout (the server may itself wait one
//! timeout for another worker), and fails naming the server that stays silent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use mpi::point_to_point::Destination;
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::data::Batch;
use kandle::optimizers::NamedOptimizerState;
use kandle::params::Weights;
use kandle::strategy::{Replica, StepStats};
use kandle::training_state::TrainingState;
use kandle::{Error, Result};

use super::protocol::{
    Encoded, EpochTotals, Kind, LoadPart, Message, Snapshot, Staleness, StepTotals,
};
use super::server::{read_shard_state, Mode};
use super::shards::Sharding;
use super::transport;
use super::Roles;
use crate::mpi::abort::abort_job;
use crate::mpi::poll::{Backoff, SendPace};
use crate::mpi::world::World;
use crate::mpi::{seconds, worker_label};
use crate::replica_set::cpu_weights;

/// One worker.
pub(crate) struct Worker {
    world: Arc<World>,
    roles: Roles,
    mode: Mode,
    timeout: Duration,
    replica: Replica,
    sharding: Sharding,
    /// The call of fit, evaluate or predict this worker is in, from 1 (between calls, the
    /// next one).
    call: u32,
    /// Whether the servers serve the current call (between `begin_call` and `end_call`).
    in_call: bool,
    /// The version of each server's weights this worker holds.
    base: Vec<u64>,
    /// Whether it holds weights it may train on without pulling (always, when synchronous).
    fresh: bool,
    /// Whether it holds the servers' weights as they were when its evaluation began.
    fetched: bool,
    steps: u32,
    test_steps: u32,
    epochs: u32,
    /// Staleness of this worker's applied updates in the current epoch.
    staleness: Staleness,
    host: Vec<f32>,
}

impl Worker {
    /// Introduces this worker to every server (which check its model) and loads the initial
    /// weights they answer with.
    pub(crate) fn new(
        world: Arc<World>,
        roles: Roles,
        mode: Mode,
        timeout: Duration,
        replica: Replica,
        sharding: Sharding,
    ) -> Result<Self> {
        let servers = sharding.servers();
        let mut worker = Self {
            world,
            roles,
            mode,
            timeout,
            replica,
            sharding,
            call: 0,
            in_call: false,
            base: vec![0; servers],
            fresh: mode == Mode::Synchronous,
            fetched: true,
            steps: 0,
            test_steps: 0,
            epochs: 0,
            staleness: Staleness::default(),
            host: Vec::new(),
        };
        let hello = Message::Hello {
            signature: worker.sharding.signature,
            buffer_len: worker.replica.layout().len() as u64,
        };
        let replies = worker.ask_all(
            &hello,
            Kind::Weights,
            weights_of,
            "the model's construction",
        )?;
        worker.call = 1;
        worker.load(&replies)?;
        Ok(worker)
    }

    /// The worker's copy of the model.
    pub(crate) fn replica(&self) -> &Replica {
        &self.replica
    }

    /// The weights this worker holds, on the CPU.
    pub(crate) fn weights(&self) -> Result<Weights> {
        cpu_weights(self.replica.store())
    }

    /// Sends `messages[s]` to server `s`, for each message, and waits for each of those
    /// servers' answer of kind `answer`, whose contents `take` takes (see [`exchange`]).
    fn exchange<T>(
        &self,
        messages: &[Message],
        answer: Kind,
        take: fn(Message) -> Option<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        let encoded: Vec<Encoded> = messages.iter().map(|m| m.encode(self.call)).collect();
        let to: Vec<(usize, &Encoded)> = encoded.iter().enumerate().collect();
        let awaited: Vec<usize> = (0..messages.len()).collect();
        self.exchange_with(&to, &awaited, answer, take, what)
    }

    /// Sends `message` to every server and waits for each one's answer of kind `answer`, whose
    /// contents `take` takes (see [`exchange`]).
    fn ask_all<T>(
        &self,
        message: &Message,
        answer: Kind,
        take: fn(Message) -> Option<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        let encoded = message.encode(self.call);
        let servers: Vec<usize> = (0..self.sharding.servers()).collect();
        let to: Vec<(usize, &Encoded)> = servers.iter().map(|&s| (s, &encoded)).collect();
        self.exchange_with(&to, &servers, answer, take, what)
    }

    /// Sends each `(server, message)` of `to` and waits for one answer of kind `answer` from
    /// each server of `awaited`, whose contents `take` takes (see [`exchange`]).
    fn exchange_with<T>(
        &self,
        to: &[(usize, &Encoded)],
        awaited: &[usize],
        answer: Kind,
        take: fn(Message) -> Option<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        let expected = Expected {
            answer,
            take,
            call: self.call,
            what,
        };
        let (roles, timeout) = (self.roles, self.timeout);
        self.world
            .point_to_point(|comm| exchange(comm, roles, to, awaited, &expected, timeout))
    }

    /// Loads each server's variables from its `Weights` answer.
    fn load(&mut self, replies: &[Snapshot]) -> Result<()> {
        let params: Vec<_> = self.replica.store().iter().cloned().collect();
        for (s, reply) in replies.iter().enumerate() {
            self.base[s] = reply.version;
            let body = &reply.values[..];
            let layout = &self.sharding.weights[s];
            if body.len() != layout.len() {
                return Err(Error::Replica {
                    replica: self.roles.server_label(s),
                    reason: format!(
                        "sent {} weights where this worker expects {}",
                        body.len(),
                        layout.len()
                    ),
                });
            }
            let values = Tensor::from_slice(body, body.len(), &Device::Cpu)?;
            for (&i, value) in self.sharding.vars[s].iter().zip(layout.split(&values, 0)?) {
                params[i].var.set(&value.to_dtype(params[i].var.dtype())?)?;
            }
        }
        Ok(())
    }

    /// Sends `note` (a message with no payload) to every server and loads the weights they
    /// answer with.
    fn pull(&mut self, note: Message, what: &str) -> Result<()> {
        let replies = self.ask_all(&note, Kind::Weights, weights_of, what)?;
        self.load(&replies)
    }

    /// One training step on this worker's part of the global batch.
    pub(crate) fn train(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        self.steps += 1;
        if !self.fresh {
            self.pull(Message::Pull, "a pull of the weights")?;
            self.fresh = true;
        }
        let buffer = self.replica.step_buffer(batch)?;
        copy_to_host(&buffer.fused, &mut self.host)?;
        let finite = self.host.iter().all(|v| v.is_finite());
        let messages: Vec<Message> = (0..self.sharding.servers())
            .map(|s| {
                let mut buffer = Vec::with_capacity(self.sharding.layouts[s].len());
                self.sharding.cut(s, &self.host, &mut buffer);
                if !finite {
                    // Every server then reads a non-finite step and leaves it out.
                    if let Some(loss) = buffer.get_mut(self.sharding.layouts[s].stats_offset()) {
                        *loss = f32::NAN;
                    }
                }
                Message::Push {
                    base: self.base[s],
                    step: self.steps,
                    lr,
                    buffer,
                }
            })
            .collect();
        let what = format!("the push of step {}", self.steps);
        let replies = self.exchange(&messages, Kind::Weights, weights_of, &what)?;
        self.load(&replies)?;
        self.fetched = false;
        let Some(first) = replies.first() else {
            return Err(Error::invalid(
                "a parameter-server step without a server (internal error)",
            ));
        };
        let applied = first.staleness.is_some();
        if applied {
            let stale = replies.iter().filter_map(|r| r.staleness).max();
            self.staleness.record(stale.unwrap_or(0));
        }
        // Mixed precision's loss scale, which each worker keeps: synchronous workers all see
        // whether the step applied; an asynchronous push applies alone, and its own
        // finite-ness decides.
        let step_finite = match self.mode {
            Mode::Synchronous => applied,
            _ => finite,
        };
        self.replica
            .update_loss_scale(&kandle::strategy::step::StepTotals {
                sums: Vec::new(),
                samples: first.samples as usize,
                finite: step_finite,
            })?;
        Ok(StepStats {
            samples: first.samples as usize,
            sums: first.sums.iter().map(|&v| f64::from(v)).collect(),
            applied,
        })
    }

    /// Fetches the servers' current weights once per evaluation or prediction.
    fn fetch(&mut self) -> Result<()> {
        if !self.fetched {
            self.pull(Message::Fetch, "a fetch of the weights")?;
            self.fetched = true;
            self.fresh = self.mode == Mode::Synchronous;
        }
        Ok(())
    }

    /// Gradient accumulation: this worker's part of a micro-batch, computed on the weights of
    /// the step it belongs to and kept for the next push ([`Replica::accumulate`]); nothing is
    /// sent. Returns this worker's sample count and sums.
    pub(crate) fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        if !self.fresh {
            self.pull(Message::Pull, "a pull of the weights")?;
            self.fresh = true;
        }
        let (samples, sums) = self.replica.accumulate(batch)?;
        Ok(StepStats {
            samples,
            sums,
            applied: false,
        })
    }

    /// Loss and metric sums of this worker's part of an evaluation batch, summed over every
    /// worker by server 0.
    pub(crate) fn test(&mut self, batch: &Batch) -> Result<StepStats> {
        self.fetch()?;
        self.test_steps += 1;
        let sums = self
            .replica
            .evaluate(batch)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let m = Message::Test {
            step: self.test_steps,
            totals: StepTotals {
                samples: batch.len() as u64,
                sums: sums.iter().map(|&v| v as f32).collect(),
            },
        };
        let what = format!("evaluation step {}", self.test_steps);
        let replies = self.exchange(&[m], Kind::TestTotals, test_totals_of, &what)?;
        let total = replies
            .into_iter()
            .next()
            .ok_or_else(|| Error::invalid("an empty evaluation answer"))?;
        Ok(StepStats {
            samples: total.samples as usize,
            sums: total.sums.iter().map(|&v| f64::from(v)).collect(),
            applied: false,
        })
    }

    /// The model's outputs for `inputs`, on the servers' current weights.
    pub(crate) fn predict(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.fetch()?;
        self.replica
            .predict(inputs)?
            .into_iter()
            .map(|y| Ok(y.to_device(&Device::Cpu)?))
            .collect()
    }

    /// At an epoch's end (asynchronous mode): waits until every worker has ended the epoch,
    /// replaces `totals` (this worker's training steps) with the totals over every worker, and
    /// returns the staleness of the epoch's applied updates over every worker.
    pub(crate) fn end_epoch(&mut self, totals: &mut StepStats) -> Result<Vec<(String, f64)>> {
        if self.mode == Mode::Synchronous {
            return Ok(Vec::new());
        }
        self.epochs += 1;
        let sent = totals.sums.len();
        let m = Message::Epoch {
            epoch: self.epochs,
            totals: EpochTotals {
                staleness: std::mem::take(&mut self.staleness),
                samples: totals.samples as u64,
                sums: totals.sums.iter().map(|&v| v as f32).collect(),
            },
        }
        .encode(self.call);
        let what = format!("the end of epoch {}", self.epochs);
        let to: Vec<(usize, &Encoded)> = (0..self.sharding.servers()).map(|s| (s, &m)).collect();
        let replies = self.exchange_with(&to, &[0], Kind::EpochTotals, epoch_totals_of, &what)?;
        self.fresh = false;
        let Some(t) = replies.into_iter().next() else {
            return Err(Error::invalid("an empty answer to the end of an epoch"));
        };
        if t.sums.len() != sent {
            return Err(Error::Replica {
                replica: self.roles.server_label(0),
                reason: format!(
                    "answered the end of epoch {} with {} sums where {sent} were sent",
                    self.epochs,
                    t.sums.len(),
                ),
            });
        }
        totals.samples = t.samples as usize;
        totals.sums = t.sums.iter().map(|&v| f64::from(v)).collect();
        Ok(vec![
            ("staleness_mean".to_string(), t.staleness.mean()),
            ("staleness_max".to_string(), t.staleness.max as f64),
        ])
    }

    /// The servers serve a call of fit, evaluate, predict or a single batch from now on.
    pub(crate) fn begin_call(&mut self) {
        self.in_call = true;
    }

    /// Tells every server this worker ended the call, and loads the final weights they send
    /// once every worker has.
    pub(crate) fn end_call(&mut self) -> Result<()> {
        self.pull(Message::End, "the end of the call")?;
        self.in_call = false;
        self.call += 1;
        self.steps = 0;
        self.test_steps = 0;
        self.fetched = true;
        self.fresh = self.mode == Mode::Synchronous;
        Ok(())
    }
}

impl Worker {
    /// The whole optimizer state, joined from every server's shard. During a call it asks the
    /// servers, and takes their current weights with it (so that [`Worker::weights`] then
    /// gives the weights this state goes with); between calls the servers send it unasked, as
    /// every rank runs the same program.
    pub(crate) fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        let servers = self.sharding.servers();
        let replies = if self.in_call {
            self.ask_all(
                &Message::StateRequest,
                Kind::State,
                state_of,
                "a request for the training state",
            )?
        } else {
            let awaited: Vec<usize> = (0..servers).collect();
            self.exchange_with(&[], &awaited, Kind::State, state_of, "the optimizer state")?
        };
        let mut parts = Vec::with_capacity(servers);
        for (s, (version, bytes)) in replies.into_iter().enumerate() {
            let shard = read_shard_state(&bytes, &self.roles.server_label(s))?;
            if self.in_call {
                for p in self.replica.store().iter() {
                    if let Some(value) = shard.weights.get(&p.name) {
                        p.var.set(&value.to_dtype(p.var.dtype())?)?;
                    }
                }
                self.base[s] = version;
            }
            parts.push(shard.optimizer);
        }
        NamedOptimizerState::join(parts)
    }

    /// Replaces the weights: on this worker, and during a call on the servers too, once every
    /// worker has asked the same (the chief's are loaded). Fails without changing anything when
    /// the names or shapes do not match.
    pub(crate) fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        let store = self.replica.store();
        store
            .check_compatible(weights)
            .map_err(|reason| Error::invalid(format!("cannot set weights: {reason}")))?;
        store.assign(weights)?;
        let state = TrainingState {
            weights: weights.clone(),
            ..TrainingState::default()
        };
        self.load_on_servers(LoadPart::Weights, &state, "a load of the weights")
    }

    /// Checks `state` against the model's optimizer and, during a call, loads it on the
    /// servers once every worker has asked the same (between calls each server loads it
    /// itself). Fails without changing anything when the kind, names or shapes do not match.
    pub(crate) fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        self.replica.load_optimizer_state(state)?;
        let state = TrainingState {
            optimizer: state.clone(),
            ..TrainingState::default()
        };
        self.load_on_servers(LoadPart::Optimizer, &state, "a load of the optimizer state")
    }

    /// During a call, sends `state` to every server to load its `part`, and takes the weights
    /// they answer with; between calls, nothing.
    fn load_on_servers(&mut self, part: LoadPart, state: &TrainingState, what: &str) -> Result<()> {
        if !self.in_call {
            return Ok(());
        }
        let message = Message::Load {
            part,
            state: state.to_bytes()?,
        };
        let replies = self.ask_all(&message, Kind::Weights, weights_of, what)?;
        self.load(&replies)?;
        self.fresh = self.mode == Mode::Synchronous;
        self.fetched = true;
        Ok(())
    }

    /// Every worker's `values`, in rank order, through server 0, during a call.
    pub(crate) fn all_gather(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        if !self.in_call {
            return Err(Error::invalid(
                "ParameterServerStrategy gathers values across workers only during fit, \
                 evaluate or predict",
            ));
        }
        let m = Message::Gather {
            values: values.to_vec(),
        }
        .encode(self.call);
        let what = "a gather across the workers";
        let replies = self.exchange_with(&[(0, &m)], &[0], Kind::Gathered, gathered_of, what)?;
        let all = replies.into_iter().next().unwrap_or_default();
        let roles = self.roles;
        if all.len() != values.len() * roles.workers {
            return Err(Error::Replica {
                replica: roles.server_label(0),
                reason: format!(
                    "gathered {} values from {} workers that sent {} each",
                    all.len(),
                    roles.workers,
                    values.len()
                ),
            });
        }
        Ok(all)
    }
}

impl Drop for Worker {
    /// A worker that leaves a call before its end failed (its error is on its way to the
    /// caller): the servers are told at once, so that every rank fails now instead of waiting
    /// for it until the timeout, and MPI is not finalised, so that this process exits with its
    /// error.
    fn drop(&mut self) {
        if !self.in_call {
            return;
        }
        let error = Error::Replica {
            replica: worker_label(self.world.rank()),
            reason: format!(
                "left call {} of fit/evaluate/predict with an error (its own message says which)",
                self.call
            ),
        };
        let servers = (0..self.roles.servers).map(|s| self.roles.server_rank(s));
        let _ = self.world.point_to_point(|comm| {
            transport::send_abort(comm, servers, &error);
            Ok(())
        });
        self.world.mark_broken();
    }
}

/// The answer an exchange waits for from each server.
struct Expected<'a, T> {
    /// Its kind.
    answer: Kind,
    /// Takes its contents out of a message of that kind.
    take: fn(Message) -> Option<T>,
    /// The call it belongs to.
    call: u32,
    /// What it answers, for errors: `the push of step 3`.
    what: &'a str,
}

/// Sends each `(server, message)` of `to` and waits for one answer as `expected` says from
/// each server of `awaited`, in one loop that also takes the answers of the servers that
/// already have their message while a send to another is still under way.
///
/// Each server gets twice the timeout (it may itself wait one timeout for another worker; a
/// `Waiting` note from it starts its wait again). Meanwhile the worker tells every server, a
/// few times per timeout, that it is alive, so that a server does not take a worker that waits
/// on another, stalled server for a stalled worker. An abort notice fails the exchange with the
/// error it carries. A server that does not take its message in time cannot be answered by
/// cancelling the send, so the job is ended naming it; one that takes it but does not answer is
/// named in the error.
fn exchange<T>(
    comm: &SimpleCommunicator,
    roles: Roles,
    to: &[(usize, &Encoded)],
    awaited: &[usize],
    expected: &Expected<'_, T>,
    timeout: Duration,
) -> Result<Vec<T>> {
    let what = expected.what;
    let patience = timeout * 2;
    let start = Instant::now();
    let mut answers: Vec<Option<T>> = awaited.iter().map(|_| None).collect();
    let mut deadlines = vec![start + patience; awaited.len()];
    let mut alive_sent = start;
    let alive = Message::Alive.encode(expected.call);
    mpi::request::scope(|scope| {
        let mut sends: Vec<_> = to
            .iter()
            .map(|&(s, message)| {
                Some(
                    comm.process_at_rank(roles.server_rank(s) as i32)
                        .immediate_send_with_tag(scope, &message.words[..], message.tag),
                )
            })
            .collect();
        let mut backoff = Backoff::default();
        let mut pace = SendPace::default();
        let outcome = loop {
            let mut progressed = false;
            for slot in sends.iter_mut() {
                if let Some(request) = slot.take() {
                    match request.test() {
                        Ok(_) => progressed = true,
                        Err(pending) => *slot = Some(pending),
                    }
                }
            }
            match receive_answers(comm, roles, awaited, expected, &mut answers) {
                Ok(Some(waiting)) => {
                    for i in waiting {
                        deadlines[i] = Instant::now() + patience;
                    }
                    progressed = true;
                }
                Ok(None) => {}
                Err(e) => break Err(e),
            }
            let sent = sends.iter().all(Option::is_none);
            if sent && answers.iter().all(Option::is_some) {
                break Ok(());
            }
            if progressed {
                backoff = Backoff::default();
                continue;
            }
            let now = Instant::now();
            if now.duration_since(alive_sent) > timeout / 4 {
                alive_sent = now;
                for s in 0..roles.servers {
                    comm.process_at_rank(roles.server_rank(s) as i32)
                        .buffered_send_with_tag(&alive.words[..], alive.tag);
                }
            }
            let unsent = to
                .iter()
                .zip(&sends)
                .find(|(_, r)| r.is_some())
                .map(|(&(s, _), _)| s);
            if let Some(s) = unsent.filter(|_| now >= start + patience) {
                break Err(Error::Replica {
                    replica: roles.server_label(s),
                    reason: format!("did not take {what} within {}", seconds(patience)),
                });
            }
            if let Some(i) =
                (0..awaited.len()).find(|&i| answers[i].is_none() && now >= deadlines[i])
            {
                break Err(Error::Replica {
                    replica: roles.server_label(awaited[i]),
                    reason: format!(
                        "did not answer {what} within {} (twice the timeout, as a server may \
                         wait one timeout for another worker)",
                        seconds(patience)
                    ),
                });
            }
            if sent {
                backoff.wait();
            } else {
                pace.wait();
            }
        };
        if let Err(e) = &outcome {
            if sends.iter().any(Option::is_some) {
                // MPI still owns the buffers of the unfinished sends: end the job, naming why.
                std::mem::forget(sends);
                abort_job(comm, &e.to_string())
            }
        }
        outcome
    })?;
    Ok(answers.into_iter().flatten().collect())
}

/// Takes the answers that have arrived from the servers of `awaited` into `answers`; returns
/// which of them sent a `Waiting` note (or `None` when nothing arrived), or the error of an
/// abort notice or a stray message.
fn receive_answers<T>(
    comm: &SimpleCommunicator,
    roles: Roles,
    awaited: &[usize],
    expected: &Expected<'_, T>,
    answers: &mut [Option<T>],
) -> Result<Option<Vec<usize>>> {
    let mut arrived = None;
    for (i, &s) in awaited.iter().enumerate() {
        if answers[i].is_some() {
            continue;
        }
        let Some(m) = transport::try_receive(comm, &roles, Some(roles.server_rank(s)))? else {
            continue;
        };
        let waiting: &mut Vec<usize> = arrived.get_or_insert_with(Vec::new);
        if let Some(error) = m.abort_error() {
            return Err(match error {
                Error::Replica { replica, reason } => Error::Replica {
                    replica,
                    reason: format!("{reason} (reported by {})", roles.server_label(s)),
                },
                other => other,
            });
        }
        if m.message == Message::Waiting {
            waiting.push(i);
            continue;
        }
        let (kind, call) = (m.message.kind(), m.call);
        let taken = (call == expected.call)
            .then(|| (expected.take)(m.message))
            .flatten();
        let Some(answer) = taken else {
            return Err(Error::Replica {
                replica: roles.server_label(s),
                reason: format!(
                    "answered {} with message tag {:#x} of call {call} (expected tag {:#x} of \
                     call {})",
                    expected.what,
                    kind.tag(),
                    expected.answer.tag(),
                    expected.call
                ),
            });
        };
        answers[i] = Some(answer);
    }
    Ok(arrived)
}

/// The variables a `Weights` answer carries.
fn weights_of(message: Message) -> Option<Snapshot> {
    match message {
        Message::Weights(snapshot) => Some(snapshot),
        _ => None,
    }
}

/// The sums a `TestTotals` answer carries.
fn test_totals_of(message: Message) -> Option<StepTotals> {
    match message {
        Message::TestTotals(totals) => Some(totals),
        _ => None,
    }
}

/// The totals an `EpochTotals` answer carries.
fn epoch_totals_of(message: Message) -> Option<EpochTotals> {
    match message {
        Message::EpochTotals(totals) => Some(totals),
        _ => None,
    }
}

/// Every worker's values, which a `Gathered` answer carries.
fn gathered_of(message: Message) -> Option<Vec<u64>> {
    match message {
        Message::Gathered { values } => Some(values),
        _ => None,
    }
}

/// The version and training state bytes a `State` message carries.
fn state_of(message: Message) -> Option<(u64, Vec<u8>)> {
    match message {
        Message::State { version, state } => Some((version, state)),
        _ => None,
    }
}

/// Copies a 1-D `f32` CPU tensor into `out` (cleared first).
fn copy_to_host(t: &Tensor, out: &mut Vec<f32>) -> Result<()> {
    let t = t.to_device(&Device::Cpu)?.contiguous()?;
    out.clear();
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(values)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            out.extend_from_slice(&values[a..b]);
            return Ok(());
        }
    }
    out.extend(t.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}
