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
        table.contains("dense_1 (Dense)") && table.contains("(None, 8, 5, 5)"),
        "{table}"
    );
    let classes: Vec<(&str, &str)> = summary
        .rows
        .iter()
        .map(|r| (r.kind.as_str(), r.class_name.as_str()))
        .collect();
    assert_eq!(
        classes,
        vec![
            ("conv2d", "Conv2D"),
            ("batch_normalization", "BatchNormalization"),
            ("relu", "Activation"),
            ("max_pooling2d", "MaxPooling2D"),
            ("flatten", "Flatten"),
            ("dense", "Dense"),
            ("dense", "Dense"),
            ("softmax", "Activation"),
        ]
    );
    for line in [
        "conv2d_1 (Conv2D)",
        "batch_normalization_1 (BatchNormalization)",
        "relu_1 (Activation)",
        "max_pooling2d_1 (MaxPooling2D)",
        "flatten_1 (Flatten)",
        "dense_2 (Dense)",
        "softmax_1 (Activation)",
    ] {
        assert!(table.contains(line), "no `{line}` in\n{table}");
    }
    Ok(())
}

/// Every layer kind prints the class name Keras prints for it, nested rows included; names
/// (and so variable names) stay the snake-case kinds.
#[test]
fn class_names_are_keras_class_names() -> anyhow::Result<()> {
    let net = Sequential::new()
        .add(Conv2D::new(4, 3).padding(Padding::Same))
        .add(Concat::new([
            Sequential::new()
                .add(AveragePooling2D::new(3).stride(1).padding(Padding::Same))
                .add(Dropout::new(0.2)),
            Sequential::new().add(Conv2D::new(2, 1)),
        ]))
        .add(GlobalAveragePooling2D)
        .add(CandleLayer::new(|vb| candle_nn::linear(6, 3, vb)))
        .add(Dense::new(2).named("head"));
    let summary = net.summary(&[3, 6, 6])?;
    fn flatten(rows: &[kandle::layers::SummaryRow], out: &mut Vec<(String, String)>) {
        for r in rows {
            out.push((r.name.clone(), r.class_name.clone()));
            flatten(&r.children, out);
        }
    }
    let mut rows = Vec::new();
    flatten(&summary.rows, &mut rows);
    let rows: Vec<(&str, &str)> = rows.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    assert_eq!(
        rows,
        vec![
            ("conv2d_1", "Conv2D"),
            ("concat_1", "Concatenate"),
            ("branch_1", "Sequential"),
            ("average_pooling2d_1", "AveragePooling2D"),
            ("dropout_1", "Dropout"),
            ("branch_2", "Sequential"),
            ("conv2d_1", "Conv2D"),
            ("global_average_pooling2d_1", "GlobalAveragePooling2D"),
            ("candle_1", "CandleLayer"),
            ("head", "Dense"),
        ]
    );
    let table = summary.to_string();
    assert!(table.contains("concat_1 (Concatenate)"), "{table}");
    assert!(table.contains("  branch_1 (Sequential)"), "{table}");
    assert!(table.contains("    conv2d_1 (Conv2D)"), "{table}");
    assert!(table.contains("head (Dense)"), "{table}");
    let store = net
        .build_network(&candle_core::Device::Cpu, &[3, 6, 6], 0)?
        .1;
    // The parameters keep their names; the dropout layer's generator position is a variable
    // of its own, not a parameter.
    let generators: Vec<&str> = store
        .iter()
        .filter(|p| p.generator)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(generators, ["concat_1.branch_1.dropout_1.generator"]);
    let names: Vec<&str> = store
        .iter()
        .filter(|p| !p.generator)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        names,
        vec![
            "conv2d_1.weight",
            "conv2d_1.bias",
            "concat_1.branch_2.conv2d_1.weight",
            "concat_1.branch_2.conv2d_1.bias",
            "candle_1.bias",
            "candle_1.weight",
            "head.weight",
            "head.bias",
        ]
    );
    Ok(())
}

/// A user layer's class name is its type's name; wrappers keep the inner layer's.
#[test]
fn user_layers_get_their_type_name() -> anyhow::Result<()> {
    use kandle::layers::{BuildContext, Built, LayerSpec};

    #[derive(Clone)]
    struct Residual<T>(T);

    impl<T: LayerSpec + Clone> LayerSpec for Residual<T> {
        fn kind(&self) -> &'static str {
            "residual"
        }
        fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> kandle::Result<Built> {
            self.0.build(ctx, input_shape)
        }
        fn clone_spec(&self) -> Box<dyn LayerSpec> {
            Box::new(self.clone())
        }
    }

    let net = Sequential::new()
        .add(Flatten)
        .add(Residual(Dense::new(3)).trainable(false).named("block"));
    let summary = net.summary(&[2, 2])?;
    assert_eq!(summary.rows[1].name, "block");
    assert_eq!(summary.rows[1].kind, "residual");
    assert_eq!(summary.rows[1].class_name, "Residual");
    assert!(summary.to_string().contains("block (Residual)"));
    Ok(())
}

/// `Dense(..).activation(..)` and `Conv2D(..).activation(..)` take one row and add no
/// variable, as in Keras.
#[test]
fn layers_with_an_activation_take_one_row() -> anyhow::Result<()> {
    let fused = Sequential::new()
        .add(Conv2D::new(4, 3).activation(Activation::Relu))
        .add(Flatten)
        .add(Dense::new(5).activation(Activation::Softmax));
    let separate = Sequential::new()
        .add(Conv2D::new(4, 3))
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(5))
        .add(Activation::Softmax);
    let (a, b) = (fused.summary(&[2, 5, 5])?, separate.summary(&[2, 5, 5])?);
    let names: Vec<&str> = a.rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, vec!["conv2d_1", "flatten_1", "dense_1"]);
    assert_eq!(
        (a.trainable, a.non_trainable),
        (b.trainable, b.non_trainable)
    );
    let device = candle_core::Device::Cpu;
    let names = |net: &Sequential| -> anyhow::Result<Vec<String>> {
        let store = net.build_network(&device, &[2, 5, 5], 0)?.1;
        Ok(store.iter().map(|p| p.name.clone()).collect())
    };
    assert_eq!(names(&fused)?, names(&separate)?);
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
    let x = kandle_testing::random::seeded_normal(&[256, 2], 1.0, 1)?;
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
