//! Real crashes: a training binary run with `--backup-dir` is killed with SIGKILL mid-epoch
//! after a backup (or in the middle of writing one), run again with the same command, says on
//! its first line that it resumes, and ends where an uninterrupted run ends:
//! - `quickstart` (Adam, batch norm, dropout) under `OneDeviceStrategy` on the CPU: the same
//!   CSV log (each epoch once), plot and final training state, bit for bit;
//! - `quickstart` under `MirroredStrategy::cpu(2)`: the final training state within 1e-6
//!   relative (the test prints whether it is also bitwise);
//! - `train_cifar10` (MiniGoogLeNet, augmentation, polynomial decay): the same CSV, bit for bit,
//!   also when the kill lands while a backup is being written (the previous backup loads).
//!
//! And preemptions: `quickstart` sent SIGTERM mid-epoch stops after the step it is in, backs
//! up there, says so and exits with status 75; the same command resumes there and ends as an
//! uninterrupted run (bit for bit on one device, within 1e-6 under `MirroredStrategy::cpu(2)`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kandle::training_state::TrainingState;

const EPOCHS: &str = "3";

/// `quickstart` writing into `dir` (its final training state in `dir/final.safetensors`),
/// under the strategy `strategy` names (`--strategy ...` arguments).
fn quickstart(dir: &Path, backups: Option<&Path>, strategy: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quickstart"));
    cmd.args(["--epochs", EPOCHS, "--seed", "5"])
        .args(strategy)
        .arg("--plot")
        .arg(dir.join("q.png"))
        .arg("--checkpoint")
        .arg(dir.join("best.safetensors"))
        .arg("--save")
        .arg(dir.join("final.safetensors"));
    if let Some(backups) = backups {
        cmd.arg("--backup-dir")
            .arg(backups)
            .args(["--backup-every-steps", "7"]);
    }
    cmd
}

/// Runs to completion; returns stdout.
fn run(mut cmd: Command) -> anyhow::Result<String> {
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    anyhow::ensure!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

fn final_line(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("final model"))
        .unwrap_or_default()
        .to_string()
}

/// Starts `cmd`, waits (up to `limit`) for `backup` to appear, lets the run go on for `grace`,
/// then SIGKILLs it. Fails if the run ended before it could be killed after a backup.
fn kill_after_backup(
    mut cmd: Command,
    backup: &Path,
    limit: Duration,
    grace: Duration,
) -> anyhow::Result<()> {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let start = Instant::now();
    let mut killed = false;
    while start.elapsed() < limit {
        if backup.is_file() {
            std::thread::sleep(grace);
            killed = child.try_wait()?.is_none();
            child.kill()?;
            break;
        }
        if child.try_wait()?.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.wait()?;
    anyhow::ensure!(
        killed,
        "the run ended before it could be killed after a backup"
    );
    Ok(())
}

/// How far apart two training states are: the largest difference of any weight or optimizer
/// slot relative to its tensor's largest magnitude, and whether every value is bit for bit
/// the same. Fails when their names, shapes or learning rates differ.
fn state_difference(a: &Path, b: &Path) -> anyhow::Result<(f64, bool)> {
    let (a, b) = (TrainingState::load(a)?, TrainingState::load(b)?);
    anyhow::ensure!(a.learning_rate == b.learning_rate, "learning rates differ");
    anyhow::ensure!(
        a.optimizer.scalars == b.optimizer.scalars,
        "optimizer scalars differ"
    );
    let tensors = |s: &TrainingState| {
        let slots = s.optimizer.slots.iter().flat_map(|(slot, w)| {
            w.iter()
                .map(move |(name, t)| (format!("{slot}/{name}"), t.clone()))
        });
        s.weights
            .iter()
            .map(|(name, t)| (name.clone(), t.clone()))
            .chain(slots)
            .collect::<Vec<_>>()
    };
    let (ta, tb) = (tensors(&a), tensors(&b));
    anyhow::ensure!(
        ta.iter().map(|(n, _)| n).eq(tb.iter().map(|(n, _)| n)),
        "the states hold different tensors"
    );
    let (mut worst, mut bitwise) = (0f64, true);
    for ((name, x), (_, y)) in ta.iter().zip(&tb) {
        anyhow::ensure!(x.dims() == y.dims(), "`{name}`: shapes differ");
        let as_f64 = |t: &candle_core::Tensor| {
            t.flatten_all()?
                .to_dtype(candle_core::DType::F64)?
                .to_vec1::<f64>()
        };
        let (x, y) = (as_f64(x)?, as_f64(y)?);
        let scale = x.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
        for (u, v) in x.iter().zip(&y) {
            bitwise &= u == v;
            worst = worst.max((u - v).abs() / scale);
        }
    }
    Ok((worst, bitwise))
}

/// What a killed and resumed run left, next to an uninterrupted run's.
struct Resumed {
    csv: String,
    want_csv: String,
    /// Whether the training-curve PNGs are the same bytes.
    same_plot: bool,
    /// [`state_difference`] of the final training states.
    difference: (f64, bool),
}

/// An uninterrupted `quickstart` under `strategy`, then one SIGKILLed after a backup and run
/// again: checks the resumed run's first line and final test line, and returns what both left.
fn kill_and_resume_quickstart(strategy: &[&str]) -> anyhow::Result<Resumed> {
    let plain = tempfile::tempdir()?;
    let reference = run(quickstart(plain.path(), None, strategy))?;
    let want_csv = std::fs::read_to_string(plain.path().join("q.csv"))?;

    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = backups.join("backup.safetensors");
    // Let a few more steps run past the backup, then SIGKILL.
    kill_after_backup(
        quickstart(dir.path(), Some(&backups), strategy),
        &backup,
        Duration::from_secs(120),
        Duration::from_millis(150),
    )?;
    anyhow::ensure!(backup.is_file(), "no backup survived the kill");

    let resumed = run(quickstart(dir.path(), Some(&backups), strategy))?;
    let first = resumed.lines().next().unwrap_or_default();
    anyhow::ensure!(
        first.starts_with("resuming from"),
        "first line: {first}\n{resumed}"
    );
    anyhow::ensure!(
        !final_line(&reference).is_empty() && !final_line(&resumed).is_empty(),
        "{resumed}\nvs\n{reference}"
    );
    anyhow::ensure!(!backup.exists(), "the backup is deleted when fit completes");
    let plot = |d: &Path| std::fs::read(d.join("q.png"));
    Ok(Resumed {
        csv: std::fs::read_to_string(dir.path().join("q.csv"))?,
        want_csv,
        same_plot: plot(plain.path())? == plot(dir.path())?,
        difference: state_difference(
            &plain.path().join("final.safetensors"),
            &dir.path().join("final.safetensors"),
        )?,
    })
}

/// Starts `cmd`, waits (up to `limit`) for `backup` (its first scheduled backup: the run is
/// mid-epoch), sends SIGTERM, and waits for the run to end. Returns its stdout and the time
/// from the signal to its exit; fails unless it exited with status 75.
fn sigterm_after_backup(
    mut cmd: Command,
    backup: &Path,
    limit: Duration,
) -> anyhow::Result<(String, Duration)> {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
    let start = Instant::now();
    while !backup.is_file() && start.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(5));
    }
    anyhow::ensure!(backup.is_file(), "no backup within {limit:?}");
    let signalled = Instant::now();
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    anyhow::ensure!(sent.success(), "kill -TERM failed");
    let out = child.wait_with_output()?;
    let took = signalled.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    anyhow::ensure!(
        out.status.code() == Some(kandle::preemption::EXIT_PREEMPTED),
        "exit status {:?}\n{stdout}",
        out.status
    );
    Ok((stdout, took))
}

/// An uninterrupted `quickstart` under `strategy`, then one sent SIGTERM mid-epoch and run
/// again: the stopped run's last line says where, the resumed run's first line says it resumes
/// there, and what both left is returned.
fn preempt_and_resume_quickstart(strategy: &[&str]) -> anyhow::Result<Resumed> {
    let plain = tempfile::tempdir()?;
    run(quickstart(plain.path(), None, strategy))?;
    let want_csv = std::fs::read_to_string(plain.path().join("q.csv"))?;

    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = backups.join("backup.safetensors");
    let (stopped, took) = sigterm_after_backup(
        quickstart(dir.path(), Some(&backups), strategy),
        &backup,
        Duration::from_secs(120),
    )?;
    eprintln!(
        "{strategy:?}: from SIGTERM to exit {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    let said = stopped.lines().last().unwrap_or_default();
    anyhow::ensure!(
        said.starts_with("preempted: stopped by SIGTERM at epoch ")
            && said.ends_with("(a backup was written there); run the same command to resume"),
        "{stopped}"
    );
    // `... at epoch E step S (...`: the resumed run's first line names the same place.
    let place = said
        .split(" at ")
        .nth(1)
        .and_then(|rest| rest.split(" (").next())
        .unwrap_or_default()
        .to_string();

    let resumed = run(quickstart(dir.path(), Some(&backups), strategy))?;
    let first = resumed.lines().next().unwrap_or_default();
    anyhow::ensure!(
        first.starts_with("resuming from") && first.ends_with(&format!(": {place}")),
        "first line: {first}, stopped at {place}"
    );
    let plot = |d: &Path| std::fs::read(d.join("q.png"));
    Ok(Resumed {
        csv: std::fs::read_to_string(dir.path().join("q.csv"))?,
        want_csv,
        same_plot: plot(plain.path())? == plot(dir.path())?,
        difference: state_difference(
            &plain.path().join("final.safetensors"),
            &dir.path().join("final.safetensors"),
        )?,
    })
}

#[test]
fn a_preempted_run_resumes_bit_for_bit_on_one_device() -> anyhow::Result<()> {
    let r = preempt_and_resume_quickstart(&[])?;
    anyhow::ensure!(r.csv == r.want_csv, "{}\nvs\n{}", r.csv, r.want_csv);
    let (worst, bitwise) = r.difference;
    anyhow::ensure!(bitwise, "final states differ by {worst:e} (relative)");
    anyhow::ensure!(r.same_plot, "the resumed run drew another plot");
    Ok(())
}

#[test]
fn a_preempted_mirrored_run_resumes_within_1e_6() -> anyhow::Result<()> {
    let r = preempt_and_resume_quickstart(&["--strategy", "mirrored", "--replicas", "2"])?;
    let (worst, bitwise) = r.difference;
    eprintln!("mirrored x2, preempted and resumed: within {worst:e} relative (bitwise: {bitwise})");
    anyhow::ensure!(worst <= 1e-6, "final states differ by {worst:e} (relative)");
    Ok(())
}

/// Two SIGTERMs in a row while a backup is written after every step: the second ends the run
/// at once (status 128 + 15) wherever it was, a backup write included, unless the run already
/// stopped after its step (status 75; its steps take milliseconds); either way the backup there
/// is whole and the same command resumes from it. (`testing/tests/multi_worker.rs` checks the
/// second signal's exit on a run whose steps are slow.)
#[test]
fn two_signals_in_a_row_leave_a_whole_backup() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = backups.join("backup.safetensors");
    // A backup after every step, so the signals are likely to land during one.
    let mut cmd = quickstart(dir.path(), None, &[]);
    cmd.arg("--backup-dir")
        .arg(&backups)
        .args(["--backup-every-steps", "1"]);
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let start = Instant::now();
    while !backup.is_file() && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(2));
    }
    anyhow::ensure!(backup.is_file(), "no backup");
    let pid = child.id().to_string();
    for _ in 0..2 {
        Command::new("kill").args(["-TERM", &pid]).status()?;
    }
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        matches!(out.status.code(), Some(143) | Some(75)),
        "status {:?}",
        out.status
    );
    eprintln!("two SIGTERMs: exit status {:?}", out.status.code());
    TrainingState::load(&backup)?;
    let resumed = run(quickstart(dir.path(), Some(&backups), &[]))?;
    anyhow::ensure!(resumed
        .lines()
        .next()
        .unwrap_or_default()
        .starts_with("resuming from"));
    Ok(())
}

#[test]
fn a_killed_run_resumes_bit_for_bit_on_one_device() -> anyhow::Result<()> {
    let r = kill_and_resume_quickstart(&[])?;
    anyhow::ensure!(
        r.csv == r.want_csv,
        "resumed CSV:\n{}\nuninterrupted:\n{}",
        r.csv,
        r.want_csv
    );
    let (worst, bitwise) = r.difference;
    anyhow::ensure!(bitwise, "final states differ by {worst:e} (relative)");
    anyhow::ensure!(r.same_plot, "the resumed run drew another plot");
    Ok(())
}

#[test]
fn a_killed_mirrored_run_resumes_within_1e_6() -> anyhow::Result<()> {
    let r = kill_and_resume_quickstart(&["--strategy", "mirrored", "--replicas", "2"])?;
    let (worst, bitwise) = r.difference;
    eprintln!(
        "mirrored x2, killed and resumed: final state within {worst:e} relative (bitwise: \
         {bitwise}); CSV identical: {}; plot identical: {}",
        r.csv == r.want_csv,
        r.same_plot
    );
    anyhow::ensure!(
        worst <= 1e-6,
        "final states differ by {worst:e} (relative)\nresumed CSV:\n{}\nuninterrupted:\n{}",
        r.csv,
        r.want_csv
    );
    Ok(())
}

/// A pipeline of two stages (four micro-batches, 1F1B) killed after a backup resumes as an
/// uninterrupted run: its stages sum each step's micro-batches in a fixed order, so bit for
/// bit.
#[test]
fn a_killed_pipeline_run_resumes_bit_for_bit() -> anyhow::Result<()> {
    let r = kill_and_resume_quickstart(&[
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "4",
        "--stage-starts",
        "batch_normalization_2",
    ])?;
    anyhow::ensure!(r.csv == r.want_csv, "{}\nvs\n{}", r.csv, r.want_csv);
    let (worst, bitwise) = r.difference;
    anyhow::ensure!(bitwise, "final states differ by {worst:e} (relative)");
    anyhow::ensure!(r.same_plot, "the resumed run drew another plot");
    Ok(())
}

/// What one backup of the flagship model costs: the training state of MiniGoogLeNet with SGD
/// momentum (weights, batch-norm statistics, momentum buffers), saved with `Model::save` as
/// `BackupAndRestore` does. A measurement, not a check: run by hand with
/// `cargo test --release -p kandle-examples --test resume -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, run by hand"]
fn backup_cost_of_minigooglenet() -> anyhow::Result<()> {
    use kandle::prelude::*;
    let mut model = kandle_models::mini_googlenet(10).compile(
        Sgd::new(5e-3).momentum(0.9),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )?;
    model.build(&[3, 32, 32])?;
    let x = candle_core::Tensor::zeros(
        (2, 3, 32, 32),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    let y = candle_core::Tensor::new(&[0u32, 1], &candle_core::Device::Cpu)?;
    model.train_on_batch(&x, &y, None)?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("backup.safetensors");
    let mut times = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        model.save(&path)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let bytes = std::fs::metadata(&path)?.len();
    let start = Instant::now();
    model.load(&path)?;
    let load = start.elapsed().as_secs_f64() * 1e3;
    eprintln!(
        "MiniGoogLeNet backup: {:.1} MB, save {:.1} ms (median of 5, fsync included), load {load:.1} ms",
        bytes as f64 / 1e6,
        times[2]
    );
    Ok(())
}

/// `train_cifar10` on the CIFAR-format fixtures in `data` (MiniGoogLeNet with batch norm, the
/// tutorial's shifts and flips, SGD momentum, polynomial decay), writing into `dir`, backing
/// up every `every` steps into `backups` when given.
fn train_cifar10(data: &Path, dir: &Path, backups: Option<(&Path, usize)>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train_cifar10"));
    cmd.arg("--data-dir")
        .arg(data)
        .arg("--output")
        .arg(dir.join("cifar.png"))
        .args(["--epochs", "2", "--batch-size-per-replica", "8"]);
    if let Some((backups, every)) = backups {
        cmd.arg("--backup-dir")
            .arg(backups)
            .args(["--backup-every-steps", &every.to_string()]);
    }
    cmd
}

/// CIFAR-format fixtures, and the CSV log of an uninterrupted `train_cifar10` on them.
fn uninterrupted_train_cifar10() -> anyhow::Result<(tempfile::TempDir, String)> {
    let data = tempfile::tempdir()?;
    kandle_examples::cifar10_fixture::write_fixture(data.path(), 8, 8, 3)?;
    let plain = tempfile::tempdir()?;
    run(train_cifar10(data.path(), plain.path(), None))?;
    let csv = std::fs::read_to_string(plain.path().join("cifar.csv"))?;
    Ok((data, csv))
}

/// Runs `cmd` to completion and checks that it said first that it resumes.
fn run_resumed(cmd: Command) -> anyhow::Result<()> {
    let resumed = run(cmd)?;
    let first = resumed.lines().next().unwrap_or_default();
    anyhow::ensure!(
        first.starts_with("resuming from"),
        "first line: {first}\n{resumed}"
    );
    Ok(())
}

/// `train_cifar10 --backup-dir`, SIGKILLed after a backup and run again: the first line says
/// where it resumes, and the CSV log equals an uninterrupted run's, bit for bit.
#[test]
fn a_killed_train_cifar10_resumes_bit_for_bit() -> anyhow::Result<()> {
    let (data, want_csv) = uninterrupted_train_cifar10()?;
    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = backups.join("backup.safetensors");
    kill_after_backup(
        train_cifar10(data.path(), dir.path(), Some((&backups, 2))),
        &backup,
        Duration::from_secs(300),
        Duration::from_millis(0),
    )?;
    run_resumed(train_cifar10(data.path(), dir.path(), Some((&backups, 2))))?;
    let csv = std::fs::read_to_string(dir.path().join("cifar.csv"))?;
    anyhow::ensure!(
        csv == want_csv,
        "resumed CSV:\n{csv}\nuninterrupted:\n{want_csv}"
    );
    Ok(())
}

/// Starts `cmd` (which backs up into `backups` every step) and SIGKILLs it as soon as it is
/// writing a backup while an earlier one exists: the moment its temporary file is there.
/// Returns whether the kill landed inside the write (the temporary file outlived the process),
/// or `None` when the run ended first.
fn kill_while_saving(mut cmd: Command, backups: &Path) -> anyhow::Result<Option<bool>> {
    let mut child: Child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let partial = backups.join(format!(".backup.safetensors.{}.tmp", child.id()));
    let backup = backups.join("backup.safetensors");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(300) {
        if backup.is_file() && partial.exists() {
            child.kill()?;
            child.wait()?;
            return Ok(Some(partial.exists()));
        }
        if child.try_wait()?.is_some() {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    child.kill()?;
    child.wait()?;
    anyhow::bail!("no backup was written within 300 s")
}

/// A kill inside the write of a backup (the file is written to a temporary name, synced, then
/// renamed): the previous backup is whole and loads, the rerun removes the partial file,
/// resumes from the previous backup and ends with the uninterrupted run's CSV, bit for bit.
#[test]
fn a_kill_during_a_save_leaves_the_previous_backup() -> anyhow::Result<()> {
    let (data, want_csv) = uninterrupted_train_cifar10()?;
    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = backups.join("backup.safetensors");
    let command = || train_cifar10(data.path(), dir.path(), Some((&backups, 1)));
    // The write takes a good part of each step (13 MB, fsync included), but a kill may still
    // land just before or after it: try a few times, each try resuming the last.
    let mut inside = false;
    for attempt in 1..=8 {
        match kill_while_saving(command(), &backups)? {
            Some(true) => {
                eprintln!("kill {attempt} landed inside a save");
                inside = true;
                break;
            }
            Some(false) => continue,
            None => anyhow::bail!("the run ended before a kill could land in a save"),
        }
    }
    anyhow::ensure!(inside, "no kill landed inside a save in 8 tries");
    let previous = TrainingState::load(&backup)
        .map_err(|e| anyhow::anyhow!("the previous backup does not load: {e}"))?;
    anyhow::ensure!(
        previous.extra.contains_key("fit"),
        "the previous backup has no fit position"
    );

    run_resumed(command())?;
    let csv = std::fs::read_to_string(dir.path().join("cifar.csv"))?;
    anyhow::ensure!(
        csv == want_csv,
        "resumed CSV:\n{csv}\nuninterrupted:\n{want_csv}"
    );
    let left: Vec<_> = std::fs::read_dir(&backups)?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    anyhow::ensure!(left.is_empty(), "left in the backup directory: {left:?}");
    Ok(())
}
