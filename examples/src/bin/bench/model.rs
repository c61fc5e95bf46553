//! kandle's training step and inference of a [`Workload`] (MiniGoogLeNet, its functional form,
//! or a ResNet on CIFAR's or ImageNet's images), timed through the public API: a strategy
//! distributes the compiled recipe, and each step is `DistributedModel::train_step`, the call
//! `fit` makes for every batch (forward, loss, backward, the finite-ness check and the SGD update).

use crate::timing::Timer;
use crate::workload::Workload;
use anyhow::Result;
use candle_core::{Device, Tensor};
use kandle::data::Batch;
use kandle::optimizers::Sgd;
use kandle::prelude::{Accuracy, SparseCategoricalCrossentropy};
use kandle::strategy::{ModelSpec, Replica};
use kandle::Strategy;
use kandle::{ComputePath, DTypePolicy};

/// The tutorial's learning rate.
const LR: f64 = 5e-3;

/// `which` with the tutorial's optimizer (SGD, momentum 0.9), under `policy`.
pub fn spec(which: Workload, policy: DTypePolicy) -> Result<ModelSpec> {
    Ok(ModelSpec {
        dtype_policy: policy,
        ..spec_on(ComputePath::Auto, which)?
    })
}

/// [`spec`] in float32, running `compute_path`.
fn spec_on(compute_path: ComputePath, which: Workload) -> Result<ModelSpec> {
    Ok(ModelSpec {
        network: which.network()?,
        input_shapes: vec![which.input_shape().to_vec()],
        optimizer: Box::new(Sgd::new(LR).momentum(0.9)),
        loss: kandle::Objective::new(SparseCategoricalCrossentropy::new()),
        metrics: [Accuracy].into(),
        seed: 0,
        compute_path,
        dtype_policy: DTypePolicy::default(),
    })
}

/// A batch of `n` random images of `which`'s shape with labels, on `device`.
pub fn random_batch(which: Workload, n: usize, device: &Device) -> Result<Batch> {
    let classes = which.classes() as u32;
    let labels: Vec<u32> = (0..n as u32).map(|i| i % classes).collect();
    let [c, h, w] = which.input_shape();
    Ok(Batch::new(
        Tensor::randn(0f32, 1., (n, c, h, w), &Device::Cpu)?.to_device(device)?,
        Tensor::from_vec(labels, n, &Device::Cpu)?.to_device(device)?,
    ))
}

/// Median seconds of one training step at global batch `batch` under `strategy`, its batch
/// already on `device` (as PyTorch's is).
pub fn train_step_time(
    (which, policy): (Workload, DTypePolicy),
    strategy: &dyn Strategy,
    device: &Device,
    batch: usize,
    timer: Timer,
) -> Result<f64> {
    step_time(which, spec(which, policy)?, strategy, device, batch, timer)
}

/// [`train_step_time`] with every layer frozen but the last that has variables (the
/// classifier): the step of transfer learning's first phase, a frozen base under a new head.
pub fn frozen_base_step_time(
    (which, policy): (Workload, DTypePolicy),
    strategy: &dyn Strategy,
    device: &Device,
    batch: usize,
    timer: Timer,
) -> Result<f64> {
    let mut spec = spec(which, policy)?;
    let summary = spec.network.summary(&spec.input_shapes[0])?;
    let head = summary
        .rows
        .iter()
        .rev()
        .find(|r| r.trainable > 0)
        .map(|r| r.name.clone())
        .unwrap_or_default();
    spec.network = spec
        .network
        .with_trainable(&[""], false)
        .with_trainable(&[&head], true);
    step_time(which, spec, strategy, device, batch, timer)
}

/// Median seconds of one training step of `spec` at global batch `batch` under `strategy`.
fn step_time(
    which: Workload,
    spec: ModelSpec,
    strategy: &dyn Strategy,
    device: &Device,
    batch: usize,
    timer: Timer,
) -> Result<f64> {
    let mut model = strategy.distribute(&spec)?;
    let batch = random_batch(which, batch, device)?;
    timer.median(|| {
        model.train_step(&batch, LR)?;
        Ok(())
    })
}

/// Median seconds of one replica's training step (gradients, then the SGD update) at batch
/// `batch` on the CPU, on `path`: kandle's recorded backward pass ([`ComputePath::Auto`])
/// against candle's autograd over the whole network ([`ComputePath::Autograd`]).
pub fn replica_step_time(
    which: Workload,
    path: ComputePath,
    batch: usize,
    timer: Timer,
) -> Result<f64> {
    let mut replica = Replica::new(&spec_on(path, which)?, &Device::Cpu)?;
    let batch = random_batch(which, batch, &Device::Cpu)?;
    timer.median(|| {
        let step = replica.step_buffer(&batch)?;
        let totals = replica.layout().read(&step.fused)?;
        replica.finish_step(&step.fused, &totals, &step.statistics_before, LR)?;
        Ok(())
    })
}

/// Median seconds of inference (the softmax outputs, read back to the host) on `batch` images
/// already on `device` under `strategy`.
pub fn inference_time(
    (which, policy): (Workload, DTypePolicy),
    strategy: &dyn Strategy,
    device: &Device,
    batch: usize,
    timer: Timer,
) -> Result<f64> {
    let mut model = strategy.distribute(&spec(which, policy)?)?;
    let x = random_batch(which, batch, device)?.inputs;
    timer.median(|| {
        // Read back to the host: on a GPU this waits for the computation, as PyTorch's side does.
        for y in model.predict_step(&x)? {
            std::hint::black_box(y.to_device(&Device::Cpu)?);
        }
        Ok(())
    })
}
