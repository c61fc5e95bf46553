//! `MultiWorkerMirroredStrategy` and the model it distributes: Mirrored inside each worker
//! process, then one guarded all-reduce of the fused step buffer across workers, over MPI on the
//! host or over NCCL on the GPUs; with gradient buckets the gradients cross workers in buckets
//! during the backward pass instead (`gradient_buckets.rs`, over either), and the all-reduce at
//! the end sums the rest.

use std::sync::Arc;
#[cfg(feature = "nccl")]
use std::sync::Mutex;
use std::time::Duration;

use candle_core::{Device, Storage, Tensor};
use kandle::data::Batch;
use kandle::strategy::step::StepLayout;
use kandle::strategy::{DistributedModel, ModelSpec, StepStats, Strategy, WorkerInfo};
use kandle::{Error, Result};

use super::communication::CommunicationImplementation;
use super::gradient_buckets::{CrossWorkerBuckets, Route};
#[cfg(feature = "nccl")]
use super::nccl::Clique;
use super::sync_batch_norm::CrossWorkerSum;
use crate::bucket_exchange::OuterBucketSum;
use crate::cross_device_ops::CrossDeviceOps;
use crate::mpi::watchdog::Phase;
use crate::mpi::world::World;
use crate::rendezvous::{OuterSum, Rendezvous, OUTER_PATIENCE};
use crate::replica_set::{
    fuse_store, load_fused, replica_devices, Reduce, ReplicaModel, ReplicaOptions, ReplicaSet,
};

/// Synchronous data parallelism across worker processes launched by `mpirun`, each with one or
/// more local replicas.
///
/// Rank, size and the chief (rank 0) come from `MPI_COMM_WORLD`. Each worker reads only its
/// shard of every global batch, and its local replicas compute gradients as
/// [`MirroredStrategy`](crate::MirroredStrategy) does. The fused step buffer (gradients, loss
/// and metric sums, sample count, moving statistics) then crosses workers in one all-reduce,
/// and every replica of every worker applies the same update, so a model trains as one device
/// would at the same global batch. Every worker must run the same model with as many local
/// devices (checked when the model is distributed).
///
/// **Across workers**, [`communication`](Self::communication) picks the library:
/// - MPI (CPU replicas, or a build without `nccl`): the local replicas' sum, reduced with the
///   [`CrossDeviceOps`], is copied to the host and summed with one `MPI_Allreduce`;
/// - NCCL (features `mpi` and `nccl`, every local device a distinct GPU): one NCCL all-reduce
///   over every GPU of every worker sums the replicas' buffers on the GPUs, local and remote at
///   once, with no host staging (worker `w` of `L` GPUs holds NCCL ranks `w * L ..`). The chief
///   creates NCCL's unique id and broadcasts it through MPI. The initial weight broadcast and
///   the evaluation sums still go through MPI, as do SyncBatchNorm's exchanges.
///
/// Either way, with [`gradient_buckets`](ReplicaOptions::gradient_buckets) (the default) and
/// without SyncBatchNorm, the gradients cross workers in buckets while the backward passes go
/// on, each bucket one guarded all-reduce of the same library (PyTorch DDP's overlap), and the
/// all-reduce at the end of the step sums the rest of the buffer.
///
/// **Batch normalisation** uses each replica's part of the batch by default, and the moving
/// statistics are averaged over every replica of every worker. With
/// [`sync_batch_norm`](ReplicaOptions::sync_batch_norm), it normalises with the statistics of
/// the whole global batch, and its backward pass sums their gradients the same way: the local
/// replicas meet in process, and their total crosses workers with one small MPI all-reduce per
/// exchange (two per batch-norm layer in the forward pass, and as many in the backward pass), on
/// the host. The model then trains as one device would, batch norm included.
///
/// **Failures.** A worker that dies or stalls makes the others fail within the
/// [timeout](ReplicaOptions::timeout) with an error naming it ([`kandle::Error::Replica`], e.g.
/// `worker 1: did not reach training step 57 within 60 s`), before a collective starts or, if it
/// stops inside one, when the collective's deadline passes: an MPI collective cannot be
/// cancelled, so that ends the job with `MPI_Abort`, while NCCL's communicators are aborted and
/// the step returns the error. After such an error the MPI job cannot continue: return the
/// error from `main` so that the process exits non-zero and `mpirun` ends the others. Dropping
/// the strategy after a failure skips `MPI_Finalize`, so it never hangs.
///
/// **Limits.** The NCCL path is compile-checked in CI but has no automated test on GPUs here;
/// it needs NCCL 2.14 or newer (non-blocking communicators) and one replica per GPU. A GPU that
/// hangs on its own (rather than waiting for a peer) is not recovered by aborting NCCL. Under
/// SyncBatchNorm, a worker with no samples in a step (a short last batch with fewer samples than
/// workers) joins the others' exchanges with zeros, shaped after its previous step, so such a
/// batch cannot be the model's first step (use `drop_remainder`).
///
/// ```no_run
/// use kandle::prelude::*;
/// use kandle_strategies::MultiWorkerMirroredStrategy;
///
/// // mpirun -n 2 ./train
/// let strategy = MultiWorkerMirroredStrategy::from_env()?; // the one line that changes
/// let net = Sequential::new().add(Flatten).add(Dense::new(10)).add(Activation::Softmax);
/// let mut model = net.compile(Sgd::new(0.1), SparseCategoricalCrossentropy::new(), [Accuracy], &strategy)?;
/// let data = kandle::data::digits::load()?;
/// model.fit(&data, FitOptions { batch_size_per_replica: 16, ..Default::default() })?;
/// model.save_weights("digits.safetensors")?; // the chief writes
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Clone)]
pub struct MultiWorkerMirroredStrategy {
    world: Arc<World>,
    devices: Vec<Device>,
    options: ReplicaOptions,
    ops: CrossDeviceOps,
    communication: CommunicationImplementation,
}

impl std::fmt::Debug for MultiWorkerMirroredStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiWorkerMirroredStrategy")
            .field("rank", &self.world.rank())
            .field("size", &self.world.size())
            .field("devices", &self.devices)
            .field("options", &self.options)
            .field("ops", &self.ops)
            .field("communication", &self.communication)
            .finish()
    }
}

impl MultiWorkerMirroredStrategy {
    /// Joins the MPI job this process was launched in (`mpirun -n W <binary>`), initialising
    /// MPI once per process; every strategy of the process shares it. A binary started without
    /// `mpirun` is a job of one worker. Each worker has one CPU replica until
    /// [`local_devices`](Self::local_devices) or [`local_replicas_cpu`](Self::local_replicas_cpu)
    /// says otherwise.
    ///
    /// Fails if MPI cannot provide thread level `Serialized`, or was finalised already because
    /// every earlier strategy of the process was dropped.
    pub fn from_env() -> Result<Self> {
        Ok(Self {
            world: World::get()?,
            devices: vec![Device::Cpu],
            options: ReplicaOptions::default(),
            ops: CrossDeviceOps::default(),
            communication: CommunicationImplementation::default(),
        })
    }

    /// One replica per device in this worker (Mirrored inside the worker). Fails on an empty
    /// list.
    pub fn local_devices(mut self, devices: Vec<Device>) -> Result<Self> {
        self.devices = replica_devices(devices, NAME)?;
        Ok(self)
    }

    /// `replicas` CPU replicas in this worker. Fails on 0.
    pub fn local_replicas_cpu(self, replicas: usize) -> Result<Self> {
        self.local_devices(vec![Device::Cpu; replicas])
    }

    /// How the local replicas sum their gradients before the buffer crosses processes over MPI
    /// (default [`CrossDeviceOps::ReductionToOneDevice`]). The NCCL path sums local and remote
    /// replicas in one all-reduce and does not use it.
    pub fn cross_device_ops(mut self, ops: CrossDeviceOps) -> Self {
        self.ops = ops;
        self
    }

    /// Which library carries the fused buffer between workers (default
    /// [`CommunicationImplementation::Auto`]: NCCL for GPU replicas in a build with `nccl`, MPI
    /// otherwise). [`CommunicationImplementation::Nccl`] where NCCL cannot be used makes
    /// distributing a model fail with the reason.
    pub fn communication(mut self, communication: CommunicationImplementation) -> Self {
        self.communication = communication;
        self
    }

    /// How the local replicas run: SyncBatchNorm (across every worker), the timeout (for a
    /// replica or a worker), threads per local replica (default [`ReplicaOptions::default`]).
    pub fn with_options(self, options: ReplicaOptions) -> Self {
        Self { options, ..self }
    }

    /// The local replicas' options.
    pub fn options(&self) -> &ReplicaOptions {
        &self.options
    }

    /// This worker's local devices.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Sums `buffer` element-wise over all workers, in place, by exactly the guarded path that
    /// every training step takes with its fused buffer: the watchdog's heartbeat rendezvous
    /// (every worker proves it reached this call, within the
    /// [timeout](ReplicaOptions::timeout)), then a non-blocking `MPI_Iallreduce` polled against
    /// the same deadline. Every worker must call it, with buffers of the same length, in the same
    /// order as its other collectives.
    ///
    /// It is there for measuring that path against a raw `MPI_Allreduce` (the
    /// `bench_allreduce` example) and for custom reductions between steps. The buffer's
    /// allocation is swapped with the receive buffer of the previous all-reduce, so repeated
    /// calls with one length allocate nothing.
    ///
    /// Errors are those of a training step: a worker that does not arrive in time is named, and
    /// the MPI world is unusable afterwards.
    pub fn all_reduce_sum(&self, buffer: &mut Vec<f32>) -> Result<()> {
        self.world
            .all_reduce_sum(buffer, Phase::Direct, self.options.timeout)
    }
}

/// The strategy's name in messages.
const NAME: &str = "MultiWorkerMirroredStrategy";

impl Strategy for MultiWorkerMirroredStrategy {
    fn name(&self) -> &str {
        "multi_worker_mirrored"
    }

    fn num_replicas_in_sync(&self) -> usize {
        self.world.size() * self.devices.len()
    }

    fn local_replicas(&self) -> usize {
        self.devices.len()
    }

    fn worker(&self) -> WorkerInfo {
        WorkerInfo {
            rank: self.world.rank(),
            size: self.world.size(),
        }
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        let (devices, timeout) = (&self.devices, self.options.timeout);
        let nccl = self.communication.uses_nccl(devices)?;
        let cross_worker_bn = self
            .options
            .sync_batch_norm
            .then(|| Arc::new(CrossWorkerSum::new(Arc::clone(&self.world), timeout)));
        let rendezvous = cross_worker_bn.as_ref().map(|sum| {
            let outer = Arc::clone(sum) as Arc<dyn OuterSum>;
            Arc::new(Rendezvous::new(devices.len(), timeout).with_outer(outer))
        });
        let bucket_bytes = self.bucket_bytes();
        // A replica's share of a step then includes guarded exchanges across workers: it gets as
        // long as the rendezvous, so that the watchdog's error, which names a late worker,
        // arrives first.
        let replica_timeout = if cross_worker_bn.is_some() || bucket_bytes.is_some() {
            timeout * OUTER_PATIENCE
        } else {
            timeout
        };
        let mut set = ReplicaSet::new(
            spec,
            devices,
            rendezvous,
            replica_timeout,
            self.options.threads_per_replica,
        )?;
        self.check_agreement(&set.layout, nccl, bucket_bytes)?;
        let transport = if nccl {
            nccl_transport(&self.world, devices, timeout)?
        } else {
            Transport::Mpi
        };
        let buckets = match bucket_bytes {
            Some(bytes) => {
                let route = transport.bucket_route();
                let world = Arc::clone(&self.world);
                let sum = Arc::new(CrossWorkerBuckets::new(world, timeout, route));
                let outer = Arc::clone(&sum) as Arc<dyn OuterBucketSum>;
                set.use_buckets(self.ops, bytes, replica_timeout, Some(outer))?;
                Some(sum)
            }
            None => None,
        };
        // Every worker built the same seeded model; the chief's weights make sure of it.
        let mut weights = host_vec(&fuse_store(&set.stores[0])?)?;
        self.world
            .broadcast_from_chief(&mut weights, Phase::Distribute, timeout)?;
        let len = weights.len();
        let weights = Tensor::from_vec(weights, len, &Device::Cpu)?;
        for store in &set.stores {
            load_fused(store, &weights)?;
        }
        Ok(Box::new(ReplicaModel {
            set,
            reduce: CrossWorker {
                world: Arc::clone(&self.world),
                ops: self.ops,
                transport,
                cross_worker_bn,
                buckets,
                timeout,
                train_steps: 0,
                test_steps: 0,
                host: Vec::new(),
                in_call: false,
            },
        }))
    }
}

impl MultiWorkerMirroredStrategy {
    /// The size of the gradient buckets summed across workers during the backward passes, when
    /// they are: [`ReplicaOptions::gradient_buckets`] without SyncBatchNorm, whose exchanges
    /// across workers in the backward pass would otherwise interleave with the buckets'
    /// differently on different workers.
    fn bucket_bytes(&self) -> Option<usize> {
        self.options
            .gradient_buckets
            .filter(|_| !self.options.sync_batch_norm)
    }

    /// Fails, on every worker alike, unless every worker runs as many local replicas, the same
    /// step buffer, the same library across workers and the same batch normalisation: otherwise
    /// their collectives would not match.
    fn check_agreement(
        &self,
        layout: &StepLayout,
        nccl: bool,
        bucket_bytes: Option<usize>,
    ) -> Result<()> {
        let mine = [
            self.devices.len() as u64,
            layout.len() as u64,
            u64::from(nccl),
            u64::from(self.options.sync_batch_norm),
            bucket_bytes.unwrap_or(0) as u64,
        ];
        let all = self
            .world
            .all_gather(&mine, Phase::Distribute, self.options.timeout)?;
        let chief = &all[..mine.len()];
        for (rank, theirs) in all.chunks(mine.len()).enumerate().skip(1) {
            if theirs != chief {
                return Err(Error::Replica {
                    replica: format!("worker {rank}"),
                    reason: format!(
                        "runs {}, but the chief runs {}: every worker must run the same model \
                         with as many local devices of the same kind",
                        describe_worker(theirs),
                        describe_worker(chief)
                    ),
                });
            }
        }
        Ok(())
    }
}

/// A worker's `[local replicas, step buffer length, NCCL, SyncBatchNorm, gradient bucket
/// bytes]`, for messages.
fn describe_worker(w: &[u64]) -> String {
    let across = if w[2] == 1 { "NCCL" } else { "MPI" };
    let norm = if w[3] == 1 {
        "synchronised"
    } else {
        "per-replica"
    };
    let buckets = match w[4] {
        0 => "one sum of the gradients after the backward pass".to_string(),
        bytes => format!("gradient buckets of {bytes} bytes"),
    };
    format!(
        "{} local replica(s), a step buffer of {} values, {across} across workers, {norm} \
         batch norm and {buckets}",
        w[0], w[1]
    )
}

/// How the fused step buffer crosses workers.
enum Transport {
    /// The local replicas' sum is copied to the host and summed with MPI.
    Mpi,
    /// One NCCL all-reduce over every GPU of every worker (the clique shared with the gradient
    /// buckets).
    #[cfg(feature = "nccl")]
    Nccl(Arc<Mutex<Clique>>),
}

impl Transport {
    /// The route of the gradient buckets: the same library.
    fn bucket_route(&self) -> Route {
        match self {
            Transport::Mpi => Route::Mpi,
            #[cfg(feature = "nccl")]
            Transport::Nccl(clique) => Route::Nccl(Arc::clone(clique)),
        }
    }
}

#[cfg(feature = "nccl")]
fn nccl_transport(world: &World, devices: &[Device], timeout: Duration) -> Result<Transport> {
    let clique = Clique::new(world, devices, timeout)?;
    Ok(Transport::Nccl(Arc::new(Mutex::new(clique))))
}

#[cfg(not(feature = "nccl"))]
fn nccl_transport(_world: &World, _devices: &[Device], _timeout: Duration) -> Result<Transport> {
    Err(Error::Device(
        "NCCL across workers needs kandle-strategies built with the `nccl` feature".into(),
    ))
}

/// How a multi-worker model sums its step buffers: over every replica of every worker, through
/// the MPI world or an NCCL clique. The model is a [`ReplicaModel`] over this worker's replicas.
struct CrossWorker {
    world: Arc<World>,
    /// How the local replicas sum their buffers before they cross workers over MPI.
    ops: CrossDeviceOps,
    transport: Transport,
    /// SyncBatchNorm's sums across workers, when batch norm is synchronised.
    cross_worker_bn: Option<Arc<CrossWorkerSum>>,
    /// The gradient buckets' sums across workers, when the gradients cross in buckets.
    buckets: Option<Arc<CrossWorkerBuckets>>,
    timeout: Duration,
    train_steps: u64,
    test_steps: u64,
    /// The fused step buffer on the host (MPI), reused every step.
    host: Vec<f32>,
    /// Whether a call of fit, evaluate, predict or a single batch is under way.
    in_call: bool,
}

impl Drop for CrossWorker {
    /// A model dropped in the middle of a call is being dropped on its way out with an error
    /// of this worker's own (a callback's, a file's): the other workers will not meet it at the
    /// next collective, so MPI is not finalised (which would wait for them), and the process
    /// exits with its error at once; `mpirun` then ends the job.
    fn drop(&mut self) {
        if self.in_call {
            self.world.mark_broken();
        }
    }
}

impl Reduce for CrossWorker {
    fn within_process(&self) -> bool {
        false
    }

    /// Computes this worker's step buffers and sums the buffers of every replica of every
    /// worker. Returns the sum for each local replica (on the host or on its device) and each
    /// local replica's moving statistics from before the step.
    fn reduce_step(
        &mut self,
        set: &mut ReplicaSet,
        batch: &Batch,
    ) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
        self.train_steps += 1;
        let step = self.train_steps;
        if let Some(bn) = &self.cross_worker_bn {
            bn.begin_step(step, !batch.is_empty())?;
        }
        if let Some(buckets) = &self.buckets {
            buckets.begin_step(step);
        }
        let phase = Phase::Train(step);
        match &mut self.transport {
            Transport::Mpi => {
                let (local, before) = set.compute_reduced(batch, self.ops)?;
                stand_in(self.cross_worker_bn.as_deref(), batch)?;
                let first = local
                    .first()
                    .ok_or_else(|| Error::invalid("a worker with no replica"))?;
                let _reduce = kandle::timeline::span("all-reduce across workers");
                copy_to_host(first, &mut self.host)?;
                // Gradients summed in buckets have crossed the workers already.
                let summed = match set.has_buckets() {
                    true => set.layout.grads.len(),
                    false => 0,
                };
                let mut rest = self.host.split_off(summed);
                self.world.all_reduce_sum(&mut rest, phase, self.timeout)?;
                self.host.extend(rest);
                let total = Tensor::from_slice(&self.host, self.host.len(), &Device::Cpu)?;
                Ok((vec![total; before.len()], before))
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(clique) => {
                let buffers = set.compute(batch, None)?;
                stand_in(self.cross_worker_bn.as_deref(), batch)?;
                let _reduce = kandle::timeline::span("all-reduce across workers");
                let mut clique = clique.lock().map_err(|_| {
                    Error::invalid("the NCCL communicators were poisoned by a panic")
                })?;
                // Gradients summed in buckets have crossed the workers already.
                set.reduce_remaining(buffers, |fused| {
                    self.world.guarded_external(phase, self.timeout, |vigil| {
                        clique.all_reduce(&fused, vigil, phase)
                    })
                })
            }
        }
    }

    /// Sums this worker's evaluation sums and sample count over every worker.
    fn reduce_evaluation(&mut self, local: StepStats) -> Result<StepStats> {
        self.test_steps += 1;
        self.host.clear();
        self.host.extend(local.sums.iter().map(|&s| s as f32));
        self.host.push(local.samples as f32);
        self.world
            .all_reduce_sum(&mut self.host, Phase::Test(self.test_steps), self.timeout)?;
        let (samples, sums) = self
            .host
            .split_last()
            .ok_or_else(|| Error::invalid("empty evaluation buffer"))?;
        Ok(StepStats {
            samples: samples.round().max(0.0) as usize,
            sums: sums.iter().map(|&s| f64::from(s)).collect(),
            applied: false,
        })
    }

    fn all_gather_workers(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        self.world.all_gather(values, Phase::Resume, self.timeout)
    }

    /// After a failed step the workers are out of step, so no further collective may run.
    fn failed(&self) {
        self.world.mark_broken();
    }

    fn begin_call(&mut self) {
        self.in_call = true;
    }

    fn end_call(&mut self) {
        self.in_call = false;
    }
}

/// A worker without samples in this step joins the SyncBatchNorm exchanges that the others run.
fn stand_in(bn: Option<&CrossWorkerSum>, batch: &Batch) -> Result<()> {
    match bn {
        Some(bn) if batch.is_empty() => bn.stand_in(),
        _ => Ok(()),
    }
}

/// A tensor's values as a host vector.
fn host_vec(t: &Tensor) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    copy_to_host(t, &mut v)?;
    Ok(v)
}

/// Copies a 1-D `f32` tensor into `out` (cleared first), straight from the storage of a CPU
/// tensor so that the step reuses `out`'s allocation.
fn copy_to_host(t: &Tensor, out: &mut Vec<f32>) -> Result<()> {
    let t = t.to_device(&Device::Cpu)?.contiguous()?;
    out.clear();
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(candle_core::CpuStorage::F32(values)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            out.extend_from_slice(&values[start..end]);
            return Ok(());
        }
    }
    out.extend(t.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}
