//! `custom_objective` trains on digits with the focal loss and macro-F1 metric it defines, under
//! one device and under two mirrored CPU replicas: `macro_f1` is in its epoch lines, its CSV
//! and its plot (which gets a third panel for it), and the model learns.

use std::path::Path;
use std::process::Command;

fn run(dir: &Path, strategy: &[&str]) -> anyhow::Result<(String, String)> {
    let plot = dir.join("objective.png");
    let out = Command::new(env!("CARGO_BIN_EXE_custom_objective"))
        .args(["--epochs", "8", "--plot", &plot.to_string_lossy()])
        .args(strategy)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stdout}{stderr}");
    Ok((stdout, stderr))
}

fn check(dir: &Path, stdout: &str, stderr: &str) -> anyhow::Result<()> {
    // The epoch lines (stderr, no terminal) carry the metric and its validation value.
    let epochs: Vec<&str> = stderr.lines().filter(|l| l.starts_with("Epoch ")).collect();
    assert_eq!(epochs.len(), 8, "{stderr}");
    assert!(
        epochs
            .iter()
            .all(|l| l.contains("macro_f1") && l.contains("val_macro_f1")),
        "{stderr}"
    );
    let csv = std::fs::read_to_string(dir.join("objective.csv"))?;
    let header: Vec<&str> = csv.lines().next().unwrap_or("").split(',').collect();
    assert!(
        header.contains(&"macro_f1") && header.contains(&"val_macro_f1"),
        "{csv}"
    );
    assert_eq!(csv.lines().count(), 9, "{csv}");
    // Three panels side by side: loss, accuracy, macro_f1 (640 pixels each).
    let file = std::fs::File::open(dir.join("objective.png"))?;
    let reader = png::Decoder::new(std::io::BufReader::new(file)).read_info()?;
    assert_eq!((reader.info().width, reader.info().height), (3 * 640, 480));
    // The final line reports a macro F1 that shows learning (chance is 0.1; the exact value
    // moves by a test sample or two with the kernels' rounding).
    let f1: f64 = stdout
        .split("macro F1 ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.trim_end_matches(',').parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no macro F1 in {stdout}"))?;
    assert!(f1 > 0.85, "macro F1 {f1} after 8 epochs: {stdout}");
    Ok(())
}

#[test]
fn trains_with_its_own_loss_and_metric_under_two_strategies() -> anyhow::Result<()> {
    let one = tempfile::tempdir()?;
    let (stdout, stderr) = run(one.path(), &["--strategy", "one-device"])?;
    check(one.path(), &stdout, &stderr)?;
    let two = tempfile::tempdir()?;
    let (stdout, stderr) = run(two.path(), &["--strategy", "mirrored", "--replicas", "2"])?;
    check(two.path(), &stdout, &stderr)?;
    assert!(stdout.contains("on 2 replica(s)"), "{stdout}");
    Ok(())
}
