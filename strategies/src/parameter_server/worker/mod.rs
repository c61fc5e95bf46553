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
//!
//! - `exchange`: sending messages to servers and waiting for their answers, under the
//!   deadlines above, with the worker's liveness notes to the other servers;
//! - `steps`: a training step's push and the pull of the weights it trains on, and gradient
//!   accumulation;
//! - `evaluation`: evaluation and prediction on the servers' current weights, and what every
//!   worker sums or gathers through server 0: an evaluation step's sums, an epoch's totals (the
//!   epoch barrier, with the staleness of its updates), the gather;
//! - `state`: the training state to and from the servers: the optimizer state joined from their
//!   shards, and weights or optimizer state loaded on them.

mod evaluation;
mod exchange;
mod state;
mod steps;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};

use kandle::params::Weights;
use kandle::strategy::Replica;
use kandle::{Error, Result};

use super::protocol::{Kind, Message, Snapshot, Staleness};
use super::server::Mode;
use super::shards::Sharding;
use super::transport;
use super::Roles;
use crate::mpi::worker_label;
use crate::mpi::world::World;
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

/// The variables a `Weights` answer carries.
fn weights_of(message: Message) -> Option<Snapshot> {
    match message {
        Message::Weights(snapshot) => Some(snapshot),
        _ => None,
    }
}
