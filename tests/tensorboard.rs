//! The `TensorBoard` callback in a real `fit`: Keras's layout (`train/`, `validation/`) and
//! names (`epoch_loss`, `epoch_accuracy`, `epoch_learning_rate`, `batch_*` every so many
//! batches, `<variable>/histogram`), read back with an independent reader of the file format
//! (`kandle_testing::tensorboard`) and, when `python3` can import `tensorboard`, with
//! TensorBoard's own (`testing/scripts/read_tensorboard.py`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::{ensure, Result};
use kandle::callbacks::{TensorBoard, UpdateFreq};
use kandle::data::digits;
use kandle::prelude::*;
use kandle_testing::tensorboard::{read_events, the_event_file, Event};

/// Every scalar tag's `(step, value)` pairs in `events`.
fn scalars(events: &[Event]) -> BTreeMap<String, Vec<(i64, f32)>> {
    let mut out: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    for e in events {
        for v in &e.values {
            if let Some(x) = v.simple_value {
                out.entry(v.tag.clone()).or_default().push((e.step, x));
            }
        }
    }
    out
}

#[test]
fn tensorboard_logs_read_back_as_keras_names_them() -> Result<()> {
    let (train, val) = digits::load()?
        .subset(&(0..400).collect::<Vec<_>>())?
        .train_test_split(0.2, 1)?;
    let mut model = Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Flatten)
        .add(Dense::new(10).named("head"))
        .add(Activation::Softmax)
        .compile(
            Sgd::new(0.1),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )?;
    let dir = tempfile::tempdir()?;
    let logs = dir.path().join("logs");
    // 320 samples in batches of 32: 10 steps an epoch, batch scalars every 4 steps.
    let history = model.fit(
        &train,
        FitOptions {
            epochs: 3,
            validation: Some(&val),
            verbosity: Verbosity::Silent,
            callbacks: vec![Box::new(
                TensorBoard::new(&logs)
                    .update_freq(UpdateFreq::Batches(4))
                    .histogram_freq(1),
            )],
            ..Default::default()
        },
    )?;

    let train_events = read_events(&the_event_file(&logs.join("train"))?)?;
    ensure!(train_events[0].file_version.as_deref() == Some("brain.Event:2"));
    let train_scalars = scalars(&train_events);
    let series = |key: &str| {
        history
            .series(key)
            .into_iter()
            .enumerate()
            .map(|(epoch, v)| (epoch as i64, v as f32))
            .collect::<Vec<_>>()
    };
    ensure!(
        train_scalars["epoch_loss"] == series("loss"),
        "{train_scalars:?}"
    );
    ensure!(train_scalars["epoch_accuracy"] == series("accuracy"));
    ensure!(train_scalars["epoch_learning_rate"] == series("lr"));
    ensure!(train_scalars["epoch_skipped_steps"] == series("skipped_steps"));
    let steps: Vec<i64> = train_scalars["batch_loss"].iter().map(|p| p.0).collect();
    ensure!(steps == [4, 8, 12, 16, 20, 24, 28], "{steps:?}");
    ensure!(!train_scalars.contains_key("epoch_val_loss"));

    let val_scalars = scalars(&read_events(&the_event_file(&logs.join("validation"))?)?);
    ensure!(
        val_scalars["epoch_loss"] == series("val_loss"),
        "{val_scalars:?}"
    );
    ensure!(val_scalars["epoch_accuracy"] == series("val_accuracy"));

    // A histogram of each variable each epoch, counting all its values.
    let histograms: Vec<(i64, String, f64)> = train_events
        .iter()
        .flat_map(|e| {
            e.values.iter().filter_map(move |v| {
                v.histogram.as_ref().map(|(num, _, buckets)| {
                    (e.step, v.tag.clone(), *num, buckets.iter().sum::<f64>())
                })
            })
        })
        .map(|(step, tag, num, counted)| {
            assert_eq!(num, counted, "{tag}: the buckets hold every value");
            (step, tag, num)
        })
        .collect();
    ensure!(
        histograms
            == [0, 1, 2]
                .iter()
                .flat_map(|&s| [
                    (s, "head.bias/histogram".to_string(), 10.0),
                    (s, "head.weight/histogram".to_string(), 640.0)
                ])
                .collect::<Vec<_>>(),
        "{histograms:?}"
    );

    tensorboard_reads(&logs, &train_scalars, &val_scalars)
}

/// What TensorBoard itself reads from `logs`, compared with our reader's scalars; skipped, and
/// said so, when `python3` cannot import `tensorboard`.
fn tensorboard_reads(
    logs: &Path,
    train: &BTreeMap<String, Vec<(i64, f32)>>,
    validation: &BTreeMap<String, Vec<(i64, f32)>>,
) -> Result<()> {
    let python = std::env::var("KANDLE_TENSORBOARD_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_tensorboard = Command::new(&python)
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_tensorboard {
        eprintln!("{python} cannot import tensorboard: TensorBoard's own reader not run");
        return Ok(());
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("testing/scripts/read_tensorboard.py");
    let out = Command::new(&python).arg(script).arg(logs).output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    for (run, ours) in [("train", train), ("validation", validation)] {
        for (tag, points) in ours {
            let theirs = &read[run]["scalars"][tag];
            let theirs: Vec<(i64, f32)> = theirs
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|p| {
                            (
                                p[0].as_i64().unwrap_or(-1),
                                p[1].as_f64().unwrap_or(f64::NAN) as f32,
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            ensure!(
                &theirs == points,
                "{run}/{tag}: TensorBoard read {theirs:?}, we wrote {points:?}"
            );
        }
    }
    let histograms = read["train"]["histograms"]["head.weight/histogram"]
        .as_array()
        .map_or(0, Vec::len);
    ensure!(
        histograms == 3,
        "TensorBoard read {histograms} histograms of head.weight"
    );
    eprintln!("TensorBoard's EventAccumulator read every scalar and histogram back");
    Ok(())
}
