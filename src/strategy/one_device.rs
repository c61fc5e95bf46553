//! `OneDeviceStrategy`: the whole model on one device, the reference every other strategy is
//! tested against.

use candle_core::{DType, Device, Tensor};

use super::{DistributedModel, ModelSpec, Replica, StepStats, Strategy, WorkerHooks};
use crate::data::Batch;
use crate::optimizers::NamedOptimizerState;
use crate::params::Weights;
use crate::Result;

/// Trains on a single device.
#[derive(Debug, Clone)]
pub struct OneDeviceStrategy {
    device: Device,
}

impl OneDeviceStrategy {
    /// On `device`.
    pub fn new(device: Device) -> Self {
        Self { device }
    }

    /// On the CPU.
    pub fn cpu() -> Self {
        Self::new(Device::Cpu)
    }

    /// On CUDA device `index` (as numbered after `CUDA_VISIBLE_DEVICES`). Fails clearly when
    /// the device does not exist or kandle was built without the `cuda` feature.
    pub fn gpu(index: usize) -> Result<Self> {
        Ok(Self::new(crate::devices::cuda(index)?))
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Strategy for OneDeviceStrategy {
    fn name(&self) -> &str {
        "one_device"
    }

    fn num_replicas_in_sync(&self) -> usize {
        1
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        Ok(Box::new(OneDeviceModel {
            replica: Replica::new(spec, &self.device)?,
        }))
    }
}

struct OneDeviceModel {
    replica: Replica,
}

impl WorkerHooks for OneDeviceModel {}

impl DistributedModel for OneDeviceModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        Ok(self.replica.train_alone(batch, lr)?.into_stats())
    }

    /// Its CUDA device: batches copied there by the prefetch thread. On the CPU, none.
    fn input_device(&self) -> Option<Device> {
        let device = self.replica.device();
        device.is_cuda().then(|| device.clone())
    }

    fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        let (samples, sums) = self.replica.accumulate(batch)?;
        Ok(StepStats {
            samples,
            sums,
            applied: false,
        })
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        let sums = self
            .replica
            .evaluate(batch)?
            .to_dtype(DType::F64)?
            .to_vec1()?;
        Ok(StepStats {
            samples: batch.len(),
            sums,
            applied: false,
        })
    }

    fn predict_step(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.replica
            .predict(inputs)?
            .into_iter()
            .map(|y| Ok(y.to_device(&Device::Cpu)?))
            .collect()
    }

    fn summary(&self) -> &crate::layers::Summary {
        self.replica.summary()
    }

    fn weights(&self) -> Result<Weights> {
        self.replica
            .store()
            .weights()?
            .into_iter()
            .map(|(k, v)| Ok((k, v.to_device(&Device::Cpu)?)))
            .collect()
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.replica.store().assign(weights)
    }

    fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        self.replica.optimizer_state()?.to_device(&Device::Cpu)
    }

    fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        self.replica.load_optimizer_state(state)
    }
}
