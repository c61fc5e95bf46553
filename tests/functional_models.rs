//! A functional model is a model like a `Sequential`: a residual CNN with a shared convolution
//! learns the digits to at least 97% test accuracy through `fit`, its checkpoint reproduces its
//! predictions in a freshly built model, its summary shows what each layer is connected to, and
//! used as a layer of a `Sequential` it gives what it gives alone.

use kandle::data::InMemoryDataset;
use kandle::functional::{add, Functional, Input};
use kandle::prelude::*;

fn residual_cnn() -> kandle::Result<Functional> {
    let image = Input::new(&[1, 8, 8]).named("image").tensor();
    let stem = Conv2D::new(16, 3)
        .padding(Padding::Same)
        .use_bias(false)
        .call(&image)?;
    let stem = Activation::Relu.call(&BatchNormalization::new().call(&stem)?)?;
    let shared = Conv2D::new(16, 3)
        .padding(Padding::Same)
        .named("shared")
        .shared();
    let h = Activation::Relu.call(&shared.call(&stem)?)?;
    let h = shared.call(&h)?;
    let h = Activation::Relu.call(&add(&[&stem, &h])?)?;
    let h = Flatten.call(&MaxPooling2D::new(2).call(&h)?)?;
    let h = Dropout::new(0.2).call(&Dense::new(64).call(&h)?)?;
    let probabilities = Activation::Softmax.call(&Dense::new(10).call(&h)?)?;
    Functional::new([&image], [&probabilities])
}

fn compiled(seed: u64) -> kandle::Result<Model> {
    residual_cnn()?
        .compile(
            Adam::new(3e-3),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )?
        .with_seed(seed)
}

#[test]
fn a_residual_functional_model_learns_digits_and_round_trips_through_a_checkpoint(
) -> anyhow::Result<()> {
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let mut model = compiled(1)?;
    assert!(
        model.is_built(),
        "a functional model is built when compiled"
    );
    let summary = model.summary()?.to_string();
    for part in [
        "Connected to",
        "shared (Conv2D)",
        "image[0][0]",
        "shared[1][0]",
    ] {
        assert!(summary.contains(part), "`{part}` missing from:\n{summary}");
    }
    let history = model.fit(
        &train,
        FitOptions {
            epochs: 12,
            batch_size_per_replica: 32,
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let losses = history.series("loss");
    assert!(
        losses[11] < losses[0] / 3.0,
        "loss did not fall: {losses:?}"
    );
    let logs = model.evaluate(&test, 128)?;
    let accuracy = logs.get("accuracy").unwrap_or(0.0);
    eprintln!("functional digits test accuracy: {accuracy:.4}");
    assert!(accuracy >= 0.97, "test accuracy {accuracy}");

    let dir = tempfile::tempdir()?;
    let path = dir.path().join("functional.safetensors");
    model.save_weights(&path)?;
    let (x, _) = test.to_tensors()?;
    let expected = model.predict(&x, 64)?;
    let mut fresh = compiled(99)?;
    fresh.load_weights(&path)?;
    let got = fresh.predict(&x, 100)?;
    assert_eq!(
        expected.flatten_all()?.to_vec1::<f32>()?,
        got.flatten_all()?.to_vec1::<f32>()?
    );

    // The same graph as the one layer of a Sequential, with the trained weights under its name.
    let mut nested = Sequential::new()
        .add(residual_cnn()?.named("graph"))
        .compile(
            Adam::new(3e-3),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )?;
    nested.build(&[1, 8, 8])?;
    let renamed: kandle::params::Weights = kandle::checkpoint::load(&path)?
        .into_iter()
        .map(|(name, value)| (format!("graph.{name}"), value))
        .collect();
    nested.set_weights(&renamed)?;
    let got = nested.predict(&x, 64)?;
    assert_eq!(
        expected.flatten_all()?.to_vec1::<f32>()?,
        got.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}

/// An input of another shape than the model's is an error naming both shapes.
#[test]
fn data_of_another_shape_is_refused_naming_the_input() -> anyhow::Result<()> {
    let mut model = compiled(0)?;
    let x = candle_core::Tensor::zeros(
        (2, 1, 9, 9),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    let err = model.predict(&x, 2).expect_err("9x9 images").to_string();
    for part in ["(batch, 1, 8, 8)", "9, 9"] {
        assert!(err.contains(part), "`{part}` missing from: {err}");
    }
    Ok(())
}

/// Three inputs (the image, its row means and the ids of each row's brightest column), two
/// outputs (`class` and `ink`, the image's standardised mean value), a residual sum, an
/// embedding of the ids and a concatenation of the inputs' features.
fn three_input_classifier() -> kandle::Result<kandle::functional::Functional> {
    use kandle::functional::concatenate;
    let image = Input::new(&[1, 8, 8]).named("image").tensor();
    let rows = Input::new(&[8]).named("rows").tensor();
    let brightest = Input::new(&[8]).named("brightest").tensor();
    let stem = Conv2D::new(16, 3).padding(Padding::Same).call(&image)?;
    let stem = Activation::Relu.call(&stem)?;
    let inner = Conv2D::new(16, 3).padding(Padding::Same).call(&stem)?;
    let h = Activation::Relu.call(&add(&[&stem, &inner])?)?;
    let h = Flatten.call(&MaxPooling2D::new(2).call(&h)?)?;
    let image_features = Activation::Relu.call(&Dense::new(32).call(&h)?)?;
    let row_features = Activation::Relu.call(&Dense::new(16).call(&rows)?)?;
    let columns = Flatten.call(&Embedding::new(8, 4).call(&brightest)?)?;
    let both = concatenate(&[&image_features, &row_features, &columns])?;
    let class = Activation::Softmax
        .named("class")
        .call(&Dense::new(10).call(&both)?)?;
    let ink = Dense::new(1).named("ink").call(&both)?;
    Functional::new([&image, &rows, &brightest], [&class, &ink])
}

/// A model of three inputs of three dtypes (an `f32` image, `f16` row means, `u32` ids), given
/// as named parts in another order than the model's, and two outputs learns both targets: the
/// class to at least 95% test accuracy, the ink (standardised: variance 1) to a mean squared
/// error under 0.1. The logs have Keras's keys, the total loss is the weighted sum of the
/// outputs' losses, and `predict_outputs` gives one tensor per output.
#[test]
fn a_three_input_two_output_model_learns_both_targets() -> anyhow::Result<()> {
    use kandle_testing::strategies::equivalence_run::digits_in_parts;
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
    let (train, test) = (digits_in_parts(&train)?, digits_in_parts(&test)?);
    let losses = kandle::functional::PerOutput::new()
        .loss("class", SparseCategoricalCrossentropy::new())
        .loss("ink", MeanSquaredError)
        .weight("ink", 0.5)
        .metric("class", Accuracy);
    let mut model = three_input_classifier()?
        .compile(Adam::new(3e-3), losses, (), &OneDeviceStrategy::cpu())?
        .with_seed(1)?;
    let history = model.fit(
        &train,
        FitOptions {
            epochs: 20,
            batch_size_per_replica: 32,
            validation: Some(&test),
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let summary = model.summary()?.to_string();
    assert!(
        summary.contains(
            "Model inputs: `image` (None, 1, 8, 8), `rows` (None, 8), `brightest` (None, 8)"
        ),
        "{summary}"
    );
    let keys = [
        "loss",
        "class_loss",
        "ink_loss",
        "class_accuracy",
        "val_loss",
        "val_ink_loss",
    ];
    for key in keys {
        assert!(
            history.last(key).is_some_and(f64::is_finite),
            "{key}: {:?}",
            history.to_map()
        );
    }
    let logs = model.evaluate(&test, 64)?;
    let get = |key: &str| logs.get(key).unwrap_or(f64::NAN);
    eprintln!(
        "two outputs: class accuracy {:.4}, ink mse {:.2e}",
        get("class_accuracy"),
        get("ink_loss")
    );
    assert!(get("class_accuracy") >= 0.95, "{logs:?}");
    assert!(get("ink_loss") < 0.1, "{logs:?}");
    let weighted = get("class_loss") + 0.5 * get("ink_loss");
    assert!(
        (get("loss") - weighted).abs() <= 1e-5 * weighted,
        "{logs:?}"
    );

    let inputs = test.to_batch()?.inputs;
    let n = inputs[0].dim(0)?;
    assert_eq!(inputs[2].dtype(), candle_core::DType::U32);
    let outputs = model.predict_outputs(&inputs, 64)?;
    assert_eq!(outputs[0].dims(), [n, 10]);
    assert_eq!(outputs[1].dims(), [n, 1]);
    let sums = outputs[0].sum(1)?.to_vec1::<f32>()?;
    assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5), "softmax rows");
    Ok(())
}

/// Parts that do not fit the model's inputs are errors that name the input and both shapes,
/// before any step: swapped in order, an image given flat, a part missing, a part the model
/// does not take; and ids given as floats are an error of the embedding at the first step.
#[test]
fn parts_that_do_not_fit_the_inputs_are_named_errors() -> anyhow::Result<()> {
    let batch = kandle::data::digits::load()?.subset(&(0..64).collect::<Vec<_>>())?;
    let parts = kandle_testing::strategies::equivalence_run::digits_in_parts(&batch)?.to_batch()?;
    let [image, rows, ids] = &parts.inputs[..] else {
        panic!("three inputs");
    };
    let mut model = three_input_classifier()?.compile(
        Sgd::new(0.1),
        kandle::functional::PerOutput::new()
            .loss("class", SparseCategoricalCrossentropy::new())
            .loss("ink", MeanSquaredError),
        (),
        &OneDeviceStrategy::cpu(),
    )?;
    let fit = |model: &mut kandle::Model, data: kandle::data::InMemoryDataset| {
        let options = FitOptions {
            epochs: 1,
            verbosity: Verbosity::Silent,
            ..Default::default()
        };
        match model.fit(&data, options) {
            Ok(_) => panic!("fitted on parts that do not fit"),
            Err(e) => e.to_string(),
        }
    };
    let targets = parts.targets.clone();
    let swapped =
        InMemoryDataset::from_parts(&[rows.clone(), image.clone(), ids.clone()], &targets)?;
    let err = fit(&mut model, swapped);
    for part in ["`image`", "(batch, 1, 8, 8)", "(batch, 8)"] {
        assert!(err.contains(part), "`{part}` missing from: {err}");
    }
    let flat = image.flatten_from(1)?;
    let err = fit(
        &mut model,
        InMemoryDataset::from_named_parts(
            &[
                ("image", flat),
                ("rows", rows.clone()),
                ("brightest", ids.clone()),
            ],
            &targets,
        )?,
    );
    for part in ["`image`", "(batch, 1, 8, 8)", "(batch, 64)"] {
        assert!(err.contains(part), "`{part}` missing from: {err}");
    }
    let err = fit(
        &mut model,
        InMemoryDataset::from_named_parts(
            &[("image", image.clone()), ("rows", rows.clone())],
            &targets,
        )?,
    );
    assert!(err.contains("no input `brightest`"), "{err}");
    let err = fit(
        &mut model,
        InMemoryDataset::from_named_parts(
            &[
                ("image", image.clone()),
                ("rows", rows.clone()),
                ("brightest", ids.clone()),
                ("mask", rows.clone()),
            ],
            &targets,
        )?,
    );
    assert!(
        err.contains("`mask`") && err.contains("does not take"),
        "{err}"
    );
    let float_ids = ids.to_dtype(candle_core::DType::F32)?;
    let err = fit(
        &mut model,
        InMemoryDataset::from_parts(&[image.clone(), rows.clone(), float_ids], &targets)?,
    );
    assert!(err.contains("integer ids"), "{err}");
    let err = model
        .predict_outputs(&[rows.clone(), image.clone(), ids.clone()], 8)
        .expect_err("swapped inputs")
        .to_string();
    assert!(err.contains("`image`"), "{err}");
    Ok(())
}

/// A network that takes images of any size (`Network::any_size`) trains on 8x8 digits and
/// then predicts on 12x12 images: built again for them, it keeps every weight and the
/// optimizer's momentum bit for bit, and its predictions on 8x8 images are unchanged after.
#[test]
fn an_any_size_network_keeps_its_state_across_sizes() -> anyhow::Result<()> {
    use candle_core::Tensor;
    let trace = |shape: &[usize]| {
        let image = Input::new(shape).named("image").tensor();
        let x = Conv2D::new(8, 3).padding(Padding::Same).call(&image)?;
        let x = Activation::Relu.call(&BatchNormalization::new().call(&x)?)?;
        let pooled = GlobalAveragePooling2D.call(&x)?;
        let y = Activation::Softmax.call(&Dense::new(10).call(&pooled)?)?;
        Functional::new([&image], [&y])
    };
    let data = kandle::data::digits::load()?.subset(&(0..256).collect::<Vec<_>>())?;
    let mut model = kandle::Network::any_size(&[1, 8, 8], trace)?.compile(
        Sgd::new(0.05).momentum(0.9),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )?;
    model.fit(
        &data,
        FitOptions {
            epochs: 1,
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let (x, _) = data.to_tensors()?;
    let before = model.training_state()?;
    let predicted = model.predict(&x, 64)?;
    let large = Tensor::zeros(
        (2, 1, 12, 12),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    assert_eq!(model.predict(&large, 2)?.dims(), [2, 10]);
    let after = model.training_state()?;
    let same = |a: &Tensor, b: &Tensor| -> anyhow::Result<bool> {
        Ok(a.flatten_all()?.to_vec1::<f32>()? == b.flatten_all()?.to_vec1::<f32>()?)
    };
    for (name, value) in &before.weights {
        assert!(same(value, &after.weights[name])?, "weight {name} changed");
    }
    for (slot, values) in &before.optimizer.slots {
        for (name, value) in values {
            let now = &after.optimizer.slots[slot][name];
            assert!(same(value, now)?, "optimizer slot {slot} of {name} changed");
        }
    }
    assert!(same(&predicted, &model.predict(&x, 64)?)?);
    Ok(())
}
