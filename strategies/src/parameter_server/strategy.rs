//! `ParameterServerStrategy` and the model it distributes: a worker's or a server's part,
//! depending on the rank.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use kandle::data::Batch;
use kandle::layers::Summary;
use kandle::optimizers::NamedOptimizerState;
use kandle::params::Weights;
use kandle::strategy::{
    DistributedModel, ModelSpec, Replica, StepStats, Strategy, WorkerHooks, WorkerInfo,
};
use kandle::{Error, Result};

use super::server::{Mode, Server};
use super::shards::Sharding;
use super::worker::Worker;
use super::Roles;
use crate::mpi::world::World;
use crate::replica_set::DEFAULT_TIMEOUT;

/// The environment variable that gives the number of parameter servers when the program does
/// not ([`ParameterServerStrategy::num_ps`]).
pub const NUM_PS_ENV: &str = "KANDLE_NUM_PS";

/// Data parallelism over parameter servers, on MPI: the variables live on P server processes,
/// and W worker processes pull them, compute gradients on their shard of every global batch,
/// and push the gradients to the servers, which apply them.
///
/// Launched as `mpirun -n W+P <binary>`: the last P ranks are the servers
/// ([`num_ps`](Self::num_ps), default 1, or [`KANDLE_NUM_PS`](NUM_PS_ENV)), the others are
/// workers, and the first worker (rank 0) is the chief, which shows progress and writes files.
/// The same program runs on every rank: on a server, `fit`, `evaluate` and `predict` serve the
/// workers until they end the same call, then return (with an empty history, empty logs or no
/// predictions).
///
/// **Placement.** Each variable lives whole on one server, placed by size, largest first, on
/// the least loaded server ([`partition`](crate::partition::partition)); each server keeps the
/// optimizer state of its variables and applies their updates. A push and a pull are one
/// message per server (MPI point-to-point), not one per variable.
///
/// **Synchronous** ([`synchronous`](Self::synchronous)): each step, every server sums the
/// workers' step buffers and applies one update, divided by the global sample count, exactly as
/// [`MirroredStrategy`](crate::MirroredStrategy) does: W workers at global batch B train as one
/// device at B.
///
/// **Asynchronous** (the default, as in TensorFlow): each worker pushes its gradients, which the
/// servers apply at once (divided by the worker's own sample count), and trains on the weights
/// they send back. The *staleness* of an update is the number of updates a server applied
/// between the weights the gradients were computed on and their own; with
/// [`max_staleness(k)`](Self::max_staleness) no update is applied more than `k` updates stale (a
/// worker whose push would be, or would make another's, waits). Every epoch logs
/// `staleness_mean` and `staleness_max` over every worker's applied updates.
///
/// **What the rest means here**, in both modes:
/// - an epoch ends when every worker has ended its shard of it (workers wait for each other at
///   the end of each epoch in asynchronous mode; in synchronous mode they are in step anyway);
/// - the learning rate of an update is the one its worker trained with (the schedule, by epoch,
///   is the same on every worker, since epochs end together);
/// - batch norm's moving statistics live on the servers like any variable: an update sets them
///   to the sample-weighted mean of those its workers computed from the weights they pulled;
/// - a step's logs (what `on_train_batch_end` sees) are those of the update that applied this
///   worker's gradients (the whole global batch in synchronous mode, the worker's own batch in
///   asynchronous mode); an epoch's logs cover every worker's steps in both modes, so that every
///   worker's callbacks decide alike; validation and `evaluate` fetch the servers' current
///   weights and sum every worker's shard.
///
/// **Failures.** A worker that dies or stalls while a server waits on it makes that server fail
/// within the [timeout](Self::timeout), naming it, and tell every other rank, which fail with the
/// same error. A server that stops answering is named by the workers within twice the timeout.
/// A server applies only whole steps: a step buffer arrives whole in one message, and a step
/// whose loss or gradients are not finite on any worker is left out by every server. Return the
/// error from `main`: the MPI job cannot continue after it.
///
/// **Training state.** The optimizer state lives on the servers. `Model::save` gathers it from
/// them (call it on every rank, as the same program does; the chief writes) and `Model::load`
/// gives each server its part; during `fit`, `BackupAndRestore`'s backups ask the servers for
/// their parts, and a resume loads them onto the servers once every worker has asked the same.
/// `set_weights` during a call likewise waits for every worker and loads the chief's weights.
///
/// **Limits.** Workers train on one CPU replica each. Between calls every rank holds the whole
/// model's final weights (the servers exchange theirs at the end of each call), but during a
/// call a worker holds those it last got and a server only its own current ones.
///
/// ```no_run
/// use kandle::prelude::*;
/// use kandle_strategies::ParameterServerStrategy;
///
/// // mpirun -n 3 ./train: 2 workers and 1 parameter server
/// let strategy = ParameterServerStrategy::from_env()?.num_ps(1); // the one line that changes
/// let net = Sequential::new().add(Flatten).add(Dense::new(10)).add(Activation::Softmax);
/// let mut model = net.compile(Sgd::new(0.1), SparseCategoricalCrossentropy::new(), [Accuracy], &strategy)?;
/// let data = kandle::data::digits::load()?;
/// model.fit(&data, FitOptions { batch_size_per_replica: 16, ..Default::default() })?;
/// model.save_weights("digits.safetensors")?; // the chief writes
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Clone)]
pub struct ParameterServerStrategy {
    world: Arc<World>,
    num_ps: usize,
    mode: Mode,
    timeout: Duration,
}

impl std::fmt::Debug for ParameterServerStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParameterServerStrategy")
            .field("rank", &self.world.rank())
            .field("size", &self.world.size())
            .field("num_ps", &self.num_ps)
            .field("mode", &self.mode)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ParameterServerStrategy {
    /// Joins the MPI job this process was launched in, initialising MPI once per process (the
    /// world is shared with any other MPI strategy of the process). The number of servers is
    /// [`KANDLE_NUM_PS`](NUM_PS_ENV) when set, else 1; asynchronous mode, no staleness bound,
    /// a 60 s timeout.
    ///
    /// Fails if MPI cannot provide thread level `Serialized`, or `KANDLE_NUM_PS` is not a
    /// positive number. A launch with no rank left for a worker fails when the model is built.
    pub fn from_env() -> Result<Self> {
        let num_ps = match std::env::var(NUM_PS_ENV) {
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "{NUM_PS_ENV}=`{v}`: the number of parameter servers must be a positive \
                     integer"
                    ))
                })?,
            Err(_) => 1,
        };
        Ok(Self {
            world: World::get()?,
            num_ps,
            mode: Mode::Asynchronous(None),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The number of parameter servers: the last `num_ps` ranks of the job.
    pub fn num_ps(mut self, num_ps: usize) -> Self {
        self.num_ps = num_ps;
        self
    }

    /// Synchronous training: one update per step from every worker's gradients.
    pub fn synchronous(mut self) -> Self {
        self.mode = Mode::Synchronous;
        self
    }

    /// Asynchronous training (the default): each worker's gradients are applied as they come.
    /// Keeps a staleness bound set before.
    pub fn asynchronous(mut self) -> Self {
        if self.mode == Mode::Synchronous {
            self.mode = Mode::Asynchronous(None);
        }
        self
    }

    /// Asynchronous training in which no update is applied more than `k` updates stale: a
    /// worker waits rather than push gradients older than that, or make another worker's so.
    pub fn max_staleness(mut self, k: u64) -> Self {
        self.mode = Mode::Asynchronous(Some(k));
        self
    }

    /// How long a rank waits for another before failing with an error that names it
    /// (default 60 s; a worker waits twice as long for a server, which may itself wait for a
    /// worker).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Number of parameter servers.
    pub fn servers(&self) -> usize {
        self.num_ps
    }

    /// Number of workers: the ranks that are not servers (0 when there are too few ranks).
    pub fn workers(&self) -> usize {
        self.world.size().saturating_sub(self.num_ps)
    }

    /// Whether this rank is a parameter server.
    pub fn is_server(&self) -> bool {
        self.world.rank() >= self.workers()
    }

    fn roles(&self) -> Result<Roles> {
        let (size, servers) = (self.world.size(), self.num_ps);
        if servers == 0 {
            return Err(Error::invalid(
                "ParameterServerStrategy needs at least one parameter server (num_ps(0))",
            ));
        }
        if servers >= size {
            return Err(Error::invalid(format!(
                "ParameterServerStrategy: a job of {size} rank(s) with {servers} parameter \
                 server(s) leaves no worker; launch mpirun -n W+{servers} with at least one \
                 worker (W >= 1)"
            )));
        }
        Ok(Roles {
            workers: size - servers,
            servers,
        })
    }
}

impl Strategy for ParameterServerStrategy {
    fn name(&self) -> &str {
        "parameter_server"
    }

    fn num_replicas_in_sync(&self) -> usize {
        self.workers().max(1)
    }

    fn local_replicas(&self) -> usize {
        1
    }

    fn worker(&self) -> WorkerInfo {
        WorkerInfo {
            rank: self.world.rank(),
            size: self.workers().max(1),
        }
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        let roles = self.roles()?;
        let replica = Replica::new(spec, &Device::Cpu)?;
        let sharding = Sharding::new(replica.store(), replica.layout(), roles.servers)?;
        let world = Arc::clone(&self.world);
        if roles.server_index(world.rank()).is_some() {
            let (signature, len) = (sharding.signature, replica.layout().len());
            let mut server = Server::new(
                world,
                roles,
                spec,
                replica,
                &sharding,
                self.mode,
                self.timeout,
            )?;
            server.greet(signature, len)?;
            Ok(Box::new(PsModel::Server(Box::new(server))))
        } else {
            let worker = Worker::new(world, roles, self.mode, self.timeout, replica, sharding)?;
            Ok(Box::new(PsModel::Worker(Box::new(worker))))
        }
    }
}

/// What a rank holds: a worker's copy of the model, or a server's shard.
enum PsModel {
    Worker(Box<Worker>),
    Server(Box<Server>),
}

impl PsModel {
    fn replica(&self) -> &Replica {
        match self {
            PsModel::Worker(w) => w.replica(),
            PsModel::Server(s) => s.replica(),
        }
    }

    fn worker(&mut self, what: &str) -> Result<&mut Worker> {
        match self {
            PsModel::Worker(w) => Ok(w),
            PsModel::Server(_) => Err(Error::invalid(format!(
                "{what} on a parameter server: a server serves in fit, evaluate and predict and \
                 runs no step of its own"
            ))),
        }
    }
}

impl WorkerHooks for PsModel {
    fn serve(&mut self) -> Result<bool> {
        match self {
            PsModel::Server(s) => s.serve().map(|()| true),
            PsModel::Worker(w) => {
                w.begin_call();
                Ok(false)
            }
        }
    }

    fn end_epoch(&mut self, totals: &mut StepStats) -> Result<Vec<(String, f64)>> {
        match self {
            PsModel::Worker(w) => w.end_epoch(totals),
            PsModel::Server(_) => Ok(Vec::new()),
        }
    }

    fn end_call(&mut self) -> Result<()> {
        match self {
            PsModel::Worker(w) => w.end_call(),
            PsModel::Server(_) => Ok(()),
        }
    }

    fn all_gather_workers(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        self.worker("a gather across the workers")?
            .all_gather(values)
    }
}

impl DistributedModel for PsModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        self.worker("a training step")?.train(batch, lr)
    }

    fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        self.worker("gradient accumulation")?.accumulate(batch)
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        self.worker("an evaluation step")?.test(batch)
    }

    fn predict_step(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.worker("a prediction")?.predict(inputs)
    }

    fn weights(&self) -> Result<Weights> {
        match self {
            PsModel::Worker(w) => w.weights(),
            PsModel::Server(s) => crate::replica_set::cpu_weights(s.replica().store()),
        }
    }

    fn summary(&self) -> &Summary {
        self.replica().summary()
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        match self {
            PsModel::Worker(w) => w.set_weights(weights),
            PsModel::Server(s) => s.set_weights(weights),
        }
    }

    fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        match self {
            PsModel::Worker(w) => w.optimizer_state(),
            PsModel::Server(s) => s.optimizer_state(),
        }
    }

    fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        match self {
            PsModel::Worker(w) => w.set_optimizer_state(state),
            PsModel::Server(s) => s.set_optimizer_state(state),
        }
    }
}
