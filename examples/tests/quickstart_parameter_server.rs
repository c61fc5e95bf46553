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
    let plot = dir.path().join("quickstart.png");
    let checkpoint = dir.path().join("quickstart.safetensors");
    let state = dir.path().join("state.safetensors");
    let (plot, checkpoint, state_arg) = (
        plot.to_string_lossy().to_string(),
        checkpoint.to_string_lossy().to_string(),
        state.to_string_lossy().to_string(),
    );
    let _one = launch::lock();
    let outcome = launch::run(launch::mpirun(
        env!("CARGO_BIN_EXE_quickstart"),
        3,
        &[
            "--strategy",
            "parameter-server",
            "--plot",
            &plot,
            "--checkpoint",
            &checkpoint,
            "--save",
            &state_arg,
        ],
    ))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    let (line, accuracy) = launch::test_accuracy(&outcome.output, "final model:")?;
    eprintln!("{line} ({:.1} s in all)", outcome.elapsed.as_secs_f64());
    assert!(accuracy >= 97.0, "{line}");
    assert!(line.contains("under parameter-server"), "{line}");
    assert!(
        outcome.output.contains("staleness_max"),
        "{}",
        outcome.output
    );
    assert!(std::path::Path::new(&checkpoint).exists());
    // The server's optimizer state: a moment of every trainable variable, not all zero.
    let saved = kandle::training_state::TrainingState::load(&state)?;
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
