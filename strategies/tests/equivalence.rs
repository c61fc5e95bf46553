//! Every strategy trains as one device does at the same global batch: after 20 steps (the last
//! one short) the weights match `OneDeviceStrategy` within 1e-5, relative to each tensor's scale.

use kandle::params::Weights;
use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, CrossDeviceOps, MirroredStrategy};

mod support;
use support::assert_close;

/// 470 samples at a global batch of 24: 19 full steps and a short one of 14.
const SAMPLES: usize = 470;
const GLOBAL_BATCH: usize = 24;

fn plain_cnn() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(6, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(MaxPooling2D::new(2))
        .add(Flatten)
        .add(Dense::new(16))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

/// Biases directly before a batch norm have a zero gradient in exact arithmetic, so they only
/// accumulate rounding noise; as usual, they are left out.
fn bn_cnn() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(6, 3).padding(Padding::Same).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10).use_bias(false))
        .add(BatchNormalization::new())
        .add(Activation::Softmax)
}

fn train<S: Strategy + Clone + 'static>(net: Sequential, strategy: &S) -> anyhow::Result<Weights> {
    let data = kandle::data::digits::load()?.subset(&(0..SAMPLES).collect::<Vec<_>>())?;
    let replicas = strategy.num_replicas_in_sync();
    assert_eq!(GLOBAL_BATCH % replicas, 0);
    let mut model = net
        .compile(
            Sgd::new(0.05).momentum(0.9),
            Loss::SparseCategoricalCrossentropy,
            [Metric::Accuracy],
            strategy,
        )?
        .with_seed(5)?;
    let history = model.fit(
        &data,
        FitOptions {
            epochs: 1,
            batch_size_per_replica: GLOBAL_BATCH / replicas,
            seed: Some(9),
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    assert!(history.last("loss").is_some_and(f64::is_finite));
    Ok(model.get_weights()?)
}

#[test]
fn mirrored_and_central_storage_match_one_device() -> anyhow::Result<()> {
    let reference = train(plain_cnn(), &OneDeviceStrategy::cpu())?;
    assert_close(
        &reference,
        &train(plain_cnn(), &MirroredStrategy::cpu(2)?)?,
        "mirrored x2",
    )?;
    assert_close(
        &reference,
        &train(plain_cnn(), &MirroredStrategy::cpu(3)?)?,
        "mirrored x3",
    )?;
    let hierarchical = MirroredStrategy::cpu(3)?.cross_device_ops(CrossDeviceOps::HierarchicalCopy);
    assert_close(
        &reference,
        &train(plain_cnn(), &hierarchical)?,
        "mirrored x3 hierarchical",
    )?;
    assert_close(
        &reference,
        &train(plain_cnn(), &CentralStorageStrategy::cpu(2)?)?,
        "central storage x2",
    )?;
    Ok(())
}

#[test]
fn sync_batch_norm_matches_one_device() -> anyhow::Result<()> {
    let reference = train(bn_cnn(), &OneDeviceStrategy::cpu())?;
    let mirrored = MirroredStrategy::cpu(2)?.sync_batch_norm(true);
    assert_close(
        &reference,
        &train(bn_cnn(), &mirrored)?,
        "mirrored x2 sync bn",
    )?;
    let mirrored3 = MirroredStrategy::cpu(3)?.sync_batch_norm(true);
    assert_close(
        &reference,
        &train(bn_cnn(), &mirrored3)?,
        "mirrored x3 sync bn",
    )?;
    let central = CentralStorageStrategy::cpu(2)?.sync_batch_norm(true);
    assert_close(
        &reference,
        &train(bn_cnn(), &central)?,
        "central storage x2 sync bn",
    )?;
    Ok(())
}
