//! `MirroredStrategy`: a copy of the model on every device of this process, one thread per
//! replica; each step the global batch is split across replicas, their gradients are summed
//! as one fused buffer, and every replica applies the same update.

use std::time::Duration;

use candle_core::{Device, Tensor};
use kandle::data::Batch;
use kandle::params::Weights;
use kandle::replica::ModelSpec;
use kandle::strategy::{DistributedModel, StepStats, Strategy};
use kandle::Result;

use crate::cross_device_ops::CrossDeviceOps;
use crate::replica_pool::ReplicaThreads;
use crate::replica_set::{LocalReplicas, ReplicaSet};

/// How long a step waits for a silent replica before failing, unless set otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Synchronous data parallelism over the devices of one process.
///
/// ```
/// use kandle_strategies::{CrossDeviceOps, MirroredStrategy};
/// use kandle::Strategy;
///
/// let strategy = MirroredStrategy::cpu(2)?.cross_device_ops(CrossDeviceOps::HierarchicalCopy);
/// assert_eq!(strategy.num_replicas_in_sync(), 2);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MirroredStrategy {
    local: LocalReplicas,
    ops: CrossDeviceOps,
}

impl MirroredStrategy {
    /// One replica per device. Fails on an empty list.
    pub fn new(devices: Vec<Device>) -> Result<Self> {
        Ok(Self {
            local: LocalReplicas::new(devices, "MirroredStrategy")?,
            ops: CrossDeviceOps::default(),
        })
    }

    /// One replica per visible GPU (`CUDA_VISIBLE_DEVICES` is honoured). Fails when there is
    /// none or kandle was built without `cuda`.
    pub fn all_gpus() -> Result<Self> {
        Ok(Self {
            local: LocalReplicas::all_gpus("MirroredStrategy")?,
            ops: CrossDeviceOps::default(),
        })
    }

    /// `replicas` replicas on the CPU.
    pub fn cpu(replicas: usize) -> Result<Self> {
        Self::new(vec![Device::Cpu; replicas])
    }

    /// How replicas sum their gradients (default [`CrossDeviceOps::ReductionToOneDevice`]).
    pub fn cross_device_ops(mut self, ops: CrossDeviceOps) -> Self {
        self.ops = ops;
        self
    }

    /// Batch normalisation with statistics of the whole global batch (`SyncBatchNorm`) instead of
    /// each replica's part. Either way the moving statistics agree on every replica.
    pub fn sync_batch_norm(mut self, sync: bool) -> Self {
        self.local.sync_batch_norm = sync;
        self
    }

    /// How long a step waits for a replica before failing with an error naming it (default 60 s).
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

    /// The replicas' devices.
    pub fn devices(&self) -> &[Device] {
        &self.local.devices
    }
}

impl Strategy for MirroredStrategy {
    fn name(&self) -> &str {
        "mirrored"
    }

    fn num_replicas_in_sync(&self) -> usize {
        self.local.devices.len()
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        Ok(Box::new(MirroredModel {
            set: self.local.build(spec)?,
            ops: self.ops,
        }))
    }
}

struct MirroredModel {
    set: ReplicaSet,
    ops: CrossDeviceOps,
}

impl DistributedModel for MirroredModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        let (reduced, before) = self.set.compute_reduced(batch, batch.len(), self.ops)?;
        let reduced_stats = self.set.layout.read(&reduced[0])?;
        let applied = reduced_stats.finite;
        let layout = std::sync::Arc::clone(&self.set.layout);
        let replicas = self.set.len() as f64;
        let average_statistics = !self.set.syncs_batch_norm();
        let inputs: Vec<(Tensor, Vec<Tensor>)> = reduced.into_iter().zip(before).collect();
        self.set
            .pool
            .run(inputs, move |_, replica, (buffer, before)| {
                if !applied {
                    return restore(replica.statistics(), &before);
                }
                let grads = layout.grads.split(&buffer, 0)?;
                replica.apply_gradients(&grads, lr)?;
                if average_statistics {
                    let means = layout
                        .statistics
                        .split(&buffer, layout.statistics_offset())?;
                    for (var, sum) in replica.statistics().iter().zip(means) {
                        var.set(&(sum / replicas)?)?;
                    }
                }
                Ok(())
            })?;
        Ok(StepStats {
            samples: reduced_stats.samples,
            sums: reduced_stats.sums,
            applied,
        })
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        self.set.evaluate(batch)
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

/// Puts moving statistics back to the values they had before a discarded step.
pub(crate) fn restore(vars: &[candle_core::Var], before: &[Tensor]) -> Result<()> {
    for (var, value) in vars.iter().zip(before) {
        var.set(value)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kandle::layers::{Activation, BatchNormalization, Conv2D, Dense, Flatten, Sequential};
    use kandle::optimizers::Sgd;
    use kandle::{Loss, Metric};

    fn statistics_of(model: &MirroredModel) -> Result<Vec<Vec<f32>>> {
        model
            .set
            .stores
            .iter()
            .map(|s| {
                let parts = s
                    .iter()
                    .filter(|p| p.statistic)
                    .map(|p| Ok(p.var.as_tensor().flatten_all()?.to_vec1::<f32>()?))
                    .collect::<Result<Vec<_>>>()?;
                Ok(parts.concat())
            })
            .collect()
    }

    #[test]
    fn per_replica_batch_norm_keeps_moving_statistics_identical() -> Result<()> {
        let spec = ModelSpec {
            network: Sequential::new()
                .add(Conv2D::new(4, 3))
                .add(BatchNormalization::new())
                .add(Activation::Relu)
                .add(Flatten)
                .add(Dense::new(10))
                .add(Activation::Softmax),
            input_shape: vec![1, 8, 8],
            optimizer: Box::new(Sgd::new(0.1)),
            loss: Loss::SparseCategoricalCrossentropy,
            metrics: vec![Metric::Accuracy],
            seed: 1,
        };
        let mut model = MirroredModel {
            set: ReplicaSet::new(&spec, &vec![Device::Cpu; 3], false, DEFAULT_TIMEOUT)?,
            ops: CrossDeviceOps::default(),
        };
        let data = kandle::data::digits::load()?;
        let (x, y) = data.to_tensors()?;
        for step in 0..3 {
            // 20 samples over 3 replicas: parts of 7, 7 and 6 with different statistics.
            let batch = Batch {
                x: x.narrow(0, step * 20, 20)?,
                y: y.narrow(0, step * 20, 20)?,
            };
            model.train_step(&batch, 0.1)?;
            let stats = statistics_of(&model)?;
            assert!(stats[0].iter().any(|v| *v != 0.0 && *v != 1.0));
            assert_eq!(stats[0], stats[1], "step {step}");
            assert_eq!(stats[0], stats[2], "step {step}");
        }
        Ok(())
    }
}
