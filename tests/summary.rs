//! `summary()` counts parameters as Keras does; the expected numbers are worked out by hand.

use kandle::prelude::*;

#[test]
fn counts_match_hand_computation() -> anyhow::Result<()> {
    // conv 3x3, 3 -> 8 channels: 8*3*3*3 weights + 8 biases = 224
    // batch norm over 8 channels: 16 trainable (scale, offset) + 16 moving statistics
    // max pool 2 on 10x10 -> 5x5; flatten 8*5*5 = 200
    // dense 200 -> 10: 2000 + 10 = 2010, frozen here, so non-trainable
    // dense 10 -> 4: 40 + 4 = 44
    let net = Sequential::new()
        .add(Conv2D::new(8, 3).padding(Padding::Same))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Flatten)
        .add(Dense::new(10).trainable(false))
        .add(Dense::new(4))
        .add(Activation::Softmax);
    let summary = net.summary(&[3, 10, 10])?;
    assert_eq!(summary.trainable, 224 + 16 + 44);
    assert_eq!(summary.non_trainable, 16 + 2010);
    assert_eq!(summary.total(), 2310);
    let rows: Vec<(&str, Vec<usize>, usize, usize)> = summary
        .rows
        .iter()
        .map(|r| {
            (
                r.name.as_str(),
                r.output_shape.clone(),
                r.trainable,
                r.non_trainable,
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            ("conv2d_1", vec![8, 10, 10], 224, 0),
            ("batch_normalization_1", vec![8, 10, 10], 16, 16),
            ("relu_1", vec![8, 10, 10], 0, 0),
            ("max_pooling2d_1", vec![8, 5, 5], 0, 0),
            ("flatten_1", vec![200], 0, 0),
            ("dense_1", vec![10], 0, 2010),
            ("dense_2", vec![4], 44, 0),
            ("softmax_1", vec![4], 0, 0),
        ]
    );
    let table = summary.to_string();
    assert!(table.contains("Total params: 2,310"), "{table}");
    assert!(table.contains("Non-trainable params: 2,026"), "{table}");
    assert!(
        table.contains("dense_1 (dense)") && table.contains("(None, 8, 5, 5)"),
        "{table}"
    );
    Ok(())
}

#[test]
fn frozen_layers_are_not_trained() -> anyhow::Result<()> {
    let net = Sequential::new()
        .add(Flatten)
        .add(Dense::new(16).trainable(false))
        .add(Dense::new(10))
        .add(Activation::Softmax);
    let mut model = net.compile(
        Sgd::new(0.5),
        SparseCategoricalCrossentropy::new(),
        (),
        &OneDeviceStrategy::cpu(),
    )?;
    let digits = kandle::data::digits::load()?;
    model.build(&[1, 8, 8])?;
    let before = model.get_weights()?;
    model.fit(
        &digits,
        FitOptions {
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let after = model.get_weights()?;
    let same = |k: &str| -> anyhow::Result<bool> {
        Ok(before[k].flatten_all()?.to_vec1::<f32>()?
            == after[k].flatten_all()?.to_vec1::<f32>()?)
    };
    assert!(same("dense_1.weight")? && same("dense_1.bias")?);
    assert!(!same("dense_2.weight")?);
    Ok(())
}

#[test]
fn candle_modules_train_inside_a_model_from_tensors() -> anyhow::Result<()> {
    use candle_core::{Device, Tensor};
    // y = 2 * x0 - x1, learned by a wrapped candle Linear.
    let x = Tensor::randn(0f32, 1., (256, 2), &Device::Cpu)?;
    let y = x.matmul(&Tensor::new(&[[2f32], [-1.]], &Device::Cpu)?)?;
    let net =
        Sequential::new().add(CandleLayer::new(|vb| candle_nn::linear(2, 1, vb)).named("linear"));
    let mut model = net.compile(
        Sgd::new(0.1),
        MeanSquaredError,
        [kandle::metrics::MeanAbsoluteError],
        &OneDeviceStrategy::cpu(),
    )?;
    let history = model.fit_tensors(
        &x,
        &y,
        FitOptions {
            epochs: 30,
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    assert!(
        history.last("loss").is_some_and(|l| l < 1e-4),
        "{:?}",
        history.series("loss")
    );
    let weights = model.get_weights()?;
    let w = weights["linear.weight"].flatten_all()?.to_vec1::<f32>()?;
    assert!(
        (w[0] - 2.0).abs() < 1e-2 && (w[1] + 1.0).abs() < 1e-2,
        "{w:?}"
    );
    assert_eq!(model.summary()?.trainable, 3);
    Ok(())
}
