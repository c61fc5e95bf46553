//! `Server`: one parameter server. It holds its shard of the model, answers every worker's
//! messages during one `fit`, `evaluate` or `predict`, and applies the pushed gradients.
//!
//! - `variables`: the server's variables, their optimizer state and the version (the number of
//!   updates applied), and the update that applies a sum of step buffers;
//! - `workers`: what the server knows of each worker: where it is in the call, when it was
//!   last heard from, and what it sent that waits for every other worker's;
//! - `schedule`: when pushes are applied: synchronously, or asynchronously with an optional
//!   staleness bound;
//! - `serving`: the loop that serves one call: it takes every message as it comes
//!   (`MPI_Improbe` on any source, with short sleeps when idle), answers it, applies the pushes
//!   the schedule allows, and names a silent worker;
//! - `peers`: what the servers send each other: their variables at the end of a call, and their
//!   shards of the optimizer state between calls.
//!
//! A worker this server waits on (for its push, an evaluation sum, an epoch end or the end of
//! the call) that sends nothing for the timeout fails the server with an error naming it; the
//! server then sends every other rank an abort notice with that error before it returns it.

mod peers;
mod schedule;
mod serving;
mod variables;
mod workers;

use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::optimizers::NamedOptimizerState;
use kandle::params::Weights;
use kandle::strategy::{ModelSpec, Replica};
use kandle::training_state::TrainingState;
use kandle::{Error, Result};

pub(crate) use schedule::Mode;

use super::protocol::{Kind, Message, Snapshot};
use super::shards::Sharding;
use super::transport::{self, Incoming};
use super::Roles;
use crate::mpi::poll::Backoff;
use crate::mpi::world::World;
use crate::mpi::{seconds, worker_label};
use schedule::Schedule;
use variables::Variables;
use workers::{Position, Workers};

/// One parameter server.
pub(crate) struct Server {
    world: Arc<World>,
    roles: Roles,
    /// This server's index among the servers.
    index: usize,
    timeout: Duration,
    /// The call of `fit`, `evaluate` or `predict` being served, from 1 (0 while the model is
    /// built).
    call: u32,
    variables: Variables,
    workers: Workers,
    schedule: Schedule,
    /// The other servers' variables at the end of the current call, taken while this server
    /// still serves it.
    early_shards: Vec<Option<Snapshot>>,
    /// The other servers' optimizer states for the next training-state exchange, taken while
    /// this server still greets the workers: a server that has its workers' greetings first
    /// may go on to the exchange before this one has all of them.
    early_states: Vec<Option<Vec<u8>>>,
}

impl Server {
    /// Builds this server's shard of `spec` (server `index` of the placement `sharding`).
    pub(crate) fn new(
        world: Arc<World>,
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
        Ok(Self {
            world,
            roles,
            index,
            timeout,
            call: 0,
            variables: Variables::new(spec, replica, sharding, index)?,
            workers: Workers::new(roles.workers),
            schedule: Schedule::new(mode),
            early_shards: vec![None; roles.servers],
            early_states: vec![None; roles.servers],
        })
    }

    /// The server's name in messages: `parameter server 1 (rank 3)`.
    fn label(&self) -> String {
        self.roles.server_label(self.index)
    }

    /// The whole model this server built; only this server's variables are current.
    pub(crate) fn replica(&self) -> &Replica {
        self.variables.replica()
    }

    /// Sets every variable of this server's copy of the model (its shard's, and the others it
    /// holds between calls) from `weights`, the whole model's. Fails without changing anything
    /// when the names or shapes do not match.
    pub(crate) fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.variables.set_weights(weights)
    }

    /// Checks `state` (the whole model's) against the optimizer and loads this server's part
    /// of it. Fails without changing anything when the kind, names or shapes do not match.
    pub(crate) fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        self.variables.set_optimizer_state(state)
    }

    /// Checks every worker's model against this server's when the model is built, and sends
    /// each its initial weights. A worker whose model differs fails every rank alike.
    pub(crate) fn greet(&mut self, signature: u64, buffer_len: usize) -> Result<()> {
        let world = Arc::clone(&self.world);
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
            let Some(m) = transport::try_receive(comm, &self.roles, None)? else {
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
            if matches!(m.message, Message::State { .. })
                && self.roles.server_index(m.source).is_some()
            {
                self.keep_state(m)?;
                continue;
            }
            let worker = self.expect_worker(&m)?;
            let (theirs, len) = match m.message {
                Message::Alive => continue,
                Message::Hello {
                    signature,
                    buffer_len,
                } => (signature, buffer_len),
                other => {
                    return Err(self.unexpected(worker, other.kind(), "the model's construction"))
                }
            };
            if theirs != signature || len != buffer_len as u64 {
                return Err(Error::Replica {
                    replica: worker_label(worker),
                    reason: format!(
                        "built a model that differs from the parameter servers' (a step buffer \
                         of {len} values, signature {theirs:016x}, against {buffer_len} values, \
                         signature {signature:016x}): every rank must build the same model"
                    ),
                });
            }
            greeted[worker] = true;
            self.workers.place(worker, Position::Idle);
        }
        let workers: Vec<usize> = (0..self.roles.workers).collect();
        self.send_weights(comm, &workers)
    }

    /// Serves the workers until every one has ended the current call.
    pub(crate) fn serve(&mut self) -> Result<()> {
        self.call += 1;
        self.workers.begin_call();
        let world = Arc::clone(&self.world);
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
        transport::send_abort(comm, (0..comm.size() as usize).filter(|&r| r != me), error);
    }

    /// Sends `message`, as part of the current call, to each worker of `workers`.
    fn send_to(&self, comm: &SimpleCommunicator, workers: &[usize], message: &Message) {
        let encoded = message.encode(self.call);
        let to: Vec<(usize, _)> = workers.iter().map(|&w| (w, &encoded)).collect();
        transport::send_all(comm, &self.roles, &to, self.timeout);
    }

    /// Sends this server's current weights to each worker of `workers`.
    fn send_weights(&self, comm: &SimpleCommunicator, workers: &[usize]) -> Result<()> {
        let weights = Message::Weights(self.variables.snapshot(None, None)?);
        self.send_to(comm, workers, &weights);
        Ok(())
    }

    /// The rank of the worker that sent `m`, or the error of an abort notice or a stray
    /// message.
    fn expect_worker(&self, m: &Incoming) -> Result<usize> {
        if let Some(error) = m.abort_error() {
            return Err(error);
        }
        if m.source < self.roles.workers {
            Ok(m.source)
        } else {
            Err(self.unexpected(m.source, m.message.kind(), "serving the workers"))
        }
    }

    /// The error for a message of `kind` from rank `source`, which has no place `during` what
    /// the server does.
    fn unexpected(&self, source: usize, kind: Kind, during: &str) -> Error {
        Error::Replica {
            replica: self.roles.label(source),
            reason: format!(
                "sent message tag {:#x} to {} during {during} (call {}): the ranks ran \
                 different sequences of fit, evaluate and predict",
                kind.tag(),
                self.label(),
                self.call
            ),
        }
    }
}

/// The shard of a training state that a `State` message from `server` carries, as `bytes`.
pub(crate) fn read_shard_state(bytes: &[u8], server: &str) -> Result<TrainingState> {
    TrainingState::from_bytes(bytes).map_err(|e| Error::Replica {
        replica: server.to_string(),
        reason: format!("sent a training state that cannot be read: {e}"),
    })
}
