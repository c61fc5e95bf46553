//! A training state saved under an MPI strategy resumes there: K steps, `Model::save` with every
//! process taking part, `Model::load` on every process into a fresh model, M more steps, and the
//! weights match K + M uninterrupted steps on one device within ten times the float32 spread of
//! the same steps with each batch reversed. Needs Open MPI's `mpirun` (`.ci/mpi-tests.sh`).

#![cfg(feature = "mpi")]

use kandle::params::Weights;
use kandle::prelude::*;
use kandle_testing::strategies as support;
use support::equivalence_run::plain_cnn;

/// The steps before the save.
const K: usize = 6;
/// The steps after the load.
const M: usize = 6;

/// The worker programs' `resume` task under `mpirun -n <ranks>`: 6 `train_on_batch` steps,
/// `Model::save` with every process taking part, `Model::load` on every process into a fresh
/// model, 6 more steps; returns the final weights, to compare with one device's.
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
#[test]
fn multi_worker_saves_on_the_chief_and_resumes_on_every_worker() -> anyhow::Result<()> {
    let weights = resume_under_mpirun(env!("CARGO_BIN_EXE_kandle-mpi-check"), 2, &[])?;
    let reference = support::uninterrupted(plain_cnn, Sgd::new(0.05).momentum(0.9), K + M)?;
    reference.assert_matches(&weights, "multi-worker x2 save -> load")?;
    Ok(())
}

/// Under synchronous `ParameterServerStrategy` the optimizer state lives on the servers:
/// `Model::save` gathers it from them (every rank takes part), `Model::load` gives each server
/// its part back, and training continues as one device's does, with 1 and 2 servers. Needs
/// Open MPI's `mpirun`.
#[test]
fn parameter_servers_save_and_resume_their_optimizer_state() -> anyhow::Result<()> {
    let reference = support::uninterrupted(plain_cnn, Sgd::new(0.05).momentum(0.9), K + M)?;
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
