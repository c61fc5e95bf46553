//! The training state survives a stop: an optimizer's exported state continues its steps bit for
//! bit, a model saved after K steps and loaded into a fresh model ends M steps later exactly
//! where K + M uninterrupted steps end (one CPU device), and a file that is truncated, corrupt,
//! foreign, too new or from another optimizer is refused with an error naming it, leaving the
//! model and the file as they were.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use kandle::optimizers::{Adam, AdamW, Optimizer, OptimizerConfig, OptimizerState, Sgd};
use kandle::params::Weights;
use kandle::prelude::*;
use kandle::training_state::{TrainingState, FORMAT_VERSION};

// ---- The optimizers alone ----

/// Two variables and a gradient sequence that depends on the step.
fn variables() -> anyhow::Result<Vec<Var>> {
    Ok(vec![
        Var::from_tensor(&Tensor::new(
            &[[0.5f32, -1.0, 2.0], [0.0, 1.5, -0.25]],
            &Device::Cpu,
        )?)?,
        Var::from_tensor(&Tensor::new(&[0.1f32, -0.2, 0.3], &Device::Cpu)?)?,
    ])
}

fn grads(step: usize, vars: &[Var]) -> anyhow::Result<Vec<Tensor>> {
    vars.iter()
        .map(|v| {
            let t = v.as_tensor();
            Ok(((t.sin()? * (0.3 + step as f64 * 0.17))? + (step as f64 * 0.05).cos())?)
        })
        .collect()
}

fn bits(vars: &[Var]) -> anyhow::Result<Vec<u32>> {
    let mut out = Vec::new();
    for v in vars {
        out.extend(
            v.as_tensor()
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|x| x.to_bits()),
        );
    }
    Ok(out)
}

/// `n + m` steps in one go against `n` steps, the state moved into a fresh optimizer over fresh
/// variables holding the same values, and `m` more.
fn resumes_exactly(config: &dyn OptimizerConfig, n: usize, m: usize) -> anyhow::Result<()> {
    let vars = variables()?;
    let mut opt = config.build(vars.clone())?;
    for step in 0..n + m {
        opt.step(&grads(step, &vars)?, 0.1)?;
    }

    let first = variables()?;
    let mut opt = config.build(first.clone())?;
    for step in 0..n {
        opt.step(&grads(step, &first)?, 0.1)?;
    }
    let state = opt.state()?;
    drop(opt);
    let second = variables()?;
    for (to, from) in second.iter().zip(&first) {
        to.set(from.as_tensor())?;
    }
    let mut resumed = config.build(second.clone())?;
    resumed.load_state(&state)?;
    for step in n..n + m {
        resumed.step(&grads(step, &second)?, 0.1)?;
    }
    assert_eq!(bits(&vars)?, bits(&second)?, "{n} + {m} steps");
    Ok(())
}

#[test]
fn every_optimizer_resumes_bit_for_bit() -> anyhow::Result<()> {
    let configs: Vec<Box<dyn OptimizerConfig>> = vec![
        Box::new(Sgd::new(0.1)),
        Box::new(Sgd::new(0.1).momentum(0.9)),
        Box::new(
            Sgd::new(0.1)
                .momentum(0.9)
                .nesterov(true)
                .weight_decay(0.01),
        ),
        Box::new(Adam::new(0.1)),
        Box::new(Adam::new(0.1).weight_decay(0.01)),
        Box::new(AdamW::new(0.1)),
    ];
    for config in &configs {
        resumes_exactly(config.as_ref(), 3, 4)?;
        // A state taken before the first step.
        resumes_exactly(config.as_ref(), 0, 3)?;
    }
    Ok(())
}

#[test]
fn states_report_their_slots() -> anyhow::Result<()> {
    let vars = variables()?;
    let mut sgd = Sgd::new(0.1).momentum(0.9).build(vars.clone())?;
    assert!(sgd.state()?.is_empty(), "no momentum buffer before a step");
    sgd.step(&grads(0, &vars)?, 0.1)?;
    let state = sgd.state()?;
    assert_eq!(state.kind, "SGD");
    assert_eq!(state.slot("momentum").map(<[Tensor]>::len), Some(2));

    let mut adam = AdamW::new(0.1).build(vars.clone())?;
    adam.step(&grads(0, &vars)?, 0.1)?;
    adam.step(&grads(1, &vars)?, 0.1)?;
    let state = adam.state()?;
    assert_eq!(state.kind, "AdamW");
    assert_eq!(state.scalar("step"), Some(2.0));
    assert_eq!(state.slots.keys().collect::<Vec<_>>(), ["m", "v"]);
    Ok(())
}

#[test]
fn a_state_that_does_not_fit_is_refused_and_changes_nothing() -> anyhow::Result<()> {
    let vars = variables()?;
    let mut adam = Adam::new(0.1).build(vars.clone())?;
    adam.step(&grads(0, &vars)?, 0.1)?;
    let adam_state = adam.state()?;

    let mut sgd = Sgd::new(0.1).momentum(0.9).build(vars.clone())?;
    sgd.step(&grads(0, &vars)?, 0.1)?;
    let before = sgd.state()?;
    let check = |opt: &mut Box<dyn Optimizer>, state: &OptimizerState, want: &str| {
        let err = opt.load_state(state).expect_err(want).to_string();
        assert!(err.contains(want), "{err}");
    };
    check(
        &mut sgd,
        &adam_state,
        "written by Adam, but this optimizer is SGD",
    );
    let mut short = before.clone();
    short
        .slots
        .insert("momentum".into(), before.slots["momentum"][..1].to_vec());
    check(&mut sgd, &short, "holds 1 tensors for 2 variables");
    let mut misshaped = before.clone();
    misshaped.slots.insert(
        "momentum".into(),
        vec![
            Tensor::zeros(3, DType::F32, &Device::Cpu)?,
            Tensor::zeros(3, DType::F32, &Device::Cpu)?,
        ],
    );
    check(&mut sgd, &misshaped, "has shape [3] for variable 0");
    check(
        &mut sgd,
        &before.clone().with_scalar("lr", 1.0),
        "unknown slots [] and scalars [\"lr\"]",
    );
    let after = sgd.state()?;
    for (a, b) in after.slots["momentum"]
        .iter()
        .zip(&before.slots["momentum"])
    {
        assert_eq!(
            a.flatten_all()?.to_vec1::<f32>()?,
            b.flatten_all()?.to_vec1::<f32>()?
        );
    }

    let mut no_step = adam_state.clone();
    no_step.scalars.clear();
    check(&mut adam, &no_step, "scalar `step` is missing");
    let mut half = adam_state.clone();
    half.slots.remove("v");
    check(&mut adam, &half, "slot `v` is missing");
    Ok(())
}

/// An optimizer that keeps no state takes part through the trait's defaults.
struct PlainDescent(Vec<Var>);

impl Optimizer for PlainDescent {
    fn step(&mut self, grads: &[Tensor], lr: f64) -> kandle::Result<()> {
        for (v, g) in self.0.iter().zip(grads) {
            v.set(&(v.as_tensor() - (g * lr)?)?)?;
        }
        Ok(())
    }
}

#[test]
fn a_user_optimizer_without_state_uses_the_defaults() -> anyhow::Result<()> {
    let vars = variables()?;
    let mut plain = PlainDescent(vars.clone());
    let state = plain.state()?;
    assert!(state.is_empty() && state.kind.is_empty());
    plain.load_state(&state)?;
    let mut sgd = Sgd::new(0.1).momentum(0.9).build(vars.clone())?;
    sgd.step(&grads(0, &vars)?, 0.1)?;
    let err = plain
        .load_state(&sgd.state()?)
        .expect_err("a stateful state into a stateless optimizer")
        .to_string();
    assert!(err.contains("keeps no state"), "{err}");
    Ok(())
}

// ---- Models ----

/// A small CNN with batch normalisation (moving statistics are part of the state).
fn network() -> Sequential {
    Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Conv2D::new(4, 3).padding(Padding::Same).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

fn model<O: OptimizerConfig>(optimizer: O, seed: u64) -> anyhow::Result<Model> {
    Ok(network()
        .compile(
            optimizer,
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )?
        .with_seed(seed)?)
}

/// Batch `i` of 16 digits.
fn batch(i: usize) -> anyhow::Result<(Tensor, Tensor)> {
    let (x, y) = kandle::data::digits::load()?.to_tensors()?;
    Ok((x.narrow(0, i * 16, 16)?, y.narrow(0, i * 16, 16)?))
}

fn train(model: &mut Model, steps: std::ops::Range<usize>) -> anyhow::Result<()> {
    for i in steps {
        let (x, y) = batch(i)?;
        model.train_on_batch(&x, &y, None)?;
    }
    Ok(())
}

fn weight_bits(weights: &Weights) -> anyhow::Result<BTreeMap<String, Vec<u32>>> {
    weights
        .iter()
        .map(|(k, v)| {
            let values = v.flatten_all()?.to_vec1::<f32>()?;
            Ok((k.clone(), values.iter().map(|x| x.to_bits()).collect()))
        })
        .collect()
}

fn save_train_load_continues_exactly<O: OptimizerConfig + Clone>(
    optimizer: O,
    dir: &Path,
) -> anyhow::Result<()> {
    const K: usize = 4;
    const M: usize = 5;
    let mut uninterrupted = model(optimizer.clone(), 1)?;
    train(&mut uninterrupted, 0..K)?;
    uninterrupted.set_learning_rate(0.02)?;
    train(&mut uninterrupted, K..K + M)?;

    let path = dir.join("state.safetensors");
    let mut first = model(optimizer.clone(), 1)?;
    train(&mut first, 0..K)?;
    first.set_learning_rate(0.02)?;
    first.save(&path)?;
    drop(first);
    // Other initial weights: everything must come from the file.
    let mut resumed = model(optimizer, 2)?;
    resumed.load(&path)?;
    assert_eq!(resumed.learning_rate(), 0.02);
    train(&mut resumed, K..K + M)?;
    assert_eq!(
        weight_bits(&uninterrupted.get_weights()?)?,
        weight_bits(&resumed.get_weights()?)?
    );
    Ok(())
}

#[test]
fn a_saved_model_resumes_bit_for_bit_with_sgd_momentum() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    save_train_load_continues_exactly(Sgd::new(0.05).momentum(0.9), dir.path())
}

#[test]
fn a_saved_model_resumes_bit_for_bit_with_adam() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    save_train_load_continues_exactly(Adam::new(1e-2), dir.path())
}

#[test]
fn the_file_holds_canonical_names_and_its_metadata() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("state.safetensors");
    let mut m = model(Sgd::new(0.05).momentum(0.9), 1)?;
    train(&mut m, 0..2)?;
    m.save(&path)?;
    let state = TrainingState::load(&path)?;
    assert_eq!(state.optimizer.kind, "SGD");
    assert_eq!(
        state.optimizer.slots["momentum"].keys().collect::<Vec<_>>(),
        [
            "batch_normalization_1.bias",
            "batch_normalization_1.weight",
            "conv2d_1.weight",
            "dense_1.bias",
            "dense_1.weight"
        ]
    );
    assert!(state
        .weights
        .contains_key("batch_normalization_1.running_mean"));
    assert!(state
        .weights
        .contains_key("batch_normalization_1.running_var"));
    let bytes = std::fs::read(&path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    assert!(st.names().contains(&"optimizer.momentum.conv2d_1.weight"));
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
    let meta = header.metadata().clone().unwrap_or_default();
    assert_eq!(meta["format"], "kandle.training_state");
    assert_eq!(meta["format_version"], FORMAT_VERSION.to_string());
    assert_eq!(meta["optimizer"], "SGD");
    assert_eq!(meta["learning_rate"], "0.05");
    Ok(())
}

// ---- Files that must be refused ----

/// Loads `path` into `model` and checks that it fails with an error naming the file and
/// containing `want`, and that neither the model nor the file changed.
fn refused(model: &mut Model, path: &Path, want: &str) -> anyhow::Result<()> {
    let file_before = std::fs::read(path).ok();
    let weights_before = weight_bits(&model.get_weights()?)?;
    let state_before = model.training_state()?;
    let lr_before = model.learning_rate();
    let err = model.load(path).expect_err(want);
    let text = err.to_string();
    assert!(
        matches!(
            err,
            kandle::Error::Checkpoint { .. } | kandle::Error::Io { .. }
        ),
        "{text}"
    );
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains(want), "{text}");
    assert_eq!(
        weight_bits(&model.get_weights()?)?,
        weights_before,
        "{want}"
    );
    assert_eq!(model.learning_rate(), lr_before);
    let state_after = model.training_state()?;
    assert_eq!(state_after.optimizer.kind, state_before.optimizer.kind);
    for (slot, tensors) in &state_before.optimizer.slots {
        assert_eq!(
            weight_bits(tensors)?,
            weight_bits(&state_after.optimizer.slots[slot])?,
            "{want}: slot {slot}"
        );
    }
    assert_eq!(
        std::fs::read(path).ok(),
        file_before,
        "the file must not change"
    );
    Ok(())
}

/// Rewrites a training-state file with one metadata entry changed.
fn with_metadata(from: &Path, to: &Path, key: &str, value: &str) -> anyhow::Result<()> {
    let bytes = std::fs::read(from)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
    let mut meta = header.metadata().clone().unwrap_or_default();
    meta.insert(key.into(), value.into());
    let out = safetensors::serialize(st.tensors(), Some(meta))?;
    std::fs::write(to, out)?;
    Ok(())
}

#[test]
fn bad_files_are_refused_with_the_file_named() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let good = dir.path().join("good.safetensors");
    let mut sgd_model = model(Sgd::new(0.05).momentum(0.9), 1)?;
    train(&mut sgd_model, 0..2)?;
    sgd_model.save(&good)?;
    train(&mut sgd_model, 2..3)?;
    let bytes = std::fs::read(&good)?;

    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100])?;
    refused(
        &mut sgd_model,
        &truncated,
        "truncated or not a safetensors file",
    )?;

    let header_cut = dir.path().join("header_cut.safetensors");
    std::fs::write(&header_cut, &bytes[..5])?;
    refused(
        &mut sgd_model,
        &header_cut,
        "truncated or not a safetensors file",
    )?;

    let random = dir.path().join("random.safetensors");
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&random, noise)?;
    refused(
        &mut sgd_model,
        &random,
        "truncated or not a safetensors file",
    )?;

    let weights_only = dir.path().join("weights.safetensors");
    sgd_model.save_weights(&weights_only)?;
    refused(&mut sgd_model, &weights_only, "not a kandle training state")?;

    let foreign = dir.path().join("foreign.safetensors");
    with_metadata(&good, &foreign, "format", "pytorch")?;
    refused(&mut sgd_model, &foreign, "its format is `pytorch`")?;

    let newer = dir.path().join("newer.safetensors");
    with_metadata(&good, &newer, "format_version", "999")?;
    refused(&mut sgd_model, &newer, "format version 999 is newer")?;

    let missing = dir.path().join("missing.safetensors");
    refused(&mut sgd_model, &missing, "cannot read training state")?;

    let adam = dir.path().join("adam.safetensors");
    let mut adam_model = model(Adam::new(1e-2), 1)?;
    train(&mut adam_model, 0..2)?;
    adam_model.save(&adam)?;
    refused(
        &mut sgd_model,
        &adam,
        "the state's optimizer is Adam, but the model's is SGD",
    )?;

    let other_net = dir.path().join("other_net.safetensors");
    let mut wider = Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Conv2D::new(6, 3).padding(Padding::Same).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10))
        .add(Activation::Softmax)
        .compile(
            Sgd::new(0.05).momentum(0.9),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )?;
    train(&mut wider, 0..1)?;
    wider.save(&other_net)?;
    refused(
        &mut sgd_model,
        &other_net,
        "`conv2d_1.weight` is [6, 1, 3, 3] in the file",
    )?;

    // A state whose optimizer part does not fit, although its weights do: the weights that were
    // set first are put back.
    let odd_slot = dir.path().join("odd_slot.safetensors");
    let mut state = TrainingState::load(&good)?;
    if let Some(momentum) = state.optimizer.slots.get_mut("momentum") {
        momentum.remove("dense_1.bias");
    }
    state.save(&odd_slot)?;
    refused(
        &mut sgd_model,
        &odd_slot,
        "slot `momentum` misses `dense_1.bias`",
    )?;

    // The model still loads a good file and trains on.
    sgd_model.load(&good)?;
    train(&mut sgd_model, 2..3)?;
    Ok(())
}

#[test]
fn loading_needs_a_built_model() -> anyhow::Result<()> {
    let mut unbuilt = Sequential::new().add(Flatten).add(Dense::new(10)).compile(
        Sgd::new(0.1),
        MeanSquaredError,
        (),
        &OneDeviceStrategy::cpu(),
    )?;
    let err = unbuilt
        .load("nowhere.safetensors")
        .expect_err("not built")
        .to_string();
    assert!(err.contains("needs a built model"), "{err}");
    let err = unbuilt
        .save("nowhere.safetensors")
        .expect_err("not built")
        .to_string();
    assert!(err.contains("not built"), "{err}");
    assert!(!Path::new("nowhere.safetensors").exists());
    Ok(())
}
