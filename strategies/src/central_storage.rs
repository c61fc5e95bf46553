//! `CentralStorageStrategy`: the variables and the optimizer state live once, on a central
//! device (the CPU by default). Each step the variables are copied to the compute devices, the
//! replicas compute gradients, the gradients are summed on the central device and the update
//! is applied there.

use std::time::Duration;

use candle_core::{Device, Tensor};
use kandle::data::Batch;
use kandle::params::Weights;
use kandle::replica::{ModelSpec, Replica};
use kandle::strategy::{DistributedModel, StepStats, Strategy};
use kandle::{Error, Result};

use crate::replica_pool::ReplicaThreads;
use crate::replica_set::{cpu_weights, fuse_store, LocalReplicas, ReplicaSet};

/// Data parallelism with the variables kept in one place.
#[derive(Debug, Clone)]
pub struct CentralStorageStrategy {
    local: LocalReplicas,
    central: Device,
}

impl CentralStorageStrategy {
    /// Computes on `devices`, stores the variables on the CPU. Fails on an empty list.
    pub fn new(devices: Vec<Device>) -> Result<Self> {
        Ok(Self {
            local: LocalReplicas::new(devices, "CentralStorageStrategy")?,
            central: Device::Cpu,
        })
    }

    /// Computes on every visible GPU. Fails when there is none.
    pub fn all_gpus() -> Result<Self> {
        Ok(Self {
            local: LocalReplicas::all_gpus("CentralStorageStrategy")?,
            central: Device::Cpu,
        })
    }

    /// `replicas` compute replicas on the CPU.
    pub fn cpu(replicas: usize) -> Result<Self> {
        Self::new(vec![Device::Cpu; replicas])
    }

    /// Where the variables live (default: the CPU).
    pub fn central_device(mut self, device: Device) -> Self {
        self.central = device;
        self
    }

    /// Batch normalisation with statistics of the whole global batch.
    pub fn sync_batch_norm(mut self, sync: bool) -> Self {
        self.local.sync_batch_norm = sync;
        self
    }

    /// How long a step waits for a replica before failing (default 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.local.timeout = timeout;
        self
    }

    /// How many threads each replica's CPU work may use: a count, or a [`ReplicaThreads`].
    /// The default, [`ReplicaThreads::Auto`], divides the cores evenly among CPU replicas, so
    /// replicas sharing the CPU do not oversubscribe it.
    pub fn threads_per_replica(mut self, threads: impl Into<ReplicaThreads>) -> Self {
        self.local.threads = threads.into();
        self
    }
}

impl Strategy for CentralStorageStrategy {
    fn name(&self) -> &str {
        "central_storage"
    }

    fn num_replicas_in_sync(&self) -> usize {
        self.local.devices.len()
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        let set = self.local.build(spec)?;
        let central = Replica::new(spec, &self.central)?;
        central.store().assign(&set.weights()?)?;
        Ok(Box::new(CentralModel { set, central }))
    }
}

struct CentralModel {
    set: ReplicaSet,
    /// Holds the variables and the optimizer; it never runs a forward pass.
    central: Replica,
}

impl DistributedModel for CentralModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        let weights = fuse_store(self.central.store())?;
        let outputs = self.set.compute(batch, batch.len(), Some(weights))?;
        let device = self.central.device().clone();
        let mut total: Option<Tensor> = None;
        for out in &outputs {
            let buffer = out.fused.to_device(&device)?;
            total = Some(match total {
                None => buffer,
                Some(t) => (t + buffer)?,
            });
        }
        let total = total.ok_or_else(|| Error::invalid("no replica produced gradients"))?;
        let layout = &self.set.layout;
        let reduced_stats = layout.read(&total)?;
        let applied = reduced_stats.finite;
        if applied {
            let grads = layout.grads.split(&total, 0)?;
            self.central.apply_gradients(&grads, lr)?;
            let replicas = self.set.len() as f64;
            let sums_of_statistics = layout
                .statistics
                .split(&total, layout.statistics_offset())?;
            for (var, sum) in self.central.statistics().iter().zip(sums_of_statistics) {
                var.set(&(sum / replicas)?)?;
            }
        }
        Ok(StepStats {
            samples: reduced_stats.samples,
            sums: reduced_stats.sums,
            applied,
        })
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        self.sync_replicas()?;
        self.set.evaluate(batch)
    }

    fn predict_step(&mut self, x: &Tensor) -> Result<Tensor> {
        self.sync_replicas()?;
        self.set.predict(x)
    }

    fn weights(&self) -> Result<Weights> {
        cpu_weights(self.central.store())
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.central.store().assign(weights)
    }
}

impl CentralModel {
    /// Copies the central variables to the compute replicas, for inference.
    fn sync_replicas(&self) -> Result<()> {
        self.set.set_weights(&self.central.store().weights()?)
    }
}
