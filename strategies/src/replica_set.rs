//! `ReplicaSet`: the replicas of one process, one thread each, and what every strategy of this
//! crate does with them: split a batch, turn each part into a step buffer in parallel, run the
//! step's final phase on every replica, evaluate and predict. [`ReplicaOptions`] is the
//! configuration of the replicas that every strategy holds, and [`ReplicaModel`] the model of
//! the strategies whose replicas all hold the variables, parameterised by how it sums their step
//! buffers ([`Reduce`]).

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use kandle::data::{shard_range, Batch};
use kandle::layers::Summary;
use kandle::optimizers::NamedOptimizerState;
use kandle::params::{ParamStore, Weights};
use kandle::strategy::buckets::{BucketPlan, BucketReducer};
use kandle::strategy::fused::{fuse, FusedLayout};
use kandle::strategy::step::{StepLayout, StepTotals};
use kandle::strategy::{
    DistributedModel, ModelSpec, Replica, ReplicaGroup, ReplicaHandle, StepBuffer, StepStats,
    WorkerHooks,
};
use kandle::Result;

use crate::bucket_exchange::{BucketExchange, OuterBucketSum};
use crate::cross_device_ops::CrossDeviceOps;
use crate::rendezvous::Rendezvous;
use crate::replica_pool::{ReplicaPool, ReplicaThreads};

/// How long a step waits for a silent replica (or worker) before failing, unless set otherwise.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How a strategy runs its replicas: whether batch norm uses the statistics of the whole global
/// batch, how long a step waits for a replica, and how many threads each replica may use.
///
/// Every strategy with replicas in this process ([`MirroredStrategy`](crate::MirroredStrategy),
/// [`CentralStorageStrategy`](crate::CentralStorageStrategy) and, with the `mpi` feature,
/// `MultiWorkerMirroredStrategy`) holds one: built here with the builder methods of the same
/// names as the fields, given to the strategy with its `with_options`, and read back with its
/// `options`.
///
/// ```
/// use std::time::Duration;
/// use kandle_strategies::{CentralStorageStrategy, MirroredStrategy, ReplicaOptions};
///
/// let options = ReplicaOptions::default()
///     .sync_batch_norm(true)
///     .timeout(Duration::from_secs(120))
///     .threads_per_replica(1);
/// let mirrored = MirroredStrategy::cpu(2)?.with_options(options);
/// let central = CentralStorageStrategy::cpu(2)?.with_options(options);
/// assert_eq!(mirrored.options(), central.options());
/// assert!(mirrored.options().sync_batch_norm);
/// assert_eq!(MirroredStrategy::cpu(2)?.options(), &ReplicaOptions::default());
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaOptions {
    /// Batch normalisation with the statistics of the whole global batch, over every replica
    /// (and worker), instead of each replica's part (`SyncBatchNorm`). Either way the moving
    /// statistics agree on every replica. In one process the statistics are summed where they
    /// lie, with the strategy's cross-device ops (NCCL between GPUs); across workers, on the
    /// host through MPI. Default false.
    pub sync_batch_norm: bool,
    /// How long a step waits for a replica (or a worker) before failing with an error that
    /// names it. Default 60 s.
    pub timeout: Duration,
    /// How many threads each replica's CPU work may use. The default,
    /// [`ReplicaThreads::Auto`], divides the cores evenly among this process's CPU replicas, so
    /// replicas sharing the CPU do not oversubscribe it.
    pub threads_per_replica: ReplicaThreads,
    /// [`MirroredStrategy`](crate::MirroredStrategy), and `MultiWorkerMirroredStrategy` (over
    /// MPI or NCCL) without SyncBatchNorm: the gradients are cut into buckets of at most this many bytes
    /// (the first, of the last layers, at most 1 MiB), each summed across the replicas (and the
    /// workers) as soon as every replica's backward pass has finished it, while the passes go
    /// on (PyTorch DDP's `bucket_cap_mb`, Horovod's overlap); `None` sums the whole step buffer
    /// after every backward pass has ended. The sums are the same either way, bit for bit in
    /// one process with [`CrossDeviceOps::ReductionToOneDevice`] and
    /// [`CrossDeviceOps::HierarchicalCopy`]. Default 25 MiB. Mirrored replicas on CUDA devices
    /// whose steps are captured as CUDA graphs ([`kandle::devices::set_cuda_graphs`]) sum after
    /// the passes whatever this says: a captured step cannot hand buckets in midway.
    pub gradient_buckets: Option<usize>,
}

/// The default size of a gradient bucket, PyTorch DDP's.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The most the first gradient bucket holds, so that the first sum starts early.
const FIRST_BUCKET_BYTES: usize = 1 << 20;

impl Default for ReplicaOptions {
    fn default() -> Self {
        Self {
            sync_batch_norm: false,
            timeout: DEFAULT_TIMEOUT,
            threads_per_replica: ReplicaThreads::default(),
            gradient_buckets: Some(DEFAULT_BUCKET_BYTES),
        }
    }
}

impl ReplicaOptions {
    /// Batch normalisation with the statistics of the whole global batch, over every replica
    /// (and, for `MultiWorkerMirroredStrategy`, every worker), instead of each replica's part
    /// (`SyncBatchNorm`); default false. See
    /// [`sync_batch_norm`](Self#structfield.sync_batch_norm).
    pub fn sync_batch_norm(self, sync: bool) -> Self {
        Self {
            sync_batch_norm: sync,
            ..self
        }
    }

    /// How long a step waits for a replica (or a worker) before failing with an error that
    /// names it; default 60 s. See [`timeout`](Self#structfield.timeout).
    pub fn timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    /// How many threads each replica's CPU work may use: a count, or a [`ReplicaThreads`]
    /// (default [`ReplicaThreads::Auto`]: the cores divided evenly among this process's CPU
    /// replicas). See [`threads_per_replica`](Self#structfield.threads_per_replica).
    pub fn threads_per_replica(self, threads: impl Into<ReplicaThreads>) -> Self {
        Self {
            threads_per_replica: threads.into(),
            ..self
        }
    }

    /// Gradient buckets of at most `bytes` bytes summed while the backward passes go on, or
    /// `None` for one sum after them (default [`DEFAULT_BUCKET_BYTES`]). See
    /// [`gradient_buckets`](Self#structfield.gradient_buckets).
    pub fn gradient_buckets(self, bytes: Option<usize>) -> Self {
        Self {
            gradient_buckets: bytes,
            ..self
        }
    }
}

/// `devices`, one replica each, unless the list is empty; `strategy` names the caller in the
/// error.
pub(crate) fn replica_devices(devices: Vec<Device>, strategy: &str) -> Result<Vec<Device>> {
    if devices.is_empty() {
        return Err(kandle::Error::invalid(format!(
            "{strategy} needs at least one device"
        )));
    }
    Ok(devices)
}

/// Every visible GPU, one replica each; fails when there is none. `strategy` names the caller
/// in the error.
pub(crate) fn all_gpus(strategy: &str) -> Result<Vec<Device>> {
    let gpus = kandle::devices::gpus()?;
    if gpus.is_empty() {
        return Err(kandle::Error::Device(format!(
            "{strategy}::all_gpus found no GPU (built without the `cuda` feature, or \
             CUDA_VISIBLE_DEVICES hides them); use {strategy}::cpu(n) for CPU replicas"
        )));
    }
    replica_devices(gpus, strategy)
}

/// The replicas of one process.
pub(crate) struct ReplicaSet {
    pub(crate) pool: ReplicaPool,
    pub(crate) devices: Vec<Device>,
    /// Handles on each replica's variables (sharing storage with the replica threads).
    pub(crate) stores: Vec<ParamStore>,
    pub(crate) layout: Arc<StepLayout>,
    summary: Summary,
    rendezvous: Option<Arc<Rendezvous>>,
    /// The exchange of gradient buckets, when the replicas sum their gradients in buckets.
    buckets: Option<Arc<BucketExchange>>,
}

/// Human-readable replica labels for errors: `replica 1 (cuda:1)`.
fn labels(devices: &[Device]) -> Vec<String> {
    devices
        .iter()
        .enumerate()
        .map(|(i, d)| format!("replica {i} ({})", kandle::devices::label(d)))
        .collect()
}

impl ReplicaSet {
    /// Builds one replica of `spec` per device as `options` say, with an in-process rendezvous
    /// for `SyncBatchNorm` when asked, which sums the statistics where they lie with `ops`.
    pub(crate) fn build(
        spec: &ModelSpec,
        devices: &[Device],
        options: &ReplicaOptions,
        ops: CrossDeviceOps,
    ) -> Result<Self> {
        let rendezvous = options.sync_batch_norm.then(|| {
            Arc::new(Rendezvous::new(devices.len(), options.timeout).summing_tensors(ops, devices))
        });
        Self::new(
            spec,
            devices,
            rendezvous,
            options.timeout,
            options.threads_per_replica,
        )
    }

    /// Builds one replica of `spec` per device, all starting from the first replica's weights,
    /// batch normalisation synchronised through `rendezvous` when given (one member per
    /// device), each call on the replicas waiting up to `timeout`.
    pub(crate) fn new(
        spec: &ModelSpec,
        devices: &[Device],
        rendezvous: Option<Arc<Rendezvous>>,
        timeout: Duration,
        threads: ReplicaThreads,
    ) -> Result<Self> {
        let pool_sizes = threads.pool_sizes(devices)?;
        let replicas = devices
            .iter()
            .enumerate()
            .map(|(i, d)| match &rendezvous {
                Some(group) => {
                    let handle = ReplicaHandle::new(Arc::clone(group) as Arc<dyn ReplicaGroup>, i);
                    Replica::in_group(spec, d, handle)
                }
                None => Replica::new(spec, d),
            })
            .collect::<Result<Vec<_>>>()?;
        let first = replicas[0].store().weights()?;
        for r in &replicas[1..] {
            r.store().assign(&first)?;
        }
        let stores: Vec<ParamStore> = replicas.iter().map(|r| r.store().clone()).collect();
        let layout = Arc::clone(replicas[0].layout());
        let summary = replicas[0].summary().clone();
        let pool = ReplicaPool::new(replicas, labels(devices), timeout, &pool_sizes)?;
        Ok(Self {
            pool,
            devices: devices.to_vec(),
            stores,
            layout,
            summary,
            rendezvous,
            buckets: None,
        })
    }

    /// Has the replicas sum their gradients with `ops` in buckets of at most `bytes` bytes
    /// while their backward passes go on ([`ReplicaOptions::gradient_buckets`]), each bucket
    /// then summed over the workers by `outer` when given, each wait bounded by `timeout`.
    pub(crate) fn use_buckets(
        &mut self,
        ops: CrossDeviceOps,
        bytes: usize,
        timeout: Duration,
        outer: Option<Arc<dyn OuterBucketSum>>,
    ) -> Result<()> {
        let sizes: Vec<usize> = self.stores[0]
            .trainable_vars()
            .iter()
            .map(|v| v.elem_count())
            .collect();
        if sizes.is_empty() {
            // Nothing to sum during the backward pass: the step buffer holds no gradient.
            return Ok(());
        }
        let plan = Arc::new(BucketPlan::new(
            &sizes,
            FIRST_BUCKET_BYTES.min(bytes),
            bytes,
        ));
        let exchange =
            BucketExchange::new(self.devices.clone(), labels(&self.devices), ops, timeout);
        let exchange = Arc::new(match outer {
            Some(outer) => exchange.with_outer(outer),
            None => exchange,
        });
        let reducer = Arc::clone(&exchange) as Arc<dyn BucketReducer>;
        let inputs = vec![(reducer, plan); self.len()];
        self.pool.run(inputs, |i, replica, (reducer, plan)| {
            replica.set_buckets(reducer, i, plan)
        })?;
        let waiting = Arc::clone(&exchange);
        self.pool
            .set_waiting(Arc::new(move |i| waiting.is_waiting(i)));
        self.buckets = Some(exchange);
        Ok(())
    }

    /// Whether the replicas sum their gradients in buckets.
    #[cfg_attr(
        not(feature = "mpi"),
        expect(dead_code, reason = "used by the multi-worker strategy")
    )]
    pub(crate) fn has_buckets(&self) -> bool {
        self.buckets.is_some()
    }

    /// Buckets handed in while a backward pass was running, over all steps (0 without
    /// buckets).
    #[cfg(test)]
    pub(crate) fn buckets_during_backward(&self) -> usize {
        self.buckets
            .as_ref()
            .map_or(0, |b| b.handed_in_during_backward())
    }

    /// Number of replicas.
    pub(crate) fn len(&self) -> usize {
        self.devices.len()
    }

    /// The layer table of the replicas' network.
    pub(crate) fn summary(&self) -> &Summary {
        &self.summary
    }

    /// Splits a batch into one near-equal part per replica (the first parts take the extra
    /// samples of an uneven batch).
    pub(crate) fn split(&self, batch: &Batch) -> Result<Vec<Batch>> {
        let n = batch.len();
        (0..self.len())
            .map(|i| {
                let r = shard_range(n, i, self.len());
                batch.narrow(r.start, r.len())
            })
            .collect()
    }

    /// Every replica's step buffer for its part of `batch`. With `weights`, each replica first
    /// loads these values (a fused buffer of all variables in store order), as CentralStorage
    /// does.
    pub(crate) fn compute(
        &mut self,
        batch: &Batch,
        weights: Option<Tensor>,
    ) -> Result<Vec<StepBuffer>> {
        self.on_parts(batch, weights, Replica::step_buffer)
    }

    /// Gradient accumulation: every replica keeps the gradients and sums of its part of the
    /// micro-batch `batch` for its next step buffer ([`Replica::accumulate`]); with `weights`,
    /// each first loads them as in [`Self::compute`]. Returns the micro-batch's sample count
    /// and sums over these replicas.
    pub(crate) fn accumulate(
        &mut self,
        batch: &Batch,
        weights: Option<Tensor>,
    ) -> Result<StepStats> {
        let parts = self.on_parts(batch, weights, Replica::accumulate)?;
        let samples = parts.iter().map(|(n, _)| n).sum();
        let sums = self.sum_of(parts.into_iter().map(|(_, sums)| sums));
        Ok(StepStats {
            samples,
            sums,
            applied: false,
        })
    }

    /// Runs `f` on every replica with its part of `batch`, in parallel, after loading
    /// `weights` (a fused buffer of all variables in store order) when given.
    fn on_parts<R: Send + 'static>(
        &mut self,
        batch: &Batch,
        weights: Option<Tensor>,
        f: fn(&Replica, &Batch) -> Result<R>,
    ) -> Result<Vec<R>> {
        let parts = self.split(batch)?;
        if let Some(group) = &self.rendezvous {
            let active: Vec<bool> = parts.iter().map(|p| !p.is_empty()).collect();
            group.set_active(&active)?;
        }
        if let Some(buckets) = &self.buckets {
            buckets.begin_step()?;
        }
        let inputs: Vec<(Batch, Option<Tensor>)> =
            parts.into_iter().map(|p| (p, weights.clone())).collect();
        self.pool.run(inputs, move |_, replica, (part, weights)| {
            if let Some(w) = weights {
                load_fused(replica.store(), &w)?;
            }
            f(replica, &part)
        })
    }

    /// [`Self::compute`], then the sum of the replicas' buffers with `ops`: the total on every
    /// replica's device, and each replica's moving statistics from before the step.
    pub(crate) fn compute_reduced(
        &mut self,
        batch: &Batch,
        ops: CrossDeviceOps,
    ) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
        let buffers = self.compute(batch, None)?;
        let _reduce = kandle::timeline::span("all-reduce");
        self.reduce_remaining(buffers, |fused| ops.all_reduce(fused, &self.devices))
    }

    /// The replicas' step `buffers` summed by `sum` (one tensor per replica in, the total on
    /// each replica's device out): whole, or only the sums and statistics after the gradients
    /// when the gradients were summed in buckets during the backward passes already. Returns the
    /// totals and each replica's moving statistics from before the step.
    pub(crate) fn reduce_remaining(
        &self,
        buffers: Vec<StepBuffer>,
        sum: impl FnOnce(Vec<Tensor>) -> Result<Vec<Tensor>>,
    ) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
        let reduced = buffers.iter().filter(|b| b.grads_reduced).count();
        let (fused, before) = unzip(buffers);
        if reduced == 0 {
            return Ok((sum(fused)?, before));
        }
        if reduced != fused.len() {
            return Err(kandle::Error::invalid(format!(
                "{reduced} of {} replicas summed their gradients in buckets",
                fused.len()
            )));
        }
        // The gradients are summed already: only the sums and statistics after them are left.
        let grads = self.layout.grads.len();
        let tails = fused
            .iter()
            .map(|f| Ok(f.narrow(0, grads, f.dim(0)? - grads)?))
            .collect::<Result<Vec<_>>>()?;
        let totals = fused
            .iter()
            .zip(sum(tails)?)
            .map(|(f, tail)| {
                let summed = f.narrow(0, 0, grads)?;
                Ok(Tensor::cat(&[&summed, &tail.to_device(f.device())?], 0)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((totals, before))
    }

    /// The step's final phase on every replica, in parallel: replica `i` finishes with
    /// `totals[i]` (the summed buffer, on any device) and its statistics from before the step.
    pub(crate) fn finish(
        &mut self,
        totals: Vec<Tensor>,
        read: &StepTotals,
        before: Vec<Vec<Tensor>>,
        lr: f64,
    ) -> Result<StepStats> {
        let shared = Arc::new(read.clone());
        let inputs: Vec<(Tensor, Vec<Tensor>)> = totals.into_iter().zip(before).collect();
        self.pool.run(inputs, move |_, replica, (total, before)| {
            replica.finish_step(&total, &shared, &before, lr)
        })?;
        Ok(read.clone().into_stats())
    }

    /// Loss and metric sums of `batch` in inference mode, over all replicas.
    pub(crate) fn evaluate(&mut self, batch: &Batch) -> Result<StepStats> {
        let parts = self.split(batch)?;
        let sums = self.pool.run(parts, |_, replica, part| {
            Ok(replica
                .evaluate(&part)?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?)
        })?;
        Ok(StepStats {
            samples: batch.len(),
            sums: self.sum_of(sums),
            applied: false,
        })
    }

    /// The element-wise sum of the replicas' `[loss_sum, metric states...]` vectors.
    fn sum_of(&self, parts: impl IntoIterator<Item = Vec<f64>>) -> Vec<f64> {
        let mut total = vec![0.0; self.layout.num_stats];
        for part in parts {
            for (t, v) in total.iter_mut().zip(part) {
                *t += v;
            }
        }
        total
    }

    /// Outputs for `inputs` (CPU, one tensor per model input), each replica predicting its
    /// part of the samples, gathered on the CPU: one tensor per output.
    pub(crate) fn predict(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let n = inputs.first().map_or(Ok(0), |x| x.dim(0))?;
        let parts = (0..self.len())
            .map(|i| {
                let r = shard_range(n, i, self.len());
                inputs
                    .iter()
                    .map(|x| Ok(x.narrow(0, r.start, r.len())?))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let outputs = self.pool.run(parts, |_, replica, part| {
            if part.first().map_or(Ok(0), |x| x.dim(0))? == 0 {
                return Ok(None);
            }
            let out = replica.predict(&part)?;
            out.into_iter()
                .map(|y| Ok(y.to_device(&Device::Cpu)?))
                .collect::<Result<Vec<_>>>()
                .map(Some)
        })?;
        let outputs: Vec<Vec<Tensor>> = outputs.into_iter().flatten().collect();
        let count = outputs.first().map_or(0, Vec::len);
        (0..count)
            .map(|o| {
                let column: Vec<&Tensor> = outputs.iter().map(|out| &out[o]).collect();
                Ok(Tensor::cat(&column, 0)?)
            })
            .collect()
    }

    /// The first replica's weights, on the CPU.
    pub(crate) fn weights(&self) -> Result<Weights> {
        cpu_weights(&self.stores[0])
    }

    /// The first replica's optimizer state (every replica's is the same), on the CPU.
    pub(crate) fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        let states = self.pool.run(vec![(); self.len()], |i, replica, ()| {
            if i == 0 {
                Ok(Some(replica.optimizer_state()?.to_device(&Device::Cpu)?))
            } else {
                Ok(None)
            }
        })?;
        states
            .into_iter()
            .flatten()
            .next()
            .ok_or_else(|| kandle::Error::invalid("a replica set without replicas"))
    }

    /// Loads `state` into every replica's optimizer. Each replica checks it before changing
    /// anything, and all hold the same variables, so a state that does not fit changes none.
    pub(crate) fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        let shared = Arc::new(state.clone());
        let inputs = vec![shared; self.len()];
        self.pool.run(inputs, |_, replica, state| {
            replica.load_optimizer_state(&state)
        })?;
        Ok(())
    }

    /// Sets the weights of every replica; checks them against the model first, so a mismatch
    /// changes nothing.
    pub(crate) fn set_weights(&self, weights: &Weights) -> Result<()> {
        self.stores[0]
            .check_compatible(weights)
            .map_err(|reason| kandle::Error::invalid(format!("cannot set weights: {reason}")))?;
        for s in &self.stores {
            s.assign(weights)?;
        }
        Ok(())
    }
}

/// How a [`ReplicaModel`] sums what its replicas computed: over the replicas of this process
/// ([`CrossDeviceOps`]), or over every replica of every worker (the multi-worker strategy's
/// communication). The rest of a step is the same for both.
pub(crate) trait Reduce: Send {
    /// Computes every replica's step buffer for its part of `batch` and sums the buffers over
    /// every replica this reduction reaches. Returns the total for each replica of `set` (on
    /// any device) and each replica's moving statistics from before the step.
    fn reduce_step(
        &mut self,
        set: &mut ReplicaSet,
        batch: &Batch,
    ) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)>;

    /// The evaluation sums over every replica reached, from those over `set`'s replicas. The
    /// default, for one process, returns them.
    fn reduce_evaluation(&mut self, local: StepStats) -> Result<StepStats> {
        Ok(local)
    }

    /// [`WorkerHooks::all_gather_workers`]; the default, for one process, returns
    /// `values`.
    fn all_gather_workers(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        Ok(values.to_vec())
    }

    /// Whether the reduction reaches only this process's replicas. The default, for one
    /// process: yes.
    fn within_process(&self) -> bool {
        true
    }

    /// Told that a step or a gather failed. The default does nothing.
    fn failed(&self) {}

    /// Told that a call of `fit`, `evaluate`, `predict` or a single batch begins
    /// ([`WorkerHooks::serve`]). The default does nothing.
    fn begin_call(&mut self) {}

    /// Told that such a call ended without error ([`WorkerHooks::end_call`]). The default
    /// does nothing.
    fn end_call(&mut self) {}
}

/// The replicas of this process sum their buffers with the chosen algorithm.
impl Reduce for CrossDeviceOps {
    fn reduce_step(
        &mut self,
        set: &mut ReplicaSet,
        batch: &Batch,
    ) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
        set.compute_reduced(batch, *self)
    }
}

/// A model replicated on every replica of a [`ReplicaSet`], each holding the variables and
/// applying the same update: every step, the replicas' buffers are summed by `R`, and every
/// replica runs the step's final phase on the total.
pub(crate) struct ReplicaModel<R> {
    pub(crate) set: ReplicaSet,
    pub(crate) reduce: R,
}

impl<R: Reduce> ReplicaModel<R> {
    /// Passes `result` on, telling the reduction when it is an error.
    fn checked<T>(&self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            self.reduce.failed();
        }
        result
    }

    /// Whether the one replica of this process is the only one: its steps have nothing to sum
    /// and run whole ([`Replica::train_alone`]).
    fn alone(&self) -> bool {
        self.set.len() == 1 && self.reduce.within_process()
    }

    fn train(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        if self.alone() {
            let totals = self
                .set
                .pool
                .run(vec![batch.clone()], move |_, replica, part| {
                    replica.train_alone(&part, lr)
                })?;
            return totals
                .into_iter()
                .next()
                .map(StepTotals::into_stats)
                .ok_or_else(|| kandle::Error::invalid("the replica returned no step totals"));
        }
        let (totals, before) = self.reduce.reduce_step(&mut self.set, batch)?;
        // Every replica (of every worker) holds the same sum, so all decide alike.
        let read = self.set.layout.read(&totals[0])?;
        self.set.finish(totals, &read, before, lr)
    }

    fn test(&mut self, batch: &Batch) -> Result<StepStats> {
        let local = self.set.evaluate(batch)?;
        self.reduce.reduce_evaluation(local)
    }
}

impl<R: Reduce> WorkerHooks for ReplicaModel<R> {
    fn serve(&mut self) -> Result<bool> {
        self.reduce.begin_call();
        Ok(false)
    }

    fn end_call(&mut self) -> Result<()> {
        self.reduce.end_call();
        Ok(())
    }

    fn all_gather_workers(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        let result = self.reduce.all_gather_workers(values);
        self.checked(result)
    }
}

impl<R: Reduce> DistributedModel for ReplicaModel<R> {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        let result = self.train(batch, lr);
        self.checked(result)
    }

    /// The CUDA device of a replica that is the only one.
    fn input_device(&self) -> Option<Device> {
        let device = self.set.devices.first()?;
        (self.alone() && device.is_cuda()).then(|| device.clone())
    }

    fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        let result = self.set.accumulate(batch, None);
        self.checked(result)
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        let result = self.test(batch);
        self.checked(result)
    }

    fn predict_step(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.set.predict(inputs)
    }

    fn weights(&self) -> Result<Weights> {
        self.set.weights()
    }

    fn summary(&self) -> &Summary {
        self.set.summary()
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.set.set_weights(weights)
    }

    fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        self.set.optimizer_state()
    }

    fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        self.set.set_optimizer_state(state)
    }
}

/// The replicas' buffers and their statistics from before the step, apart.
pub(crate) fn unzip(buffers: Vec<StepBuffer>) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
    buffers
        .into_iter()
        .map(|b| (b.fused, b.statistics_before))
        .unzip()
}

/// A store's weights moved to the CPU.
pub(crate) fn cpu_weights(store: &ParamStore) -> Result<Weights> {
    store
        .weights()?
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_device(&Device::Cpu)?)))
        .collect()
}

/// All of a store's variables, fused in store order.
pub(crate) fn fuse_store(store: &ParamStore) -> Result<Tensor> {
    let tensors: Vec<Tensor> = store.iter().map(|p| p.var.as_tensor().detach()).collect();
    fuse(&tensors.iter().collect::<Vec<_>>())
}

/// Loads a buffer made by [`fuse_store`] (possibly on another device) into `store`.
pub(crate) fn load_fused(store: &ParamStore, buffer: &Tensor) -> Result<()> {
    let buffer = buffer.to_device(store.iter().next().map_or(&Device::Cpu, |p| p.var.device()))?;
    let layout = FusedLayout::from_shapes(store.iter().map(|p| p.var.shape().clone()));
    for (p, value) in store.iter().zip(layout.split(&buffer, 0)?) {
        p.var.set(&value)?;
    }
    Ok(())
}
