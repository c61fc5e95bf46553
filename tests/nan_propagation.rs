//! A NaN in one sample reaches that sample's prediction and the loss, as in PyTorch, on every
//! compute path: `Model::predict` gives NaN for that sample's outputs alone, and
//! `Model::evaluate` a NaN loss on a dataset holding it (a finite one without it). The model
//! runs the fused patterns of inference: a convolution with its BatchNorm and ReLU folded in,
//! a max pool, a residual sum absorbing its ReLU, a concatenation written in place, a global
//! average, a dense layer and a softmax. (Each layer's own propagation, in training too, is
//! tested beside the layers, in `src/layers/nan_tests.rs`.)

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use kandle::data::InMemoryDataset;
use kandle::layers::{Add, Identity};
use kandle::prelude::*;
use kandle::ComputePath;

const SAMPLES: usize = 5;
const NAN_SAMPLE: usize = 2;

fn conv_bn(filters: usize) -> Sequential {
    Sequential::new()
        .add(
            Conv2D::new(filters, 3)
                .padding(Padding::Same)
                .use_bias(false),
        )
        .add(BatchNormalization::new())
}

fn model(path: ComputePath) -> kandle::Result<Model> {
    let net = Sequential::new()
        .input_shape(&[3, 8, 8])
        .add(conv_bn(16))
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Add::new([conv_bn(16).boxed(), Identity.boxed()]))
        .add(Activation::Relu)
        .add(Concat::new([
            conv_bn(8).add(Activation::Relu).boxed(),
            MaxPooling2D::new(3)
                .stride(1)
                .padding(Padding::Same)
                .boxed(),
        ]))
        .add(GlobalAveragePooling2D)
        .add(Dense::new(3))
        .add(Activation::Softmax);
    net.compile(
        Sgd::new(0.01),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )?
    .with_seed(4)?
    .with_compute_path(path)
}

/// Five seeded images, the third holding one NaN, and their labels.
fn data() -> Result<(Tensor, Tensor)> {
    let len = SAMPLES * 3 * 8 * 8;
    let mut x: Vec<f32> = (0..len)
        .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 105.0)
        .collect();
    x[NAN_SAMPLE * 3 * 64 + 64 + 3 * 8 + 5] = f32::NAN;
    let x = Tensor::from_vec(x, (SAMPLES, 3, 8, 8), &Device::Cpu)?;
    let y = Tensor::new(&[0u32, 1, 2, 0, 1], &Device::Cpu)?;
    Ok((x, y))
}

#[test]
fn a_nan_sample_gives_a_nan_prediction_and_loss_on_every_path() -> Result<()> {
    let (x, y) = data()?;
    let with_nan = InMemoryDataset::new(x.clone(), y)?;
    let clean: Vec<usize> = (0..SAMPLES).filter(|&i| i != NAN_SAMPLE).collect();
    let without = with_nan.subset(&clean)?;
    for path in [
        ComputePath::Auto,
        ComputePath::Autograd,
        ComputePath::DeviceGeneric,
    ] {
        let mut model = model(path)?;
        let predictions = model.predict(&x, 2)?.to_vec2::<f32>()?;
        for (i, row) in predictions.iter().enumerate() {
            let nan = row.iter().filter(|v| v.is_nan()).count();
            let want = if i == NAN_SAMPLE { row.len() } else { 0 };
            ensure!(nan == want, "{path}: sample {i} predicts {row:?}");
            ensure!(
                row.iter().all(|v| v.is_nan() || v.is_finite()),
                "{path}: {row:?}"
            );
        }
        let loss = |data: &InMemoryDataset, model: &mut Model| -> Result<f64> {
            let logs = model.evaluate(data, 2)?;
            logs.get("loss")
                .ok_or_else(|| anyhow::anyhow!("{path}: no loss in {logs:?}"))
        };
        let nan_loss = loss(&with_nan, &mut model)?;
        ensure!(
            nan_loss.is_nan(),
            "{path}: loss {nan_loss} with the NaN sample"
        );
        let clean_loss = loss(&without, &mut model)?;
        ensure!(
            clean_loss.is_finite(),
            "{path}: loss {clean_loss} without it"
        );
    }
    Ok(())
}
