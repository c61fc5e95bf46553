//! The functional API's construction checks, its summary, and its recorded backward pass
//! against candle's autograd.

use crate::Compile;
use candle_core::{Device, Tensor};

use super::{add, average, concatenate, multiply, subtract, Functional, Input, LayerCall};
use crate::layers::{
    Activation, BatchNormalization, Conv2D, Dense, Flatten, Layer, LayerSpecExt, Padding,
    Sequential,
};
use crate::{ComputePath, Result};

fn message(result: Result<impl std::fmt::Debug>) -> String {
    result.expect_err("an error").to_string()
}

fn assert_names(err: &str, parts: &[&str]) {
    for part in parts {
        assert!(err.contains(part), "`{part}` missing from: {err}");
    }
}

/// A graph with every merge, a shared convolution called on two tensors, a residual sum
/// whose ReLU it absorbs, and a chain where a BatchNorm absorbs its ReLU.
fn every_merge() -> Result<Functional> {
    let x = Input::new(&[16, 6, 6]).named("image").tensor();
    let conv = |filters| Conv2D::new(filters, 3).padding(Padding::Same);
    let a = conv(16).use_bias(false).call(&x)?;
    let a = BatchNormalization::new().call(&a)?;
    let a = Activation::Relu.call(&a)?;
    let shared = conv(16).named("shared").shared();
    let b = shared.call(&a)?;
    let c = shared.call(&x)?;
    let residual = Activation::Relu.call(&add(&[&x, &b])?)?;
    let product = multiply(&[&residual, &c])?;
    let difference = subtract(&product, &a)?;
    let mean = average(&[&difference, &residual, &c])?;
    let joined = concatenate(&[&mean, &Conv2D::new(8, 1).call(&x)?])?;
    let y = Flatten.call(&joined)?;
    let y = Dense::new(5).call(&y)?;
    Functional::new([&x], [&y])
}

#[test]
fn recorded_gradients_of_a_graph_match_autograd() -> Result<()> {
    let graph = every_merge()?;
    crate::layers::assert_recorded_matches_autograd(
        |path| {
            let ctx = crate::params::BuildContext::new(&Device::Cpu, 3).with_compute_path(path);
            let (net, store, _) = Sequential::new()
                .add(graph.clone())
                .build_in(ctx, &[16, 6, 6])?;
            Ok((net, store))
        },
        &[16, 6, 6],
    )
}

/// A functional `add` with the ReLU it absorbs, and a `concatenate`, keep a NaN on every
/// compute path (the layers' table, `layers/nan_tests.rs`, runs the same checks).
#[test]
fn merges_keep_a_nan() -> Result<()> {
    use crate::layers::nan_tests::{both_halves, check_nans, same, Case};
    let x = Input::new(&[4, 6, 6]).tensor();
    let relu = Activation::Relu.call(&x)?;
    let sum = Activation::Relu.call(&add(&[&x, &relu])?)?;
    let joined = concatenate(&[&x, &relu])?;
    for (name, y, rule) in [
        (
            "functional add + relu",
            sum,
            same as crate::layers::nan_tests::Rule,
        ),
        ("functional concatenate", joined, both_halves),
    ] {
        check_nans(&Case {
            name,
            net: Sequential::new().add(Functional::new([&x], [&y])?),
            input: &[2, 4, 6, 6],
            train: rule,
            infer: rule,
            // The NaN's gradient passes both the ReLU and the identity.
            grad_at_nan: Some(2.0),
        })?;
    }
    Ok(())
}

#[test]
fn a_shared_layer_has_one_set_of_variables() -> Result<()> {
    let summary = every_merge()?.summary()?;
    let shared: Vec<_> = summary.rows.iter().filter(|r| r.name == "shared").collect();
    assert_eq!(shared.len(), 1);
    assert_eq!(shared[0].trainable, 16 * 16 * 9 + 16);
    assert_eq!(shared[0].connected_to, ["relu_1[0][0]", "image[0][0]"]);
    Ok(())
}

#[test]
fn the_graph_gives_what_its_layers_give_one_after_the_other() -> Result<()> {
    let x = Input::new(&[4]).tensor();
    let dense = Dense::new(4).named("dense").shared();
    let once = dense.call(&x)?;
    let twice = dense.call(&once)?;
    let y = add(&[&x, &twice])?;
    let graph = Functional::new([&x], [&y])?;
    let ctx = crate::params::BuildContext::new(&Device::Cpu, 0);
    let (net, store, _) = Sequential::new().add(graph).build_in(ctx, &[4])?;
    let kernel = store
        .get("functional_1.dense.weight")
        .expect("the weight")
        .var
        .as_tensor()
        .clone();
    let bias = store
        .get("functional_1.dense.bias")
        .expect("the bias")
        .var
        .as_tensor()
        .clone();
    let input = kandle_testing::random::seeded_normal(&[3, 4], 1.0, 1)?;
    let layer =
        |h: &Tensor| -> Result<Tensor> { Ok(h.matmul(&kernel.t()?)?.broadcast_add(&bias)?) };
    let want = (&input + layer(&layer(&input)?)?)?;
    let got = net.forward_t(&input, false)?;
    let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-6, "{diff}");
    Ok(())
}

#[test]
fn the_summary_shows_connections_only_for_graphs_that_are_not_chains() -> Result<()> {
    let text = every_merge()?.summary()?.to_string();
    assert_names(
        &text,
        &[
            "Connected to",
            "add_1 (Add)",
            "image[0][0]",
            "shared[1][0]",
            "InputLayer",
        ],
    );
    let x = Input::new(&[3]).tensor();
    let y = Dense::new(2).call(&Dense::new(3).call(&x)?)?;
    let chain = Functional::new([&x], [&y])?.summary()?;
    assert!(!chain.to_string().contains("Connected to"), "{chain}");
    assert_eq!(chain.trainable, 3 * 3 + 3 + 3 * 2 + 2);
    Ok(())
}

#[test]
fn shapes_that_do_not_merge_name_the_layer_and_both_shapes() -> Result<()> {
    let x = Input::new(&[4, 8, 8]).tensor();
    let pooled = crate::layers::MaxPooling2D::new(2).named("pool").call(&x)?;
    let err = message(add(&[&x, &pooled]));
    assert_names(
        &err,
        &["`add`", "(batch, 4, 8, 8)", "`pool`", "(batch, 4, 4, 4)"],
    );
    let err = message(concatenate(&[&x, &pooled]));
    assert_names(
        &err,
        &["Concatenate", "(batch, 4, 4, 4)", "every axis but channels"],
    );
    let flat = Flatten.call(&x)?;
    let err = message(subtract(&x, &flat));
    assert_names(&err, &["Subtract", "(batch, 256)"]);
    Ok(())
}

#[test]
fn a_shared_layer_called_on_another_shape_is_refused() -> Result<()> {
    let a = Input::new(&[4]).tensor();
    let b = Input::new(&[5]).tensor();
    let dense = Dense::new(3).named("encoder").shared();
    dense.call(&a)?;
    let err = message(dense.call(&b));
    assert_names(&err, &["`encoder`", "(batch, 4)", "(batch, 5)"]);
    Ok(())
}

#[test]
fn a_layer_that_cannot_take_its_input_fails_at_the_call() {
    let x = Input::new(&[4]).tensor();
    let err = message(Conv2D::new(2, 3).named("conv").call(&x));
    assert_names(&err, &["conv", "(batch, 4)"]);
}

#[test]
fn graphs_that_are_not_models_are_refused_naming_the_layers() -> Result<()> {
    let x = Input::new(&[4]).named("x").tensor();
    let other = Input::new(&[4]).named("other").tensor();
    let y = Dense::new(2).named("head").call(&add(&[&x, &other])?)?;
    let err = message(Functional::new([&x], [&y]));
    assert_names(&err, &["disconnected", "`other`", "`add`"]);

    let unused = Input::new(&[7]).named("unused").tensor();
    let err = message(Functional::new([&x, &other, &unused], [&y]));
    assert_names(&err, &["`unused`", "(batch, 7)", "not used"]);

    let err = message(Functional::new([&y], [&y]));
    assert_names(&err, &["`head`", "not an Input"]);

    let a = Dense::new(2).named("twin").call(&x)?;
    let b = Dense::new(2).named("twin").call(&x)?;
    let err = message(Functional::new([&x], [&add(&[&a, &b])?]));
    assert_names(&err, &["two layers", "`twin`"]);
    Ok(())
}

/// The graph's layers are named per model, in the order they were called; a graph used as a
/// layer nests its variables under its own name.
#[test]
fn layers_are_numbered_in_the_order_they_were_called() -> Result<()> {
    let x = Input::new(&[3]).tensor();
    let first = Dense::new(2).call(&x)?;
    let second = Dense::new(2).call(&x)?;
    let y = add(&[&second, &first])?;
    let graph = Functional::new([&x], [&y])?;
    let summary = graph.summary()?;
    let names: Vec<&str> = summary.rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["input_1", "dense_1", "dense_2", "add_1"]);
    assert_eq!(
        summary.rows[3].connected_to,
        ["dense_2[0][0]", "dense_1[0][0]"]
    );
    let outer = Sequential::new()
        .add(graph.named("block"))
        .add(Dense::new(1));
    let ctx = crate::params::BuildContext::new(&Device::Cpu, 0);
    let (_, store, _) = outer.build_in(ctx, &[3])?;
    assert!(store.get("block.dense_2.weight").is_some());
    Ok(())
}

/// A functional model is a layer of another functional model too.
#[test]
fn a_functional_model_is_called_like_a_layer() -> Result<()> {
    let block = |width| -> Result<Functional> {
        let x = Input::new(&[width]).tensor();
        let h = Activation::Relu.call(&Dense::new(width).call(&x)?)?;
        Functional::new([&x], [&add(&[&x, &h])?])
    };
    let x = Input::new(&[6]).tensor();
    let h = block(6)?.call(&x)?;
    let y = block(6)?.call(&h)?;
    let model = Functional::new([&x], [&y])?;
    let summary = model.summary()?;
    assert_eq!(summary.trainable, 2 * (6 * 6 + 6));
    assert_eq!(summary.rows[1].name, "functional_1");
    assert_eq!(summary.rows[1].class_name, "Functional");
    let several = Functional::new([&x], [&h, &y])?;
    let err = message(several.call(&x));
    assert_names(&err, &["1 inputs and 2 outputs"]);
    Ok(())
}

#[test]
fn a_graph_runs_on_the_device_generic_path_as_on_the_kernels() -> Result<()> {
    let graph = every_merge()?;
    let run = |path: ComputePath| -> Result<Tensor> {
        let ctx = crate::params::BuildContext::new(&Device::Cpu, 1).with_compute_path(path);
        let (net, _, _) = Sequential::new()
            .add(graph.clone())
            .build_in(ctx, &[16, 6, 6])?;
        let x = Tensor::arange(0f32, 2. * 16. * 36., &Device::Cpu)?.reshape((2, 16, 6, 6))?;
        net.forward_t(&(x / 500.)?.sin()?, false)
    };
    let a = run(ComputePath::Auto)?;
    let b = run(ComputePath::DeviceGeneric)?;
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff <= 1e-5 * scale.max(1.0), "{diff} against {scale}");
    Ok(())
}

/// A model of two inputs and two outputs (one a softmax): its recorded backward pass gives
/// autograd's gradients.
#[test]
fn recorded_gradients_of_a_two_output_graph_match_autograd() -> Result<()> {
    let a = Input::new(&[2, 4, 4]).tensor();
    let b = Input::new(&[5]).tensor();
    let h = Conv2D::new(3, 3).padding(Padding::Same).call(&a)?;
    let h = Dense::new(5).call(&Flatten.call(&h)?)?;
    let h = Activation::Relu.call(&add(&[&h, &b])?)?;
    let class = Activation::Softmax.call(&Dense::new(4).call(&h)?)?;
    let value = Dense::new(2).call(&h)?;
    let graph = Functional::new([&a, &b], [&class, &value])?;
    assert_graph_recorded_matches_autograd(&graph, 3)
}

/// `graph`'s recorded backward pass, run on the CPU kernels with one tensor per input and per
/// output, gives candle's autograd's gradients of the device-generic graph with the same
/// variables: every input's and every trainable variable's (a convolution's bias before a
/// BatchNorm, whose gradient is rounding noise, aside).
fn assert_graph_recorded_matches_autograd(graph: &Functional, seed: u64) -> Result<()> {
    use candle_core::Var;
    let shapes = graph.input_shapes();
    let build = |path| {
        let mut ctx = crate::params::BuildContext::new(&Device::Cpu, seed).with_compute_path(path);
        let (net, _) = graph.build_graph(&mut ctx, &shapes)?;
        Ok::<_, crate::Error>((net, ctx.into_store()))
    };
    let (recorded, store) = build(ComputePath::Auto)?;
    let (generic, generic_store) = build(ComputePath::DeviceGeneric)?;
    generic_store.assign(&store.weights()?)?;
    let xs = shapes
        .iter()
        .zip(1..)
        .map(|(shape, seed)| {
            let mut dims = vec![3];
            dims.extend(shape);
            kandle_testing::random::seeded_uniform(&dims, seed)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let (outputs, _, backward) = recorded.record(&xs, false, true)?;
    let dys = outputs
        .iter()
        .zip(10..)
        .map(|(y, seed)| kandle_testing::random::seeded_uniform(y.dims(), seed))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut grads = crate::layers::ParamGrads::new();
    let dxs = backward.backward(dys.clone(), &mut grads, true)?;

    let vars = xs
        .iter()
        .map(|x| Ok(Var::from_tensor(x)?))
        .collect::<Result<Vec<_>>>()?;
    let inputs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (ys, _) = generic.run(&inputs, true, false)?;
    let mut objective = Tensor::zeros((), candle_core::DType::F32, &Device::Cpu)?;
    for (y, dy) in ys.iter().zip(&dys) {
        objective = (objective + (y * dy)?.sum_all()?)?;
    }
    let autograd = objective.backward()?;
    for (i, (dx, var)) in dxs.iter().zip(&vars).enumerate() {
        let dx = dx
            .as_ref()
            .ok_or_else(|| crate::Error::invalid("no input gradient"))?;
        let want = autograd
            .get(var.as_tensor())
            .ok_or_else(|| crate::Error::invalid("no autograd input gradient"))?;
        let err = crate::layers::relative_difference(dx, want)?;
        assert!(err < 1e-4, "input {i}'s gradient: relative error {err}");
    }
    crate::layers::assert_param_grads_match(&store, &generic_store, &mut grads, &autograd)
}

/// A model of two inputs and two outputs, named `encoder`: a convolution, a BatchNorm and a
/// ReLU on the image, a sum with the vector, and two dense heads.
fn encoder() -> Result<Functional> {
    let image = Input::new(&[2, 4, 4]).named("image").tensor();
    let vector = Input::new(&[5]).named("vector").tensor();
    let h = Conv2D::new(3, 3).padding(Padding::Same).call(&image)?;
    let h = Activation::Relu.call(&BatchNormalization::new().call(&h)?)?;
    let h = Dense::new(5).call(&Flatten.call(&h)?)?;
    let h = Activation::Relu.call(&add(&[&h, &vector])?)?;
    let first = Dense::new(4).named("first").call(&h)?;
    let second = Dense::new(3).named("second").call(&h)?;
    Ok(Functional::new([&image, &vector], [&first, &second])?.named("encoder"))
}

/// `encoder` called in a model of two inputs whose outputs are a dense layer on both of the
/// encoder's outputs and the encoder's second output itself.
fn calls_the_encoder(encoder: &Functional) -> Result<Functional> {
    let x = Input::new(&[2, 4, 4]).named("x").tensor();
    let y = Input::new(&[5]).named("y").tensor();
    let parts = encoder.call_on(&[&x, &y])?;
    let joined = concatenate(&[&parts[0], &parts[1]])?;
    let head = Dense::new(2).named("head").call(&joined)?;
    Functional::new([&x, &y], [&head, &parts[1]])
}

/// The inputs of `encoder` for `n` samples, drawn from `seed`.
fn encoder_inputs(n: usize, seed: u64) -> Result<[Tensor; 2]> {
    Ok([
        kandle_testing::random::seeded_normal(&[n, 2, 4, 4], 1.0, 2 * seed)?,
        kandle_testing::random::seeded_normal(&[n, 5], 1.0, 2 * seed + 1)?,
    ])
}

/// A model of several inputs and outputs called in another gives, through the outer model,
/// what it gives run on its own with the same variables; they are the outer model's, under
/// its name.
#[test]
fn a_model_of_several_inputs_and_outputs_is_called_like_a_layer() -> Result<()> {
    let inner = encoder()?;
    let outer = calls_the_encoder(&inner)?;
    assert_eq!(outer.output_names(), ["head", "encoder.second"]);
    assert_eq!(outer.output_shapes(), [vec![2], vec![3]]);
    let summary = outer.summary()?;
    let row = summary
        .rows
        .iter()
        .find(|r| r.name == "encoder")
        .expect("the encoder's row");
    assert_eq!(row.class_name, "Functional");
    assert_eq!(row.connected_to, ["x[0][0]", "y[0][0]"]);
    assert_eq!(
        row.trainable,
        2 * 3 * 9 + 3 + 2 * 3 + 48 * 5 + 5 + 5 * 4 + 4 + 5 * 3 + 3
    );
    let joined = summary
        .rows
        .iter()
        .find(|r| r.class_name == "Concatenate")
        .expect("the concatenation's row");
    assert_eq!(joined.connected_to, ["encoder[0][0]", "encoder[0][1]"]);

    for path in [ComputePath::Auto, ComputePath::DeviceGeneric] {
        let mut ctx = crate::params::BuildContext::new(&Device::Cpu, 5).with_compute_path(path);
        let (net, _) = outer.build_graph(&mut ctx, &outer.input_shapes())?;
        let store = ctx.into_store();
        let weights = store.weights()?;
        assert!(weights.contains_key("encoder.first.weight"), "{weights:?}");
        let mut alone = crate::params::BuildContext::new(&Device::Cpu, 9).with_compute_path(path);
        let (inner_net, _) = inner.build_graph(&mut alone, &inner.input_shapes())?;
        let inner_store = alone.into_store();
        let mut inner_weights = inner_store.weights()?;
        for (name, value) in inner_weights.iter_mut() {
            *value = weights[&format!("encoder.{name}")].clone();
        }
        inner_store.assign(&inner_weights)?;

        let xs = encoder_inputs(3, 1)?;
        let (outputs, _) = net.run(&xs, false, false)?;
        let (direct, _) = inner_net.run(&xs, false, false)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
        };
        assert_eq!(diff(&outputs[1], &direct[1])?, 0.0, "{path:?}");
        let head = Tensor::cat(&direct, 1)?
            .matmul(&weights["head.weight"].t()?)?
            .broadcast_add(&weights["head.bias"])?;
        assert!(diff(&outputs[0], &head)? < 1e-6, "{path:?}");
    }
    Ok(())
}

/// The recorded backward pass through a model of several inputs and outputs called in another
/// gives candle's autograd's gradients.
#[test]
fn recorded_gradients_through_a_called_model_of_several_outputs_match_autograd() -> Result<()> {
    assert_graph_recorded_matches_autograd(&calls_the_encoder(&encoder()?)?, 4)
}

/// A model that leaves one of the called model's outputs unused trains on both paths, and
/// its weights (the called model's under its name) save and load.
#[test]
fn an_outer_model_trains_saves_and_loads_the_called_models_variables() -> Result<()> {
    let inner = encoder()?;
    let x = Input::new(&[2, 4, 4]).tensor();
    let y = Input::new(&[5]).tensor();
    let parts = inner.call_on(&[&x, &y])?;
    let out = Dense::new(1).named("out").call(&parts[0])?;
    let outer = Functional::new([&x, &y], [&out])?;
    let xs = encoder_inputs(32, 2)?;
    let target = xs[1].sum_keepdim(1)?;
    let data = crate::data::InMemoryDataset::from_parts(&xs, &[target])?;
    let dir = tempfile::tempdir().map_err(|e| crate::Error::io("cannot create", "tempdir", e))?;
    for path in [ComputePath::Auto, ComputePath::DeviceGeneric] {
        let mut model = outer
            .clone()
            .compile(
                crate::optimizers::Adam::new(0.01),
                crate::losses::MeanSquaredError,
                (),
                &crate::OneDeviceStrategy::cpu(),
            )?
            .with_compute_path(path)?;
        // Over 16 draws of the data, 16 epochs left 0.08 to 0.38 of the first epoch's loss
        // (8 epochs left up to 0.53): halving it is learning on any draw, not on this one.
        let history = model.fit(
            &data,
            crate::FitOptions {
                epochs: 16,
                batch_size_per_replica: 8,
                verbosity: crate::callbacks::Verbosity::Silent,
                ..Default::default()
            },
        )?;
        let loss = history.series("loss");
        assert!(loss[loss.len() - 1] < 0.5 * loss[0], "{path:?}: {loss:?}");
        assert!(model.get_weights()?.contains_key("encoder.second.weight"));

        let file = dir.path().join(format!("{path:?}.safetensors"));
        model.save_weights(&file)?;
        let mut fresh = outer
            .clone()
            .compile(
                crate::optimizers::Sgd::new(0.1),
                crate::losses::MeanSquaredError,
                (),
                &crate::OneDeviceStrategy::cpu(),
            )?
            .with_compute_path(path)?
            .with_seed(7)?;
        fresh.load_weights(&file)?;
        let probe = encoder_inputs(4, 3)?;
        let (a, b) = (
            model.predict_outputs(&probe, 4)?,
            fresh.predict_outputs(&probe, 4)?,
        );
        let diff = (&a[0] - &b[0])?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{path:?}");
    }
    Ok(())
}

/// Calling a model on the wrong number of tensors, or on a tensor of another shape, is an
/// error naming the model (and the input with both shapes).
#[test]
fn a_called_model_checks_its_inputs() -> Result<()> {
    let inner = encoder()?;
    let x = Input::new(&[2, 4, 4]).tensor();
    let err = message(inner.call_on(&[&x]));
    assert_names(
        &err,
        &[
            "`encoder`",
            "takes 2 inputs",
            "`image` (batch, 2, 4, 4)",
            "called on 1",
        ],
    );
    let wide = Input::new(&[6]).tensor();
    let err = message(inner.call_on(&[&x, &wide]));
    assert_names(&err, &["`encoder`", "`vector`", "(batch, 5)", "(batch, 6)"]);
    let flat = Input::new(&[5]).tensor();
    let outputs = inner.call_on(&[&x, &flat])?;
    let err = message(add(&[&outputs[0], &outputs[1]]));
    assert_names(
        &err,
        &[
            "`encoder` output 1",
            "(batch, 4)",
            "`encoder` output 2",
            "(batch, 3)",
        ],
    );
    Ok(())
}

/// `encoder`, shared, called on two pairs of inputs of a Siamese model of four inputs: the
/// outputs of both calls and a dense head on the first call's.
fn siamese(encoder: &Functional) -> Result<Functional> {
    let shared = encoder.clone().shared();
    let (x1, y1) = (Input::new(&[2, 4, 4]).tensor(), Input::new(&[5]).tensor());
    let (x2, y2) = (Input::new(&[2, 4, 4]).tensor(), Input::new(&[5]).tensor());
    let first = shared.call_on(&[&x1, &y1])?;
    let second = shared.call_on(&[&x2, &y2])?;
    let difference = subtract(&first[0], &second[0])?;
    let head = Dense::new(2).named("head").call(&first[1])?;
    Functional::new([&x1, &y1, &x2, &y2], [&difference, &second[1], &head])
}

/// A shared functional model is one layer: one set of variables (under its name, counted once
/// in the summary, with both calls in "Connected to"), both calls computing what the model
/// computes alone with those variables.
#[test]
fn a_shared_model_called_twice_has_one_set_of_variables() -> Result<()> {
    let inner = encoder()?;
    let outer = siamese(&inner)?;
    let summary = outer.summary()?;
    let rows: Vec<_> = summary
        .rows
        .iter()
        .filter(|r| r.name == "encoder")
        .collect();
    assert_eq!(rows.len(), 1);
    let encoder_params = 2 * 3 * 9 + 3 + 2 * 3 + 48 * 5 + 5 + 5 * 4 + 4 + 5 * 3 + 3;
    assert_eq!(rows[0].trainable, encoder_params);
    assert_eq!(summary.trainable, encoder_params + 3 * 2 + 2);
    assert_eq!(
        rows[0].connected_to,
        [
            "input_1[0][0]",
            "input_2[0][0]",
            "input_3[0][0]",
            "input_4[0][0]",
        ]
    );
    assert_eq!(
        (&rows[0].output_shape, &rows[0].more_output_shapes),
        (&vec![4], &vec![vec![3]])
    );
    assert!(
        summary.to_string().contains("[(None, 4), (None, 3)]"),
        "{summary}"
    );

    let mut ctx = crate::params::BuildContext::new(&Device::Cpu, 5);
    let (net, _) = outer.build_graph(&mut ctx, &outer.input_shapes())?;
    let weights = ctx.into_store().weights()?;
    let mut alone = crate::params::BuildContext::new(&Device::Cpu, 9);
    let (inner_net, _) = inner.build_graph(&mut alone, &inner.input_shapes())?;
    let inner_store = alone.into_store();
    let mut inner_weights = inner_store.weights()?;
    assert_eq!(weights.len(), inner_weights.len() + 2);
    for (name, value) in inner_weights.iter_mut() {
        *value = weights[&format!("encoder.{name}")].clone();
    }
    inner_store.assign(&inner_weights)?;
    let [a1, b1] = encoder_inputs(3, 4)?;
    let [a2, b2] = encoder_inputs(3, 5)?;
    let (outputs, _) = net.run(
        &[a1.clone(), b1.clone(), a2.clone(), b2.clone()],
        false,
        false,
    )?;
    let (first, _) = inner_net.run(&[a1, b1], false, false)?;
    let (second, _) = inner_net.run(&[a2, b2], false, false)?;
    let max = |t: Tensor| -> Result<f32> { Ok(t.abs()?.max_all()?.to_scalar::<f32>()?) };
    assert_eq!(max((&outputs[0] - (&first[0] - &second[0])?)?)?, 0.0);
    assert_eq!(max((&outputs[1] - &second[1])?)?, 0.0);
    Ok(())
}

/// The recorded backward pass of a model shared by two calls sums both calls' gradients into
/// its one set of variables, as candle's autograd does.
#[test]
fn recorded_gradients_of_a_shared_model_match_autograd() -> Result<()> {
    assert_graph_recorded_matches_autograd(&siamese(&encoder()?)?, 4)
}

/// A shared model called on other shapes than its first call's is refused naming it and
/// both calls' shapes.
#[test]
fn a_shared_model_called_on_other_shapes_is_refused() -> Result<()> {
    let shared = encoder()?.shared();
    let (x, y) = (Input::new(&[2, 4, 4]).tensor(), Input::new(&[5]).tensor());
    shared.call_on(&[&x, &y])?;
    let other = Input::new(&[2, 5, 5]).tensor();
    let err = message(shared.call_on(&[&other, &y]));
    assert_names(&err, &["`encoder`", "(batch, 2, 4, 4)", "(batch, 2, 5, 5)"]);
    Ok(())
}

/// Calling a model twice without sharing it makes two layers of one name: refused, pointing
/// at `.shared()`.
#[test]
fn a_model_called_twice_unshared_is_refused_pointing_at_shared() -> Result<()> {
    let inner = encoder()?;
    let (x, y) = (Input::new(&[2, 4, 4]).tensor(), Input::new(&[5]).tensor());
    let (a, b) = (inner.call_on(&[&x, &y])?, inner.call_on(&[&x, &y])?);
    let out = subtract(&a[0], &b[0])?;
    let err = message(Functional::new([&x, &y], [&out]));
    assert_names(&err, &["named `encoder`", "`.shared()`"]);
    Ok(())
}
