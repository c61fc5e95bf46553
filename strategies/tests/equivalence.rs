//! Every strategy trains as one device does at the same global batch: after 20 steps (the last
//! one short) the weights match `OneDeviceStrategy` within ten times the float32 spread of the
//! same run with each batch's samples reversed, relative to each tensor's scale. So does the
//! device-generic path (what CUDA runs) against the CPU kernels, max pooling's ties included.

use kandle::params::Weights;
use kandle::prelude::*;
use kandle::ComputePath;
use kandle_strategies::{CentralStorageStrategy, CrossDeviceOps, MirroredStrategy, ReplicaOptions};

use kandle_testing::strategies as support;
use support::equivalence_run::{
    bn_cnn, graph_cnn, plain_cnn, three_in_two_out, train_on, Order, SAMPLES,
};
use support::one_device_reference;

fn train<S: Strategy + Clone + 'static>(
    net: impl Into<kandle::Network>,
    strategy: &S,
) -> anyhow::Result<Weights> {
    let model = support::equivalence_run::train(net, strategy, SAMPLES)?;
    Ok(model.get_weights()?)
}

#[test]
fn mirrored_and_central_storage_match_one_device() -> anyhow::Result<()> {
    let reference = one_device_reference(plain_cnn, SAMPLES)?;
    reference.assert_matches(
        &train(plain_cnn(), &MirroredStrategy::cpu(2)?)?,
        "mirrored x2",
    )?;
    reference.assert_matches(
        &train(plain_cnn(), &MirroredStrategy::cpu(3)?)?,
        "mirrored x3",
    )?;
    let hierarchical = MirroredStrategy::cpu(3)?.cross_device_ops(CrossDeviceOps::HierarchicalCopy);
    reference.assert_matches(
        &train(plain_cnn(), &hierarchical)?,
        "mirrored x3 hierarchical",
    )?;
    reference.assert_matches(
        &train(plain_cnn(), &CentralStorageStrategy::cpu(2)?)?,
        "central storage x2",
    )?;
    Ok(())
}

/// A functional model with a residual sum, a convolution shared by two calls and a
/// concatenation.
#[test]
fn a_functional_model_matches_one_device() -> anyhow::Result<()> {
    let reference = one_device_reference(graph_cnn, SAMPLES)?;
    reference.assert_matches(
        &train(graph_cnn(), &MirroredStrategy::cpu(2)?)?,
        "functional model, mirrored x2",
    )?;
    reference.assert_matches(
        &train(graph_cnn(), &CentralStorageStrategy::cpu(2)?)?,
        "functional model, central storage x2",
    )?;
    let generic = train_on(
        graph_cnn(),
        &OneDeviceStrategy::cpu(),
        SAMPLES,
        Some(ComputePath::DeviceGeneric),
        Order::Fixed,
    )?;
    reference.assert_matches(
        &generic.get_weights()?,
        "functional model, device-generic path",
    )?;
    Ok(())
}

/// A model of two inputs and two outputs (per-output losses, a loss weight, a shared layer
/// and a residual sum), with a short last batch.
#[test]
fn a_two_input_two_output_model_matches_one_device() -> anyhow::Result<()> {
    let reference = one_device_reference(three_in_two_out, SAMPLES)?;
    reference.assert_matches(
        &train(three_in_two_out(), &MirroredStrategy::cpu(2)?)?,
        "two inputs and outputs, mirrored x2",
    )?;
    reference.assert_matches(
        &train(three_in_two_out(), &CentralStorageStrategy::cpu(2)?)?,
        "two inputs and outputs, central storage x2",
    )?;
    Ok(())
}

#[test]
fn sync_batch_norm_matches_one_device() -> anyhow::Result<()> {
    let reference = one_device_reference(bn_cnn, SAMPLES)?;
    let synced = ReplicaOptions::default().sync_batch_norm(true);
    let mirrored = MirroredStrategy::cpu(2)?.with_options(synced);
    reference.assert_matches(&train(bn_cnn(), &mirrored)?, "mirrored x2 sync bn")?;
    let mirrored3 = MirroredStrategy::cpu(3)?.with_options(synced);
    reference.assert_matches(&train(bn_cnn(), &mirrored3)?, "mirrored x3 sync bn")?;
    let central = CentralStorageStrategy::cpu(2)?.with_options(synced);
    reference.assert_matches(&train(bn_cnn(), &central)?, "central storage x2 sync bn")?;
    Ok(())
}

/// The device-generic path (candle's ops and autograd, as on CUDA) trains as the CPU kernels do.
/// The digits' flat regions tie many maxima in each pooling window: both paths send the gradient
/// to the first one (candle's own `maximum` would split it, and 20 steps then differ by 13%).
#[test]
fn device_generic_path_trains_as_the_kernels() -> anyhow::Result<()> {
    let cpu = OneDeviceStrategy::cpu();
    for (name, net) in [
        ("plain", plain_cnn as fn() -> Sequential),
        ("batch norm", bn_cnn),
    ] {
        let run = |path, order| -> anyhow::Result<Weights> {
            Ok(train_on(net(), &cpu, SAMPLES, Some(path), order)?.get_weights()?)
        };
        let kernels = support::Reference::new(
            run(ComputePath::Auto, Order::Fixed)?,
            &run(ComputePath::Auto, Order::ReversedInBatches)?,
        )?;
        kernels.assert_matches(
            &run(ComputePath::DeviceGeneric, Order::Fixed)?,
            &format!("{name}: device-generic vs kernels"),
        )?;
    }
    Ok(())
}
