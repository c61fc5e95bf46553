//! `train_cifar10` runs end to end on CIFAR-format fixtures, under one device and under two
//! mirrored CPU replicas, and writes the PNG, CSV, JSON history and checkpoint.

use std::path::Path;
use std::process::Command;

use kandle::prelude::*;

fn run(dir: &Path, extra: &[&str]) -> anyhow::Result<String> {
    let data = dir.join("cifar");
    kandle_examples::cifar10_fixture::write_fixture(&data, 8, 16, 3)?;
    let output = dir.join("plots").join("cifar.png");
    let out = Command::new(env!("CARGO_BIN_EXE_train_cifar10"))
        .args([
            "--data-dir",
            &data.to_string_lossy(),
            "--output",
            &output.to_string_lossy(),
        ])
        .args([
            "--epochs",
            "1",
            "--max-steps-per-epoch",
            "2",
            "--batch-size-per-replica",
            "4",
        ])
        .args(extra)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    Ok(text)
}

fn check_outputs(dir: &Path, strategy: &str, replicas: usize) -> anyhow::Result<()> {
    let plots = dir.join("plots");
    let png = std::fs::read(plots.join("cifar.png"))?;
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let csv = std::fs::read_to_string(plots.join("cifar.csv"))?;
    let mut lines = csv.lines();
    let header = lines.next().unwrap_or_default();
    for key in [
        "epoch",
        "loss",
        "accuracy",
        "val_loss",
        "val_accuracy",
        "lr",
    ] {
        assert!(header.split(',').any(|h| h == key), "{header}");
    }
    assert_eq!(lines.count(), 1);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plots.join("cifar.json"))?)?;
    assert_eq!(json["strategy"], strategy);
    assert_eq!(json["replicas"], replicas);
    assert_eq!(json["epoch_seconds"].as_array().map(Vec::len), Some(1));
    assert!(json["epoch_images_per_second"][0]
        .as_f64()
        .is_some_and(|r| r > 0.0 && r.is_finite()));
    assert!(json["val_accuracy"][0]
        .as_f64()
        .is_some_and(|a| (0.0..=1.0).contains(&a)));
    assert!((json["lr"][0].as_f64().unwrap_or(0.0) - 5e-3).abs() < 1e-12);

    let mut model = kandle_models::mini_googlenet(10).compile(
        Sgd::new(5e-3),
        CategoricalCrossentropy::new(),
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )?;
    model.build(&[3, 32, 32])?;
    model.load_weights(plots.join("cifar.safetensors"))?;
    Ok(())
}

#[test]
fn one_device_smoke_run_writes_every_output() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let text = run(dir.path(), &[])?;
    assert!(text.contains("Total params: 1,656,250"), "{text}");
    assert!(text.contains("total wall time"), "{text}");
    // 2 steps of 4 images.
    assert!(text.contains("epoch 1: 8 images in "), "{text}");
    check_outputs(dir.path(), "one_device", 1)
}

#[test]
fn mirrored_smoke_run_writes_every_output() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    run(dir.path(), &["--gpus", "2", "--strategy", "mirrored"])?;
    check_outputs(dir.path(), "mirrored", 2)
}

/// `--model resnet18` trains the small-image ResNet-18, a functional model, under two mirrored
/// replicas, and its checkpoint loads into the same network.
#[test]
fn resnet18_smoke_run_trains_a_functional_model() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let text = run(
        dir.path(),
        &[
            "--model",
            "resnet18",
            "--gpus",
            "2",
            "--strategy",
            "mirrored",
        ],
    )?;
    assert!(text.contains("Connected to"), "{text}");
    assert!(text.contains("layer4.1.conv2 (Conv2D)"), "{text}");
    let mut model = kandle_examples::CifarModel::Resnet18.network()?.compile(
        Sgd::new(5e-3),
        CategoricalCrossentropy::new(),
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )?;
    model.load_weights(dir.path().join("plots").join("cifar.safetensors"))?;
    Ok(())
}

#[test]
fn missing_data_says_where_to_put_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = Command::new(env!("CARGO_BIN_EXE_train_cifar10"))
        .args([
            "--data-dir",
            &dir.path().join("nowhere").to_string_lossy(),
            "--epochs",
            "1",
        ])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("data_batch_1.bin") && err.contains("test_batch.bin"),
        "{err}"
    );
    Ok(())
}

#[test]
fn zero_epochs_writes_nothing_and_says_so() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("cifar");
    kandle_examples::cifar10_fixture::write_fixture(&data, 1, 1, 3)?;
    let plots = dir.path().join("plots");
    let out = Command::new(env!("CARGO_BIN_EXE_train_cifar10"))
        .args([
            "--data-dir",
            &data.to_string_lossy(),
            "--output",
            &plots.join("cifar.png").to_string_lossy(),
            "--epochs",
            "0",
        ])
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("trained no epoch, so wrote no curves, CSV, JSON history or checkpoint"),
        "{text}"
    );
    assert!(!text.contains("total wall time"), "{text}");
    for ext in ["png", "csv", "json", "safetensors"] {
        let file = plots.join("cifar").with_extension(ext);
        assert!(!file.exists(), "{} written: {text}", file.display());
    }
    Ok(())
}

#[test]
#[cfg(unix)]
fn a_data_file_linked_to_dev_zero_is_named() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("cifar");
    kandle_examples::cifar10_fixture::write_fixture(&data, 1, 1, 3)?;
    let file = data.join("data_batch_3.bin");
    std::fs::remove_file(&file)?;
    std::os::unix::fs::symlink("/dev/zero", &file)?;
    let out = Command::new(env!("CARGO_BIN_EXE_train_cifar10"))
        .args(["--data-dir", &data.to_string_lossy(), "--epochs", "1"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&file.display().to_string())
            && err.contains("not a regular file")
            && !err.contains("not found"),
        "{err}"
    );
    Ok(())
}
