//! `MultiWorkerMirroredStrategy` across real processes: each test launches
//! `mpirun -n 2 kandle-mpi-check ...` (the worker program in `src/bin/mpi_check.rs`) and checks
//! what it did: the same weights as one device (with SyncBatchNorm across workers too), the
//! world size, clear errors when the workers disagree or NCCL cannot be used, a named error
//! within the timeout when a worker stalls or dies, and real accuracy on digits.
//!
//! Needs Open MPI's `mpirun` on the `PATH` (`.ci/mpi-tests.sh` runs these). Every launch runs
//! under a deadline and is killed past it, so a broken build can fail these tests but never
//! hang them.

#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kandle_testing::strategies as support;
use support::equivalence_run::{self, SAMPLES};
use support::launch::{
    self, bound, lock, run, signal_after, stalled_run, Outcome, TIMEOUT_SECS, WORKER_1_FAILS,
};
use support::{assert_resumed_as_uninterrupted, one_device_reference, Reference};

const WORKER: &str = env!("CARGO_BIN_EXE_kandle-mpi-check");

/// `mpirun -n <workers> kandle-mpi-check <args>`, with output captured.
fn mpirun(workers: usize, args: &[&str]) -> Command {
    launch::mpirun(WORKER, workers, args)
}

/// `kandle-mpi-check <args>` started without `mpirun`: a worker alone, a world of one.
fn alone<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Command {
    let mut cmd = Command::new(WORKER);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

// ---- equivalence ---------------------------------------------------------------------------

/// One device's [`Reference`] for the equivalence run of `model` (`plain`, `bn` or `graph`) on `samples`
/// digits, as `equivalence.rs` and the worker program's `equivalence` task run it.
fn one_device_weights(model: &str, samples: usize) -> anyhow::Result<Reference> {
    match model {
        "bn" => one_device_reference(equivalence_run::bn_cnn, samples),
        "graph" => one_device_reference(equivalence_run::graph_cnn, samples),
        "three-in-two-out" => one_device_reference(equivalence_run::three_in_two_out, samples),
        _ => one_device_reference(equivalence_run::plain_cnn, samples),
    }
}

/// Runs the worker program's `equivalence` task under `mpirun -n 2` for each of `runs`
/// (`(local replicas, extra arguments, what)`) and compares the chief's weights with
/// `reference`.
fn check_equivalence(
    reference: &Reference,
    common: &[&str],
    runs: &[(&str, &[&str], &str)],
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let _one = lock();
    for (local, extra, what) in runs {
        let out = dir
            .path()
            .join(format!("{}.safetensors", what.replace([' ', ','], "_")));
        let out_arg = out.to_string_lossy().to_string();
        let mut args = vec!["--expect-world-size", "2", "--local-replicas", local];
        args.extend(*extra);
        args.extend(["equivalence", "--out", &out_arg]);
        args.extend(common);
        let outcome = run(mpirun(2, &args))?;
        assert!(outcome.status.success(), "{what}:\n{}", outcome.output);
        reference.assert_matches(&kandle::checkpoint::load(&out)?, what)?;
    }
    Ok(())
}

#[test]
fn two_workers_train_as_one_device() -> anyhow::Result<()> {
    let reference = one_device_weights("plain", SAMPLES)?;
    check_equivalence(
        &reference,
        &[],
        &[
            ("1", &[], "2 workers x 1 replica"),
            ("2", &[], "2 workers x 2 replicas"),
            (
                "2",
                &["--hierarchical"],
                "2 workers x 2 replicas, hierarchical copy",
            ),
            (
                "2",
                &["--whole-buffer"],
                "2 workers x 2 replicas, one sum after the backward pass",
            ),
        ],
    )
}

/// The gradients cross workers in buckets during the backward pass (by default): a worker
/// without samples in the last step hands in zeros for every bucket and joins the same sums.
#[test]
fn an_empty_worker_joins_the_gradient_buckets_of_the_last_step() -> anyhow::Result<()> {
    let samples = SAMPLES + 1;
    let reference = one_device_weights("plain", samples)?;
    let samples = samples.to_string();
    check_equivalence(
        &reference,
        &["--samples", &samples],
        &[
            ("1", &[], "2 workers x 1 replica, a last batch of 1"),
            ("2", &[], "2 workers x 2 replicas, a last batch of 1"),
        ],
    )
}

/// Gradient accumulation across workers: micro-batches of a third of the global batch, their
/// gradients kept by every replica and all-reduced once per group, train as one device does on
/// the whole batches; so do they under mixed_float16.
#[test]
fn accumulated_gradients_on_two_workers_give_one_devices_weights() -> anyhow::Result<()> {
    let reference = one_device_weights("plain", SAMPLES)?;
    check_equivalence(
        &reference,
        &["--accumulate", "3"],
        &[
            ("1", &[], "2 workers x 1 replica, accumulating 3"),
            ("2", &[], "2 workers x 2 replicas, accumulating 3"),
        ],
    )?;
    // Under mixed_float16 every replica of every worker keeps the loss scale (the kernels stay
    // float32, and power-of-two scales change no bit).
    check_equivalence(
        &reference,
        &["--accumulate", "3", "--dtype-policy", "mixed_float16"],
        &[(
            "2",
            &[],
            "2 workers x 2 replicas, accumulating 3, mixed_float16",
        )],
    )
}

/// Functional models train on two workers as on one device: one with a residual sum, a shared
/// layer and a concatenation, and one of two inputs and two outputs.
#[test]
fn functional_models_train_on_two_workers_as_one_device() -> anyhow::Result<()> {
    let reference = one_device_weights("graph", SAMPLES)?;
    check_equivalence(
        &reference,
        &["--model", "graph"],
        &[("2", &[], "functional model, 2 workers x 2 replicas")],
    )?;
    let reference = one_device_weights("three-in-two-out", SAMPLES)?;
    check_equivalence(
        &reference,
        &["--model", "three-in-two-out"],
        &[("1", &[], "two inputs and outputs, 2 workers x 1 replica")],
    )
}

/// SyncBatchNorm across workers: batch norm normalises with the statistics of the global batch
/// (summed over the local replicas, then over the workers, forward and backward), so 2 workers
/// train the BN model as one device does.
#[test]
fn sync_batch_norm_across_two_workers_trains_as_one_device() -> anyhow::Result<()> {
    let reference = one_device_weights("bn", SAMPLES)?;
    check_equivalence(
        &reference,
        &["--model", "bn"],
        &[
            (
                "1",
                &["--sync-batch-norm"],
                "2 workers x 1 replica, sync bn",
            ),
            (
                "2",
                &["--sync-batch-norm"],
                "2 workers x 2 replicas, sync bn",
            ),
        ],
    )?;
    // Without it, each replica normalises with its own part of the batch: not one device.
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("per_replica.safetensors");
    let out_arg = out.to_string_lossy().to_string();
    let _one = lock();
    let outcome = run(mpirun(
        2,
        &["equivalence", "--out", &out_arg, "--model", "bn"],
    ))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    let per_replica = kandle::checkpoint::load(&out)?;
    let mut differs = 0f32;
    for (name, want) in &reference.weights {
        let diff = (&per_replica[name] - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-2);
        differs = differs.max(diff / scale);
    }
    assert!(
        differs > 1e-3,
        "per-replica batch norm differs by only {differs}"
    );
    Ok(())
}

/// 481 samples make the last global batch a single sample: worker 0's first replica has it,
/// its second replica and all of worker 1 have none. Worker 1 joins the batch-norm exchanges
/// with zeros shaped after its previous step, and the weights still match one device.
#[test]
fn sync_batch_norm_with_an_empty_worker_in_the_last_step() -> anyhow::Result<()> {
    let samples = SAMPLES + 11;
    let reference = one_device_weights("bn", samples)?;
    let samples = samples.to_string();
    check_equivalence(
        &reference,
        &["--model", "bn", "--samples", &samples],
        &[(
            "2",
            &["--sync-batch-norm"],
            "2 workers x 2 replicas, sync bn, a last batch of 1",
        )],
    )
}

// ---- workers that cannot work together -----------------------------------------------------

/// Launches the `equivalence` task with `options` before it, expects the job to fail, and
/// returns the workers' errors (`worker R/2: ...`, from lines `kandle-mpi-check: worker R/2:
/// ...`). Every worker fails alike, but `mpirun` ends the job as soon as the first one exits, so
/// the other's line may never arrive: at least one must.
fn failing_equivalence(options: &[&str]) -> anyhow::Result<Vec<String>> {
    let _one = lock();
    let mut args = options.to_vec();
    args.extend([
        "equivalence",
        "--out",
        "/nonexistent/never-written.safetensors",
    ]);
    let outcome = run(mpirun(2, &args))?;
    assert!(!outcome.status.success(), "{}", outcome.output);
    let errors: Vec<String> = (0..2)
        .filter_map(|rank| {
            outcome.output.lines().find_map(|l| {
                l.find(&format!("worker {rank}/2: "))
                    .map(|at| l[at..].to_string())
            })
        })
        .collect();
    anyhow::ensure!(!errors.is_empty(), "no worker's error:\n{}", outcome.output);
    Ok(errors)
}

#[test]
fn workers_with_different_replica_counts_fail_alike() -> anyhow::Result<()> {
    for line in failing_equivalence(&["--replicas-on-worker", "1", "2"])? {
        assert!(
            line.contains(": worker 1: runs 2 local replica(s), a step buffer of")
                && line.contains("but the chief runs 1 local replica(s)"),
            "{line}"
        );
    }
    Ok(())
}

#[test]
fn nccl_on_cpu_replicas_is_a_clear_error() -> anyhow::Result<()> {
    let why = if cfg!(feature = "nccl") {
        "NCCL all-reduce needs CUDA replicas, got cpu"
    } else {
        "kandle-strategies was built without the `nccl` feature"
    };
    for line in failing_equivalence(&["--communication", "nccl"])? {
        assert!(
            line.contains("CommunicationImplementation::Nccl") && line.contains(why),
            "{line}"
        );
    }
    Ok(())
}

// ---- world size ----------------------------------------------------------------------------

#[test]
fn workers_see_the_world_mpirun_made() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = run(mpirun(2, &["--expect-world-size", "2", "world"]))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    assert!(
        outcome.output.contains("worker 0/2 pid") && outcome.output.contains("worker 1/2 pid"),
        "{}",
        outcome.output
    );
    // Started without mpirun (or by another MPI's), a worker is a world of one: it must say so.
    let outcome = run(alone(&["--expect-world-size", "2", "world"]))?;
    outcome.assert_failed_with("expected a world of 2 workers but MPI reports 1");
    Ok(())
}

// ---- a worker that stalls or dies ----------------------------------------------------------

#[test]
fn a_stalled_worker_is_named_by_the_chief_within_the_timeout() -> anyhow::Result<()> {
    // The gradients cross workers in buckets during the backward pass: the first bucket's sum
    // of step 4 is where worker 1 is missed.
    let want = format!(
        "worker 1: did not reach the sum of gradient bucket 0 of training step 4 within \
         {TIMEOUT_SECS} s"
    );
    stalled_run(|args| mpirun(2, args), (1, 3), &want, 1)?;
    Ok(())
}

#[test]
fn a_stalled_chief_is_named_by_the_workers() -> anyhow::Result<()> {
    let want = "worker 0 (chief): did not reach the sum of gradient bucket 0 of training step 3";
    stalled_run(|args| mpirun(2, args), (0, 2), want, 2)?;
    Ok(())
}

/// Starts a long run, waits until worker 1 has finished 3 steps, sends it `signal`, and returns
/// how the job ended.
fn signal_worker_1(signal: &str) -> anyhow::Result<Outcome> {
    let timeout = TIMEOUT_SECS.to_string();
    signal_after(
        mpirun(2, &["--timeout-secs", &timeout, "train"]),
        "worker 1/2 ",
        "worker 1/2 finished step 3",
        signal,
    )
}

/// A worker whose `fit` fails with its own error (a callback's, here) exits at once with it
/// instead of waiting for the others in `MPI_Finalize`, and `mpirun` ends the job: the error is
/// printed, long before the 60 s the others would wait at the next all-reduce.
#[test]
fn a_worker_that_fails_exits_at_once_with_its_error() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = run(mpirun(2, &WORKER_1_FAILS))?;
    outcome.assert_failed_with("worker 1/2: invalid input: failing on purpose before step 4");
    outcome.assert_took_less_than(Duration::from_secs(30));
    Ok(())
}

#[test]
fn a_stopped_worker_is_named_within_the_timeout() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = signal_worker_1("-STOP")?;
    assert!(!outcome.status.success(), "{}", outcome.output);
    // Where the signal lands decides who notices: the chief's rendezvous (before or after the
    // go-ahead: an error returned from the step), or, in the short window inside the
    // collective, the all-reduce's deadline (a ping, then MPI_Abort). All name worker 1.
    // The phase is a training step's end, or the sum of one of its gradient buckets (which
    // cross workers during the backward pass).
    let named = outcome.output.lines().any(|l| {
        let chief = l.starts_with("kandle-mpi-check: worker 0/2: ");
        (chief && l.contains("worker 1: did not reach "))
            || (chief
                && l.contains("worker 1: reached ")
                && l.contains("did not join its collective"))
            || ((l.starts_with("kandle: worker 0: the all-reduce of ")
                || l.starts_with("[ERROR] worker 0: the all-reduce of "))
                && l.contains("worker 1 stopped answering"))
    });
    assert!(named, "{}", outcome.output);
    outcome.assert_took_less_than(bound(1) + Duration::from_secs(10));
    Ok(())
}

#[test]
fn a_killed_worker_ends_the_job() -> anyhow::Result<()> {
    let _one = lock();
    let start = Instant::now();
    let outcome = signal_worker_1("-KILL")?;
    // mpirun notices the death at once and ends the job, naming the rank.
    assert!(!outcome.status.success(), "{}", outcome.output);
    assert!(
        outcome.output.contains("rank 1") && outcome.output.contains("signal 9"),
        "{}",
        outcome.output
    );
    assert!(
        start.elapsed() < bound(1) + Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    Ok(())
}

// ---- backup and restore --------------------------------------------------------------------

/// The worker program's `backup` task writing its backups into `dir` and its final training
/// state to `out`, under `mpirun -n 2` (or alone, as a worker restarted by itself).
fn backup_task(dir: &str, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["backup", "--dir", dir, "--out"].map(String::from).to_vec();
    args.push(out.to_string_lossy().into_owned());
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

fn mpirun_owned(workers: usize, args: &[String]) -> Command {
    mpirun(
        workers,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    )
}

/// A multi-worker job with `BackupAndRestore` whose chief is SIGKILLed mid-epoch after a
/// backup: the whole job run again resumes and ends within 1e-6 of an uninterrupted job, the
/// backup left as it was until then.
#[test]
fn a_killed_job_resumes_as_a_whole_and_ends_as_an_uninterrupted_one() -> anyhow::Result<()> {
    let _one = lock();
    let tmp = tempfile::tempdir()?;
    let (plain, resumed) = (tmp.path().join("plain"), tmp.path().join("resumed"));
    let plain_out = tmp.path().join("plain.safetensors");
    let out = tmp.path().join("resumed.safetensors");
    let task =
        |dir: &Path, out: &Path| backup_task(&dir.to_string_lossy(), out, &["--step-millis", "20"]);

    let outcome = run(mpirun_owned(2, &task(&plain, &plain_out)))?;
    assert!(outcome.status.success(), "{}", outcome.output);

    let backup = resumed.join("backup.safetensors");
    let killed = signal_after(
        mpirun_owned(2, &task(&resumed, &out)),
        "worker 0/2 ",
        "worker 0/2 finished step 10",
        "-KILL",
    )?;
    assert!(!killed.status.success(), "{}", killed.output);
    assert!(backup.is_file(), "no backup after 10 steps");
    assert!(!out.exists(), "the killed job finished anyway");

    let outcome = run(mpirun_owned(2, &task(&resumed, &out)))?;
    assert_resumed_as_uninterrupted(&outcome, &backup, &plain_out, &out, 1e-6)
}

/// A second SIGTERM ends a worker at once, in the middle of a slow step: status 128 + 15, no
/// waiting for the step to finish.
#[test]
fn a_second_signal_ends_a_worker_at_once() -> anyhow::Result<()> {
    let _one = lock();
    let tmp = tempfile::tempdir()?;
    let out = tmp.path().join("out.safetensors");
    let task = backup_task(
        &tmp.path().join("b").to_string_lossy(),
        &out,
        &["--step-millis", "3000"],
    );
    let mut launch = launch::Launch::start(alone(&task))?;
    let pid_line = launch.wait_for_line(|l| l.contains(" pid "))?;
    let pid = pid_line.rsplit(' ').next().unwrap_or_default().to_string();
    launch.wait_for_line(|l| l.ends_with("finished step 1"))?;
    let start = Instant::now();
    for _ in 0..2 {
        Command::new("kill").args(["-TERM", &pid]).status()?;
        std::thread::sleep(Duration::from_millis(50));
    }
    let outcome = launch.finish()?;
    assert_eq!(outcome.status.code(), Some(143), "{}", outcome.output);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    Ok(())
}

/// The validation accuracy a finished `backup` task printed.
fn val_accuracy(outcome: &Outcome) -> f64 {
    outcome
        .output
        .lines()
        .find_map(|l| l.split(" val_accuracy ").nth(1))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Elastic resume: a job of two workers (global batch 32) stopped mid-epoch resumes with three
/// (48) at the samples it had seen, and ends as accurate as an uninterrupted job; one worker
/// alone (16) resumes a two-worker backup too.
#[test]
fn a_job_resumes_on_another_number_of_workers() -> anyhow::Result<()> {
    let _one = lock();
    let tmp = tempfile::tempdir()?;
    let task = |dir: &Path, out: &Path| {
        backup_task(
            &dir.to_string_lossy(),
            out,
            &["--step-millis", "20", "--every", "100"],
        )
    };
    let plain = run(mpirun_owned(
        2,
        &task(&tmp.path().join("plain"), &tmp.path().join("p.st")),
    ))?;
    assert!(plain.status.success(), "{}", plain.output);
    let uninterrupted = val_accuracy(&plain);

    for (resume_workers, label) in [(3, "worker 0/3"), (1, "worker 0/1")] {
        let dir = tmp.path().join(format!("elastic{resume_workers}"));
        let out = tmp.path().join(format!("elastic{resume_workers}.st"));
        let stopped = signal_after(
            mpirun_owned(2, &task(&dir, &out)),
            "worker 1/2 ",
            "worker 1/2 finished step 30",
            "-TERM",
        )?;
        assert!(!stopped.status.success(), "{}", stopped.output);
        let launch = match resume_workers {
            1 => alone(&task(&dir, &out)),
            n => mpirun_owned(n, &task(&dir, &out)),
        };
        let resumed = run(launch)?;
        assert!(resumed.status.success(), "{}", resumed.output);
        assert!(
            resumed
                .output
                .contains("the backup was taken at global batch 32"),
            "{}",
            resumed.output
        );
        let accuracy = val_accuracy(&resumed);
        eprintln!(
            "{label}: resumed a 2-worker backup, val_accuracy {accuracy:.4} (uninterrupted \
             {uninterrupted:.4})"
        );
        assert!(
            uninterrupted >= 0.9 && accuracy >= uninterrupted - 0.03,
            "{accuracy} against {uninterrupted}\n{}",
            resumed.output
        );
    }
    Ok(())
}

/// A multi-worker job with `BackupAndRestore` whose worker 1 (not the chief) gets SIGTERM
/// mid-epoch: both workers stop after the same step, the chief writes one backup there, and
/// the job run again resumes there and ends within 1e-6 of an uninterrupted job.
#[test]
fn a_preempted_job_stops_as_a_whole_and_resumes_as_an_uninterrupted_one() -> anyhow::Result<()> {
    let _one = lock();
    let tmp = tempfile::tempdir()?;
    let (plain, resumed) = (tmp.path().join("plain"), tmp.path().join("resumed"));
    let plain_out = tmp.path().join("plain.safetensors");
    let out = tmp.path().join("resumed.safetensors");
    // Backups every 100 steps: none is due, the one there is the preemption's.
    let task = |dir: &Path, out: &Path| {
        backup_task(
            &dir.to_string_lossy(),
            out,
            &["--step-millis", "20", "--every", "100"],
        )
    };
    let outcome = run(mpirun_owned(2, &task(&plain, &plain_out)))?;
    assert!(outcome.status.success(), "{}", outcome.output);

    let backup = resumed.join("backup.safetensors");
    let stopped = signal_after(
        mpirun_owned(2, &task(&resumed, &out)),
        "worker 1/2 ",
        "worker 1/2 finished step 6",
        "-TERM",
    )?;
    assert!(!stopped.status.success(), "{}", stopped.output);
    let place = |rank: usize| stopped.stopped_at(&format!("worker {rank}/2"));
    let (chief, worker) = (place(0), place(1));
    assert!(chief.is_some() && chief == worker, "{}", stopped.output);
    assert!(backup.is_file(), "no backup at the preemption");
    assert!(!out.exists(), "the stopped job finished anyway");
    let state = kandle::training_state::TrainingState::load(&backup)?;
    let fit = &state.extra["fit"];
    let at = format!(
        "epoch {} step {}",
        fit["epoch"].as_u64().unwrap_or(99) + 1,
        fit["step"]
    );
    assert!(
        chief.as_deref().is_some_and(|c| c.starts_with(&at)),
        "the backup is at {at}, the workers said {chief:?}"
    );

    let outcome = run(mpirun_owned(2, &task(&resumed, &out)))?;
    assert_resumed_as_uninterrupted(&outcome, &backup, &plain_out, &out, 1e-6)
}

/// Workers that do not share the backup directory (`{rank}` makes one per worker): the chief
/// finds the backup its last run left, worker 1 finds none, and both fail naming worker 1
/// instead of training from different points.
#[test]
fn workers_that_found_different_backups_fail_alike() -> anyhow::Result<()> {
    let _one = lock();
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("{rank}").to_string_lossy().into_owned();
    let out = tmp.path().join("out.safetensors");
    let args = backup_task(&dir, &out, &["--epochs", "1", "--keep-backups"]);
    let outcome = run(mpirun_owned(2, &args))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    assert!(tmp.path().join("0/backup.safetensors").is_file());

    let outcome = run(mpirun_owned(2, &args))?;
    assert!(!outcome.status.success(), "{}", outcome.output);
    let want = "worker 1: found no backup (it starts from the beginning), but the chief found \
                the backup of epoch";
    assert!(outcome.output.contains(want), "{}", outcome.output);
    Ok(())
}

// ---- accuracy ------------------------------------------------------------------------------

#[test]
fn two_workers_learn_digits() -> anyhow::Result<()> {
    let _one = lock();
    let outcome = run(mpirun(
        2,
        &[
            "--expect-world-size",
            "2",
            "digits",
            "--min-accuracy",
            "0.97",
        ],
    ))?;
    assert!(outcome.status.success(), "{}", outcome.output);
    let (line, accuracy) = launch::test_accuracy(&outcome.output, "worker 0/2 test accuracy")?;
    assert!(accuracy >= 0.97, "{line}");
    eprintln!("{line} ({:.1} s in all)", outcome.elapsed.as_secs_f64());
    Ok(())
}
