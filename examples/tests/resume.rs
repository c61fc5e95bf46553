//! A real crash: `quickstart --backup-dir` is killed with SIGKILL mid-epoch after a backup, run
//! again with the same command, says on its first line that it resumes, and ends exactly where
//! an uninterrupted run ends: the same CSV log (each epoch once, every value bit for bit) and
//! the same final test loss and accuracy, under `OneDeviceStrategy` on the CPU (Adam, batch
//! norm and dropout included).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EPOCHS: &str = "3";

fn quickstart(dir: &Path, backups: Option<&Path>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quickstart"));
    cmd.args(["--epochs", EPOCHS, "--seed", "5"])
        .arg("--plot")
        .arg(dir.join("q.png"))
        .arg("--checkpoint")
        .arg(dir.join("best.safetensors"));
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

#[test]
fn a_killed_run_resumes_and_ends_where_an_uninterrupted_run_ends() -> anyhow::Result<()> {
    let plain = tempfile::tempdir()?;
    let reference = run(quickstart(plain.path(), None))?;
    let want_csv = std::fs::read_to_string(plain.path().join("q.csv"))?;

    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = backups.join("backup.safetensors");
    // Let a few more steps run past the backup, then SIGKILL.
    kill_after_backup(
        quickstart(dir.path(), Some(&backups)),
        &backup,
        Duration::from_secs(120),
        Duration::from_millis(150),
    )?;
    anyhow::ensure!(backup.is_file(), "no backup survived the kill");

    let resumed = run(quickstart(dir.path(), Some(&backups)))?;
    let first = resumed.lines().next().unwrap_or_default();
    anyhow::ensure!(
        first.starts_with("resuming from"),
        "first line: {first}\n{resumed}"
    );
    let csv = std::fs::read_to_string(dir.path().join("q.csv"))?;
    anyhow::ensure!(
        csv == want_csv,
        "resumed CSV:\n{csv}\nuninterrupted:\n{want_csv}"
    );
    anyhow::ensure!(
        final_line(&resumed) == final_line(&reference) && !final_line(&reference).is_empty(),
        "{resumed}\nvs\n{reference}"
    );
    anyhow::ensure!(!backup.exists(), "the backup is deleted when fit completes");
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

/// `train_cifar10 --backup-dir` on CIFAR-format fixtures (MiniGoogLeNet with batch norm, the
/// tutorial's shifts and flips, SGD momentum, polynomial decay), SIGKILLed after a backup and
/// run again: the first line says where it resumes, and the CSV log equals an uninterrupted
/// run's, bit for bit.
#[test]
fn a_killed_train_cifar10_resumes_bit_for_bit() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    kandle::data::cifar10::write_fixture(data.path(), 8, 8, 3)?;
    let cifar = |dir: &Path, backups: Option<&Path>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_train_cifar10"));
        cmd.arg("--data-dir")
            .arg(data.path())
            .arg("--output")
            .arg(dir.join("cifar.png"))
            .args(["--epochs", "2", "--batch-size-per-replica", "8"]);
        if let Some(backups) = backups {
            cmd.arg("--backup-dir")
                .arg(backups)
                .args(["--backup-every-steps", "2"]);
        }
        cmd
    };
    let plain = tempfile::tempdir()?;
    run(cifar(plain.path(), None))?;
    let want_csv = std::fs::read_to_string(plain.path().join("cifar.csv"))?;

    let dir = tempfile::tempdir()?;
    let backups = dir.path().join("backups");
    let backup = backups.join("backup.safetensors");
    // Let a few more steps run past the backup, then SIGKILL.
    kill_after_backup(
        cifar(dir.path(), Some(&backups)),
        &backup,
        Duration::from_secs(300),
        Duration::from_millis(0),
    )?;

    let resumed = run(cifar(dir.path(), Some(&backups)))?;
    let first = resumed.lines().next().unwrap_or_default();
    anyhow::ensure!(
        first.starts_with("resuming from"),
        "first line: {first}\n{resumed}"
    );
    let csv = std::fs::read_to_string(dir.path().join("cifar.csv"))?;
    anyhow::ensure!(
        csv == want_csv,
        "resumed CSV:\n{csv}\nuninterrupted:\n{want_csv}"
    );
    Ok(())
}
