//! `ParameterServerStrategy` across real processes: each test launches
//! `mpirun -n W+P kandle-ps-check ...` (the program in `src/bin/ps_check.rs`, which every rank
//! runs, workers and servers alike) and checks what it did: synchronous training gives one
//! device's weights with 1 and 2 servers and a short last batch; asynchronous training learns
//! digits; the staleness bound holds under a slow worker; bad configurations are clear errors
//! when the model is built; a stalled or dead worker or server is named within the timeout.
//!
//! Needs Open MPI's `mpirun` on the `PATH` (`.ci/mpi-tests.sh` runs these). Every launch runs
//! under a deadline and is killed past it.

#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kandle_testing::strategies as support;
use support::equivalence_run::{self, SAMPLES};
use support::launch::{
    self, bound, lock, run, signal_after, stalled_run, Outcome, TIMEOUT_SECS, WORKER_1_FAILS,
};
use support::{assert_resumed_as_uninterrupted, one_device_reference};

const PROGRAM: &str = env!("CARGO_BIN_EXE_kandle-ps-check");

/// `mpirun -n <ranks> kandle-ps-check <args>`.
fn mpirun(ranks: usize, args: &[&str]) -> Command {
    launch::mpirun(PROGRAM, ranks, args)
}

// ---- synchronous equivalence ---------------------------------------------------------------

/// 470 samples at a global batch of 24: 19 full steps and a short one of 14, split over the
/// workers; the servers sum the workers' buffers and divide by the global sample count. With
/// gradient accumulation, a worker pushes once per group of micro-batches.
#[test]
fn synchronous_training_gives_one_devices_weights_with_one_and_two_servers() -> anyhow::Result<()> {
    let plain = one_device_reference(equivalence_run::plain_cnn, SAMPLES)?;
    let graph = one_device_reference(equivalence_run::three_in_two_out, SAMPLES)?;
    let dir = tempfile::tempdir()?;
    let _one = lock();
    // The same updates in micro-batches of a third, gradients accumulated over 3; and under
    // mixed_float16, whose loss scale each worker keeps (the kernels stay float32).
    let accumulating: &[&str] = &["--accumulate", "3"];
    let mixed: &[&str] = &["--dtype-policy", "mixed_float16"];
    for (ranks, servers, model, extra, what) in [
        (3, "1", "plain", &[][..], "2 workers, 1 server"),
        (
            3,
            "1",
            "plain",
            accumulating,
            "2 workers, 1 server, accumulating 3",
        ),
        (3, "1", "plain", mixed, "2 workers, 1 server, mixed_float16"),
        (4, "2", "plain", &[], "2 workers, 2 servers"),
        (4, "1", "plain", &[], "3 workers, 1 server"),
        (
            4,
            "2",
            "three-in-two-out",
            &[],
            "two inputs and outputs, 2 workers, 2 servers",
        ),
    ] {
        let reference = if model == "plain" { &plain } else { &graph };
        let out = dir
            .path()
            .join(format!("{}.safetensors", what.replace([' ', ','], "_")));
        let out_arg = out.to_string_lossy().to_string();
        let mut args = vec![
            "--sync",
            "--num-ps",
            servers,
            "--timeout-secs",
            "20",
            "equivalence",
            "--out",
            &out_arg,
            "--model",
            model,
        ];
        args.extend(extra);
        let outcome = run(mpirun(ranks, &args))?;
        assert!(outcome.status.success(), "{what}:\n{}", outcome.output);
        reference.assert_matches(&kandle::checkpoint::load(&out)?, what)?;
        // Every server ends the fit holding the whole model, the other servers' variables too.
        let workers = ranks - servers.parse::<usize>()?;
        for rank in workers..ranks {
            let held = PathBuf::from(format!("{out_arg}.rank{rank}"));
            let what = format!("{what}: the weights rank {rank} (a server) holds");
            reference.assert_matches(&kandle::checkpoint::load(&held)?, &what)?;
        }
    }
    Ok(())
}

// ---- asynchronous training -----------------------------------------------------------------

/// The line `rank 0/N test accuracy A ...` and its accuracy.
fn accuracy(outcome: &Outcome) -> anyhow::Result<(String, f64)> {
    let line = outcome
        .output
        .lines()
        .find(|l| l.starts_with("rank 0/") && l.contains(" test accuracy "))
        .ok_or_else(|| anyhow::anyhow!("no accuracy line:\n{}", outcome.output))?;
    let accuracy = line
        .split_whitespace()
        .nth(4)
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("cannot read `{line}`"))?;
    Ok((line.to_string(), accuracy))
}

#[test]
fn two_asynchronous_workers_and_a_server_learn_digits() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = run(mpirun(3, &["digits", "--min-accuracy", "0.97"]))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    let (line, accuracy) = accuracy(&outcome)?;
    assert!(accuracy >= 0.97, "{line}");
    // The epochs log the staleness of the asynchronous updates.
    assert!(
        outcome.output.contains("staleness_max"),
        "{}",
        outcome.output
    );
    eprintln!("{line} ({:.1} s in all)", outcome.elapsed.as_secs_f64());
    Ok(())
}

/// The largest `staleness max` the chief printed over the epochs of a `staleness` run.
fn max_staleness(outcome: &Outcome) -> anyhow::Result<f64> {
    let values: Vec<f64> = outcome
        .output
        .lines()
        .filter(|l| l.starts_with("rank 0/") && l.contains(" staleness mean "))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse().ok()))
        .collect();
    anyhow::ensure!(!values.is_empty(), "no staleness line:\n{}", outcome.output);
    Ok(values.into_iter().fold(0.0, f64::max))
}

/// Asserts that each of `workers` printed its epochs' losses (`rank R/N epoch E loss L`), and
/// that they agree: an asynchronous worker's epoch logs cover every worker's steps.
fn assert_epoch_logs_agree(outcome: &Outcome, workers: usize) -> anyhow::Result<()> {
    let losses = |rank: usize| -> Vec<String> {
        let prefix = format!("rank {rank}/");
        outcome
            .output
            .lines()
            .filter(|l| l.starts_with(&prefix) && l.contains(" epoch ") && l.contains(" loss "))
            .filter_map(|l| l.split_once(" epoch ").map(|(_, rest)| rest.to_string()))
            .collect()
    };
    let chief = losses(0);
    anyhow::ensure!(
        !chief.is_empty(),
        "no epoch loss lines:\n{}",
        outcome.output
    );
    for rank in 1..workers {
        assert_eq!(losses(rank), chief, "worker {rank}:\n{}", outcome.output);
    }
    Ok(())
}

/// Every worker sleeps 30 ms before each step (a stand-in for computation) and worker 1
/// 120 ms, while the three train asynchronously on one server: without a bound, worker 1's
/// updates land several updates late; with `--max-staleness 2` none is more than 2 late.
/// With 1 and with 2 servers (each applies every push to its own shard, so each bounds the
/// staleness of its own updates). Every worker's epoch logs agree though each trained on its
/// own batches.
#[test]
fn the_staleness_bound_holds_under_a_slow_worker() -> anyhow::Result<()> {
    let _one = lock();
    for servers in ["1", "2"] {
        let ranks = 3 + servers.parse::<usize>()?;
        let slow = [
            "--num-ps",
            servers,
            "staleness",
            "--compute-ms",
            "30",
            "--slow-worker",
            "1",
            "--slow-ms",
            "120",
        ];
        let free = run(mpirun(ranks, &slow))?;
        assert!(free.status.success(), "{}", free.output);
        assert_epoch_logs_agree(&free, 3)?;
        let unbounded = max_staleness(&free)?;
        let mut args = vec!["--max-staleness", "2"];
        args.extend(slow);
        let bounded = run(mpirun(ranks, &args))?;
        assert!(bounded.status.success(), "{}", bounded.output);
        let within = max_staleness(&bounded)?;
        eprintln!(
            "{servers} server(s): max staleness {unbounded} without a bound, {within} with \
             --max-staleness 2"
        );
        assert!(unbounded > 2.0, "{}", free.output);
        assert!(within <= 2.0, "{}", bounded.output);
    }
    Ok(())
}

// ---- backup and restore --------------------------------------------------------------------

/// `kandle-ps-check --sync --num-ps 2 backup --dir DIR --out OUT`, pausing after each step so
/// that a test can kill the job mid-epoch.
fn backup_run(dir: &Path, out: &Path) -> Command {
    let (dir, out) = (dir.to_string_lossy(), out.to_string_lossy());
    mpirun(
        4,
        &[
            "--sync",
            "--num-ps",
            "2",
            "--timeout-secs",
            "20",
            "backup",
            "--dir",
            &dir,
            "--out",
            &out,
            "--epochs",
            "2",
            "--step-millis",
            "20",
        ],
    )
}

/// A synchronous job of 2 workers and 2 servers with `BackupAndRestore`, its chief SIGKILLed
/// mid-epoch after a backup: the backup holds the servers' optimizer state (gathered from both
/// during `fit`), the job run again resumes (the workers agree through server 0 on what they
/// found, and each server loads its part) and ends within 1e-5 of an uninterrupted job.
#[test]
fn a_killed_job_resumes_from_the_servers_state_and_ends_as_an_uninterrupted_one(
) -> anyhow::Result<()> {
    let _one = lock();
    let tmp = tempfile::tempdir()?;
    let (plain, resumed) = (tmp.path().join("plain"), tmp.path().join("resumed"));
    let plain_out = tmp.path().join("plain.safetensors");
    let out = tmp.path().join("resumed.safetensors");
    let outcome = run(backup_run(&plain, &plain_out))?;
    assert!(outcome.status.success(), "{}", outcome.output);

    let backup = resumed.join("backup.safetensors");
    let chief = "rank 0/4 ";
    let killed = signal_after(
        backup_run(&resumed, &out),
        chief,
        "rank 0/4 finished step 10",
        "-KILL",
    )?;
    assert!(!killed.status.success(), "{}", killed.output);
    assert!(backup.is_file(), "no backup after 10 steps");
    assert!(!out.exists(), "the killed job finished anyway");
    let state = kandle::training_state::TrainingState::load(&backup)?;
    assert!(
        !state.optimizer.slots.is_empty() && state.optimizer.scalars.contains_key("step"),
        "the backup holds no optimizer state: {:?}",
        state.optimizer.scalars
    );

    let outcome = run(backup_run(&resumed, &out))?;
    assert_resumed_as_uninterrupted(&outcome, &backup, &plain_out, &out, 1e-5)
}

/// The same synchronous job, its worker 1 (not the chief) sent SIGTERM mid-epoch: both
/// workers stop after the same step, the chief writes one backup there (with the servers'
/// state), and the job run again resumes and ends within 1e-5 of an uninterrupted job.
#[test]
fn a_preempted_job_stops_as_a_whole_and_resumes_as_an_uninterrupted_one() -> anyhow::Result<()> {
    let _one = lock();
    let tmp = tempfile::tempdir()?;
    let (plain, resumed) = (tmp.path().join("plain"), tmp.path().join("resumed"));
    let plain_out = tmp.path().join("plain.safetensors");
    let out = tmp.path().join("resumed.safetensors");
    let outcome = run(backup_run(&plain, &plain_out))?;
    assert!(outcome.status.success(), "{}", outcome.output);

    let backup = resumed.join("backup.safetensors");
    let stopped = signal_after(
        backup_run(&resumed, &out),
        "rank 1/4 ",
        "rank 1/4 finished step 6",
        "-TERM",
    )?;
    assert!(!stopped.status.success(), "{}", stopped.output);
    let place = |rank: usize| stopped.stopped_at(&format!("rank {rank}/4"));
    assert!(
        place(0).is_some() && place(0) == place(1),
        "{}",
        stopped.output
    );
    assert!(backup.is_file(), "no backup at the preemption");
    assert!(!out.exists(), "the stopped job finished anyway");

    let outcome = run(backup_run(&resumed, &out))?;
    assert_resumed_as_uninterrupted(&outcome, &backup, &plain_out, &out, 1e-5)
}

// ---- bad configurations --------------------------------------------------------------------

/// The error lines of a failed launch: `rank R/N: ...`.
fn errors(outcome: &Outcome) -> Vec<String> {
    outcome
        .output
        .lines()
        .filter_map(|l| l.strip_prefix("kandle-ps-check: ").map(str::to_string))
        .collect()
}

#[test]
fn a_mismatched_model_on_a_worker_is_a_clear_error() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = run(mpirun(3, &["--timeout-secs", "20", "mismatch"]))?;
    assert!(!outcome.status.success(), "{}", outcome.output);
    let errors = errors(&outcome);
    assert!(
        errors
            .iter()
            .any(|l| l
                .contains(": worker 1: built a model that differs from the parameter servers'")),
        "{}",
        outcome.output
    );
    Ok(())
}

#[test]
fn servers_without_a_worker_or_more_servers_than_variables_are_clear_errors() -> anyhow::Result<()>
{
    let _one = lock();
    let outcome = run(mpirun(
        2,
        &["--num-ps", "2", "--timeout-secs", "20", "mismatch"],
    ))?;
    outcome.assert_failed_with("with 2 parameter server(s) leaves no worker");
    // The digits CNN has 8 variables.
    let outcome = run(mpirun(
        10,
        &["--num-ps", "9", "--timeout-secs", "20", "mismatch"],
    ))?;
    outcome.assert_failed_with("9 parameter servers for a model of 8 variable(s)");
    Ok(())
}

// ---- failures ------------------------------------------------------------------------------

#[test]
fn a_stalled_worker_is_named_within_the_timeout() -> anyhow::Result<()> {
    let want =
        format!("worker 1: sent nothing to parameter server 0 (rank 2) for {TIMEOUT_SECS} s");
    stalled_run(|args| mpirun(3, args), (1, 3), &want, 1)?;
    Ok(())
}

/// A worker whose `fit` fails with its own error (a callback's, here) tells the servers as it
/// leaves the call: every rank fails at once naming it, long before the 60 s timeout, and the
/// worker's own error is printed.
#[test]
fn a_worker_that_fails_ends_the_job_at_once_naming_it() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = run(mpirun(3, &WORKER_1_FAILS))?;
    outcome.assert_failed_with(
        "worker 1: left call 1 of fit/evaluate/predict with an error (its own message says which)",
    );
    outcome.assert_failed_with("rank 1/3: invalid input: failing on purpose before step 4");
    outcome.assert_took_less_than(Duration::from_secs(30));
    Ok(())
}

/// Starts a long asynchronous run on 2 workers and 2 servers, waits until worker 1 has
/// finished 3 steps, sends `signal` to rank `rank`, and returns how the job ended.
fn signal_rank(rank: usize, signal: &str) -> anyhow::Result<Outcome> {
    let timeout = TIMEOUT_SECS.to_string();
    signal_after(
        mpirun(4, &["--num-ps", "2", "--timeout-secs", &timeout, "train"]),
        &format!("rank {rank}/4 "),
        "rank 1/4 finished step 3",
        signal,
    )
}

#[test]
fn a_stopped_worker_is_named_within_the_timeout() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = signal_rank(1, "-STOP")?;
    // A server waiting for the worker's next push names it as silent; one whose reply the
    // stopped worker never takes aborts the job naming it. Which comes first is a race.
    outcome.assert_failed_with_one_of(&[
        "worker 1: sent nothing to parameter server",
        "worker 1 did not take a parameter-server message",
    ]);
    outcome.assert_took_less_than(bound(1) + Duration::from_secs(10));
    Ok(())
}

#[test]
fn a_stopped_server_is_named_within_twice_the_timeout() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = signal_rank(3, "-STOP")?;
    // A push the stopped server has not taken cannot be cancelled (the job is aborted, naming
    // it); one it took but did not answer fails the step.
    outcome.assert_failed_with_one_of(&[
        "parameter server 1 (rank 3): did not answer",
        "parameter server 1 (rank 3): did not take",
    ]);
    outcome.assert_took_less_than(bound(2) + Duration::from_secs(10));
    Ok(())
}

#[test]
fn a_killed_worker_or_server_ends_the_job_naming_it() -> anyhow::Result<()> {
    let _one = lock();
    for rank in [1, 3] {
        let outcome = signal_rank(rank, "-KILL")?;
        // mpirun notices the death at once and ends the job, naming the rank.
        assert!(!outcome.status.success(), "{}", outcome.output);
        assert!(
            outcome.output.contains(&format!("rank {rank}")) && outcome.output.contains("signal 9"),
            "{}",
            outcome.output
        );
        outcome.assert_took_less_than(bound(1) + Duration::from_secs(10));
    }
    Ok(())
}
