//! The recorded backward pass as a device without a kandle kernel for a layer runs it: replicas
//! built for [`ComputePath::DeviceGeneric`] (candle's ops, no kernel) train through the recorded
//! pass, each layer recording its backward in candle's ops or under candle's autograd one
//! layer at a time, and give the gradients and weights that candle's autograd over the whole
//! network gives, in `float32` and in `mixed_float16` (which candle runs on the CPU); a
//! Sequential CNN and a functional graph with a residual `add` and a `concatenate`. On a CUDA
//! device (ignored without one), the default path records with kandle's CUDA kernels and gives
//! what candle's autograd gives over the same kernels.

use candle_core::{DType, Device, Tensor};

use super::{ModelSpec, Replica};
use crate::data::Batch;
use crate::functional::{add, concatenate, Functional, Input, LayerCall};
use crate::layers::{
    Activation, AveragePooling2D, BatchNormalization, Conv2D, Dense, Dropout,
    GlobalAveragePooling2D, LayerSpecExt, MaxPooling2D, Padding, Sequential,
};
use crate::losses::CategoricalCrossentropy;
use crate::metrics::Accuracy;
use crate::mixed_precision::LossScale;
use crate::network::Network;
use crate::objective::Objective;
use crate::optimizers::Sgd;
use crate::{ComputePath, DTypePolicy, Result};

/// The input's shape, without the batch axis.
const INPUT: [usize; 3] = [3, 10, 10];
/// The number of classes.
const CLASSES: usize = 4;

/// A CNN of the layer kinds an image classifier trains with: convolutions with batch
/// normalisation (one of them frozen) and ReLU, max and average pooling, global average
/// pooling, dropout, dense layers and a softmax head.
fn sequential_cnn() -> Network {
    let conv_bn_relu = |filters| {
        Sequential::new()
            .add(
                Conv2D::new(filters, 3)
                    .padding(Padding::Same)
                    .use_bias(false),
            )
            .add(BatchNormalization::new())
            .add(Activation::Relu)
    };
    Sequential::new()
        .add(conv_bn_relu(6))
        .add(MaxPooling2D::new(3).stride(2).padding(Padding::Same))
        .add(conv_bn_relu(8))
        .add(BatchNormalization::new().trainable(false))
        .add(AveragePooling2D::new(2).stride(1))
        .add(Conv2D::new(8, 1).activation(Activation::Relu))
        .add(GlobalAveragePooling2D)
        .add(Dropout::new(0.25))
        .add(Dense::new(12).activation(Activation::Relu))
        .add(Dense::new(CLASSES))
        .add(Activation::Softmax)
        .into()
}

/// A functional graph with a residual `add` (its ReLU absorbed) and a `concatenate` of a
/// convolution and a pool.
fn functional_graph() -> Result<Network> {
    let x = Input::new(&INPUT).tensor();
    let stem = Conv2D::new(6, 3)
        .padding(Padding::Same)
        .use_bias(false)
        .call(&x)?;
    let stem = Activation::Relu.call(&BatchNormalization::new().call(&stem)?)?;
    let h = Conv2D::new(6, 3)
        .padding(Padding::Same)
        .activation(Activation::Relu)
        .call(&stem)?;
    let h = Conv2D::new(6, 1).use_bias(false).call(&h)?;
    let h = BatchNormalization::new().call(&h)?;
    let residual = Activation::Relu.call(&add(&[&stem, &h])?)?;
    let joined = concatenate(&[
        &Conv2D::new(5, 3)
            .stride(2)
            .padding(Padding::Same)
            .call(&residual)?,
        &MaxPooling2D::new(2).call(&residual)?,
    ])?;
    let h = GlobalAveragePooling2D.call(&joined)?;
    let h = Dropout::new(0.2).call(&Dense::new(10).call(&h)?)?;
    let y = Activation::Softmax.call(&Dense::new(CLASSES).call(&h)?)?;
    Ok(Functional::new([&x], [&y])?.into())
}

fn spec(network: Network, compute_path: ComputePath, dtype_policy: DTypePolicy) -> ModelSpec {
    ModelSpec {
        network,
        input_shapes: vec![INPUT.to_vec()],
        optimizer: Box::new(Sgd::new(0.1).momentum(0.9)),
        loss: Objective::new(CategoricalCrossentropy::new()),
        metrics: [Accuracy].into(),
        seed: 5,
        compute_path,
        dtype_policy,
    }
}

/// A batch of `n` images (on the CPU) with one-hot labels, drawn from `seed`.
fn batch(n: usize, seed: u64) -> Result<Batch> {
    let x = kandle_testing::random::seeded_uniform(&[n, INPUT[0], INPUT[1], INPUT[2]], seed)?;
    let labels: Vec<u32> = (0..n as u32)
        .map(|i| (i * 3 + seed as u32) % CLASSES as u32)
        .collect();
    let y = candle_nn::encoding::one_hot(Tensor::new(labels, &Device::Cpu)?, CLASSES, 1f32, 0f32)?;
    Ok(Batch::new(x, y.to_dtype(DType::F32)?))
}

/// The largest difference between `a` and `b` relative to `b`'s largest magnitude, on the CPU
/// in `float32`; infinite unless `a` is finite.
fn relative_difference(a: &Tensor, b: &Tensor) -> Result<f32> {
    let f32_on_cpu =
        |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?) };
    let (a, b) = (f32_on_cpu(a)?, f32_on_cpu(b)?);
    let finite = a
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|v| v.is_finite());
    match finite {
        true => crate::layers::relative_difference(&a, &b),
        false => Ok(f32::INFINITY),
    }
}

/// The largest relative difference between the two replicas' trainable variables, named.
fn weights_difference(ours: &Replica, theirs: &Replica) -> Result<(f32, String)> {
    let mut worst = (0f32, String::new());
    for (name, (a, b)) in ours
        .trainable_names
        .iter()
        .zip(ours.trainable.iter().zip(&theirs.trainable))
    {
        let rel = relative_difference(a.as_tensor(), b.as_tensor())?;
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    Ok(worst)
}

/// One training step of `replica` on `batch` (the step buffer, then the final phase at a
/// learning rate of 0.05); its step buffer.
fn train_step(replica: &mut Replica, batch: &Batch) -> Result<Tensor> {
    let buffer = replica.step_buffer(batch)?;
    let totals = replica.layout().read(&buffer.fused)?;
    replica.finish_step(&buffer.fused, &totals, &buffer.statistics_before, 0.05)?;
    Ok(buffer.fused)
}

/// Trains `recorded` (through the recorded backward pass) and `autograd` (through candle's)
/// from the same weights for `steps` steps of the same batches, and returns the largest
/// relative difference of any gradient at any step, and of any trainable variable after the
/// last one; asserts that the loss sums and the moving statistics stay within `tolerance` too.
fn train_both(
    recorded: Replica,
    autograd: Replica,
    steps: u64,
    tolerance: f32,
) -> Result<(f32, f32)> {
    assert!(recorded.records_backward && !autograd.records_backward);
    autograd.store().assign(&recorded.store().weights()?)?;
    let mut replicas = [recorded, autograd];
    let mut gradients = 0f32;
    for step in 0..steps {
        let batch = batch(6, step + 1)?;
        let mut buffers = Vec::new();
        for replica in &mut replicas {
            buffers.push(train_step(replica, &batch)?);
        }
        let layout = replicas[0].layout().clone();
        let ours = layout.grads.split(&buffers[0], 0)?;
        let theirs = layout.grads.split(&buffers[1], 0)?;
        for ((a, b), name) in ours.iter().zip(&theirs).zip(&replicas[0].trainable_names) {
            let rel = relative_difference(a, b)?;
            assert!(
                rel < tolerance,
                "step {step}, {name}: gradient differs by {rel}"
            );
            gradients = gradients.max(rel);
        }
        let stats = |b: &Tensor| b.narrow(0, layout.stats_offset(), layout.num_stats);
        let rel = relative_difference(&stats(&buffers[0])?, &stats(&buffers[1])?)?;
        assert!(rel < tolerance, "step {step}: loss sums differ by {rel}");
    }
    for (a, b) in replicas[0].statistics.iter().zip(&replicas[1].statistics) {
        let rel = relative_difference(a.as_tensor(), b.as_tensor())?;
        assert!(rel < tolerance, "moving statistics differ by {rel}");
    }
    let (weights, name) = weights_difference(&replicas[0], &replicas[1])?;
    assert!(weights < tolerance, "{name} differs by {weights}");
    Ok((gradients, weights))
}

/// The two networks, by name.
fn networks() -> Result<[(&'static str, Network); 2]> {
    Ok([
        ("sequential CNN", sequential_cnn()),
        ("functional graph", functional_graph()?),
    ])
}

/// The mixed policy `policy` with a loss scale that the gradients of these small networks do
/// not overflow in `f16` (Keras's 2^15 does, and would skip every step compared).
fn mixed(policy: DTypePolicy) -> DTypePolicy {
    policy.with_loss_scale(Some(LossScale {
        initial: 256.0,
        ..Default::default()
    }))
}

/// On the CPU, built for the device-generic path (no kandle kernel, every layer's non-kernel
/// branch), the recorded backward pass trains as candle's autograd does. The recorded layers
/// compute their gradients with the ops, in the order, that candle's autograd takes: in
/// `float32` and in `mixed_float16` (the layers in `f16`) the two were measured bit for bit
/// equal, gradients at each of four steps and the weights after them; the bound, a few
/// `float32` roundings, leaves room for a sum taken in another order.
#[test]
fn recorded_ops_of_devices_without_kernels_match_autograd() -> Result<()> {
    let cpu = Device::Cpu;
    for (policy, tolerance) in [
        (DTypePolicy::float32(), 1e-6),
        (mixed(DTypePolicy::mixed_float16()), 1e-6),
    ] {
        for (name, network) in networks()? {
            let spec = spec(network, ComputePath::DeviceGeneric, policy);
            let recorded = Replica::new(&spec, &cpu)?.recording_backward(true);
            let autograd = Replica::new(&spec, &cpu)?;
            let (gradients, weights) = train_both(recorded, autograd, 4, tolerance)?;
            eprintln!("{policy}, {name}: gradients within {gradients}, weights within {weights}");
        }
    }
    Ok(())
}

/// The default path records on the CPU and on CUDA devices; the others keep candle's autograd.
#[test]
fn the_default_path_records() -> Result<()> {
    let spec = |path| spec(sequential_cnn(), path, DTypePolicy::float32());
    assert!(Replica::new(&spec(ComputePath::Auto), &Device::Cpu)?.records_backward);
    for path in [ComputePath::Autograd, ComputePath::DeviceGeneric] {
        assert!(!Replica::new(&spec(path), &Device::Cpu)?.records_backward);
    }
    Ok(())
}

/// On a CUDA device the default path trains through the recorded backward pass, with kandle's
/// CUDA kernels' backward passes (batch normalisation, pooling; with `cudnn`, cuDNN's
/// convolution gradients) and the other layers' recorded in candle's ops, and reaches what
/// candle's autograd reaches over the same kernels ([`ComputePath::Autograd`]) in `float32`
/// and in the mixed policies. Both passes call the same kernels; they may differ where cuDNN
/// picks another algorithm for a gradient or a sum is taken in another order: the bounds are
/// those `cuda_kernels_match_the_device_generic_path` of the batch normalisation allows its
/// kernels against candle's ops (1e-4 in `float32`, 1e-2 in `f16`), and five times `f16`'s
/// in `bf16`, which keeps three bits fewer; the test prints what it measures.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn recorded_steps_on_cuda_match_autograd() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    for (policy, tolerance) in [
        (DTypePolicy::float32(), 1e-4),
        (mixed(DTypePolicy::mixed_float16()), 1e-2),
        (DTypePolicy::mixed_bfloat16(), 5e-2),
    ] {
        for (name, network) in networks()? {
            let recorded = Replica::new(&spec(network.clone(), ComputePath::Auto, policy), &gpu)?;
            let autograd = Replica::new(&spec(network, ComputePath::Autograd, policy), &gpu)?;
            let (gradients, weights) = train_both(recorded, autograd, 4, tolerance)?;
            eprintln!(
                "cuda, {policy}: {name}: gradients within {gradients}, weights within {weights}"
            );
        }
    }
    Ok(())
}

/// A training step captured as a CUDA graph and replayed is the eager step: the sequential CNN
/// (dropout's masks drawn on the device, batch normalisation's moving statistics moved in
/// place) and the functional graph, in `float32` and `mixed_float16`, trained for eight steps of
/// one shape (two warm-up steps, the capture, five replays) and a short batch (eager) by a
/// replica with graphs and one without, from the same weights; then six evaluations and
/// predictions (the last of another batch size), every output compared again after the last
/// call. With candle's convolutions every
/// kernel is deterministic, so every step buffer and every variable (weights, moving
/// statistics, generators' positions) must be the same bits; with cuDNN's, whose default
/// algorithms may add in any order, within the bounds of `recorded_steps_on_cuda_match_autograd`
/// (1e-4 in `float32`, 1e-2 in `f16`). Fails, naming the reason, when the step could not be
/// captured.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_graph_steps_are_the_eager_steps() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let same = |a: &Tensor, b: &Tensor, tolerance: f32| -> Result<bool> {
        match cfg!(feature = "cudnn") {
            true => Ok(relative_difference(a, b)? <= tolerance),
            false => same_bits(a, b),
        }
    };
    for (policy, tolerance) in [
        (DTypePolicy::float32(), 1e-4),
        (mixed(DTypePolicy::mixed_float16()), 1e-2),
    ] {
        for (name, network) in networks()? {
            let spec = spec(network, ComputePath::Auto, policy);
            let graphed = Replica::new(&spec, &gpu)?.with_cuda_graphs(true);
            let eager = Replica::new(&spec, &gpu)?.with_cuda_graphs(false);
            eager.store().assign(&graphed.store().weights()?)?;
            let mut replicas = [graphed, eager];
            for step in 0..9u64 {
                let batch = batch(if step == 8 { 5 } else { 6 }, step + 1)?;
                let mut buffers = Vec::new();
                for replica in &mut replicas {
                    buffers.push(train_step(replica, &batch)?);
                }
                assert!(
                    same(&buffers[0], &buffers[1], tolerance)?,
                    "{policy}, {name}: step {step}'s buffer differs with graphs ({:?})",
                    replicas[0].cuda_graphs()
                );
                if step == 3 {
                    let state = replicas[0].cuda_graphs().unwrap_or_default();
                    assert!(state.starts_with("captured"), "{policy}, {name}: {state}");
                }
            }
            let (a, b) = (
                replicas[0].store().weights()?,
                replicas[1].store().weights()?,
            );
            for (key, value) in &a {
                let other = b
                    .get(key)
                    .ok_or_else(|| crate::Error::invalid(key.clone()))?;
                assert!(
                    same(value, other, tolerance)?,
                    "{policy}, {name}: {key} differs"
                );
            }
            // Evaluations and predictions through their own graphs, each output kept across the
            // later calls (a replay writes new memory for the caller).
            let mut kept = Vec::new();
            for call in 0..6u64 {
                let batch = batch(if call == 5 { 3 } else { 4 }, 100 + call)?;
                let x = batch.inputs.clone();
                let [graphed, eager] = &replicas;
                let pairs = [
                    (graphed.evaluate(&batch)?, eager.evaluate(&batch)?),
                    (graphed.predict(&x)?.remove(0), eager.predict(&x)?.remove(0)),
                ];
                for (a, b) in &pairs {
                    assert!(same(a, b, tolerance)?, "{policy}, {name}: call {call}");
                }
                kept.push(pairs);
            }
            for (call, pairs) in kept.iter().enumerate() {
                for (a, b) in pairs {
                    assert!(
                        same(a, b, tolerance)?,
                        "{policy}, {name}: call {call}, kept"
                    );
                }
            }
            eprintln!("cuda graphs, {policy}, {name}: nine steps, six evaluations and predictions as the eager ones");
        }
    }
    Ok(())
}

/// Trains a replica running whole steps (`whole`) and one deciding each step's final phase on
/// the host (`host`) from the same weights through [`Replica::train_alone`]: seven steps at
/// falling learning rates, the fifth of a batch holding a NaN (a step that must not apply: the
/// moving statistics go back, the loss scale halves, Adam does not count it; with CUDA graphs,
/// a replay), the last a short batch. Asserts that both read the same sums and that every
/// variable (weights, moving statistics, generators' positions, the loss scale) and the
/// optimizer's state end the same, by `same`; returns `whole`.
fn assert_whole_steps_train_as_host_steps(
    mut whole: Replica,
    mut host: Replica,
    same: &dyn Fn(&Tensor, &Tensor) -> Result<bool>,
    what: &str,
) -> Result<Replica> {
    host.store().assign(&whole.store().weights()?)?;
    for step in 0..7u64 {
        let mut batch = batch(if step == 6 { 5 } else { 6 }, step + 1)?;
        if step == NAN_STEP {
            let mut x = batch.inputs[0].flatten_all()?.to_vec1::<f32>()?;
            x[7] = f32::NAN;
            batch.inputs[0] = Tensor::from_vec(x, batch.inputs[0].dims(), &Device::Cpu)?;
        }
        let lr = 0.05 / (step + 1) as f64;
        let a = whole.train_alone(&batch, lr)?;
        let b = host.train_alone(&batch, lr)?;
        // Debug-printed, so that NaN sums compare equal.
        assert_eq!(format!("{a:?}"), format!("{b:?}"), "{what}: step {step}");
        assert_eq!(a.applies(), step != NAN_STEP, "{what}: step {step}");
    }
    let (a, b) = (whole.store().weights()?, host.store().weights()?);
    assert_eq!(a.len(), b.len());
    for (key, value) in &a {
        let other = b
            .get(key)
            .ok_or_else(|| crate::Error::invalid(key.clone()))?;
        assert!(same(value, other)?, "{what}: {key} differs");
    }
    let (a, b) = (whole.optimizer_state()?, host.optimizer_state()?);
    assert_eq!(a.scalars, b.scalars, "{what}: optimizer scalars");
    for (slot, tensors) in &a.slots {
        for (name, tensor) in tensors {
            assert!(
                same(tensor, &b.slots[slot][name])?,
                "{what}: {slot} of {name}"
            );
        }
    }
    Ok(whole)
}

/// The step of [`assert_whole_steps_train_as_host_steps`] whose batch holds a NaN.
const NAN_STEP: u64 = 4;

/// The optimizers of the whole-step tests: SGD with Nesterov momentum and weight decay (its
/// buffers start at the first applied step), and AdamW (its step count).
fn whole_step_optimizers() -> [(&'static str, Box<dyn crate::optimizers::OptimizerConfig>); 2] {
    [
        (
            "SGD",
            Box::new(
                Sgd::new(0.1)
                    .momentum(0.9)
                    .nesterov(true)
                    .weight_decay(1e-3),
            ),
        ),
        (
            "AdamW",
            Box::new(crate::optimizers::AdamW::new(1e-2).weight_decay(1e-2)),
        ),
    ]
}

/// Bit for bit equality of two tensors, on any device.
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    };
    Ok(bits(a)? == bits(b)?)
}

/// On the CPU, whole steps (the update gated on the step's finite-ness probe and reading its
/// rates from a buffer, the moving statistics chosen by the same probe) train as host-decided
/// steps bit for bit: both networks, SGD and AdamW, in `float32` and in `mixed_float16` on the
/// device-generic path (with a loss scale).
#[test]
fn whole_steps_train_as_host_decided_steps() -> Result<()> {
    for (policy, path) in [
        (DTypePolicy::float32(), ComputePath::Auto),
        (
            mixed(DTypePolicy::mixed_float16()),
            ComputePath::DeviceGeneric,
        ),
    ] {
        for (optimizer, config) in whole_step_optimizers() {
            for (name, network) in networks()? {
                let spec = ModelSpec {
                    optimizer: config.clone_config(),
                    ..spec(network, path, policy)
                };
                let whole = Replica::new(&spec, &Device::Cpu)?.with_whole_steps(true);
                let host = Replica::new(&spec, &Device::Cpu)?.with_whole_steps(false);
                let what = format!("{policy}, {optimizer}, {name}");
                assert_whole_steps_train_as_host_steps(whole, host, &same_bits, &what)?;
            }
        }
    }
    Ok(())
}

/// On a CUDA device with CUDA graphs, whole steps are captured (the update's kernels reading
/// the gate and the learning rate on the device) and replayed, and train as host-decided steps
/// without graphs: bit for bit with candle's convolutions, within
/// `recorded_steps_on_cuda_match_autograd`'s bounds with cuDNN's. Fails, naming the reason,
/// when the whole step could not be captured.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_graphs_of_whole_steps_train_as_host_decided_steps() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    for (policy, tolerance) in [
        (DTypePolicy::float32(), 1e-4),
        (mixed(DTypePolicy::mixed_float16()), 1e-2),
    ] {
        let same = |a: &Tensor, b: &Tensor| -> Result<bool> {
            match cfg!(feature = "cudnn") {
                true => Ok(relative_difference(a, b)? <= tolerance),
                false => same_bits(a, b),
            }
        };
        for (optimizer, config) in whole_step_optimizers() {
            for (name, network) in networks()? {
                let spec = ModelSpec {
                    optimizer: config.clone_config(),
                    ..spec(network, ComputePath::Auto, policy)
                };
                let whole = Replica::new(&spec, &gpu)?.with_cuda_graphs(true);
                let host = Replica::new(&spec, &gpu)?.with_cuda_graphs(false);
                let what = format!("cuda, {policy}, {optimizer}, {name}");
                let whole = assert_whole_steps_train_as_host_steps(whole, host, &same, &what)?;
                let described = whole
                    .graphs
                    .as_ref()
                    .map(|g| g.whole.describe())
                    .unwrap_or_default();
                assert!(described.starts_with("captured"), "{what}: {described}");
            }
        }
    }
    Ok(())
}
