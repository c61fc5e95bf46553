//! Every strategy trains as one device does at the same global batch: after 20 steps (the last
//! one short) the weights match `OneDeviceStrategy` within 1e-5, relative to each tensor's scale.

use kandle::params::Weights;
use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, CrossDeviceOps, MirroredStrategy};

mod support;
use support::assert_close;
use support::equivalence_run::{bn_cnn, plain_cnn, SAMPLES};

fn train<S: Strategy + Clone + 'static>(net: Sequential, strategy: &S) -> anyhow::Result<Weights> {
    let model = support::equivalence_run::train(net, strategy, SAMPLES)?;
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
