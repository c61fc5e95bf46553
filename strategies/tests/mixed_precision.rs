//! Mixed precision under the in-process strategies: on the CPU kernels (which stay float32)
//! `mixed_float16` trains as float32 does under Mirrored and CentralStorage, the loss scale
//! changing no bit; on the device-generic path (float16) an overflow skips the step and halves
//! the scale that CentralStorage's central variables hold and its replicas load.

use kandle::prelude::*;
use kandle::{ComputePath, DTypePolicy, LossScale};
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

#[test]
fn central_storage_halves_the_central_loss_scale_on_an_overflow() -> anyhow::Result<()> {
    let policy = DTypePolicy::mixed_float16().with_loss_scale(Some(LossScale {
        initial: 2f64.powi(40),
        growth_steps: 2000,
    }));
    let strategy = CentralStorageStrategy::cpu(2)?;
    let mut model = compile(plain_cnn(), Sgd::new(0.05), &strategy, 5)?
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
    // The replicas load the halved scale: steps go on until one applies.
    let mut applied = false;
    for step in 1..40 {
        let range = (step * 24, 24);
        let logs = model.train_on_batch(
            &x.narrow(0, range.0, range.1)?,
            &y.narrow(0, range.0, range.1)?,
            None,
        )?;
        assert!(logs.get("loss").is_some_and(f64::is_finite), "{logs:?}");
        if model.get_weights()?["dense_1.weight"].to_vec2::<f32>()?
            != before["dense_1.weight"].to_vec2::<f32>()?
        {
            applied = true;
            break;
        }
    }
    let scale = model.loss_scale()?.unwrap_or(f64::NAN);
    assert!(applied && scale < 2f64.powi(20), "scale {scale}");
    Ok(())
}
