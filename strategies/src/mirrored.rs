//! `MirroredStrategy`: a copy of the model on every device of this process, one thread per
//! replica; each step the global batch is split across replicas, their step buffers are summed
//! as one fused buffer, and every replica runs the same final phase on the sum.

use candle_core::Device;
use kandle::data::Batch;
use kandle::strategy::{DistributedModel, ModelSpec, StepStats, Strategy};
use kandle::Result;

use crate::cross_device_ops::CrossDeviceOps;
use crate::replica_set::{
    local_constructors, local_strategy, replica_builders, replica_set_queries, LocalReplicas,
    ReplicaSet,
};

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
    local_constructors!("MirroredStrategy");

    fn with_local(local: LocalReplicas) -> Self {
        Self {
            local,
            ops: CrossDeviceOps::default(),
        }
    }

    /// How replicas sum their step buffers (default [`CrossDeviceOps::ReductionToOneDevice`]).
    pub fn cross_device_ops(mut self, ops: CrossDeviceOps) -> Self {
        self.ops = ops;
        self
    }

    replica_builders!();

    /// The replicas' devices.
    pub fn devices(&self) -> &[Device] {
        &self.local.devices
    }
}

impl Strategy for MirroredStrategy {
    local_strategy!("mirrored");

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
        let (reduced, before) = self.set.compute_reduced(batch, self.ops)?;
        let totals = self.set.layout.read(&reduced[0])?;
        self.set.finish(reduced, &totals, before, lr)
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        self.set.evaluate(batch)
    }

    replica_set_queries!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use kandle::layers::{Activation, BatchNormalization, Conv2D, Dense, Flatten, Sequential};
    use kandle::losses::SparseCategoricalCrossentropy;
    use kandle::metrics::Accuracy;
    use kandle::optimizers::Sgd;

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
            loss: std::sync::Arc::new(SparseCategoricalCrossentropy::new()),
            metrics: [Accuracy].into(),
            seed: 1,
            compute_path: kandle::ComputePath::Auto,
        };
        let mut model = MirroredModel {
            set: LocalReplicas::new(vec![Device::Cpu; 3], "test")?.build(&spec)?,
            ops: CrossDeviceOps::default(),
        };
        let data = kandle::data::digits::load()?;
        let (x, y) = data.to_tensors()?;
        for step in 0..3 {
            // 20 samples over 3 replicas: parts of 7, 7 and 6 with different statistics.
            let batch = Batch::new(x.narrow(0, step * 20, 20)?, y.narrow(0, step * 20, 20)?);
            model.train_step(&batch, 0.1)?;
            let stats = statistics_of(&model)?;
            assert!(stats[0].iter().any(|v| *v != 0.0 && *v != 1.0));
            assert_eq!(stats[0], stats[1], "step {step}");
            assert_eq!(stats[0], stats[2], "step {step}");
        }
        Ok(())
    }

    #[test]
    fn every_replica_gets_the_loaded_optimizer_state() -> Result<()> {
        let spec = ModelSpec {
            network: Sequential::new()
                .add(Flatten)
                .add(Dense::new(10))
                .add(Activation::Softmax),
            input_shape: vec![1, 8, 8],
            optimizer: Box::new(Sgd::new(0.1).momentum(0.9)),
            loss: std::sync::Arc::new(SparseCategoricalCrossentropy::new()),
            metrics: [Accuracy].into(),
            seed: 1,
            compute_path: kandle::ComputePath::Auto,
        };
        let build = |seed| -> Result<MirroredModel> {
            let spec = ModelSpec {
                seed,
                ..spec.clone()
            };
            Ok(MirroredModel {
                set: LocalReplicas::new(vec![Device::Cpu; 3], "test")?.build(&spec)?,
                ops: CrossDeviceOps::default(),
            })
        };
        let data = kandle::data::digits::load()?;
        let (x, y) = data.to_tensors()?;
        let mut trained = build(1)?;
        for step in 0..2 {
            let batch = Batch::new(x.narrow(0, step * 12, 12)?, y.narrow(0, step * 12, 12)?);
            trained.train_step(&batch, 0.1)?;
        }
        let state = trained.optimizer_state()?;
        let mut fresh = build(2)?;
        fresh.set_optimizer_state(&state)?;
        let momenta = fresh.set.pool.run(vec![(); 3], |_, replica, ()| {
            let state = replica.optimizer_state()?;
            let mut values = Vec::new();
            for t in state.slots["momentum"].values() {
                values.extend(t.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(values)
        })?;
        let mut want = Vec::new();
        for t in state.slots["momentum"].values() {
            want.extend(t.flatten_all()?.to_vec1::<f32>()?);
        }
        assert!(want.iter().any(|v| *v != 0.0));
        for (i, got) in momenta.iter().enumerate() {
            assert_eq!(got, &want, "replica {i}");
        }
        Ok(())
    }
}
