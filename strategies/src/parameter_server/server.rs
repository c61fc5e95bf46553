//! `Server`: a parameter server's shard of the model and the loop that serves the workers
//! during one `fit`, `evaluate` or `predict`.
//!
//! The server holds its variables and the optimizer state of its trainable ones, and a version
//! (the number of updates it applied). It answers every worker's messages as they come
//! (`MPI_Improbe` on any source, with short sleeps when idle), and applies pushed gradients by
//! [`kandle::strategy::step::finish`], the final phase every strategy shares:
//!
//! - **synchronous**: once every worker still in the call has pushed its step, the sum of their
//!   buffers is applied as one update, and every worker gets the new weights;
//! - **asynchronous**: each push is applied as it comes, and the worker gets the weights as
//!   they are then. With a staleness bound `k`, an update is held back while applying it would
//!   leave a worker still computing on weights more than `k` updates old; pushes held back
//!   together whose owners would otherwise make each other stale are applied as one update. So
//!   no applied update is more than `k` updates older than the weights it lands on, and the
//!   wait never closes a cycle: the oldest outstanding worker is always free to push.
//!
//! A worker this server waits on (for its push, an evaluation sum, an epoch end or the end of
//! the call) that sends nothing for the timeout fails the server with an error naming it; the
//! server then sends every other rank an abort notice with that error before it returns it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use mpi::point_to_point::Destination;
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::optimizers::{NamedOptimizerState, Optimizer};
use kandle::params::{Param, Weights};
use kandle::strategy::step::{self, StepLayout};
use kandle::strategy::{ModelSpec, Replica};
use kandle::training_state::TrainingState;
use kandle::{Error, Result};

use super::messages::{self as msg, Incoming};
use super::shards::Sharding;
use super::Roles;
use crate::mpi::poll::Backoff;
use crate::mpi::world::World;
use crate::mpi::{seconds, worker_label};

/// How a server applies the workers' gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// One update per step from every worker's gradients.
    Synchronous,
    /// Each worker's gradients as they come, with an optional staleness bound.
    Asynchronous(Option<u64>),
}

/// Where a worker is, as this server sees it.
#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Not training on this server's weights (evaluating, at an epoch's end, between steps of
    /// another kind).
    Idle,
    /// Computing a step on the weights of version `base`.
    Outstanding { base: u64 },
    /// Its push of a step on version `base` waits to be applied.
    Pending { base: u64 },
    /// Waiting for the other workers to end the epoch (server 0 answers).
    AtEpochEnd,
    /// Ended the call.
    Ended,
}

/// A push waiting to be applied.
struct Push {
    worker: usize,
    base: u64,
    step: u32,
    lr: f64,
    /// The whole message: its header, then the server's part of the step buffer.
    message: Vec<f32>,
}

/// One parameter server.
pub(crate) struct Server {
    world: std::sync::Arc<World>,
    roles: Roles,
    index: usize,
    mode: Mode,
    timeout: Duration,
    /// The whole model as this server built it (only its shard is kept current).
    replica: Replica,
    params: Vec<Param>,
    vars: Vec<Var>,
    statistics: Vec<Var>,
    /// The trainable variables of the shard, which its optimizer updates, and their names.
    trainable: Vec<Var>,
    trainable_names: Vec<String>,
    optimizer: Box<dyn Optimizer>,
    layout: StepLayout,
    num_stats: usize,
    version: u64,
    call: u32,
    states: Vec<State>,
    heard: Vec<Instant>,
    pushes: VecDeque<Push>,
    tests: Vec<Option<(u32, Vec<f32>)>>,
    /// Each worker's end-of-epoch totals: staleness sum, count and max, then its training
    /// steps' sample count and sums.
    epochs: Vec<Option<Vec<f32>>>,
    /// Each worker's `LOAD` message, until every worker in the call sent one.
    loads: Vec<Option<Vec<f32>>>,
    /// Each worker's `GATHER` values (server 0), until every worker in the call sent them.
    gathers: Vec<Option<Vec<f32>>>,
    /// When the workers waiting at an epoch's or the call's end were last told the server is
    /// alive.
    reassured: Instant,
    /// Which variables every server holds, to take the others' at the end of a call.
    sharding: Sharding,
    /// The other servers' variables at the end of the current call, as they arrive.
    others: Vec<Option<Vec<f32>>>,
}

impl Server {
    /// Builds this server's shard of `spec` (server `index` of the placement `sharding`).
    pub(crate) fn new(
        world: std::sync::Arc<World>,
        roles: Roles,
        spec: &ModelSpec,
        replica: Replica,
        sharding: &Sharding,
        mode: Mode,
        timeout: Duration,
    ) -> Result<Self> {
        let index = roles.server_index(world.rank()).ok_or_else(|| {
            Error::invalid("a parameter server built on a worker's rank (internal error)")
        })?;
        let all: Vec<Param> = replica.store().iter().cloned().collect();
        let params: Vec<Param> = sharding.vars[index]
            .iter()
            .map(|&i| all[i].clone())
            .collect();
        let vars: Vec<Var> = params.iter().map(|p| p.var.clone()).collect();
        let trainable: Vec<Var> = params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.var.clone())
            .collect();
        let trainable_names: Vec<String> = params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.name.clone())
            .collect();
        let statistics: Vec<Var> = params
            .iter()
            .filter(|p| p.statistic)
            .map(|p| p.var.clone())
            .collect();
        let optimizer = spec.optimizer.build(trainable.clone())?;
        let workers = roles.workers;
        Ok(Self {
            world,
            roles,
            index,
            mode,
            timeout,
            replica,
            params,
            vars,
            statistics,
            trainable,
            trainable_names,
            optimizer,
            layout: sharding.layouts[index].clone(),
            num_stats: spec.num_stats(),
            version: 0,
            call: 0,
            states: vec![State::Idle; workers],
            heard: vec![Instant::now(); workers],
            pushes: VecDeque::new(),
            tests: vec![None; workers],
            epochs: vec![None; workers],
            loads: vec![None; workers],
            gathers: vec![None; workers],
            reassured: Instant::now(),
            sharding: sharding.clone(),
            others: vec![None; roles.servers],
        })
    }

    /// The server's name in messages: `parameter server 1 (rank 3)`.
    fn label(&self) -> String {
        self.roles.server_label(self.index)
    }

    /// The whole model this server built; only this server's variables are current.
    pub(crate) fn replica(&self) -> &Replica {
        &self.replica
    }

    /// Sets every variable of this server's copy of the model (its shard's, and the others it
    /// holds between calls) from `weights`, the whole model's. Fails without changing anything
    /// when the names or shapes do not match.
    pub(crate) fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        let store = self.replica.store();
        store
            .check_compatible(weights)
            .map_err(|reason| Error::invalid(format!("cannot set weights: {reason}")))?;
        store.assign(weights)
    }

    /// This server's shard of the training state: its variables and its optimizer's state.
    fn shard_state(&self) -> Result<TrainingState> {
        let weights = self
            .params
            .iter()
            .map(|p| Ok((p.name.clone(), p.var.as_tensor().copy()?)))
            .collect::<Result<Weights>>()?;
        Ok(TrainingState {
            weights,
            optimizer: self.optimizer.state()?.into_named(&self.trainable_names)?,
            ..TrainingState::default()
        })
    }

    /// A `STATE` message: this server's shard of the training state, as bytes.
    fn state_message(&self, call: u32) -> Result<Vec<f32>> {
        let version = self.version.min(u64::from(u32::MAX)) as u32;
        let bytes = self.shard_state()?.to_bytes()?;
        Ok(msg::with_bytes([call, version, 0, 0, 0, 0], 2, &bytes))
    }

    /// The whole optimizer state, between calls: every rank runs this together (the same
    /// program, at the same point). This server sends its shard's state to every other rank
    /// and joins the other servers' shards to its own.
    pub(crate) fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        let call = self.call + 1;
        let mine = self.state_message(call)?;
        let world = std::sync::Arc::clone(&self.world);
        let received = world.point_to_point(|comm| {
            let me = comm.rank() as usize;
            let to: Vec<(usize, i32, &[f32])> = (0..comm.size() as usize)
                .filter(|&r| r != me)
                .map(|r| (r, msg::STATE, &mine[..]))
                .collect();
            let none = vec![None; self.roles.servers];
            self.swap_with_servers(comm, &to, msg::STATE, call, none, "its optimizer state")
        })?;
        let mut parts = Vec::with_capacity(self.roles.servers);
        for (s, message) in received.into_iter().enumerate() {
            parts.push(match message {
                Some(m) => shard_of_message(&m, &self.roles.server_label(s))?.optimizer,
                None => self.shard_state()?.optimizer,
            });
        }
        NamedOptimizerState::join(parts)
    }

    /// Checks `state` (the whole model's) against the optimizer and loads this server's part
    /// of it. Fails without changing anything when the kind, names or shapes do not match.
    pub(crate) fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        // The whole state is checked against the full optimizer of this server's copy of the
        // model, so that every rank refuses the same states alike.
        self.replica.load_optimizer_state(state)?;
        let part = state
            .restricted_to(&self.trainable_names)
            .to_positional(&self.trainable_names, &self.trainable)?;
        self.optimizer.load_state(&part)
    }

    /// Checks every worker's model against this server's when the model is built, and sends
    /// each its initial weights. A worker whose model differs fails every rank alike.
    pub(crate) fn greet(&mut self, signature: u64, buffer_len: usize) -> Result<()> {
        let world = std::sync::Arc::clone(&self.world);
        world.point_to_point(|comm| {
            let result = self.collect_hellos(comm, signature, buffer_len);
            if let Err(e) = &result {
                self.abort_all(comm, e);
            }
            result
        })
    }

    fn collect_hellos(
        &mut self,
        comm: &SimpleCommunicator,
        signature: u64,
        buffer_len: usize,
    ) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut greeted = vec![false; self.roles.workers];
        let mut backoff = Backoff::default();
        while greeted.iter().any(|g| !g) {
            let Some(m) = msg::try_receive(comm, None) else {
                if Instant::now() >= deadline {
                    let late = greeted.iter().position(|g| !g).unwrap_or(0);
                    return Err(Error::Replica {
                        replica: worker_label(late),
                        reason: format!(
                            "did not build its model within {} of {}",
                            seconds(self.timeout),
                            self.label()
                        ),
                    });
                }
                backoff.wait();
                continue;
            };
            let worker = self.expect_worker(&m)?;
            if m.tag == msg::ALIVE {
                continue;
            }
            if m.tag != msg::HELLO {
                return Err(self.unexpected(&m, "the model's construction"));
            }
            let h = msg::read_header(&m.words)?;
            let theirs = (u64::from(h[1]) << 32) | u64::from(h[2]);
            if theirs != signature || h[3] as usize != buffer_len {
                return Err(Error::Replica {
                    replica: worker_label(worker),
                    reason: format!(
                        "built a model that differs from the parameter servers' (a step buffer \
                         of {} values, signature {theirs:016x}, against {buffer_len} values, \
                         signature {signature:016x}): every rank must build the same model",
                        h[3]
                    ),
                });
            }
            greeted[worker] = true;
            self.states[worker] = State::Idle;
        }
        let reply = self.weights_message(msg::NOT_STALE, None)?;
        let to: Vec<(usize, i32, &[f32])> = (0..self.roles.workers)
            .map(|w| (w, msg::WEIGHTS, &reply[..]))
            .collect();
        msg::send_all(comm, &to, self.timeout, worker_label);
        Ok(())
    }

    /// Serves the workers until every one has ended the current call.
    pub(crate) fn serve(&mut self) -> Result<()> {
        self.call += 1;
        let now = Instant::now();
        for w in 0..self.roles.workers {
            self.heard[w] = now;
            if self.states[w] == State::Ended {
                self.states[w] = State::Idle;
            }
        }
        let world = std::sync::Arc::clone(&self.world);
        world.point_to_point(|comm| {
            let result = self.serve_call(comm);
            if let Err(e) = &result {
                self.abort_all(comm, e);
            }
            result
        })
    }

    /// Tells every other rank that the job failed with `error`.
    fn abort_all(&self, comm: &SimpleCommunicator, error: &Error) {
        let me = comm.rank() as usize;
        msg::send_abort(comm, (0..comm.size() as usize).filter(|&r| r != me), error);
    }

    fn serve_call(&mut self, comm: &SimpleCommunicator) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            if self.states.iter().all(|s| *s == State::Ended) {
                let reply = self.weights_message(msg::NOT_STALE, None)?;
                let to: Vec<(usize, i32, &[f32])> = (0..self.roles.workers)
                    .map(|w| (w, msg::WEIGHTS, &reply[..]))
                    .collect();
                msg::send_all(comm, &to, self.timeout, worker_label);
                return self.share_shards(comm, &reply);
            }
            let mut progressed = false;
            while let Some(m) = msg::try_receive(comm, None) {
                if m.tag == msg::SHARD && self.roles.server_index(m.source).is_some() {
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

    /// At the end of a call, sends this server's final variables (`reply`, a `WEIGHTS`
    /// message) to the other servers and loads theirs into its copy of the model, so that every
    /// rank holds the whole model's weights between calls.
    fn share_shards(&mut self, comm: &SimpleCommunicator, reply: &[f32]) -> Result<()> {
        if self.roles.servers < 2 {
            return Ok(());
        }
        let to: Vec<(usize, i32, &[f32])> = (0..self.roles.servers)
            .filter(|&s| s != self.index)
            .map(|s| (self.roles.server_rank(s), msg::SHARD, reply))
            .collect();
        let early = std::mem::replace(&mut self.others, vec![None; self.roles.servers]);
        let what = format!("its variables at the end of call {}", self.call);
        let received = self.swap_with_servers(comm, &to, msg::SHARD, self.call, early, &what)?;
        let num_stats = self.num_stats;
        let params: Vec<Param> = self.replica.store().iter().cloned().collect();
        for (s, message) in received.iter().enumerate() {
            let Some(message) = message else {
                continue;
            };
            let body = &message[msg::HEADER + num_stats..];
            let layout = &self.sharding.weights[s];
            if body.len() != layout.len() {
                return Err(Error::Replica {
                    replica: self.roles.server_label(s),
                    reason: format!(
                        "sent {} values for its variables where {} expects {}",
                        body.len(),
                        self.label(),
                        layout.len()
                    ),
                });
            }
            let values = Tensor::from_slice(body, body.len(), &Device::Cpu)?;
            for (&i, value) in self.sharding.vars[s].iter().zip(layout.split(&values, 0)?) {
                params[i].var.set(&value)?;
            }
        }
        Ok(())
    }

    /// Sends `to` (messages for other ranks) while it waits for one message with `tag` of call
    /// `call` from every other server, within twice the timeout, starting from those already
    /// `received`; returns them by server index (`None` at this server's own). The error names
    /// a server that sends none in time.
    fn swap_with_servers(
        &self,
        comm: &SimpleCommunicator,
        to: &[(usize, i32, &[f32])],
        tag: i32,
        call: u32,
        mut received: Vec<Option<Vec<f32>>>,
        what: &str,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let patience = self.timeout * 2;
        let deadline = Instant::now() + patience;
        let me = self.index;
        let roles = self.roles;
        let mut backoff = Backoff::default();
        msg::send_all_while(
            comm,
            to,
            patience,
            |r| roles.label(r),
            || {
                let mut progressed = false;
                for s in (0..roles.servers).filter(|&s| s != me) {
                    if received[s].is_some() {
                        continue;
                    }
                    if let Some(m) = msg::try_receive(comm, Some(roles.server_rank(s))) {
                        received[s] = Some(self.words_from_server(m, tag, call, what)?);
                        progressed = true;
                    }
                }
                let Some(late) = (0..roles.servers).find(|&s| s != me && received[s].is_none())
                else {
                    return Ok(true);
                };
                if !progressed {
                    if Instant::now() >= deadline {
                        return Err(Error::Replica {
                            replica: roles.server_label(late),
                            reason: format!(
                                "did not send {what} to {} within {}",
                                self.label(),
                                seconds(patience)
                            ),
                        });
                    }
                    backoff.wait();
                }
                Ok(false)
            },
        )?;
        Ok(received)
    }

    /// The words of `m`, a message from another server that must have `tag` and call `call`;
    /// the error of an abort notice or of another message.
    fn words_from_server(&self, m: Incoming, tag: i32, call: u32, what: &str) -> Result<Vec<f32>> {
        if let Some(error) = m.abort {
            return Err(error);
        }
        if m.tag != tag || msg::read_header(&m.words)?[0] != call {
            return Err(self.unexpected(&m, &format!("the exchange of {what}")));
        }
        Ok(m.words)
    }

    /// Keeps another server's end-of-call variables (`m`, a `SHARD` message) until this server
    /// ends the call too.
    fn keep_shard(&mut self, m: Incoming) -> Result<()> {
        let s = self.roles.server_index(m.source).ok_or_else(|| {
            Error::invalid("a parameter server's variables from a worker (internal error)")
        })?;
        let words = self.words_from_server(m, msg::SHARD, self.call, "the servers' variables")?;
        self.others[s] = Some(words);
        Ok(())
    }

    /// The rank of the worker that sent `m`, or the error of a notice or a stray message.
    fn expect_worker(&self, m: &Incoming) -> Result<usize> {
        if let Some(error) = &m.abort {
            return Err(error.clone());
        }
        if m.source < self.roles.workers {
            Ok(m.source)
        } else {
            Err(self.unexpected(m, "serving the workers"))
        }
    }

    fn unexpected(&self, m: &Incoming, during: &str) -> Error {
        Error::Replica {
            replica: self.roles.label(m.source),
            reason: format!(
                "sent message tag {:#x} to {} during {during} (call {}): the ranks ran \
                 different sequences of fit, evaluate and predict",
                m.tag,
                self.label(),
                self.call
            ),
        }
    }

    fn handle(&mut self, comm: &SimpleCommunicator, m: Incoming) -> Result<()> {
        let worker = self.expect_worker(&m)?;
        if m.tag == msg::ALIVE {
            self.heard[worker] = Instant::now();
            return Ok(());
        }
        let h = msg::read_header(&m.words)?;
        if h[0] != self.call {
            return Err(Error::Replica {
                replica: worker_label(worker),
                reason: format!(
                    "is in call {} of fit/evaluate/predict while {} serves call {}: the ranks \
                     ran different sequences of them",
                    h[0],
                    self.label(),
                    self.call
                ),
            });
        }
        self.heard[worker] = Instant::now();
        match m.tag {
            msg::PULL | msg::FETCH => {
                self.states[worker] = if m.tag == msg::PULL {
                    State::Outstanding { base: self.version }
                } else {
                    State::Idle
                };
                let reply = self.weights_message(msg::NOT_STALE, None)?;
                msg::send_all(
                    comm,
                    &[(worker, msg::WEIGHTS, &reply[..])],
                    self.timeout,
                    worker_label,
                );
            }
            msg::PUSH => {
                let body = &m.words[msg::HEADER..];
                if body.len() != self.layout.len() {
                    return Err(Error::Replica {
                        replica: worker_label(worker),
                        reason: format!(
                            "pushed {} values to {}, which expects {}",
                            body.len(),
                            self.label(),
                            self.layout.len()
                        ),
                    });
                }
                let base = u64::from(h[1]);
                self.states[worker] = State::Pending { base };
                self.pushes.push_back(Push {
                    worker,
                    base,
                    step: h[2],
                    lr: msg::lr_from([h[3], h[4]]),
                    message: m.words,
                });
            }
            msg::TEST => {
                self.tests[worker] = Some((h[1], m.words[msg::HEADER..].to_vec()));
                self.answer_tests(comm)?;
            }
            msg::EPOCH => {
                self.states[worker] = State::AtEpochEnd;
                self.epochs[worker] = Some(m.words[msg::HEADER..].to_vec());
                self.answer_epoch(comm);
            }
            msg::END => {
                self.states[worker] = State::Ended;
            }
            msg::STATE => {
                let reply = self.state_message(self.call)?;
                msg::send_all(
                    comm,
                    &[(worker, msg::STATE, &reply[..])],
                    self.timeout,
                    worker_label,
                );
            }
            msg::LOAD => {
                self.loads[worker] = Some(m.words);
                self.answer_loads(comm)?;
            }
            msg::GATHER => {
                self.gathers[worker] = Some(m.words[msg::HEADER..].to_vec());
                self.answer_gathers(comm);
            }
            _ => return Err(self.unexpected(&m, "serving the workers")),
        }
        Ok(())
    }

    /// Workers still in the call.
    fn active(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.roles.workers).filter(|&w| self.states[w] != State::Ended)
    }

    /// Server 0 answers an evaluation step once every worker in the call sent its sums.
    fn answer_tests(&mut self, comm: &SimpleCommunicator) -> Result<()> {
        if !self.active().all(|w| self.tests[w].is_some()) {
            return Ok(());
        }
        let mut total: Vec<f32> = Vec::new();
        let mut step = None;
        for w in self.active().collect::<Vec<_>>() {
            let Some((s, sums)) = self.tests[w].take() else {
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
            total.resize(total.len().max(sums.len()), 0.0);
            for (t, v) in total.iter_mut().zip(&sums) {
                *t += v;
            }
        }
        let mut reply = msg::header([self.call, 0, 0, 0, 0, 0]);
        reply.extend(total);
        let to: Vec<(usize, i32, &[f32])> = self
            .active()
            .map(|w| (w, msg::TOTALS, &reply[..]))
            .collect();
        msg::send_all(comm, &to, self.timeout, worker_label);
        Ok(())
    }

    /// Once every worker in the call sent a `LOAD`, loads the chief's (the first worker's) and
    /// answers each with the weights after it. The workers load what they read from one file,
    /// so their messages agree; waiting for all keeps any from training on the weights before.
    fn answer_loads(&mut self, comm: &SimpleCommunicator) -> Result<()> {
        let workers: Vec<usize> = self.active().collect();
        if !workers.iter().all(|&w| self.loads[w].is_some()) {
            return Ok(());
        }
        let messages: Vec<Vec<f32>> = workers
            .iter()
            .filter_map(|&w| self.loads[w].take())
            .collect();
        let Some(first) = messages.first() else {
            return Ok(());
        };
        let part = msg::read_header(first)?[1];
        if let Some(w) = workers
            .iter()
            .zip(&messages)
            .find(|(_, m)| msg::read_header(m).map_or(true, |h| h[1] != part))
            .map(|(&w, _)| w)
        {
            return Err(Error::Replica {
                replica: worker_label(w),
                reason: "loaded other parts of a training state than the chief: the workers \
                         ran different programs"
                    .into(),
            });
        }
        let state = TrainingState::from_bytes(&msg::bytes_of(first, 2)?)?;
        match part {
            msg::LOAD_WEIGHTS => self.set_weights(&state.weights)?,
            _ => self.set_optimizer_state(&state.optimizer)?,
        }
        let reply = self.weights_message(msg::NOT_STALE, None)?;
        let to: Vec<(usize, i32, &[f32])> = workers
            .iter()
            .map(|&w| (w, msg::WEIGHTS, &reply[..]))
            .collect();
        for &w in &workers {
            self.states[w] = State::Idle;
        }
        msg::send_all(comm, &to, self.timeout, worker_label);
        Ok(())
    }

    /// Server 0 answers a gather once every worker in the call sent its values: all of them,
    /// in rank order.
    fn answer_gathers(&mut self, comm: &SimpleCommunicator) {
        let workers: Vec<usize> = self.active().collect();
        if !workers.iter().all(|&w| self.gathers[w].is_some()) {
            return;
        }
        let mut reply = msg::header([self.call, 0, 0, 0, 0, 0]);
        for &w in &workers {
            reply.extend(self.gathers[w].take().unwrap_or_default());
        }
        let to: Vec<(usize, i32, &[f32])> = workers
            .iter()
            .map(|&w| (w, msg::TOTALS, &reply[..]))
            .collect();
        msg::send_all(comm, &to, self.timeout, worker_label);
    }

    /// Every server marks a worker at an epoch's end as idle; server 0 answers once every
    /// worker in the call got there, with the staleness and the training totals over all of
    /// them.
    fn answer_epoch(&mut self, comm: &SimpleCommunicator) {
        if !self.active().all(|w| self.states[w] == State::AtEpochEnd) {
            return;
        }
        let mut total: Vec<f32> = Vec::new();
        let workers: Vec<usize> = self.active().collect();
        for &w in &workers {
            if let Some(s) = self.epochs[w].take() {
                total.resize(total.len().max(s.len()), 0.0);
                for (i, (t, v)) in total.iter_mut().zip(&s).enumerate() {
                    // Word 2 is the largest staleness; the others add up.
                    *t = if i == 2 { t.max(*v) } else { *t + v };
                }
            }
            self.states[w] = State::Idle;
        }
        if self.index == 0 {
            let mut reply = msg::header([self.call, 0, 0, 0, 0, 0]);
            reply.extend(total);
            let to: Vec<(usize, i32, &[f32])> = workers
                .iter()
                .map(|&w| (w, msg::TOTALS, &reply[..]))
                .collect();
            msg::send_all(comm, &to, self.timeout, worker_label);
        }
    }

    /// Applies the pushes that may be applied now (see the module documentation); whether any
    /// was.
    fn apply_ready(&mut self, comm: &SimpleCommunicator) -> Result<bool> {
        let mut any = false;
        while let Some(group) = self.next_group() {
            self.apply(comm, group)?;
            any = true;
        }
        Ok(any)
    }

    /// The pushes to apply as the next update, if any may be applied now.
    fn next_group(&mut self) -> Option<Vec<Push>> {
        if self.pushes.is_empty() {
            return None;
        }
        match self.mode {
            Mode::Synchronous => {
                let all_pushed = self
                    .active()
                    .all(|w| matches!(self.states[w], State::Pending { .. }));
                all_pushed.then(|| self.pushes.drain(..).collect())
            }
            Mode::Asynchronous(None) => self.pushes.pop_front().map(|p| vec![p]),
            Mode::Asynchronous(Some(k)) => {
                let next = self.version + 1;
                let oldest_outstanding = self
                    .states
                    .iter()
                    .filter_map(|s| match s {
                        State::Outstanding { base } => Some(*base),
                        _ => None,
                    })
                    .min();
                if oldest_outstanding.is_some_and(|b| next - b > k) {
                    return None;
                }
                let others_fine = self.pushes.iter().skip(1).all(|p| next - p.base <= k);
                if others_fine {
                    self.pushes.pop_front().map(|p| vec![p])
                } else {
                    Some(self.pushes.drain(..).collect())
                }
            }
        }
    }

    /// Applies `group` as one update (the sum of their buffers, by the shared final phase) and
    /// answers each pusher with the weights after it.
    fn apply(&mut self, comm: &SimpleCommunicator, mut group: Vec<Push>) -> Result<()> {
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
        let mut sum = std::mem::take(&mut group[0].message);
        for p in &group[1..] {
            for (s, v) in sum[msg::HEADER..].iter_mut().zip(&p.message[msg::HEADER..]) {
                *s += v;
            }
        }
        let len = sum.len();
        let total =
            Tensor::from_vec(sum, len, &Device::Cpu)?.narrow(0, msg::HEADER, len - msg::HEADER)?;
        let totals = self.layout.read(&total)?;
        let lr = group[0].lr;
        step::finish(
            self.optimizer.as_mut(),
            &self.statistics,
            &self.layout,
            &total,
            &totals,
            &[],
            lr,
        )?;
        let before = self.version;
        if totals.applies() {
            self.version += 1;
        }
        let replies = group
            .iter()
            .map(|p| {
                let stale = if totals.applies() {
                    (before - p.base).min(u64::from(u32::MAX - 1)) as u32
                } else {
                    msg::NOT_STALE
                };
                self.weights_message(
                    stale,
                    Some((&totals.sums, totals.samples, totals.applies())),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        for p in &group {
            self.states[p.worker] = State::Outstanding { base: self.version };
        }
        let to: Vec<(usize, i32, &[f32])> = group
            .iter()
            .zip(&replies)
            .map(|(p, r)| (p.worker, msg::WEIGHTS, &r[..]))
            .collect();
        msg::send_all(comm, &to, self.timeout, worker_label);
        Ok(())
    }

    /// A `WEIGHTS` message: header, the step's sums (zeros when it answers no step), then this
    /// server's variables.
    fn weights_message(
        &self,
        staleness: u32,
        step: Option<(&[f64], usize, bool)>,
    ) -> Result<Vec<f32>> {
        let (sums, samples, applied) = step.unwrap_or((&[], 0, false));
        let mut out = msg::header([
            self.call,
            self.version.min(u64::from(u32::MAX)) as u32,
            u32::from(applied),
            staleness,
            samples as u32,
            0,
        ]);
        let mut s: Vec<f32> = sums.iter().map(|&v| v as f32).collect();
        s.resize(self.num_stats, 0.0);
        out.extend(s);
        out.reserve(self.vars.iter().map(|v| v.elem_count()).sum());
        for v in &self.vars {
            append_values(v.as_tensor(), &mut out)?;
        }
        Ok(out)
    }

    /// Tells the workers that wait for the others at an epoch's end (server 0) or at the
    /// call's end that this server is alive, a few times per timeout, so that their deadline
    /// measures this server's silence, not the others' remaining work.
    fn reassure(&mut self, comm: &SimpleCommunicator) {
        if self.reassured.elapsed() < self.timeout / 4 {
            return;
        }
        self.reassured = Instant::now();
        let note = msg::header([self.call, 0, 0, 0, 0, 0]);
        for w in 0..self.roles.workers {
            let waits = match self.states[w] {
                State::AtEpochEnd => self.index == 0,
                State::Ended => true,
                _ => false,
            };
            if waits {
                comm.process_at_rank(w as i32)
                    .buffered_send_with_tag(&note[..], msg::WAITING);
            }
        }
    }

    /// Fails naming a worker that this server waits on and that has been silent for the
    /// timeout. A worker computing a step owes a push; the others are waited on only while
    /// someone waits for them (a synchronous step, an evaluation sum, an epoch's or the call's
    /// end).
    fn check_silence(&self) -> Result<()> {
        let now = Instant::now();
        let someone_waits = !self.pushes.is_empty()
            || self.tests.iter().any(Option::is_some)
            || self.loads.iter().any(Option::is_some)
            || self.gathers.iter().any(Option::is_some)
            || self
                .states
                .iter()
                .any(|s| matches!(s, State::AtEpochEnd | State::Ended));
        for w in 0..self.roles.workers {
            let owes = match self.states[w] {
                State::Outstanding { .. } => true,
                State::Idle => someone_waits,
                State::Pending { .. } | State::AtEpochEnd | State::Ended => false,
            };
            if owes && now.duration_since(self.heard[w]) > self.timeout {
                return Err(Error::Replica {
                    replica: worker_label(w),
                    reason: format!(
                        "sent nothing to {} for {} (it died or stalls)",
                        self.label(),
                        seconds(self.timeout)
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The shard of a training state that a `STATE` message from `server` carries.
pub(crate) fn shard_of_message(message: &[f32], server: &str) -> Result<TrainingState> {
    msg::bytes_of(message, 2)
        .and_then(|bytes| TrainingState::from_bytes(&bytes))
        .map_err(|e| Error::Replica {
            replica: server.to_string(),
            reason: format!("sent a training state that cannot be read: {e}"),
        })
}

/// Appends a CPU tensor's values, as `f32`, to `out`: straight from its storage when it is a
/// contiguous `f32` tensor.
fn append_values(t: &Tensor, out: &mut Vec<f32>) -> Result<()> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(values)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            out.extend_from_slice(&values[a..b]);
            return Ok(());
        }
    }
    out.extend(
        t.flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?,
    );
    Ok(())
}
