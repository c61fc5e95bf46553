//! The layers together. kandle's own layers build with their fast path and name their Keras
//! class.
//!
//! `ComputePath::DeviceGeneric` runs, on the CPU, the code every other device runs: no kandle
//! kernel, candle's device-generic ops, candle's autograd. For a network with every layer kind
//! (convolutions with and without padding and strides, batch normalisation in training, frozen
//! and in inference, ReLU separate, absorbed and as a layer option, max, average and global
//! pooling, concatenation, dense layers, dropout, a softmax head) its outputs and gradients
//! match the default path's (kernels and the recorded backward pass) and the kernels'
//! differentiated by candle's autograd; and it really calls no kernel.
//!
//! With the `cuda` feature, the same network on a GPU matches the CPU's default path: that test
//! needs a GPU, so it is `#[ignore]`d and run by `gpu/check.sh` on a GPU machine.

use std::sync::{Mutex, MutexGuard};

use super::*;
use crate::params::ParamStore;
use crate::ComputePath;
use candle_core::{Device, Tensor, Var};

#[derive(Clone)]
struct MyBlock<T>(std::marker::PhantomData<T>);

impl<T: Send + Sync + Clone + 'static> LayerSpec for MyBlock<T> {
    fn kind(&self) -> &'static str {
        "my_block"
    }
    fn build(&self, _: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        Ok(Built::leaf(Flatten, input_shape.to_vec()))
    }
    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

/// kandle's own layers keep their fast path when built; only layers from outside (here
/// candle's, through `CandleLayer`) take the defaults.
#[test]
fn kandle_layers_build_with_their_fast_path() -> Result<()> {
    let images: Vec<Box<dyn LayerSpec>> = vec![
        Conv2D::new(2, 3).boxed(),
        BatchNormalization::new().boxed(),
        MaxPooling2D::new(2).boxed(),
        AveragePooling2D::new(2).boxed(),
        GlobalAveragePooling2D.boxed(),
        Activation::Relu.boxed(),
        Concat::new([Identity, Identity]).boxed(),
        Add::new([Identity, Identity]).boxed(),
        Identity.boxed(),
        ZeroPadding2D::new(1, 1).boxed(),
        Flatten.boxed(),
        Dropout::new(0.5).boxed(),
        Sequential::new().add(Flatten).boxed(),
        Conv2D::new(2, 3).named("named").trainable(false).boxed(),
    ];
    let foreign = |spec: &dyn LayerSpec, shape: &[usize]| -> Result<bool> {
        let mut ctx = BuildContext::new(&candle_core::Device::Cpu, 0);
        Ok(spec.build(&mut ctx, shape)?.layer.foreign())
    };
    for spec in &images {
        assert!(!foreign(spec.as_ref(), &[1, 4, 4])?, "{}", spec.kind());
    }
    assert!(!foreign(&Dense::new(2), &[3])?);
    let candle = CandleLayer::new(|vb| candle_nn::linear(3, 2, vb));
    assert!(foreign(&candle, &[3])?);
    Ok(())
}

#[test]
fn class_names() {
    assert_eq!(short_type_name("a::b::C<d::E<f::G>>"), "C");
    assert_eq!(short_type_name("Plain"), "Plain");
    let user = MyBlock::<Vec<f32>>(std::marker::PhantomData);
    assert_eq!(user.class_name(), "MyBlock");
    assert_eq!(user.clone().boxed().class_name(), "MyBlock");
    assert_eq!(user.named("block").class_name(), "MyBlock");
    let specs: Vec<(Box<dyn LayerSpec>, &str)> = vec![
        (Conv2D::new(1, 1).boxed(), "Conv2D"),
        (BatchNormalization::new().boxed(), "BatchNormalization"),
        (MaxPooling2D::new(2).boxed(), "MaxPooling2D"),
        (AveragePooling2D::new(2).boxed(), "AveragePooling2D"),
        (GlobalAveragePooling2D.boxed(), "GlobalAveragePooling2D"),
        (Dense::new(1).boxed(), "Dense"),
        (Activation::Relu.boxed(), "Activation"),
        (Activation::Softmax.trainable(false).boxed(), "Activation"),
        (Concat::new([Flatten]).boxed(), "Concatenate"),
        (Add::new([Flatten]).boxed(), "Add"),
        (Identity.boxed(), "Identity"),
        (ZeroPadding2D::new(1, 1).boxed(), "ZeroPadding2D"),
        (Flatten.boxed(), "Flatten"),
        (Dropout::new(0.5).boxed(), "Dropout"),
        (Sequential::new().boxed(), "Sequential"),
        (
            CandleLayer::new(|vb| candle_nn::linear(1, 1, vb)).boxed(),
            "CandleLayer",
        ),
    ];
    for (spec, class) in specs {
        assert_eq!(spec.class_name(), class, "{}", spec.kind());
    }
}

/// Tests of this file that run networks take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

const INPUT: [usize; 3] = [3, 11, 11];
const CLASSES: usize = 5;

/// Every layer kind, in shapes that take each layer's interesting paths.
fn network() -> Sequential {
    Sequential::new()
        // `same` padding, stride 1; BatchNorm absorbs the ReLU after it. (A bias before a
        // BatchNorm in training has a zero gradient, which rounding makes noise: none here.)
        .add(Conv2D::new(6, 3).padding(Padding::Same).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        // 11x11 -> 5x5 in three ways.
        .add(Concat::new([
            // `valid`, stride 2, with the ReLU as the layer's option.
            Sequential::new().add(Conv2D::new(4, 3).stride(2).activation(Activation::Relu)),
            // Overlapping max pool.
            Sequential::new().add(MaxPooling2D::new(3).stride(2)),
            // Overlapping average pool, then a frozen BatchNorm (moving statistics in training).
            Sequential::new()
                .add(AveragePooling2D::new(3).stride(2))
                .add(BatchNormalization::new().trainable(false)),
            // A module whose BatchNorm absorbs the ReLU: on a CUDA device in training it
            // writes its channels of the joined output in place, and reads its channels of the
            // joined gradient where they lie.
            Sequential::new()
                .add(Conv2D::new(3, 3).stride(2).use_bias(false))
                .add(BatchNormalization::new())
                .add(Activation::Relu),
        ]))
        // `same` padding with different strides and no bias: 19x5x5 -> 8x3x5.
        .add(
            Conv2D::new(8, 3)
                .strides(2, 1)
                .padding(Padding::Same)
                .use_bias(false),
        )
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        // `same`-padded pools: 8x3x5 -> 8x2x3, then an average that divides by the real count.
        .add(MaxPooling2D::new(2).padding(Padding::Same))
        .add(AveragePooling2D::new(2).stride(1).padding(Padding::Same))
        // A ReLU no layer absorbs.
        .add(Activation::Relu)
        .add(Concat::new([
            Sequential::new()
                .add(GlobalAveragePooling2D)
                .add(Dense::new(7).activation(Activation::Relu)),
            Sequential::new()
                .add(Flatten)
                .add(Dropout::new(0.3))
                .add(Dense::new(4)),
            // An average pool whose windows tile the input (candle's own op on other devices).
            Sequential::new()
                .add(AveragePooling2D::new(1).window(2, 3))
                .add(Flatten)
                .add(Activation::Sigmoid),
        ]))
        .add(Dense::new(CLASSES).activation(Activation::Softmax))
}

fn build(path: ComputePath) -> crate::Result<(SequentialNet, ParamStore)> {
    build_on(&Device::Cpu, path)
}

fn build_on(device: &Device, path: ComputePath) -> crate::Result<(SequentialNet, ParamStore)> {
    let ctx = BuildContext::new(device, 11).with_compute_path(path);
    let (net, store, _) = network().build_in(ctx, &INPUT)?;
    Ok((net, store))
}

fn batch(n: usize, seed: u32) -> crate::Result<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    let x = kandle_testing::random::seeded_normal(
        &[n, INPUT[0], INPUT[1], INPUT[2]],
        1.0,
        seed.into(),
    )?;
    let labels: Vec<u32> = (0..n as u32)
        .map(|i| (i * 3 + seed) % CLASSES as u32)
        .collect();
    let y = candle_nn::encoding::one_hot(Tensor::new(labels, &dev)?, CLASSES, 1f32, 0f32)?;
    Ok((x, y))
}

/// Mean categorical cross-entropy from the logits.
fn loss(logits: &Tensor, y: &Tensor) -> crate::Result<Tensor> {
    let log_p = candle_nn::ops::log_softmax(logits, 1)?;
    Ok((y.mul(&log_p)?.sum_all()?.neg()? / y.dim(0)? as f64)?)
}

/// What one training step computes.
struct Step {
    output: Tensor,
    logits: Tensor,
    /// The gradient of every trainable variable, in the store's order.
    grads: Vec<(String, Tensor)>,
}

/// A training step through the network's recorded backward pass (the default on the CPU).
fn recorded_step(
    net: &SequentialNet,
    store: &ParamStore,
    x: &Tensor,
    y: &Tensor,
) -> crate::Result<Step> {
    let recorded = net.forward_recorded(x, RecordRequest::with_logits())?;
    let logits = recorded
        .logits
        .ok_or_else(|| crate::Error::invalid("the softmax head gave no logits"))?;
    let head = Var::from_tensor(&logits)?;
    let dlogits = loss(head.as_tensor(), y)?
        .backward()?
        .remove(head.as_tensor())
        .ok_or_else(|| crate::Error::invalid("no gradient for the logits"))?;
    let mut grads = ParamGrads::new();
    recorded.backward.backward(dlogits, &mut grads, false)?;
    let grads = store
        .iter()
        .filter(|p| p.trainable)
        .map(|p| {
            let g = grads
                .take(p.var.as_tensor())
                .ok_or_else(|| crate::Error::invalid(format!("no gradient for {}", p.name)))?;
            Ok((p.name.clone(), g))
        })
        .collect::<crate::Result<_>>()?;
    Ok(Step {
        output: recorded.output,
        logits,
        grads,
    })
}

/// A training step through candle's autograd over the whole network.
fn autograd_step(
    net: &SequentialNet,
    store: &ParamStore,
    x: &Tensor,
    y: &Tensor,
) -> crate::Result<Step> {
    let (output, logits) = net.forward_with_logits(x, true)?;
    let logits = logits.ok_or_else(|| crate::Error::invalid("the softmax head gave no logits"))?;
    let mut all = loss(&logits, y)?.backward()?;
    let grads = store
        .iter()
        .filter(|p| p.trainable)
        .map(|p| {
            let g = all
                .remove(p.var.as_tensor())
                .ok_or_else(|| crate::Error::invalid(format!("no gradient for {}", p.name)))?;
            Ok((p.name.clone(), g))
        })
        .collect::<crate::Result<_>>()?;
    Ok(Step {
        output: output.detach(),
        logits: logits.detach(),
        grads,
    })
}

/// The largest difference between `a` and `b` relative to `b`'s largest magnitude, on the CPU
/// (`a` may live on another device).
fn relative_difference(a: &Tensor, b: &Tensor) -> crate::Result<f32> {
    assert_eq!(a.dims(), b.dims());
    let a = &a.to_device(b.device())?;
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
    Ok(diff / scale)
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor, tolerance: f32) -> crate::Result<()> {
    let rel = relative_difference(a, b)?;
    assert!(
        rel < tolerance,
        "{what}: relative difference {rel}\n{a}\n{b}"
    );
    Ok(())
}

fn assert_steps_agree(label: &str, a: &Step, b: &Step) -> crate::Result<()> {
    assert_close(&format!("{label}: output"), &a.output, &b.output, 1e-4)?;
    assert_close(&format!("{label}: logits"), &a.logits, &b.logits, 1e-4)?;
    assert_eq!(a.grads.len(), b.grads.len());
    for ((name, ga), (other, gb)) in a.grads.iter().zip(&b.grads) {
        assert_eq!(name, other);
        let norm = gb.sqr()?.sum_all()?.to_scalar::<f32>()?;
        assert!(norm > 0.0, "{label}: {name}'s gradient is zero");
        assert_close(&format!("{label}: {name}"), ga, gb, 1e-4)?;
    }
    Ok(())
}

fn assert_statistics_agree(label: &str, a: &ParamStore, b: &ParamStore) -> crate::Result<()> {
    for (pa, pb) in a.iter().zip(b.iter()) {
        assert_eq!(pa.name, pb.name);
        if pa.statistic {
            let what = format!("{label}: {}", pa.name);
            assert_close(&what, pa.var.as_tensor(), pb.var.as_tensor(), 1e-4)?;
        }
    }
    Ok(())
}

#[test]
fn device_generic_outputs_and_gradients_match_the_default_path() -> crate::Result<()> {
    let _turn = serial();
    let (auto_net, auto_store) = build(ComputePath::Auto)?;
    let (generic_net, generic_store) = build(ComputePath::DeviceGeneric)?;
    let (autograd_net, autograd_store) = build(ComputePath::Autograd)?;
    // The same recipe and seed give the same variables whatever the path.
    assert_eq!(auto_store.len(), generic_store.len());
    for (a, b) in auto_store.iter().zip(generic_store.iter()) {
        assert_eq!((&a.name, a.trainable), (&b.name, b.trainable));
        assert_eq!(
            a.var.as_tensor().flatten_all()?.to_vec1::<f32>()?,
            b.var.as_tensor().flatten_all()?.to_vec1::<f32>()?
        );
    }
    autograd_store.assign(&auto_store.weights()?)?;

    for (step, n) in [6, 3].into_iter().enumerate() {
        let (x, y) = batch(n, step as u32)?;
        let auto = recorded_step(&auto_net, &auto_store, &x, &y)?;
        let generic = autograd_step(&generic_net, &generic_store, &x, &y)?;
        let autograd = autograd_step(&autograd_net, &autograd_store, &x, &y)?;
        let label = format!("step {step}, device-generic vs auto");
        assert_steps_agree(&label, &generic, &auto)?;
        assert_steps_agree(&format!("step {step}, autograd vs auto"), &autograd, &auto)?;
        assert_statistics_agree(&label, &generic_store, &auto_store)?;

        // Inference, with the moving statistics the training forward passes moved.
        let want = auto_net.forward_t(&x, false)?;
        let got = generic_net.forward_t(&x, false)?;
        assert_close(&format!("step {step}: inference"), &got, &want, 1e-4)?;
        let (_, got_logits) = generic_net.forward_with_logits(&x, false)?;
        let (_, want_logits) = auto_net.forward_with_logits(&x, false)?;
        match (got_logits, want_logits) {
            (Some(a), Some(b)) => assert_close("inference logits", &a, &b, 1e-4)?,
            other => panic!("inference logits: {other:?}"),
        }
    }
    Ok(())
}

/// The network on CUDA (kandle's CUDA batch norm, pooling and cuBLASLt products, candle's ops
/// for the rest), through candle's autograd and through the recorded pass (the concatenation's
/// branches writing their channels in place), against the CPU's default path: the same
/// variables, the outputs and every gradient of two training steps within 1e-4 (float32 in two
/// summation orders: cuBLAS's and the CPU kernels', as the device-generic path against the
/// kernels above), the moving statistics, and inference.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: run by gpu/check.sh"]
fn cuda_outputs_and_gradients_match_the_cpu() -> crate::Result<()> {
    let _turn = serial();
    let gpu = crate::devices::cuda(0)?;
    let (cpu_net, cpu_store) = build(ComputePath::Auto)?;
    let (gpu_net, gpu_store) = build_on(&gpu, ComputePath::Auto)?;
    // The same network on the GPU through the recorded pass: the concatenation's branches
    // write their channels in place (the BatchNorm module and the max pool), the products
    // run on cuBLASLt, and the backward pass is the layers' own.
    let (recorded_net, recorded_store) = build_on(&gpu, ComputePath::Auto)?;
    assert_eq!(cpu_store.len(), gpu_store.len());
    for (a, b) in cpu_store.iter().zip(gpu_store.iter()) {
        assert_eq!((&a.name, a.trainable), (&b.name, b.trainable));
        assert!(
            b.var.device().same_device(&gpu),
            "{} is not on the GPU",
            b.name
        );
        assert_eq!(
            a.var.as_tensor().flatten_all()?.to_vec1::<f32>()?,
            b.var.as_tensor().flatten_all()?.to_vec1::<f32>()?,
            "{}: the same seed gives other variables on the GPU",
            a.name
        );
    }
    for (step, n) in [6, 3].into_iter().enumerate() {
        let (x, y) = batch(n, step as u32)?;
        let cpu = recorded_step(&cpu_net, &cpu_store, &x, &y)?;
        let on_gpu = autograd_step(
            &gpu_net,
            &gpu_store,
            &x.to_device(&gpu)?,
            &y.to_device(&gpu)?,
        )?;
        let label = format!("step {step}, cuda vs cpu");
        assert_steps_agree(&label, &on_gpu, &cpu)?;
        assert_statistics_agree(&label, &gpu_store, &cpu_store)?;
        let recorded = recorded_step(
            &recorded_net,
            &recorded_store,
            &x.to_device(&gpu)?,
            &y.to_device(&gpu)?,
        )?;
        let label = format!("step {step}, recorded on cuda vs cpu");
        assert_steps_agree(&label, &recorded, &cpu)?;
        assert_statistics_agree(&label, &recorded_store, &cpu_store)?;
        let want = cpu_net.forward_t(&x, false)?;
        let got = gpu_net.forward_t(&x.to_device(&gpu)?, false)?;
        assert_close(&format!("step {step}: inference"), &got, &want, 1e-4)?;
    }
    Ok(())
}

#[test]
fn device_generic_calls_no_kernel() -> crate::Result<()> {
    let _turn = serial();
    let (x, y) = batch(4, 1)?;

    let before = crate::kernels::data_reads();
    let (net, store) = build(ComputePath::DeviceGeneric)?;
    autograd_step(&net, &store, &x, &y)?;
    // The recorded API also works on this path (each layer under candle's autograd).
    recorded_step(&net, &store, &x, &y)?;
    net.forward_t(&x, true)?;
    net.forward_t(&x, false)?;
    let after = crate::kernels::data_reads();
    assert_eq!(after, before, "the device-generic network ran a kernel");

    // The counter does see kernels: the default and autograd paths run them, in training
    // and in inference.
    for path in [ComputePath::Auto, ComputePath::Autograd] {
        let (net, _) = build(path)?;
        let start = crate::kernels::data_reads();
        net.forward_t(&x, false)?;
        let inference = crate::kernels::data_reads();
        assert!(inference > start, "{path}: no kernel in inference");
        net.forward_t(&x, true)?;
        assert!(
            crate::kernels::data_reads() > inference,
            "{path}: no kernel in training"
        );
    }
    Ok(())
}
