//! kandle's recorded backward pass gives the gradients candle's autograd gives, layer kind by
//! layer kind: CPU kernels (convolution with and without bias, strides and padding, batch norm
//! with an absorbed ReLU, max and average pooling, global average pooling), the concatenation
//! of branches, dense, dropout, flatten, activations with their own backward (ReLU, linear), an
//! activation that falls back to candle (sigmoid), a candle module, and the softmax head whose
//! gradient is taken at the logits. Training with either path moves the batch-norm statistics
//! the same way and reaches the same weights. With layers frozen by name, both paths give the
//! trainable variables the same gradients, leave the frozen ones (statistics included) bit for
//! bit, and the layers below the lowest trainable one run without a recorded backward pass.

use candle_core::{DType, Device, Tensor};
use kandle::data::Batch;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kandle::layers::{
    Activation, AveragePooling2D, BatchNormalization, BuildContext, Built, CandleLayer, Concat,
    Conv2D, Dense, Dropout, Flatten, GlobalAveragePooling2D, Layer, LayerSpec, LayerSpecExt,
    MaxPooling2D, Padding, Sequential,
};
use kandle::losses::CategoricalCrossentropy;
use kandle::metrics::Accuracy;
use kandle::optimizers::Sgd;
use kandle::strategy::{ModelSpec, Replica};
use kandle::ComputePath;

fn conv_bn_relu(filters: usize, k: usize, stride: usize, padding: Padding) -> Sequential {
    Sequential::new()
        .add(Conv2D::new(filters, k).stride(stride).padding(padding))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
}

/// A small network with every layer kind the recorded pass handles, in MiniGoogLeNet's shapes.
fn network() -> Sequential {
    Sequential::new()
        .add(conv_bn_relu(6, 3, 1, Padding::Same))
        .add(Concat::new([
            conv_bn_relu(4, 1, 1, Padding::Same),
            conv_bn_relu(5, 3, 1, Padding::Same),
        ]))
        .add(Concat::new([
            Sequential::new().add(conv_bn_relu(4, 3, 2, Padding::Valid)),
            Sequential::new().add(MaxPooling2D::new(3).stride(2)),
        ]))
        .add(Conv2D::new(6, 3).padding(Padding::Same).use_bias(false))
        .add(Activation::Relu)
        .add(AveragePooling2D::new(2).stride(1).padding(Padding::Same))
        .add(Activation::Sigmoid)
        .add(Concat::new([
            Sequential::new()
                .add(GlobalAveragePooling2D)
                .add(Dense::new(7)),
            Sequential::new()
                .add(AveragePooling2D::new(5))
                .add(Flatten)
                .add(Dense::new(3)),
        ]))
        .add(Dropout::new(0.3))
        .add(Activation::Linear)
        .add(CandleLayer::new(|vb| candle_nn::linear(10, 8, vb)).named("candle_linear"))
        .add(Dense::new(5))
        .add(Activation::Softmax)
}

fn spec(network: impl Into<kandle::Network>, compute_path: ComputePath) -> ModelSpec {
    ModelSpec {
        network: network.into(),
        input_shapes: vec![vec![3, 11, 11]],
        optimizer: Box::new(Sgd::new(0.1).momentum(0.9)),
        loss: kandle::Objective::new(CategoricalCrossentropy::new()),
        metrics: [Accuracy].into(),
        seed: 7,
        compute_path,
        dtype_policy: kandle::DTypePolicy::default(),
    }
}

fn batch(n: usize, seed: u64) -> kandle::Result<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    let x = kandle_testing::random::seeded_normal(&[n, 3, 11, 11], 1.0, seed)?;
    let labels: Vec<u32> = (0..n as u32).map(|i| (i * 7 + seed as u32) % 5).collect();
    let y = candle_nn::encoding::one_hot(Tensor::new(labels, &dev)?, 5, 1f32, 0f32)?;
    Ok((x, y.to_dtype(DType::F32)?))
}

/// Two replicas with the same weights (the candle module draws its own initial values), one
/// training with each backward pass.
fn replicas() -> kandle::Result<(Replica, Replica)> {
    let recorded = Replica::new(&spec(network(), ComputePath::Auto), &Device::Cpu)?;
    let candle = Replica::new(&spec(network(), ComputePath::Autograd), &Device::Cpu)?;
    candle.store().assign(&recorded.store().weights()?)?;
    Ok((recorded, candle))
}

/// A replica's gradients of the loss sum on `x`, `y` (one per trainable variable) and its loss
/// and metric sums, cut out of the step buffer it would hand its strategy.
fn gradients(replica: &Replica, x: &Tensor, y: &Tensor) -> kandle::Result<(Vec<Tensor>, Tensor)> {
    let step = replica.step_buffer(&Batch::new(x.clone(), y.clone()))?;
    let layout = replica.layout();
    let grads = layout.grads.split(&step.fused, 0)?;
    let stats = step
        .fused
        .narrow(0, layout.stats_offset(), layout.num_stats)?;
    Ok((grads, stats))
}

/// Whether variable `name` is the bias of a convolution that a BatchNorm follows: its
/// gradient is zero, so both paths give rounding noise, which only an absolute bound compares
/// (the two sum a concatenation's branch gradients in different orders).
fn feeds_batch_norm(name: &str, names: &[String]) -> bool {
    name.strip_suffix("conv2d_1.bias").is_some_and(|scope| {
        let bn = format!("{scope}batch_normalization_1.");
        names.iter().any(|n| n.starts_with(&bn))
    })
}

/// The largest difference between `a` and `b` relative to `b`'s largest magnitude.
fn relative_difference(a: &Tensor, b: &Tensor) -> kandle::Result<f32> {
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
    Ok(diff / scale)
}

#[test]
fn gradients_match_candle_autograd() -> kandle::Result<()> {
    let (recorded, candle) = replicas()?;
    let (x, y) = batch(6, 1)?;
    let (ours, our_stats) = gradients(&recorded, &x, &y)?;
    let (theirs, their_stats) = gradients(&candle, &x, &y)?;
    assert_eq!(ours.len(), theirs.len());
    assert_eq!(ours.len(), recorded.trainable_vars().len());
    let names: Vec<String> = recorded
        .store()
        .iter()
        .filter(|p| p.trainable)
        .map(|p| p.name.clone())
        .collect();
    let largest = |t: &Tensor| -> kandle::Result<f32> { Ok(t.abs()?.max_all()?.to_scalar()?) };
    let mut weights_scale = 0f32;
    for (b, name) in theirs.iter().zip(&names) {
        if name.ends_with("weight") {
            weights_scale = weights_scale.max(largest(b)?);
        }
    }
    for ((a, b), name) in ours.iter().zip(&theirs).zip(&names) {
        assert_eq!(a.dims(), b.dims(), "{name}");
        if feeds_batch_norm(name, &names) {
            // Zero in exact arithmetic: both must be negligible against the kernels' gradients.
            let noise = largest(a)?.max(largest(b)?);
            assert!(
                noise < 1e-4 * weights_scale,
                "{name}: {noise} is not negligible"
            );
            continue;
        }
        let norm = b.sqr()?.sum_all()?.to_scalar::<f32>()?;
        assert!(norm > 0.0, "{name}: candle's gradient is zero");
        let rel = relative_difference(a, b)?;
        assert!(rel < 1e-4, "{name}: relative difference {rel}");
    }
    let stats = relative_difference(&our_stats, &their_stats)?;
    assert!(stats < 1e-5, "loss and accuracy sums differ by {stats}");
    for (a, b) in recorded.statistics().iter().zip(candle.statistics()) {
        let rel = relative_difference(a.as_tensor(), b.as_tensor())?;
        assert!(rel < 1e-5, "moving statistics differ by {rel}");
    }
    Ok(())
}

#[test]
fn training_reaches_the_same_weights() -> kandle::Result<()> {
    let (mut recorded, mut candle) = replicas()?;
    for step in 0..5 {
        // A short last batch, as an epoch's remainder gives.
        let (x, y) = batch(if step == 4 { 3 } else { 8 }, step)?;
        let batch = Batch::new(x, y);
        for replica in [&mut recorded, &mut candle] {
            let step = replica.step_buffer(&batch)?;
            let totals = replica.layout().read(&step.fused)?;
            replica.finish_step(&step.fused, &totals, &step.statistics_before, 0.05)?;
        }
    }
    let (ours, theirs) = (recorded.store().weights()?, candle.store().weights()?);
    let names: Vec<String> = recorded.store().iter().map(|p| p.name.clone()).collect();
    for (name, a) in ours.iter() {
        let b = theirs
            .get(name)
            .ok_or_else(|| kandle::Error::invalid(format!("no {name}")))?;
        if feeds_batch_norm(name, &names) {
            // Moved by rounding noise alone (see `feeds_batch_norm`).
            let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-6, "{name}: differs by {diff} after 5 steps");
            continue;
        }
        let rel = relative_difference(a, b)?;
        assert!(
            rel < 1e-4,
            "{name}: relative difference {rel} after 5 steps"
        );
    }
    Ok(())
}

#[test]
fn a_wrong_input_shape_names_the_network() -> kandle::Result<()> {
    let (replica, _) = replicas()?;
    let x = Tensor::zeros((2, 3, 10, 11), DType::F32, &Device::Cpu)?;
    let y = Tensor::zeros((2, 5), DType::F32, &Device::Cpu)?;
    let err = match replica.step_buffer(&Batch::new(x, y)) {
        Ok(_) => panic!("a 10x11 input trained"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("model") && err.contains("11"), "{err}");
    Ok(())
}

/// A layer that passes its input on and counts the training calls whose input candle's
/// autograd tracks: the calls that record it (its input is then a variable).
#[derive(Debug, Clone, Default)]
struct Probe(Arc<AtomicUsize>);

impl LayerSpec for Probe {
    fn kind(&self) -> &'static str {
        "probe"
    }

    fn build(&self, _ctx: &mut BuildContext, input_shape: &[usize]) -> kandle::Result<Built> {
        Ok(Built::leaf(self.clone(), input_shape.to_vec()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

impl Layer for Probe {
    fn forward_t(&self, x: &Tensor, train: bool) -> kandle::Result<Tensor> {
        if train && x.track_op() {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        Ok(x.clone())
    }
}

#[test]
fn frozen_layers_get_no_gradient_and_the_layers_below_are_not_recorded() -> kandle::Result<()> {
    let (low, high) = (Probe::default(), Probe::default());
    let probed = || {
        Sequential::new()
            .add(low.clone())
            .add(network())
            .add(high.clone())
            .add(Activation::Linear)
    };
    // The first concatenation and the last dense layer train; everything else is frozen.
    let frozen = |path| {
        spec(
            kandle::Network::from(probed())
                .with_trainable(&[""], false)
                .with_trainable(&["sequential_1.concat_1", "sequential_1.dense_1"], true),
            path,
        )
    };
    let recorded = Replica::new(&frozen(ComputePath::Auto), &Device::Cpu)?;
    let candle = Replica::new(&frozen(ComputePath::Autograd), &Device::Cpu)?;
    candle.store().assign(&recorded.store().weights()?)?;
    let names = recorded.trainable_names().to_vec();
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("sequential_1.concat_1.")
                || n.starts_with("sequential_1.dense_1."))
    );
    assert_eq!(names.len(), 2 * (2 + 2) + 2, "{names:?}");
    let (x, y) = batch(6, 3)?;
    let (ours, _) = gradients(&recorded, &x, &y)?;
    let (theirs, _) = gradients(&candle, &x, &y)?;
    for ((a, b), name) in ours.iter().zip(&theirs).zip(&names) {
        if feeds_batch_norm(name, &names) {
            continue;
        }
        let rel = relative_difference(a, b)?;
        assert!(rel < 1e-4, "{name}: relative difference {rel}");
    }
    // Only the probe above the lowest trainable layer saw a tracked input, once per path:
    // recorded under candle's autograd, and in candle's autograd over the network. Below it
    // nothing is recorded, and autograd does not track the frozen variables.
    assert_eq!(
        (low.0.load(Ordering::SeqCst), high.0.load(Ordering::SeqCst)),
        (0, 2)
    );
    // Steps change the trainable variables and leave the frozen ones, statistics included.
    let before = recorded.store().weights()?;
    let mut recorded = recorded;
    for seed in 0..2 {
        let (x, y) = batch(8, seed)?;
        let step = recorded.step_buffer(&Batch::new(x, y))?;
        let totals = recorded.layout().read(&step.fused)?;
        recorded.finish_step(&step.fused, &totals, &step.statistics_before, 0.05)?;
    }
    let after = recorded.store().weights()?;
    for p in recorded.store().iter().filter(|p| !p.generator) {
        let bits = |w: &kandle::params::Weights| -> kandle::Result<Vec<u32>> {
            let v = w[&p.name].flatten_all()?.to_vec1::<f32>()?;
            Ok(v.iter().map(|f| f.to_bits()).collect())
        };
        let moved = bits(&after)? != bits(&before)?;
        let trains = p.name.starts_with("sequential_1.concat_1.")
            || p.name.starts_with("sequential_1.dense_1.");
        // The concatenation's convolution biases before a BatchNorm get zero gradients.
        if trains && !p.name.ends_with("conv2d_1.bias") {
            assert!(moved, "{} did not train", p.name);
        } else if !trains {
            assert!(!moved, "{} is frozen but moved", p.name);
        }
    }
    Ok(())
}
