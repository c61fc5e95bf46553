//! Mixed precision under the in-process strategies: on the CPU kernels (which stay float32)
//! `mixed_float16` trains as float32 does under Mirrored, CentralStorage and a pipeline, the
//! loss scale changing no bit; on the device-generic path (float16) an overflow skips the step
//! and halves the scale that CentralStorage's central variables hold and its replicas load, and
//! that every stage of a pipeline keeps.

use kandle::prelude::*;
use kandle::{ComputePath, DTypePolicy, LossScale};
use kandle_strategies::pipeline::{PipelineStrategy, StageSplit};
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy};

use kandle_testing::strategies as support;
use support::equivalence_run::{compile, plain_cnn, train_with, SAMPLES};
use support::one_device_reference;

#[test]
fn mixed_float16_on_the_kernels_trains_as_float32_under_every_strategy() -> anyhow::Result<()> {
    let reference = one_device_reference(plain_cnn, SAMPLES)?;
    let policy = DTypePolicy::mixed_float16();
    let one = kandle::OneDeviceStrategy::cpu();
    let mut runs = vec![(
        "one device, mixed_float16",
        train_with(plain_cnn(), &one, SAMPLES, 1, policy)?,
    )];
    let pipeline = PipelineStrategy::cpu(2)?.split(StageSplit::at(["dense_1"]));
    runs.push((
        "pipeline x2, mixed_float16",
        train_with(plain_cnn(), &pipeline, SAMPLES, 1, policy)?,
    ));
    runs.push((
        "mirrored x2, mixed_float16",
        train_with(plain_cnn(), &MirroredStrategy::cpu(2)?, SAMPLES, 1, policy)?,
    ));
    runs.push((
        "central storage x2, mixed_float16, accumulating 2",
        train_with(
            plain_cnn(),
            &CentralStorageStrategy::cpu(2)?,
            SAMPLES,
            2,
            policy,
        )?,
    ));
    for (what, mut model) in runs {
        assert_eq!(model.loss_scale()?, Some(32768.0), "{what}");
        reference.assert_matches(&model.get_weights()?, what)?;
    }
    Ok(())
}

/// On the device-generic path (float16), an overflow under `strategy` skips the step, changing
/// no weight, and halves the loss scale; steps then go on until one applies, moving the first
/// layer and the last alike.
fn an_overflow_halves_the_scale_and_training_goes_on<S: Strategy + Clone + 'static>(
    strategy: &S,
) -> anyhow::Result<()> {
    let policy = DTypePolicy::mixed_float16().with_loss_scale(Some(LossScale {
        initial: 2f64.powi(40),
        growth_steps: 2000,
    }));
    let mut model = compile(plain_cnn(), Sgd::new(0.05), strategy, 5)?
        .with_compute_path(ComputePath::DeviceGeneric)?
        .with_dtype_policy(policy)?;
    let (x, y) = kandle::data::digits::load()?.to_tensors()?;
    let before = model.get_weights()?;
    model.train_on_batch(&x.narrow(0, 0, 24)?, &y.narrow(0, 0, 24)?, None)?;
    assert_eq!(model.loss_scale()?, Some(2f64.powi(39)));
    for (name, w) in model.get_weights()? {
        if name != kandle::mixed_precision::LOSS_SCALE {
            let diff = (w - &before[&name])?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{name} changed in a skipped step");
        }
    }
    let mut applied = false;
    for step in 1..40 {
        let logs = model.train_on_batch(
            &x.narrow(0, step * 24, 24)?,
            &y.narrow(0, step * 24, 24)?,
            None,
        )?;
        assert!(logs.get("loss").is_some_and(f64::is_finite), "{logs:?}");
        let now = model.get_weights()?;
        let moved = |name: &str| -> anyhow::Result<bool> {
            Ok(now[name].flatten_all()?.to_vec1::<f32>()?
                != before[name].flatten_all()?.to_vec1::<f32>()?)
        };
        if moved("dense_2.weight")? {
            assert!(
                moved("conv2d_1.weight")?,
                "the last layer moved and the first did not"
            );
            applied = true;
            break;
        }
    }
    let scale = model.loss_scale()?.unwrap_or(f64::NAN);
    assert!(applied && scale < 2f64.powi(20), "scale {scale}");
    Ok(())
}

/// CentralStorage's replicas load the halved scale its central variables hold.
#[test]
fn central_storage_halves_the_central_loss_scale_on_an_overflow() -> anyhow::Result<()> {
    an_overflow_halves_the_scale_and_training_goes_on(&CentralStorageStrategy::cpu(2)?)
}

/// A pipeline's stages pass float16 activations and gradients; every stage skips the step and
/// halves its copy of the scale.
#[test]
fn pipeline_stages_skip_an_overflow_together() -> anyhow::Result<()> {
    let strategy = PipelineStrategy::cpu(2)?
        .micro_batches(2)
        .split(StageSplit::at(["dense_1"]));
    an_overflow_halves_the_scale_and_training_goes_on(&strategy)
}
