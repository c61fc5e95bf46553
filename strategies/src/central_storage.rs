//! `CentralStorageStrategy`: the variables and the optimizer state live once, on a central
//! device (the CPU by default). Each step the variables are copied to the compute devices, the
//! replicas compute their step buffers, the buffers are summed on the central device and the
//! step's final phase runs there.

use candle_core::{Device, Tensor};
use kandle::data::Batch;
use kandle::layers::Summary;
use kandle::optimizers::NamedOptimizerState;
use kandle::params::{ParamStore, Weights};
use kandle::strategy::{DistributedModel, ModelSpec, Replica, StepStats, Strategy, WorkerHooks};
use kandle::{Error, Result};

use crate::cross_device_ops::CrossDeviceOps;
use crate::replica_set::{
    all_gpus, cpu_weights, fuse_store, replica_devices, unzip, ReplicaOptions, ReplicaSet,
};

/// The strategy's name in messages.
const NAME: &str = "CentralStorageStrategy";

/// Data parallelism with the variables kept in one place.
#[derive(Debug, Clone)]
pub struct CentralStorageStrategy {
    devices: Vec<Device>,
    options: ReplicaOptions,
    central: Device,
}

impl CentralStorageStrategy {
    /// One replica per device, the variables on the CPU until [`Self::central_device`] says
    /// otherwise. Fails on an empty list.
    pub fn new(devices: Vec<Device>) -> Result<Self> {
        Ok(Self {
            devices: replica_devices(devices, NAME)?,
            options: ReplicaOptions::default(),
            central: Device::Cpu,
        })
    }

    /// One replica per visible GPU (`CUDA_VISIBLE_DEVICES` is honoured). Fails when there is
    /// none or kandle was built without `cuda`.
    pub fn all_gpus() -> Result<Self> {
        Self::new(all_gpus(NAME)?)
    }

    /// `replicas` replicas on the CPU.
    pub fn cpu(replicas: usize) -> Result<Self> {
        Self::new(vec![Device::Cpu; replicas])
    }

    /// Where the variables live (default: the CPU).
    pub fn central_device(mut self, device: Device) -> Self {
        self.central = device;
        self
    }

    /// How the replicas run: SyncBatchNorm, the timeout, threads per replica (default
    /// [`ReplicaOptions::default`]).
    pub fn with_options(self, options: ReplicaOptions) -> Self {
        Self { options, ..self }
    }

    /// The replicas' options.
    pub fn options(&self) -> &ReplicaOptions {
        &self.options
    }
}

impl Strategy for CentralStorageStrategy {
    fn name(&self) -> &str {
        "central_storage"
    }

    fn num_replicas_in_sync(&self) -> usize {
        self.devices.len()
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        // SyncBatchNorm's sums meet on the first compute device.
        let set = ReplicaSet::build(
            spec,
            &self.devices,
            &self.options,
            CrossDeviceOps::ReductionToOneDevice,
        )?;
        // The central replica never computes: its network is built in float32 wherever the
        // compute devices run a mixed policy, and it keeps the policy's loss scale, which its
        // final phase moves on and the compute replicas load with the variables.
        let holder = ModelSpec {
            dtype_policy: kandle::DTypePolicy::float32()
                .with_loss_scale(spec.dtype_policy.loss_scale()),
            ..spec.clone()
        };
        let central = Replica::new(&holder, &self.central)?;
        central.store().assign(&set.weights()?)?;
        Ok(Box::new(CentralModel { set, central }))
    }
}

struct CentralModel {
    set: ReplicaSet,
    /// Holds the variables and the optimizer; it never runs a forward pass.
    central: Replica,
}

impl WorkerHooks for CentralModel {}

impl DistributedModel for CentralModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        let weights = fuse_store(self.central.store())?;
        let (buffers, _) = unzip(self.set.compute(batch, Some(weights))?);
        // The replicas' dropout generators moved on from the central positions they loaded:
        // the central variables keep up, so the next step (and a checkpoint) continues there.
        copy_generators(&self.set.stores[0], self.central.store())?;
        let device = self.central.device().clone();
        let mut total: Option<Tensor> = None;
        for buffer in buffers {
            let buffer = buffer.to_device(&device)?;
            total = Some(match total {
                None => buffer,
                Some(t) => (t + buffer)?,
            });
        }
        let total = total.ok_or_else(|| Error::invalid("no replica produced gradients"))?;
        let totals = self.set.layout.read(&total)?;
        // The central replica ran no forward pass, so a discarded step has nothing to restore;
        // the compute replicas load the central variables again before the next step.
        self.central.finish_step(&total, &totals, &[], lr)?;
        Ok(totals.into_stats())
    }

    fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        let weights = fuse_store(self.central.store())?;
        let stats = self.set.accumulate(batch, Some(weights))?;
        copy_generators(&self.set.stores[0], self.central.store())?;
        Ok(stats)
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        self.sync_replicas()?;
        self.set.evaluate(batch)
    }

    fn predict_step(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.sync_replicas()?;
        self.set.predict(inputs)
    }

    fn weights(&self) -> Result<Weights> {
        cpu_weights(self.central.store())
    }

    fn summary(&self) -> &Summary {
        self.central.summary()
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.central.store().assign(weights)
    }

    /// The central replica's: the only optimizer that steps.
    fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        self.central.optimizer_state()?.to_device(&Device::Cpu)
    }

    fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        self.central.load_optimizer_state(state)
    }
}

/// Sets `to`'s generator positions ([`Param::generator`](kandle::params::Param)) to `from`'s.
fn copy_generators(from: &ParamStore, to: &ParamStore) -> Result<()> {
    for p in from.iter().filter(|p| p.generator) {
        if let Some(target) = to.get(&p.name) {
            target
                .var
                .set(&p.var.as_tensor().to_device(target.var.device())?)?;
        }
    }
    Ok(())
}

impl CentralModel {
    /// Copies the central variables to the compute replicas, for inference.
    fn sync_replicas(&self) -> Result<()> {
        self.set.set_weights(&self.central.store().weights()?)
    }
}
