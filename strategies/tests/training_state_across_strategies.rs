//! A training state saved under one strategy resumes under another: K steps under the first,
//! `Model::save`, `Model::load` into a fresh model under the second, M more steps, and the
//! weights match K + M uninterrupted steps on one device within ten times the float32 spread of
//! the same steps with each batch reversed (relative to each tensor's scale), as the
//! equivalence tests ask of the strategies themselves.

use std::path::Path;

use kandle::optimizers::OptimizerConfig;
use kandle::params::Weights;
use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy, ReplicaOptions};

use kandle_testing::strategies as support;
use support::equivalence_run::{bn_cnn, graph_cnn, plain_cnn, Order};
use support::{assert_within, Reference};

const K: usize = 6;
const M: usize = 6;

fn model<S, O>(
    net: impl Into<kandle::Network>,
    optimizer: O,
    strategy: &S,
    seed: u64,
) -> anyhow::Result<Model>
where
    S: Strategy + Clone + 'static,
    O: OptimizerConfig,
{
    Ok(support::equivalence_run::compile(
        net, optimizer, strategy, seed,
    )?)
}

fn train(model: &mut Model, steps: std::ops::Range<usize>) -> anyhow::Result<()> {
    support::train_steps(model, steps, Order::Fixed)
}

/// K + M steps on one device, with the spread of the same steps in reversed batches.
fn uninterrupted<N: Into<kandle::Network>, O: OptimizerConfig + Clone>(
    net: fn() -> N,
    optimizer: O,
) -> anyhow::Result<Reference> {
    support::uninterrupted(net, optimizer, K + M)
}

/// K steps under `first`, saved, loaded under `second` into a model of other initial weights,
/// M more steps.
fn resumed<N, A, B, O>(
    net: fn() -> N,
    optimizer: O,
    first: &A,
    second: &B,
    path: &Path,
) -> anyhow::Result<Weights>
where
    N: Into<kandle::Network>,
    A: Strategy + Clone + 'static,
    B: Strategy + Clone + 'static,
    O: OptimizerConfig + Clone,
{
    let mut before = model(net(), optimizer.clone(), first, 5)?;
    train(&mut before, 0..K)?;
    before.save(path)?;
    drop(before);
    let mut after = model(net(), optimizer, second, 6)?;
    after.load(path)?;
    train(&mut after, K..K + M)?;
    Ok(after.get_weights()?)
}

#[test]
fn mirrored_and_one_device_resume_each_other() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let sgd = Sgd::new(0.05).momentum(0.9);
    let reference = uninterrupted(plain_cnn, sgd)?;
    let one = OneDeviceStrategy::cpu();
    let mirrored = MirroredStrategy::cpu(2)?;
    let central = CentralStorageStrategy::cpu(2)?;
    let path = dir.path().join("state.safetensors");
    reference.assert_matches(
        &resumed(plain_cnn, sgd, &mirrored, &one, &path)?,
        "mirrored x2 -> one device",
    )?;
    reference.assert_matches(
        &resumed(plain_cnn, sgd, &one, &mirrored, &path)?,
        "one device -> mirrored x2",
    )?;
    reference.assert_matches(
        &resumed(plain_cnn, sgd, &central, &mirrored, &path)?,
        "central storage x2 -> mirrored x2",
    )?;
    reference.assert_matches(
        &resumed(plain_cnn, sgd, &mirrored, &central, &path)?,
        "mirrored x2 -> central storage x2",
    )?;

    let adam = Adam::new(1e-2);
    let reference = uninterrupted(plain_cnn, adam)?;
    reference.assert_matches(
        &resumed(plain_cnn, adam, &mirrored, &one, &path)?,
        "adam: mirrored x2 -> one device",
    )?;
    reference.assert_matches(
        &resumed(plain_cnn, adam, &one, &mirrored, &path)?,
        "adam: one device -> mirrored x2",
    )?;
    Ok(())
}

/// A functional model's training state (a shared layer's variables and slots among them)
/// resumes across strategies as a `Sequential`'s does.
#[test]
fn a_functional_model_resumes_across_strategies() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let adam = Adam::new(1e-2);
    let reference = uninterrupted(graph_cnn, adam)?;
    let one = OneDeviceStrategy::cpu();
    let mirrored = MirroredStrategy::cpu(2)?;
    let path = dir.path().join("state.safetensors");
    reference.assert_matches(
        &resumed(graph_cnn, adam, &mirrored, &one, &path)?,
        "functional model, adam: mirrored x2 -> one device",
    )?;
    Ok(())
}

#[test]
fn sync_batch_norm_resumes_across_strategies() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("state.safetensors");
    let sgd = Sgd::new(0.05).momentum(0.9);
    let reference = uninterrupted(bn_cnn, sgd)?;
    let one = OneDeviceStrategy::cpu();
    let mirrored =
        MirroredStrategy::cpu(2)?.with_options(ReplicaOptions::default().sync_batch_norm(true));
    reference.assert_matches(
        &resumed(bn_cnn, sgd, &mirrored, &one, &path)?,
        "sync bn: mirrored x2 -> one device",
    )?;
    reference.assert_matches(
        &resumed(bn_cnn, sgd, &one, &mirrored, &path)?,
        "sync bn: one device -> mirrored x2",
    )?;
    Ok(())
}

#[test]
fn a_refused_state_leaves_a_mirrored_model_unchanged() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("adam.safetensors");
    let mut adam = model(plain_cnn(), Adam::new(1e-2), &OneDeviceStrategy::cpu(), 5)?;
    train(&mut adam, 0..1)?;
    adam.save(&path)?;
    let mut mirrored = model(
        plain_cnn(),
        Sgd::new(0.05).momentum(0.9),
        &MirroredStrategy::cpu(2)?,
        5,
    )?;
    train(&mut mirrored, 0..2)?;
    let before = mirrored.get_weights()?;
    let err = mirrored.load(&path).expect_err("Adam into SGD").to_string();
    assert!(err.contains("adam.safetensors"), "{err}");
    assert!(err.contains("Adam, but the model's is SGD"), "{err}");
    assert_within(
        &before,
        &mirrored.get_weights()?,
        0.0,
        "after a refused load",
    )?;
    // A state whose weights fit but whose optimizer slots do not: the replicas refuse it and the
    // weights set first are put back.
    let mut state = mirrored.training_state()?;
    let fresh = model(
        plain_cnn(),
        Sgd::new(0.05).momentum(0.9),
        &OneDeviceStrategy::cpu(),
        9,
    )?;
    state.weights = fresh.get_weights()?;
    if let Some(momentum) = state.optimizer.slots.get_mut("momentum") {
        momentum.remove("dense_2.bias");
    }
    let odd = dir.path().join("odd.safetensors");
    state.save(&odd)?;
    let err = mirrored.load(&odd).expect_err("a slot short").to_string();
    assert!(err.contains("misses `dense_2.bias`"), "{err}");
    let after = mirrored.get_weights()?;
    for (name, t) in &before {
        let same = t
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .zip(after[name].flatten_all()?.to_vec1::<f32>()?)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "`{name}` changed");
    }
    Ok(())
}
