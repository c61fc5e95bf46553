//! `ReplicaSet`: the replicas of one process, one thread each, and the phases of a data-parallel
//! step that Mirrored and CentralStorage share: split the batch, compute fused gradients on
//! every replica in parallel, read the reduced statistics once, evaluate and predict.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use kandle::cross_replica::ReplicaHandle;
use kandle::data::{shard_range, Batch};
use kandle::params::{ParamStore, Weights};
use kandle::replica::{ModelSpec, Replica};
use kandle::strategy::StepStats;
use kandle::Result;

use crate::cross_device_ops::CrossDeviceOps;
use crate::fused::{fuse, FusedLayout};
use crate::rendezvous::Rendezvous;
use crate::replica_pool::{ReplicaPool, ReplicaThreads};

/// What a replica's share of a step produced.
pub struct ReplicaOutput {
    /// `[gradients..., loss and metric sums..., sample count, moving statistics...]` on the
    /// replica's device.
    pub fused: Tensor,
    /// The moving statistics before the forward pass, to restore if the step is discarded.
    pub statistics_before: Vec<Tensor>,
}

/// How a fused step buffer is laid out.
#[derive(Debug, Clone)]
pub struct StepLayout {
    /// The trainable variables' gradients, first.
    pub grads: FusedLayout,
    /// Number of loss and metric sums, next, followed by the sample count.
    pub num_stats: usize,
    /// The moving statistics, last.
    pub statistics: FusedLayout,
}

impl StepLayout {
    /// Offset of the loss and metric sums.
    pub fn stats_offset(&self) -> usize {
        self.grads.len()
    }

    /// Offset of the sample count.
    pub fn samples_offset(&self) -> usize {
        self.grads.len() + self.num_stats
    }

    /// Offset of the moving statistics.
    pub fn statistics_offset(&self) -> usize {
        self.samples_offset() + 1
    }

    /// Reads a reduced buffer's loss and metric sums and sample count to the host with one
    /// transfer, and whether every gradient and sum in it is finite.
    pub fn read(&self, reduced: &Tensor) -> Result<ReducedStats> {
        let stats = reduced.narrow(0, self.stats_offset(), self.num_stats + 1)?;
        let grads = reduced.narrow(0, 0, self.grads.len())?;
        let probe = kandle::replica::finite_probe(&stats, &[grads])?;
        let host = Tensor::cat(&[&stats, &probe.reshape(1)?], 0)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let finite = host.last().is_some_and(|p| p.is_finite());
        Ok(ReducedStats {
            sums: host[..self.num_stats].to_vec(),
            samples: host[self.num_stats].round() as usize,
            finite,
        })
    }
}

/// The replicas a strategy runs in this process: their devices, whether batch norm uses the
/// statistics of the whole global batch, how long a step waits for a replica, and how many
/// threads each replica may use.
#[derive(Debug, Clone)]
pub(crate) struct LocalReplicas {
    pub(crate) devices: Vec<Device>,
    pub(crate) sync_batch_norm: bool,
    pub(crate) timeout: Duration,
    pub(crate) threads: ReplicaThreads,
}

impl LocalReplicas {
    /// One replica per device; `strategy` names the caller in errors.
    pub(crate) fn new(devices: Vec<Device>, strategy: &str) -> Result<Self> {
        if devices.is_empty() {
            return Err(kandle::Error::invalid(format!(
                "{strategy} needs at least one device"
            )));
        }
        Ok(Self {
            devices,
            sync_batch_norm: false,
            timeout: crate::mirrored::DEFAULT_TIMEOUT,
            threads: ReplicaThreads::default(),
        })
    }

    /// One replica per visible GPU.
    pub(crate) fn all_gpus(strategy: &str) -> Result<Self> {
        let gpus = kandle::devices::gpus()?;
        if gpus.is_empty() {
            return Err(kandle::Error::Device(format!(
                "{strategy}::all_gpus found no GPU (built without the `cuda` feature, or \
                 CUDA_VISIBLE_DEVICES hides them); use {strategy}::cpu(n) for CPU replicas"
            )));
        }
        Self::new(gpus, strategy)
    }

    /// Builds the replicas of `spec`.
    pub(crate) fn build(&self, spec: &ModelSpec) -> Result<ReplicaSet> {
        ReplicaSet::with_threads(
            spec,
            &self.devices,
            self.sync_batch_norm,
            self.timeout,
            self.threads,
        )
    }
}

/// What a reduced step buffer says, read on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct ReducedStats {
    /// Loss and metric sums over every replica.
    pub sums: Vec<f64>,
    /// Samples over every replica.
    pub samples: usize,
    /// Whether every gradient and sum is finite.
    pub finite: bool,
}

/// The replicas of one process.
pub struct ReplicaSet {
    pub(crate) pool: ReplicaPool,
    pub(crate) devices: Vec<Device>,
    /// Handles on each replica's variables (sharing storage with the replica threads).
    pub(crate) stores: Vec<ParamStore>,
    pub(crate) layout: Arc<StepLayout>,
    rendezvous: Option<Arc<Rendezvous>>,
    /// Whether each replica's moving statistics enter its fused buffer multiplied by its sample
    /// count. Under SyncBatchNorm every replica with samples holds the same statistics, so the
    /// sum divided by the total sample count gives them back, and replicas without samples
    /// (whose statistics did not move) drop out.
    pub(crate) statistics_by_samples: bool,
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
    /// Builds one replica of `spec` per device, all starting from the first replica's weights.
    /// With `sync_batch_norm`, batch normalisation uses statistics of the whole global batch.
    /// Each replica gets the default thread budget ([`ReplicaThreads::Auto`]).
    // The strategies pass their configured thread budget through `with_threads`; this default
    // form serves the tests.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn new(
        spec: &ModelSpec,
        devices: &[Device],
        sync_batch_norm: bool,
        timeout: Duration,
    ) -> Result<Self> {
        Self::with_threads(
            spec,
            devices,
            sync_batch_norm,
            timeout,
            ReplicaThreads::default(),
        )
    }

    /// [`Self::new`] with each replica's thread budget.
    pub fn with_threads(
        spec: &ModelSpec,
        devices: &[Device],
        sync_batch_norm: bool,
        timeout: Duration,
        threads: ReplicaThreads,
    ) -> Result<Self> {
        let rendezvous = sync_batch_norm.then(|| Arc::new(Rendezvous::new(devices.len(), timeout)));
        Self::with_rendezvous(spec, devices, rendezvous, timeout, threads)
    }

    /// Like [`Self::with_threads`], with batch normalisation synchronised through `rendezvous`
    /// when given (which must have one member per device).
    pub(crate) fn with_rendezvous(
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
                    let handle = ReplicaHandle::new(
                        Arc::clone(group) as Arc<dyn kandle::cross_replica::ReplicaGroup>,
                        i,
                    );
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
        let layout = Arc::new(StepLayout {
            grads: FusedLayout::from_shapes(
                replicas[0]
                    .trainable_vars()
                    .iter()
                    .map(|v| v.shape().clone()),
            ),
            num_stats: spec.num_stats(),
            statistics: FusedLayout::from_shapes(
                replicas[0].statistics().iter().map(|v| v.shape().clone()),
            ),
        });
        let pool = ReplicaPool::new(replicas, labels(devices), timeout, &pool_sizes)?;
        Ok(Self {
            pool,
            devices: devices.to_vec(),
            stores,
            layout,
            rendezvous,
            statistics_by_samples: false,
        })
    }

    /// Number of replicas.
    pub(crate) fn len(&self) -> usize {
        self.devices.len()
    }

    /// Whether batch statistics are synchronised across replicas.
    pub fn syncs_batch_norm(&self) -> bool {
        self.rendezvous.is_some()
    }

    /// Splits a batch into one near-equal part per replica (the first parts take the extra
    /// samples of an uneven batch).
    pub fn split(&self, batch: &Batch) -> Result<Vec<Batch>> {
        let n = batch.len();
        (0..self.len())
            .map(|i| {
                let r = shard_range(n, i, self.len());
                Ok(Batch {
                    x: batch.x.narrow(0, r.start, r.len())?,
                    y: batch.y.narrow(0, r.start, r.len())?,
                })
            })
            .collect()
    }

    /// Computes every replica's fused gradients for its part of `batch`, scaled for a global
    /// step of `global_samples`. With `weights`, each replica first loads these values (a fused
    /// buffer of all variables in store order), as CentralStorage does.
    pub fn compute(
        &mut self,
        batch: &Batch,
        global_samples: usize,
        weights: Option<Tensor>,
    ) -> Result<Vec<ReplicaOutput>> {
        let parts = self.split(batch)?;
        if let Some(group) = &self.rendezvous {
            let active: Vec<bool> = parts.iter().map(|p| !p.is_empty()).collect();
            group.set_active(&active)?;
        }
        let inputs: Vec<(Batch, Option<Tensor>)> =
            parts.into_iter().map(|p| (p, weights.clone())).collect();
        let by_samples = self.statistics_by_samples;
        self.pool.run(inputs, move |_, replica, (part, weights)| {
            if let Some(w) = weights {
                load_fused(replica.store(), &w)?;
            }
            let (x, y) = kandle::strategy::batch_to(&part, replica.device())?;
            let g = replica.compute_gradients(&x, &y, global_samples)?;
            let statistics: Vec<Tensor> = replica
                .statistics()
                .iter()
                .map(|v| {
                    if by_samples {
                        Ok((v.as_tensor() * g.samples as f64)?)
                    } else {
                        Ok(v.as_tensor().clone())
                    }
                })
                .collect::<Result<_>>()?;
            let samples = Tensor::new(&[g.samples as f32], replica.device())?;
            let mut parts: Vec<&Tensor> = g.grads.iter().collect();
            parts.push(&g.stats);
            parts.push(&samples);
            parts.extend(statistics.iter());
            Ok(ReplicaOutput {
                fused: fuse(&parts)?,
                statistics_before: g.statistics_before,
            })
        })
    }

    /// [`Self::compute`], then the sum of the replicas' fused buffers with `ops`: the total on
    /// every replica's device, and each replica's moving statistics from before the step.
    pub fn compute_reduced(
        &mut self,
        batch: &Batch,
        global_samples: usize,
        ops: CrossDeviceOps,
    ) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
        let (fused, before): (Vec<Tensor>, Vec<Vec<Tensor>>) = self
            .compute(batch, global_samples, None)?
            .into_iter()
            .map(|out| (out.fused, out.statistics_before))
            .unzip();
        Ok((ops.all_reduce(fused, &self.devices)?, before))
    }

    /// Loss and metric sums of `batch` in inference mode, over all replicas.
    pub fn evaluate(&mut self, batch: &Batch) -> Result<StepStats> {
        let parts = self.split(batch)?;
        let sums = self.pool.run(parts, |_, replica, part| {
            let (x, y) = kandle::strategy::batch_to(&part, replica.device())?;
            Ok(replica
                .evaluate(&x, &y)?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?)
        })?;
        let mut total = vec![0.0; self.layout.num_stats];
        for s in sums {
            for (t, v) in total.iter_mut().zip(s) {
                *t += v;
            }
        }
        Ok(StepStats {
            samples: batch.len(),
            sums: total,
            applied: false,
        })
    }

    /// Outputs for `x` (CPU), each replica predicting its part, gathered on the CPU.
    pub fn predict(&mut self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let parts = (0..self.len())
            .map(|i| {
                let r = shard_range(n, i, self.len());
                Ok(x.narrow(0, r.start, r.len())?)
            })
            .collect::<Result<Vec<_>>>()?;
        let outputs = self.pool.run(parts, |_, replica, part| {
            if part.dim(0)? == 0 {
                return Ok(None);
            }
            let out = replica.predict(&part.to_device(replica.device())?)?;
            Ok(Some(out.to_device(&Device::Cpu)?))
        })?;
        let outputs: Vec<Tensor> = outputs.into_iter().flatten().collect();
        Ok(Tensor::cat(&outputs, 0)?)
    }

    /// The first replica's weights, on the CPU.
    pub fn weights(&self) -> Result<Weights> {
        cpu_weights(&self.stores[0])
    }

    /// Sets the weights of every replica; checks them against the model first, so a mismatch
    /// changes nothing.
    pub fn set_weights(&self, weights: &Weights) -> Result<()> {
        self.stores[0]
            .check_compatible(weights)
            .map_err(|reason| kandle::Error::invalid(format!("cannot set weights: {reason}")))?;
        for s in &self.stores {
            s.assign(weights)?;
        }
        Ok(())
    }
}

/// A store's weights moved to the CPU.
pub fn cpu_weights(store: &ParamStore) -> Result<Weights> {
    store
        .weights()?
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_device(&Device::Cpu)?)))
        .collect()
}

/// All of a store's variables, fused in store order.
pub fn fuse_store(store: &ParamStore) -> Result<Tensor> {
    let tensors: Vec<Tensor> = store.iter().map(|p| p.var.as_tensor().detach()).collect();
    fuse(&tensors.iter().collect::<Vec<_>>())
}

/// Loads a buffer made by [`fuse_store`] (possibly on another device) into `store`.
pub fn load_fused(store: &ParamStore, buffer: &Tensor) -> Result<()> {
    let buffer = buffer.to_device(store.iter().next().map_or(&Device::Cpu, |p| p.var.device()))?;
    let layout = FusedLayout::from_shapes(store.iter().map(|p| p.var.shape().clone()));
    for (p, value) in store.iter().zip(layout.split(&buffer, 0)?) {
        p.var.set(&value)?;
    }
    Ok(())
}
