//! Mixed precision on the CPU: `mixed_float16` trains the digits as `float32` does (kandle's
//! kernels stay `float32`; the loss scale runs: 98.3% test accuracy, as `float32`'s), and on
//! the device-generic path candle's ops compute in `float16` (95.8% after half the epochs); a loss scale too large
//! for the gradients skips the step, leaves the weights as they were and halves; the scale is
//! saved with the training state; `bfloat16`, which candle cannot run on the CPU, is refused
//! when the model is built.

use anyhow::{ensure, Result};
use kandle::data::{digits, InMemoryDataset};
use kandle::params::Weights;
use kandle::prelude::*;
use kandle::{ComputePath, DTypePolicy, LossScale};

mod support;

fn model(policy: DTypePolicy, path: ComputePath) -> kandle::Result<Model> {
    support::digits_cnn()
        .input_shape(&[1, 8, 8])
        .compile(
            Adam::new(3e-3),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )?
        .with_seed(1)?
        .with_compute_path(path)?
        .with_dtype_policy(policy)
}

/// The epochs of the digits recipe (`support::digits_cnn`).
const EPOCHS: usize = 12;

fn split() -> Result<(InMemoryDataset, InMemoryDataset)> {
    Ok(digits::load()?.train_test_split(0.2, 42)?)
}

/// Trains `epochs` epochs and returns the test accuracy and the last epoch's logs.
fn train(model: &mut Model, epochs: usize) -> Result<(f64, kandle::callbacks::Logs)> {
    let (train, test) = split()?;
    let history = model.fit(
        &train,
        FitOptions {
            epochs,
            batch_size_per_replica: 32,
            seed: Some(2),
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let logs = history.logs.last().cloned().unwrap_or_default();
    let accuracy = model.evaluate(&test, 128)?.get("accuracy").unwrap_or(0.0);
    Ok((accuracy, logs))
}

#[test]
#[ignore = "the float32 baseline, run by hand"]
fn float32_baseline() -> Result<()> {
    for path in [ComputePath::Auto, ComputePath::DeviceGeneric] {
        let mut m = model(DTypePolicy::float32(), path)?;
        let (accuracy, _) = train(&mut m, EPOCHS)?;
        eprintln!("float32, {path:?}: test accuracy {accuracy:.4}");
    }
    Ok(())
}

#[test]
fn mixed_float16_trains_digits_on_the_cpu_kernels() -> Result<()> {
    let mut m = model(DTypePolicy::mixed_float16(), ComputePath::Auto)?;
    let (accuracy, logs) = train(&mut m, EPOCHS)?;
    eprintln!("mixed_float16, kernels: test accuracy {accuracy:.4}, logs {logs:?}");
    ensure!(accuracy >= 0.97, "{accuracy}");
    ensure!(logs.get("loss_scale") == Some(32768.0), "{logs:?}");
    Ok(())
}

/// candle's `float16` ops on the CPU are slow: half the recipe's epochs. After six epochs the
/// test accuracy depends on the seed: 95.0% to 98.6% measured over model seeds 1 to 4 and two
/// dropout generators (95.8% with this one at seed 1), where the whole recipe's twelve reach
/// 96.7% to 98.9%; `float32` on the same path after six epochs, 94.2% to 98.6%.
#[test]
fn mixed_float16_trains_digits_in_float16_on_the_device_generic_path() -> Result<()> {
    let mut m = model(DTypePolicy::mixed_float16(), ComputePath::DeviceGeneric)?;
    let (accuracy, logs) = train(&mut m, EPOCHS / 2)?;
    eprintln!("mixed_float16, device-generic: test accuracy {accuracy:.4}, logs {logs:?}");
    ensure!(accuracy >= 0.94, "{accuracy}");
    // The variables stay float32, and predictions come back in float32.
    ensure!(m
        .get_weights()?
        .values()
        .all(|t| t.dtype() == candle_core::DType::F32));
    let (_, test) = split()?;
    let (x, _) = test.to_tensors()?;
    ensure!(m.predict_on_batch(&x.narrow(0, 0, 4)?)?.dtype() == candle_core::DType::F32);
    Ok(())
}

/// Every variable's values but the loss scale's and the dropout generator's position (which
/// moves on with every forward pass, applied or not).
fn values(w: &Weights) -> Result<Vec<f32>> {
    let mut all = Vec::new();
    for (name, t) in w {
        if name != "loss_scale" && !name.ends_with(".generator") {
            all.extend(t.flatten_all()?.to_vec1::<f32>()?);
        }
    }
    Ok(all)
}

#[test]
fn an_overflow_skips_the_step_and_halves_the_scale() -> Result<()> {
    // float16's largest value is 65504: a scale of 2^40 overflows the gradients at once.
    let policy = DTypePolicy::mixed_float16().with_loss_scale(Some(LossScale {
        initial: 2f64.powi(40),
        growth_steps: 2000,
    }));
    let mut m = model(policy, ComputePath::DeviceGeneric)?;
    let (x, y) = split()?.0.to_tensors()?;
    let before = values(&m.get_weights()?)?;
    let logs = m.train_on_batch(&x.narrow(0, 0, 32)?, &y.narrow(0, 0, 32)?, None)?;
    // The loss itself was finite: it is reported, not NaN; the skip is counted.
    ensure!(logs.get("loss").is_some_and(f64::is_finite), "{logs:?}");
    ensure!(logs.get("skipped_steps") == Some(1.0), "{logs:?}");
    ensure!(
        values(&m.get_weights()?)? == before,
        "the skipped step changed the weights"
    );
    ensure!(
        m.loss_scale()? == Some(2f64.powi(39)),
        "{:?}",
        m.loss_scale()?
    );

    // Through fit: the scale comes down until the gradients fit, and training goes on.
    let (_, logs) = train(&mut m, 1)?;
    let scale = logs.get("loss_scale").unwrap_or(f64::NAN);
    eprintln!("after one epoch from 2^40: loss scale 2^{}", scale.log2());
    ensure!(scale <= 2f64.powi(20) && scale >= 1.0, "{scale}");
    ensure!(logs.get("loss").is_some_and(f64::is_finite), "{logs:?}");
    // Each halving was a skipped step: from 2^39 to the scale reached.
    let halvings = 39.0 - scale.log2();
    ensure!(logs.get("skipped_steps") == Some(halvings), "{logs:?}");

    // The scale is part of the training state.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("state.safetensors");
    m.save(&path)?;
    let mut fresh = model(DTypePolicy::mixed_float16(), ComputePath::DeviceGeneric)?;
    fresh.load(&path)?;
    ensure!(fresh.loss_scale()? == Some(scale));
    Ok(())
}

#[test]
fn bfloat16_says_what_the_cpu_cannot_run() -> Result<()> {
    match model(DTypePolicy::mixed_bfloat16(), ComputePath::DeviceGeneric) {
        Ok(mut m) => {
            // candle runs bfloat16 here: it trains.
            let (accuracy, _) = train(&mut m, 3)?;
            eprintln!("mixed_bfloat16, device-generic: test accuracy {accuracy:.4}");
            ensure!(accuracy >= 0.9, "{accuracy}");
        }
        Err(e) => {
            let e = e.to_string();
            eprintln!("{e}");
            ensure!(e.contains("mixed_bfloat16") && e.contains("BF16"), "{e}");
            ensure!(
                e.contains("conv2d") || e.contains("matmul"),
                "names the op: {e}"
            );
            ensure!(!e.contains('\n'), "one line: {e}");
        }
    }
    Ok(())
}

/// Weights move between policies: a float32 model's file loads into a mixed_float16 model
/// (whose loss scale keeps its value) and the reverse (the loss scale is left out).
#[test]
fn weights_move_between_policies() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (single, mixed) = (
        dir.path().join("f32.safetensors"),
        dir.path().join("f16.safetensors"),
    );
    let plain = model(DTypePolicy::float32(), ComputePath::Auto)?;
    plain.save_weights(&single)?;
    let mut half = model(DTypePolicy::mixed_float16(), ComputePath::Auto)?.with_seed(9)?;
    half.load_weights(&single)?;
    ensure!(values(&half.get_weights()?)? == values(&plain.get_weights()?)?);
    ensure!(half.loss_scale()? == Some(32768.0));
    half.save_weights(&mixed)?;
    let mut back = model(DTypePolicy::float32(), ComputePath::Auto)?.with_seed(9)?;
    back.load_weights(&mixed)?;
    ensure!(values(&back.get_weights()?)? == values(&plain.get_weights()?)?);
    ensure!(!back.get_weights()?.contains_key("loss_scale"));
    Ok(())
}
