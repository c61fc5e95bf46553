//! The BatchNorm layer: normalisation per channel with its moving statistics, and accurate
//! batch statistics on the device-generic path; its fused path (the kernels) against its
//! composed one (the `SyncBatchNorm` code path over a single replica), moving statistics and
//! inference included; and a `Sequential` that lets BatchNorm absorb the ReLU after it against
//! one that does not. With the `cuda` feature and a GPU (`#[ignore]`d), the layer on
//! kandle's CUDA kernels against the same layer on candle's ops there.

use std::sync::Arc;

use super::*;
use crate::cross_replica::{ReplicaGroup, ReplicaHandle};
use crate::layers::{
    Activation, BatchNormalization, BuildContext, Layer, LayerSpec, LayerSpecExt, Sequential,
    SequentialNet,
};
use candle_core::{Device, Var};
use kandle_kernels::test_support::{assert_close, gradients, random, random_var, weighted_sum};

#[test]
fn normalises_per_channel_and_moves_statistics() -> Result<()> {
    let mut ctx = BuildContext::new(&Device::Cpu, 0);
    let built = BatchNormalization::new().build(&mut ctx, &[2, 1, 2])?;
    let store = ctx.into_store();
    // channel 0: 1,3,5,7 (mean 4, var 5); channel 1: all 2 (mean 2, var 0)
    let x = Tensor::new(
        &[[[[1f32, 3.]], [[2., 2.]]], [[[5., 7.]], [[2., 2.]]]],
        &Device::Cpu,
    )?;
    let y = built.layer.forward_t(&x, true)?;
    let y0: Vec<f32> = y.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
    let s = (5f32 + 1e-3).sqrt();
    for (got, want) in y0.iter().zip([-3. / s, -1. / s, 1. / s, 3. / s]) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
    let mean = store
        .get("running_mean")
        .map(|p| p.var.as_tensor().to_vec1::<f32>())
        .transpose()?;
    let var = store
        .get("running_var")
        .map(|p| p.var.as_tensor().to_vec1::<f32>())
        .transpose()?;
    let mean = mean.unwrap_or_default();
    let var = var.unwrap_or_default();
    assert!(
        (mean[0] - 0.04).abs() < 1e-6 && (mean[1] - 0.02).abs() < 1e-6,
        "{mean:?}"
    );
    assert!(
        (var[0] - (0.99 + 0.05)).abs() < 1e-6 && (var[1] - 0.99).abs() < 1e-6,
        "{var:?}"
    );
    let (trainable, frozen) = store.count("");
    assert_eq!((trainable, frozen), (4, 4));
    Ok(())
}

/// On the device-generic path, a channel's batch mean and variance over many values (4 x
/// 64 x 64 here, an offset of 100 as after a convolution with a bias) are float64's within
/// a few float32 roundings: summed in stages, not one value after another into a single
/// float32 accumulator per channel (which misses the mean by 2e-6 here).
#[test]
fn device_generic_batch_statistics_are_accurate_over_many_values() -> Result<()> {
    let mut ctx =
        BuildContext::new(&Device::Cpu, 0).with_compute_path(crate::ComputePath::DeviceGeneric);
    let layer = BatchNormalization::new().momentum(0.0);
    let built = layer.build(&mut ctx, &[2, 64, 64])?;
    let store = ctx.into_store();
    let values: Vec<f32> = (0..4 * 2 * 64 * 64)
        .map(|i| 100.0 + (i as f32 * 0.37).sin() + 0.1 * (i % 7) as f32)
        .collect();
    let x = Tensor::from_vec(values.clone(), (4, 2, 64, 64), &Device::Cpu)?;
    built.layer.forward_t(&x, true)?;
    let stat = |name: &str| -> Result<Vec<f32>> {
        let p = store
            .get(name)
            .ok_or_else(|| crate::Error::invalid(format!("no `{name}`")))?;
        Ok(p.var.as_tensor().to_vec1::<f32>()?)
    };
    let (mean, var) = (stat("running_mean")?, stat("running_var")?);
    for c in 0..2 {
        let channel: Vec<f64> = (0..4)
            .flat_map(|n| {
                let start = (n * 2 + c) * 64 * 64;
                values[start..start + 64 * 64].iter().map(|&v| v as f64)
            })
            .collect();
        let count = channel.len() as f64;
        let want_mean = channel.iter().sum::<f64>() / count;
        let want_var = channel.iter().map(|v| (v - want_mean).powi(2)).sum::<f64>() / count;
        let mean_err = (mean[c] as f64 - want_mean).abs() / want_mean;
        let var_err = (var[c] as f64 - want_var).abs() / want_var;
        assert!(
            mean_err < 2e-7,
            "channel {c}: mean {} against {want_mean}",
            mean[c]
        );
        assert!(
            var_err < 1e-6,
            "channel {c}: variance {} against {want_var}",
            var[c]
        );
    }
    Ok(())
}

/// `(shape, mean offset, seed)`: odd sizes, batch 1, one channel, a single value per channel,
/// flat features, planes the kernels walk channel by channel and planes they stream (the shapes
/// of the kernels' own tests), with means small enough for the composed path, which sums in
/// `f32`, to keep its precision.
const CASES: &[(&[usize], f32, u64)] = &[
    (&[2, 3, 5, 7], 0.0, 200),
    (&[1, 1, 4, 4], 0.5, 210),
    (&[4, 6, 3, 3], -2.0, 220),
    (&[3, 5, 1, 1], 0.0, 230),
    (&[1, 4, 1, 1], 0.0, 240),
    (&[7, 5], 1.0, 250),
    (&[5, 3, 7, 7], 0.0, 270),
    (&[6, 16, 7, 7], 0.0, 280),
    (&[2, 5, 33, 33], -1.0, 300),
];

/// A group of one replica: its sums are its own values, so `SyncBatchNorm` runs the composed
/// path on exactly this replica's batch.
struct Alone;

impl ReplicaGroup for Alone {
    fn all_reduce_sum(&self, _replica: usize, values: Vec<f32>) -> crate::Result<Vec<f32>> {
        Ok(values)
    }
}

struct BuiltBn {
    layer: Box<dyn FastPath>,
    store: crate::params::ParamStore,
}

fn build_bn(shape: &[usize], composed: bool, seed: u64) -> anyhow::Result<BuiltBn> {
    let mut ctx = BuildContext::new(&Device::Cpu, 0);
    if composed {
        ctx = ctx.with_replica_group(ReplicaHandle::new(Arc::new(Alone), 0));
    }
    build_bn_in(ctx, shape, seed)
}

/// [`build_bn`] in `ctx` (its device and compute path): the layer for `shape`, its variables
/// seeded random values.
fn build_bn_in(mut ctx: BuildContext, shape: &[usize], seed: u64) -> anyhow::Result<BuiltBn> {
    let built = BatchNormalization::new()
        .momentum(0.9)
        .build(&mut ctx, &shape[1..])?;
    let store = ctx.into_store();
    let c = shape[1];
    for (name, offset, s) in [
        ("weight", 1.0, 1),
        ("bias", 0.0, 2),
        ("running_mean", 0.0, 3),
        ("running_var", 1.5, 4),
    ] {
        let p = store
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("no {name}"))?;
        let value = random(&[c], seed + s, offset)?;
        p.var.set(&value.to_device(p.var.device())?)?;
    }
    Ok(BuiltBn {
        layer: built.layer,
        store,
    })
}

fn param(store: &crate::params::ParamStore, name: &str) -> anyhow::Result<Var> {
    Ok(store
        .get(name)
        .ok_or_else(|| anyhow::anyhow!("no {name}"))?
        .var
        .clone())
}

#[test]
fn layer_fused_path_matches_composed_path_with_moving_statistics() -> anyhow::Result<()> {
    for &(shape, offset, seed) in CASES {
        let fused = build_bn(shape, false, seed)?;
        let composed = build_bn(shape, true, seed)?;
        for step in 0..2u64 {
            let x = random_var(shape, seed + 5 + step, offset)?;
            let mut outputs = Vec::new();
            for bn in [&fused, &composed] {
                let y = bn.layer.forward_t(x.as_tensor(), true)?;
                let (w, b) = (param(&bn.store, "weight")?, param(&bn.store, "bias")?);
                let grads = gradients(
                    &weighted_sum(&y, seed + 7)?,
                    &[x.as_tensor(), w.as_tensor(), b.as_tensor()],
                )?;
                outputs.push((y, grads));
            }
            let what = |part: &str| format!("{part} of {shape:?}, step {step}");
            assert_close(&what("y"), &outputs[0].0, &outputs[1].0, 1e-5)?;
            for (name, (g, r)) in ["dx", "dweight", "dbias"]
                .iter()
                .zip(outputs[0].1.iter().zip(&outputs[1].1))
            {
                assert_close(&what(name), g, r, 1e-4)?;
            }
            for name in ["running_mean", "running_var"] {
                let got = param(&fused.store, name)?;
                let want = param(&composed.store, name)?;
                assert_close(&what(name), got.as_tensor(), want.as_tensor(), 1e-5)?;
            }
        }
        // Inference uses the moving statistics, differentiably in the input and parameters.
        let x = random_var(shape, seed + 9, offset)?;
        let mut outputs = Vec::new();
        for bn in [&fused, &composed] {
            let y = bn.layer.forward_t(x.as_tensor(), false)?;
            let w = param(&bn.store, "weight")?;
            let grads = gradients(&weighted_sum(&y, seed)?, &[x.as_tensor(), w.as_tensor()])?;
            outputs.push((y, grads));
        }
        assert_close("inference y", &outputs[0].0, &outputs[1].0, 1e-5)?;
        assert_close("inference dx", &outputs[0].1[0], &outputs[1].1[0], 1e-5)?;
        assert_close(
            "inference dweight",
            &outputs[0].1[1],
            &outputs[1].1[1],
            1e-4,
        )?;
    }
    Ok(())
}

/// Builds `net` for `shape` (optionally as the only replica of a `SyncBatchNorm` group, which
/// takes the composed path) with seeded random values for every BatchNorm variable.
fn build_net(
    net: &Sequential,
    shape: &[usize],
    composed: bool,
) -> anyhow::Result<(SequentialNet, crate::params::ParamStore)> {
    let mut ctx = BuildContext::new(&Device::Cpu, 0);
    if composed {
        ctx = ctx.with_replica_group(ReplicaHandle::new(Arc::new(Alone), 0));
    }
    let (net, store, _) = net.build_in(ctx, &shape[1..])?;
    for (i, p) in store.iter().enumerate() {
        let offset = if p.name.ends_with("var") { 1.5 } else { 0.0 };
        p.var.set(&random(p.var.dims(), 300 + i as u64, offset)?)?;
    }
    Ok((net, store))
}

#[test]
fn sequential_absorbs_relu_into_batch_norm_keeping_names_and_results() -> anyhow::Result<()> {
    let shape = [3, 4, 5, 6];
    let bn_relu = Sequential::new()
        .add(BatchNormalization::new().named("bn"))
        .add(Activation::Relu.named("relu"));
    let bn_alone = Sequential::new().add(BatchNormalization::new().named("bn"));

    let summary = bn_relu.summary(&shape[1..])?;
    let names: Vec<&str> = summary.rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["bn", "relu"]);
    assert_eq!((summary.trainable, summary.non_trainable), (8, 8));

    let (fused, fused_store) = build_net(&bn_relu, &shape, false)?;
    let (composed, composed_store) = build_net(&bn_relu, &shape, true)?;
    let (plain, plain_store) = build_net(&bn_alone, &shape, false)?;
    assert_eq!(fused.layer_names().collect::<Vec<_>>(), ["bn", "relu"]);

    for train in [true, false] {
        let x = random_var(&shape, 9, 0.3)?;
        let mut results = Vec::new();
        for (net, store, relu_after) in [
            (&fused, &fused_store, false),
            (&composed, &composed_store, false),
            (&plain, &plain_store, true),
        ] {
            let y = net.forward_t(x.as_tensor(), train)?;
            let y = if relu_after { y.relu()? } else { y };
            let (w, b) = (param(store, "bn.weight")?, param(store, "bn.bias")?);
            let grads = gradients(
                &weighted_sum(&y, 11)?,
                &[x.as_tensor(), w.as_tensor(), b.as_tensor()],
            )?;
            let stats = [
                param(store, "bn.running_mean")?.as_tensor().clone(),
                param(store, "bn.running_var")?.as_tensor().clone(),
            ];
            results.push((y, grads, stats));
        }
        for other in &results[1..] {
            let what = |part: &str| format!("{part} (train {train})");
            assert_close(&what("y"), &results[0].0, &other.0, 1e-5)?;
            for (name, (g, r)) in ["dx", "dweight", "dbias"]
                .iter()
                .zip(results[0].1.iter().zip(&other.1))
            {
                assert_close(&what(name), g, r, 1e-4)?;
            }
            for (g, r) in results[0].2.iter().zip(&other.2) {
                assert_close(&what("moving statistics"), g, r, 1e-5)?;
            }
        }
    }
    Ok(())
}

/// The layer's training pass on `x` through candle's autograd, its output weighted by
/// [`output_weights`]: the output and the gradients of `x`, the weight and the bias.
#[cfg(feature = "cuda")]
fn autograd_pass(bn: &BuiltBn, x: &Var, seed: u64) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
    let y = bn.layer.forward_t(x.as_tensor(), true)?;
    let (w, b) = (param(&bn.store, "weight")?, param(&bn.store, "bias")?);
    let loss = (&y * output_weights(&y, seed)?)?.sum_all()?;
    let grads = gradients(&loss, &[x.as_tensor(), w.as_tensor(), b.as_tensor()])?;
    Ok((y, grads))
}

/// [`autograd_pass`] through the layer's recorded backward pass.
#[cfg(feature = "cuda")]
fn recorded_pass(bn: &BuiltBn, x: &Var, seed: u64) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
    let recorded = bn
        .layer
        .forward_recorded(x.as_tensor(), RecordRequest::output())?;
    let dy = output_weights(&recorded.output, seed)?;
    let mut grads = ParamGrads::new();
    let dx = recorded.backward.backward(dy, &mut grads, true)?;
    let dx = dx.ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
    let mut param_grad = |name: &str| -> anyhow::Result<Tensor> {
        let var = param(&bn.store, name)?;
        let grad = grads.take(var.as_tensor());
        grad.ok_or_else(|| anyhow::anyhow!("no gradient for {name}"))
    };
    let grads = vec![
        dx.to_dtype(DType::F32)?,
        param_grad("weight")?,
        param_grad("bias")?,
    ];
    Ok((recorded.output, grads))
}

/// Seeded random weights of `y`'s outputs, on its device and in its dtype: the output gradient
/// of `sum(y * weights)`.
#[cfg(feature = "cuda")]
fn output_weights(y: &Tensor, seed: u64) -> anyhow::Result<Tensor> {
    let w = random(y.dims(), seed + 7, 0.0)?;
    Ok(w.to_device(y.device())?.to_dtype(y.dtype())?)
}

/// `t`'s values as `f32` on the CPU.
#[cfg(feature = "cuda")]
fn values(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// On a CUDA device the layer runs `kandle_kernels::cuda`'s kernels by default: its `f32`
/// training output is theirs bit for bit (and candle's ops give other bits somewhere, so this
/// tells the paths apart). It agrees with the same layer built for
/// [`ComputePath::DeviceGeneric`](crate::ComputePath::DeviceGeneric) (what
/// `KANDLE_COMPUTE=device-generic` runs: candle's ops and autograd) in the output, the
/// gradients of the input, weight and bias, the moving statistics (`f32` for an `f16` input
/// too) and inference, for `f32` and `f16` inputs, through candle's autograd (first step) and
/// the recorded backward pass (second step).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_kernels_match_the_device_generic_path() -> anyhow::Result<()> {
    use crate::ComputePath;
    let gpu = crate::devices::cuda(0)?;
    let mut distinguishable = false;
    for &(shape, offset, seed) in CASES {
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::F16, 1e-2)] {
            let on_gpu = |path: ComputePath| {
                let ctx = BuildContext::new(&gpu, 0).with_compute_path(path);
                build_bn_in(ctx, shape, seed)
            };
            let kernel = on_gpu(ComputePath::Auto)?;
            let generic = on_gpu(ComputePath::DeviceGeneric)?;
            for step in 0..2u64 {
                let what = |part: &str| format!("{part} of {shape:?} in {dtype:?}, step {step}");
                let x = random(shape, seed + 5 + step, offset)?;
                let x = Var::from_tensor(&x.to_device(&gpu)?.to_dtype(dtype)?)?;
                let want = autograd_pass(&generic, &x, seed)?;
                let got = match step {
                    0 => autograd_pass(&kernel, &x, seed)?,
                    _ => recorded_pass(&kernel, &x, seed)?,
                };
                assert_eq!(got.0.dtype(), dtype, "{}", what("output dtype"));
                assert_close(&what("y"), &got.0, &want.0, tol)?;
                for (name, (g, r)) in ["dx", "dweight", "dbias"]
                    .iter()
                    .zip(got.1.iter().zip(&want.1))
                {
                    assert_close(&what(name), g, r, tol)?;
                }
                for name in ["running_mean", "running_var"] {
                    let (k, g) = (param(&kernel.store, name)?, param(&generic.store, name)?);
                    assert_eq!(k.dtype(), DType::F32, "{}", what(name));
                    assert_close(&what(name), k.as_tensor(), g.as_tensor(), 1e-4)?;
                }
                if step == 0 && dtype == DType::F32 {
                    let (w, b) = (
                        param(&kernel.store, "weight")?,
                        param(&kernel.store, "bias")?,
                    );
                    let (direct, _) = kandle_kernels::cuda::batch_norm_train(
                        x.as_tensor(),
                        Some(w.as_tensor()),
                        Some(b.as_tensor()),
                        1e-3,
                        false,
                    )?;
                    let direct = values(&direct)?;
                    assert_eq!(values(&got.0)?, direct, "{}", what("the kernel's output"));
                    distinguishable |= values(&want.0)? != direct;
                }
            }
            let x = random(shape, seed + 9, offset)?
                .to_device(&gpu)?
                .to_dtype(dtype)?;
            let (got, want) = (
                kernel.layer.forward_t(&x, false)?,
                generic.layer.forward_t(&x, false)?,
            );
            assert_eq!(got.dtype(), dtype);
            assert_close(
                &format!("inference of {shape:?} in {dtype:?}"),
                &got,
                &want,
                tol,
            )?;
        }
    }
    anyhow::ensure!(
        distinguishable,
        "candle's ops gave the kernel's bits in every case: the check cannot tell the paths apart"
    );
    Ok(())
}
