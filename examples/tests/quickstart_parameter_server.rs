//! `mpirun -n 3 quickstart --strategy parameter-server`: two asynchronous workers and one
//! parameter server reach at least 97% test accuracy on digits, the epochs log the staleness
//! of the updates, and `--save` writes the final training state with the optimizer state the
//! server kept. Needs Open MPI's `mpirun` and the `mpi` feature
//! (`.ci/mpi-tests.sh` runs it); the launch runs under a deadline and is killed past it.

#![cfg(feature = "mpi")]

use kandle_testing::launch;

#[test]
fn quickstart_reaches_97_percent_with_asynchronous_parameter_servers() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let run = launch::train_under_mpirun(
        env!("CARGO_BIN_EXE_quickstart"),
        3,
        &["--strategy", "parameter-server"],
        dir.path(),
    )?;
    let outcome = run.outcome;
    let (line, accuracy) = launch::test_accuracy(&outcome.output, "final model:")?;
    eprintln!("{line} ({:.1} s in all)", outcome.elapsed.as_secs_f64());
    assert!(accuracy >= 97.0, "{line}");
    assert!(line.contains("under parameter-server"), "{line}");
    assert!(
        outcome.output.contains("staleness_max"),
        "{}",
        outcome.output
    );
    assert!(run.checkpoint.exists());
    // The server's optimizer state: a moment of every trainable variable, not all zero.
    let saved = kandle::training_state::TrainingState::load(&run.state)?;
    let trainable = saved
        .weights
        .keys()
        .filter(|k| k.ends_with(".weight"))
        .count();
    anyhow::ensure!(trainable > 0, "no weights in the state");
    anyhow::ensure!(!saved.optimizer.slots.is_empty(), "no optimizer state");
    for (slot, tensors) in &saved.optimizer.slots {
        for name in saved.weights.keys().filter(|k| k.ends_with(".weight")) {
            let t = tensors
                .get(name)
                .ok_or_else(|| anyhow::anyhow!("slot `{slot}` misses `{name}`"))?;
            let magnitude = t.abs()?.sum_all()?.to_scalar::<f32>()?;
            anyhow::ensure!(magnitude > 0.0, "slot `{slot}` of `{name}` is all zero");
        }
    }
    Ok(())
}
