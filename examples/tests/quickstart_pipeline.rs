//! `mpirun -n 2 quickstart --strategy pipeline`: the model cut into two stages, one per rank,
//! reaches at least 97% test accuracy on digits, the summary lists each stage's rank, and the
//! chief's checkpoint and `--save`d training state hold both stages' variables (and the
//! optimizer's state of each). Needs Open MPI's `mpirun` and the `mpi` feature
//! (`.ci/mpi-tests.sh` runs it); the launch runs under a deadline and is killed past it.

#![cfg(feature = "mpi")]

use kandle_testing::launch;

#[test]
fn quickstart_reaches_97_percent_with_a_stage_per_rank() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let run = launch::train_under_mpirun(
        env!("CARGO_BIN_EXE_quickstart"),
        2,
        &["--strategy", "pipeline", "--micro-batches", "4"],
        dir.path(),
    )?;
    let outcome = run.outcome;
    let (line, accuracy) = launch::test_accuracy(&outcome.output, "final model:")?;
    eprintln!("{line} ({:.1} s in all)", outcome.elapsed.as_secs_f64());
    assert!(accuracy >= 97.0, "{line}");
    assert!(
        outcome.output.contains("stage 1 on rank 1"),
        "{}",
        outcome.output
    );
    let weights = kandle::checkpoint::load(&run.checkpoint)?;
    for name in ["conv2d_1.weight", "dense_2.weight"] {
        assert!(weights.contains_key(name), "the checkpoint lacks {name}");
    }
    let saved = kandle::training_state::TrainingState::load(&run.state)?;
    let moments = saved
        .optimizer
        .slots
        .values()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no optimizer slot"))?;
    for name in ["conv2d_1.weight", "dense_2.weight"] {
        let moment = moments
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("the saved state lacks the moment of {name}"))?;
        let largest = moment.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(largest > 0.0, "the moment of {name} is zero");
    }
    Ok(())
}
