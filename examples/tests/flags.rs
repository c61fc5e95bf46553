//! The binaries' flags: a count of 0 (a batch size, replicas, steps) is refused with an error
//! that names the flag, a batch that does not split evenly over the replicas is refused, 0
//! epochs trains nothing and says so instead of claiming a checkpoint, and `--help` reads as
//! plain text (no rustdoc links or code spans).

use std::path::Path;
use std::process::{Command, Output};

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `bin` with `args` in `dir`; returns whether it succeeded and what it printed.
fn run(bin: &str, dir: &Path, args: &[&str]) -> anyhow::Result<(bool, String)> {
    let out = Command::new(bin).current_dir(dir).args(args).output()?;
    Ok((out.status.success(), text(&out)))
}

#[test]
fn a_count_of_zero_is_refused_naming_the_flag() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for (bin, flag) in [
        (env!("CARGO_BIN_EXE_quickstart"), "--batch-size"),
        (env!("CARGO_BIN_EXE_quickstart"), "--replicas"),
        (
            env!("CARGO_BIN_EXE_train_cifar10"),
            "--batch-size-per-replica",
        ),
        (env!("CARGO_BIN_EXE_train_cifar10"), "--gpus"),
        (env!("CARGO_BIN_EXE_train_cifar10"), "--max-steps-per-epoch"),
        (
            env!("CARGO_BIN_EXE_custom_objective"),
            "--batch-size-per-replica",
        ),
        (env!("CARGO_BIN_EXE_custom_objective"), "--replicas"),
        (env!("CARGO_BIN_EXE_scaling"), "--batch-size-per-replica"),
        (env!("CARGO_BIN_EXE_scaling"), "--replicas"),
        (env!("CARGO_BIN_EXE_bench_strategies"), "--steps"),
        (env!("CARGO_BIN_EXE_bench_input_pipeline"), "--batch-size"),
        (env!("CARGO_BIN_EXE_bench"), "--iters"),
        (env!("CARGO_BIN_EXE_bench"), "--threads"),
    ] {
        let (ok, out) = run(bin, dir.path(), &[flag, "0"])?;
        assert!(!ok, "{bin} {flag} 0 ran: {out}");
        assert!(
            out.contains(&format!("invalid value '0' for '{flag} ")),
            "{bin} {flag} 0: {out}"
        );
    }
    // The synthetic test file holds a fifth of a training file's records: one at least.
    let (ok, out) = run(
        env!("CARGO_BIN_EXE_bench_input_pipeline"),
        dir.path(),
        &["--records-per-file", "4"],
    )?;
    assert!(
        !ok && out.contains("invalid value '4' for '--records-per-file "),
        "{out}"
    );
    // Nothing ran: no file was written.
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 0);
    Ok(())
}

#[test]
fn a_batch_that_does_not_split_over_the_replicas_is_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for batch in ["1", "3"] {
        let (ok, out) = run(
            env!("CARGO_BIN_EXE_quickstart"),
            dir.path(),
            &[
                "--strategy",
                "mirrored",
                "--replicas",
                "2",
                "--batch-size",
                batch,
            ],
        )?;
        assert!(!ok, "--batch-size {batch} over 2 replicas ran: {out}");
        assert!(
            out.contains(&format!("--batch-size {batch} does not split evenly"))
                && out.contains("multiple of 2"),
            "{out}"
        );
    }
    Ok(())
}

#[test]
fn zero_epochs_trains_nothing_and_claims_no_checkpoint() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (ok, out) = run(
        env!("CARGO_BIN_EXE_quickstart"),
        dir.path(),
        &[
            "--epochs",
            "0",
            "--plot",
            "curves.png",
            "--checkpoint",
            "best.safetensors",
        ],
    )?;
    assert!(ok, "{out}");
    assert!(
        out.contains("after 0 epochs")
            && out.contains("trained no epoch, so wrote no checkpoint, plot or CSV"),
        "{out}"
    );
    assert!(!out.contains("(best val_accuracy)"), "{out}");
    for file in ["curves.png", "best.safetensors", "curves.csv"] {
        assert!(!dir.path().join(file).exists(), "{file} written: {out}");
    }
    Ok(())
}

#[test]
fn help_is_plain_text() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for bin in [
        env!("CARGO_BIN_EXE_quickstart"),
        env!("CARGO_BIN_EXE_train_cifar10"),
        env!("CARGO_BIN_EXE_custom_objective"),
        env!("CARGO_BIN_EXE_scaling"),
        env!("CARGO_BIN_EXE_digits_as_cifar"),
        env!("CARGO_BIN_EXE_bench"),
        env!("CARGO_BIN_EXE_bench_strategies"),
        env!("CARGO_BIN_EXE_bench_input_pipeline"),
        env!("CARGO_BIN_EXE_transfer_learning"),
    ] {
        let (ok, out) = run(bin, dir.path(), &["--help"])?;
        assert!(ok, "{bin} --help: {out}");
        for rustdoc in ["`", "](", "[crate::", "[Self::"] {
            assert!(
                !out.contains(rustdoc),
                "{bin} --help shows {rustdoc}: {out}"
            );
        }
    }
    Ok(())
}
