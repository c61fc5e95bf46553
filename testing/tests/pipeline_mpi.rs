//! `PipelineStrategy` over the ranks of an MPI job: each test launches
//! `mpirun -n N kandle-pipeline-check ...` (the program in `src/bin/pipeline_check.rs`), one
//! stage per rank, and checks what it did: the same weights as one device with 2 and 3 stages,
//! on a mesh of 2 stages x 2 replicas and with gradient accumulation, a training state saved and loaded across the stages,
//! the chief's checkpoints during `fit` gathering the other stages' weights, and real accuracy
//! on digits.
//!
//! Needs Open MPI's `mpirun` on the `PATH` (`.ci/mpi-tests.sh` runs these); every launch runs
//! under a deadline.

#![cfg(feature = "mpi")]

use std::process::Command;

use kandle_testing::strategies as support;
use support::equivalence_run::{self, SAMPLES};
use support::launch::{self, lock, run};
use support::one_device_reference;

const PROGRAM: &str = env!("CARGO_BIN_EXE_kandle-pipeline-check");

fn mpirun(ranks: usize, args: &[&str]) -> Command {
    launch::mpirun(PROGRAM, ranks, args)
}

/// The equivalence run on `ranks` ranks with `options`, against one device: within the float32
/// spread of a reordered run and 1e-5.
#[test]
fn stages_on_ranks_train_as_one_device() -> anyhow::Result<()> {
    let reference = one_device_reference(equivalence_run::plain_cnn, SAMPLES)?;
    let dir = tempfile::tempdir()?;
    let _one = lock();
    let runs: [(usize, &[&str], &str); 5] = [
        (
            2,
            &["--stage-starts", "dense_1"],
            "2 ranks, 1f1b, 4 micro-batches",
        ),
        (
            2,
            &[
                "--stage-starts",
                "dense_1",
                "--schedule",
                "gpipe",
                "--micro-batches",
                "2",
            ],
            "2 ranks, gpipe, 2 micro-batches",
        ),
        (
            3,
            &["--stage-starts", "max_pooling2d_1,dense_2"],
            "3 ranks, 1f1b, 4 micro-batches",
        ),
        (
            4,
            &["--stage-starts", "dense_1", "--replicas-per-stage", "2"],
            "4 ranks: 2 stages x 2 replicas",
        ),
        (
            2,
            &["--stage-starts", "dense_1", "--accumulate", "2"],
            "2 ranks, gradients accumulated over 2 batches",
        ),
    ];
    for (ranks, options, what) in runs {
        let out = dir
            .path()
            .join(format!("{ranks}-{}.safetensors", what.len()));
        let out_arg = out.to_string_lossy().to_string();
        let mut args = options.to_vec();
        args.extend(["equivalence", "--out", &out_arg]);
        let outcome = run(mpirun(ranks, &args))?;
        assert!(outcome.status.success(), "{what}:\n{}", outcome.output);
        let weights = kandle::checkpoint::load(&out)?;
        reference.assert_matches(&weights, what)?;
        let difference = support::relative_difference(&reference.weights, &weights)?;
        assert!(difference < 1e-5, "{what}: {difference:.2e}");
    }
    Ok(())
}

/// A training state saved by two stages (the chief gathering the other's weights and optimizer
/// state) and loaded by both trains on as one device's does.
#[test]
fn a_training_state_moves_across_the_stages() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state.safetensors");
    let out = dir.path().join("out.safetensors");
    let (state_arg, out_arg) = (
        state.to_string_lossy().to_string(),
        out.to_string_lossy().to_string(),
    );
    let _one = lock();
    let piped = run(mpirun(
        2,
        &[
            "--stage-starts",
            "dense_1",
            "resume",
            "--state",
            &state_arg,
            "--out",
            &out_arg,
        ],
    ))?;
    assert!(piped.status.success(), "{}", piped.output);
    let alone = dir.path().join("alone.safetensors");
    let alone_state = dir.path().join("alone-state.safetensors");
    let (alone_arg, alone_state_arg) = (
        alone.to_string_lossy().to_string(),
        alone_state.to_string_lossy().to_string(),
    );
    // One rank: the whole model in one stage, the same steps.
    let single = run(mpirun(
        1,
        &["resume", "--state", &alone_state_arg, "--out", &alone_arg],
    ))?;
    assert!(single.status.success(), "{}", single.output);
    let want = kandle::checkpoint::load(&alone)?;
    let got = kandle::checkpoint::load(&out)?;
    let difference = support::relative_difference(&want, &got)?;
    assert!(
        difference < 1e-5,
        "resumed across two stages: {difference:.2e}"
    );
    Ok(())
}

/// `ModelCheckpoint`, a callback of the chief alone, writes the whole model after each epoch
/// while the other stage already waits in the next: the last epoch's file is the final
/// weights, bit for bit; and the mesh of 2 x 2 learns digits.
#[test]
fn the_chief_checkpoints_every_stage_during_fit_and_a_mesh_learns_digits() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("final.safetensors");
    let (dir_arg, out_arg) = (
        dir.path().to_string_lossy().to_string(),
        out.to_string_lossy().to_string(),
    );
    let _one = lock();
    let outcome = run(mpirun(
        2,
        &["checkpoints", "--dir", &dir_arg, "--out", &out_arg],
    ))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    let last = dir.path().join("epoch_02.safetensors");
    let first = dir.path().join("epoch_01.safetensors");
    let (last, first, end) = (
        kandle::checkpoint::load(&last)?,
        kandle::checkpoint::load(&first)?,
        kandle::checkpoint::load(&out)?,
    );
    assert_eq!(support::relative_difference(&end, &last)?, 0.0);
    assert!(support::relative_difference(&end, &first)? > 0.0);

    let outcome = run(mpirun(
        4,
        &[
            "--replicas-per-stage",
            "2",
            "digits",
            "--min-accuracy",
            "0.97",
        ],
    ))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    let (line, accuracy) = launch::test_accuracy(&outcome.output, "rank 0/4 test accuracy")?;
    assert!(accuracy >= 0.97, "{line}");
    eprintln!("{line} ({:.1} s in all)", outcome.elapsed.as_secs_f64());
    Ok(())
}
