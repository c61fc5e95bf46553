//! A training state saved under one strategy resumes under another: K steps under the first,
//! `Model::save`, `Model::load` into a fresh model under the second, M more steps, and the
//! weights match K + M uninterrupted steps on one device within ten times the float32 spread of
//! the same steps with each batch reversed (relative to each tensor's scale), as the
//! equivalence tests ask of the strategies themselves.

use std::path::Path;

use candle_core::Tensor;
use kandle::optimizers::OptimizerConfig;
use kandle::params::Weights;
use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy};

mod support;
use support::equivalence_run::{bn_cnn, plain_cnn, Order, GLOBAL_BATCH};
use support::{assert_within, Reference};

const K: usize = 6;
const M: usize = 6;

/// Global batch `i` of digits, its samples in `order`.
fn batch(i: usize, order: Order) -> anyhow::Result<(Tensor, Tensor)> {
    let (x, y) = kandle::data::digits::load()?.to_tensors()?;
    let (x, y) = (
        x.narrow(0, i * GLOBAL_BATCH, GLOBAL_BATCH)?,
        y.narrow(0, i * GLOBAL_BATCH, GLOBAL_BATCH)?,
    );
    let at = order
        .indices(GLOBAL_BATCH, GLOBAL_BATCH)
        .into_iter()
        .map(|i| i as u32)
        .collect::<Vec<_>>();
    let at = Tensor::new(at, x.device())?;
    Ok((x.index_select(&at, 0)?, y.index_select(&at, 0)?))
}

fn model<S, O>(net: Sequential, optimizer: O, strategy: &S, seed: u64) -> anyhow::Result<Model>
where
    S: Strategy + Clone + 'static,
    O: OptimizerConfig,
{
    Ok(support::equivalence_run::compile(
        net, optimizer, strategy, seed,
    )?)
}

fn train(model: &mut Model, steps: std::ops::Range<usize>) -> anyhow::Result<()> {
    train_in(model, steps, Order::Fixed)
}

fn train_in(model: &mut Model, steps: std::ops::Range<usize>, order: Order) -> anyhow::Result<()> {
    for i in steps {
        let (x, y) = batch(i, order)?;
        model.train_on_batch(&x, &y, None)?;
    }
    Ok(())
}

/// K + M steps on one device, with the spread of the same steps in reversed batches.
fn uninterrupted<O: OptimizerConfig + Clone>(
    net: fn() -> Sequential,
    optimizer: O,
) -> anyhow::Result<Reference> {
    let run = |order| -> anyhow::Result<Weights> {
        let mut m = model(net(), optimizer.clone(), &OneDeviceStrategy::cpu(), 5)?;
        train_in(&mut m, 0..K + M, order)?;
        Ok(m.get_weights()?)
    };
    Reference::new(run(Order::Fixed)?, &run(Order::ReversedInBatches)?)
}

/// K steps under `first`, saved, loaded under `second` into a model of other initial weights,
/// M more steps.
fn resumed<A, B, O>(
    net: fn() -> Sequential,
    optimizer: O,
    first: &A,
    second: &B,
    path: &Path,
) -> anyhow::Result<Weights>
where
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

#[test]
fn sync_batch_norm_resumes_across_strategies() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("state.safetensors");
    let sgd = Sgd::new(0.05).momentum(0.9);
    let reference = uninterrupted(bn_cnn, sgd)?;
    let one = OneDeviceStrategy::cpu();
    let mirrored = MirroredStrategy::cpu(2)?.sync_batch_norm(true);
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

/// The worker programs' `resume` task under `mpirun -n <ranks>`: 6 `train_on_batch` steps,
/// `Model::save` with every process taking part, `Model::load` on every process into a fresh
/// model, 6 more steps; returns the final weights, to compare with one device's.
#[cfg(feature = "mpi")]
fn resume_under_mpirun(program: &str, ranks: usize, options: &[&str]) -> anyhow::Result<Weights> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state.safetensors");
    let out = dir.path().join("weights.safetensors");
    let (state_arg, out_arg) = (state.to_string_lossy(), out.to_string_lossy());
    let mut args = options.to_vec();
    args.extend(["resume", "--state", &state_arg, "--out", &out_arg]);
    let _one = support::launch::lock();
    let outcome = support::launch::run(support::launch::mpirun(program, ranks, &args))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    // The worker programs' steps: 6 before the save and 6 after, as K and M here.
    assert_eq!((K, M), (6, 6));
    Ok(kandle::checkpoint::load(&out)?)
}

/// Under `MultiWorkerMirroredStrategy` (2 workers launched by `mpirun`) the chief saves, every
/// worker loads, and training continues as one device's does. Needs Open MPI's `mpirun`.
#[cfg(feature = "mpi")]
#[test]
fn multi_worker_saves_on_the_chief_and_resumes_on_every_worker() -> anyhow::Result<()> {
    let weights = resume_under_mpirun(env!("CARGO_BIN_EXE_kandle-mpi-check"), 2, &[])?;
    let reference = uninterrupted(plain_cnn, Sgd::new(0.05).momentum(0.9))?;
    reference.assert_matches(&weights, "multi-worker x2 save -> load")?;
    Ok(())
}

/// Under synchronous `ParameterServerStrategy` the optimizer state lives on the servers:
/// `Model::save` gathers it from them (every rank takes part), `Model::load` gives each server
/// its part back, and training continues as one device's does, with 1 and 2 servers. Needs
/// Open MPI's `mpirun`.
#[cfg(feature = "mpi")]
#[test]
fn parameter_servers_save_and_resume_their_optimizer_state() -> anyhow::Result<()> {
    let reference = uninterrupted(plain_cnn, Sgd::new(0.05).momentum(0.9))?;
    for (ranks, servers, what) in [
        (3, "1", "2 workers, 1 server"),
        (4, "2", "2 workers, 2 servers"),
    ] {
        let options = ["--sync", "--num-ps", servers, "--timeout-secs", "20"];
        let weights = resume_under_mpirun(env!("CARGO_BIN_EXE_kandle-ps-check"), ranks, &options)?;
        reference.assert_matches(&weights, &format!("{what}: save -> load"))?;
    }
    Ok(())
}
