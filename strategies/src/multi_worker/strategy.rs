//! `MultiWorkerMirroredStrategy` and the model it distributes: Mirrored inside each worker
//! process, then one guarded MPI all-reduce of the fused step buffer across workers.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Storage, Tensor};
use kandle::data::Batch;
use kandle::params::Weights;
use kandle::replica::ModelSpec;
use kandle::strategy::{DistributedModel, StepStats, Strategy, WorkerInfo};
use kandle::{Error, Result};

use super::watchdog::Phase;
use super::world::World;
use crate::cross_device_ops::CrossDeviceOps;
use crate::mirrored::{restore, DEFAULT_TIMEOUT};
use crate::replica_set::{fuse_store, load_fused, ReplicaSet};

/// Synchronous data parallelism across worker processes launched by `mpirun`, each with one or
/// more local replicas.
///
/// Rank, size and the chief (rank 0) come from `MPI_COMM_WORLD`. Each worker reads only its
/// shard of every global batch; its local replicas compute gradients as
/// [`MirroredStrategy`](crate::MirroredStrategy) does, the local sum crosses processes as one
/// fused buffer in one `MPI_Allreduce`, and every replica of every worker applies the same
/// update. A model trains as one device would at the same global batch (for models without
/// batch statistics; with them, each replica normalises with its own part of the batch and the
/// moving statistics are averaged over all replicas of all workers).
///
/// A worker that dies or stalls makes the others fail within the [timeout](Self::timeout) with
/// an error naming it ([`kandle::Error::Replica`], e.g. `worker 1: did not reach training step
/// 57 within 60 s`). After such an error the MPI job cannot continue: return the error from
/// `main` so that the process exits non-zero and `mpirun` ends the others. Dropping the strategy
/// after a failure skips `MPI_Finalize`, so it never hangs.
///
/// ```no_run
/// use kandle::prelude::*;
/// use kandle_strategies::MultiWorkerMirroredStrategy;
///
/// // mpirun -n 2 ./train
/// let strategy = MultiWorkerMirroredStrategy::from_env()?; // the one line that changes
/// let net = Sequential::new().add(Flatten).add(Dense::new(10)).add(Activation::Softmax);
/// let mut model = net.compile(Sgd::new(0.1), Loss::SparseCategoricalCrossentropy, [Metric::Accuracy], &strategy)?;
/// let data = kandle::data::digits::load()?;
/// model.fit(&data, FitOptions { batch_size_per_replica: 16, ..Default::default() })?;
/// model.save_weights("digits.safetensors")?; // the chief writes
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Clone)]
pub struct MultiWorkerMirroredStrategy {
    world: Arc<World>,
    devices: Vec<Device>,
    ops: CrossDeviceOps,
    timeout: Duration,
}

impl std::fmt::Debug for MultiWorkerMirroredStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiWorkerMirroredStrategy")
            .field("rank", &self.world.rank())
            .field("size", &self.world.size())
            .field("devices", &self.devices)
            .field("ops", &self.ops)
            .field("timeout", &self.timeout)
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
            ops: CrossDeviceOps::default(),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// One replica per device in this worker (Mirrored inside the worker). Fails on an empty
    /// list.
    pub fn local_devices(mut self, devices: Vec<Device>) -> Result<Self> {
        if devices.is_empty() {
            return Err(Error::invalid(
                "MultiWorkerMirroredStrategy needs at least one local device",
            ));
        }
        self.devices = devices;
        Ok(self)
    }

    /// `replicas` CPU replicas in this worker. Fails on 0.
    pub fn local_replicas_cpu(self, replicas: usize) -> Result<Self> {
        self.local_devices(vec![Device::Cpu; replicas])
    }

    /// How the local replicas sum their gradients before the buffer crosses processes (default
    /// [`CrossDeviceOps::ReductionToOneDevice`]).
    pub fn cross_device_ops(mut self, ops: CrossDeviceOps) -> Self {
        self.ops = ops;
        self
    }

    /// Batch normalisation with statistics of the whole global batch. Not supported across
    /// workers yet: `true` is an error (`false`, the default, keeps per-replica batch statistics
    /// with moving statistics averaged over every replica of every worker).
    pub fn sync_batch_norm(self, sync: bool) -> Result<Self> {
        if sync {
            return Err(Error::invalid(
                "sync_batch_norm is not supported across workers yet (MultiWorkerMirroredStrategy \
                 uses per-replica batch statistics, averaging the moving statistics over all \
                 replicas); use MirroredStrategy for SyncBatchNorm within one process",
            ));
        }
        Ok(self)
    }

    /// How long a worker waits for the others at each step before failing with an error that
    /// names the missing one (default 60 s). It bounds how far apart workers may drift,
    /// including chief-only work between steps such as writing checkpoints and plots.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This worker's local devices.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Sums `buffer` element-wise over all workers, in place, by exactly the guarded path that
    /// every training step takes with its fused buffer: the watchdog's heartbeat rendezvous
    /// (every worker proves it reached this call, within the [timeout](Self::timeout)), then a
    /// non-blocking `MPI_Iallreduce` polled against the same deadline. Every worker must call it,
    /// with buffers of the same length, in the same order as its other collectives.
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
            .all_reduce_sum(buffer, Phase::Direct, self.timeout)
    }
}

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
        let set = ReplicaSet::new(spec, &self.devices, false, self.timeout)?;
        // Every worker built the same seeded model; the chief's weights make sure of it.
        let mut weights = host_vec(&fuse_store(&set.stores[0])?)?;
        self.world
            .broadcast_from_chief(&mut weights, Phase::Distribute, self.timeout)?;
        let len = weights.len();
        let weights = Tensor::from_vec(weights, len, &Device::Cpu)?;
        for store in &set.stores {
            load_fused(store, &weights)?;
        }
        Ok(Box::new(MultiWorkerModel {
            world: Arc::clone(&self.world),
            set,
            ops: self.ops,
            timeout: self.timeout,
            replicas_in_sync: self.num_replicas_in_sync(),
            train_steps: 0,
            test_steps: 0,
            host: Vec::new(),
        }))
    }
}

/// A model replicated on every local device of every worker.
struct MultiWorkerModel {
    world: Arc<World>,
    set: ReplicaSet,
    ops: CrossDeviceOps,
    timeout: Duration,
    replicas_in_sync: usize,
    train_steps: u64,
    test_steps: u64,
    /// The fused step buffer on the host, reused every step.
    host: Vec<f32>,
}

impl MultiWorkerModel {
    /// Marks the world broken when `result` is an error: after a failed step the workers are
    /// out of step, so no further collective may run.
    fn check<T>(&self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            self.world.mark_broken();
        }
        result
    }

    fn train(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        self.train_steps += 1;
        // Gradients of the loss *sum*: the global sample count is known only after the
        // all-reduce, which divides them.
        let (local, before) = self.set.compute_reduced(batch, 1, self.ops)?;
        let first = local
            .first()
            .ok_or_else(|| Error::invalid("a worker with no replica"))?;
        copy_to_host(first, &mut self.host)?;
        self.world
            .all_reduce_sum(&mut self.host, Phase::Train(self.train_steps), self.timeout)?;

        let layout = Arc::clone(&self.set.layout);
        let host = &mut self.host;
        let samples = host[layout.samples_offset()].round().max(0.0) as usize;
        let sums: Vec<f64> = host[layout.stats_offset()..layout.samples_offset()]
            .iter()
            .map(|&s| f64::from(s))
            .collect();
        // Every worker holds the same reduced buffer, so all decide alike.
        let applied = samples > 0
            && host[..layout.samples_offset()]
                .iter()
                .all(|v| v.is_finite());
        if applied {
            let n = samples as f32;
            for g in &mut host[..layout.grads.len()] {
                *g /= n;
            }
            let replicas = self.replicas_in_sync as f32;
            for s in &mut host[layout.statistics_offset()..] {
                *s /= replicas;
            }
        }
        let total = Tensor::from_slice(&host[..], host.len(), &Device::Cpu)?;
        let inputs: Vec<(Tensor, Vec<Tensor>)> =
            before.into_iter().map(|b| (total.clone(), b)).collect();
        self.set
            .pool
            .run(inputs, move |_, replica, (buffer, before)| {
                if !applied {
                    return restore(replica.statistics(), &before);
                }
                let buffer = buffer.to_device(replica.device())?;
                let grads = layout.grads.split(&buffer, 0)?;
                replica.apply_gradients(&grads, lr)?;
                let means = layout
                    .statistics
                    .split(&buffer, layout.statistics_offset())?;
                for (var, mean) in replica.statistics().iter().zip(means) {
                    var.set(&mean)?;
                }
                Ok(())
            })?;
        Ok(StepStats {
            samples,
            sums,
            applied,
        })
    }

    fn test(&mut self, batch: &Batch) -> Result<StepStats> {
        self.test_steps += 1;
        let local = self.set.evaluate(batch)?;
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
}

impl DistributedModel for MultiWorkerModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        let result = self.train(batch, lr);
        self.check(result)
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        let result = self.test(batch);
        self.check(result)
    }

    fn predict_step(&mut self, x: &Tensor) -> Result<Tensor> {
        self.set.predict(x)
    }

    fn weights(&self) -> Result<Weights> {
        self.set.weights()
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.set.set_weights(weights)
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
