//! The `Timeline` callback under `MirroredStrategy::cpu(2)`: a Chrome trace of the window's
//! steps in which every phase (input wait, callbacks, each replica's forward and backward
//! passes and optimizer update, the all-reduce, backups) lies inside its step, each replica on
//! its own named lane.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{ensure, Context, Result};
use kandle::callbacks::{BackupAndRestore, SaveFreq, Timeline};
use kandle::data::digits;
use kandle::prelude::*;
use kandle_strategies::MirroredStrategy;

#[test]
fn a_mirrored_step_s_phases_nest_inside_it_on_each_replica_s_lane() -> Result<()> {
    let (train, _) = digits::load()?
        .subset(&(0..320).collect::<Vec<_>>())?
        .train_test_split(0.2, 1)?;
    let cnn = Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Conv2D::new(8, 3).padding(Padding::Same))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10))
        .add(Activation::Softmax);
    let mut model = cnn.compile(
        Sgd::new(0.05),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        &MirroredStrategy::cpu(2)?,
    )?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("timeline.json");
    // 256 samples in global batches of 32: 8 steps an epoch; steps 6 to 10 span two epochs.
    model.fit(
        &train,
        FitOptions {
            epochs: 2,
            batch_size_per_replica: 16,
            verbosity: Verbosity::Silent,
            callbacks: vec![
                Box::new(Timeline::new(&path).steps(6..11)),
                BackupAndRestore::new(dir.path().join("backups"))
                    .save_freq(SaveFreq::Steps(3))
                    .boxed(),
            ],
            ..Default::default()
        },
    )?;

    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    let events = trace["traceEvents"].as_array().context("no traceEvents")?;
    let lanes: BTreeMap<u64, String> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap_or(u64::MAX),
                e["args"]["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let spans: Vec<(&str, u64, f64, f64, u64)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                e["name"].as_str().unwrap_or(""),
                e["tid"].as_u64().unwrap_or(u64::MAX),
                e["ts"].as_f64().unwrap_or(f64::NAN),
                e["dur"].as_f64().unwrap_or(f64::NAN),
                e["args"]["step"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    let steps: BTreeMap<u64, (f64, f64)> = spans
        .iter()
        .filter(|s| s.0 == "step")
        .map(|s| (s.4, (s.2, s.2 + s.3)))
        .collect();
    ensure!(
        steps.keys().copied().eq(6..11),
        "steps recorded: {:?}",
        steps.keys()
    );
    for &(name, lane, start, duration, step) in &spans {
        let (begin, end) = steps
            .get(&step)
            .copied()
            .context("a span of a step not recorded")?;
        ensure!(
            start >= begin - 1.0 && start + duration <= end + 1.0,
            "{name} on lane {lane} ({start} + {duration}) is outside step {step} ({begin}..{end})"
        );
    }
    for step in 6..11u64 {
        let phases = |name: &str| -> BTreeSet<String> {
            spans
                .iter()
                .filter(|s| s.0 == name && s.4 == step)
                .map(|s| lanes.get(&s.1).cloned().unwrap_or_default())
                .collect()
        };
        let replicas: BTreeSet<String> = ["kandle-replica-0", "kandle-replica-1"]
            .map(String::from)
            .into();
        ensure!(
            phases("forward") == replicas,
            "step {step}: forward on {:?}",
            phases("forward")
        );
        ensure!(phases("backward") == replicas, "step {step}");
        ensure!(phases("optimizer update") == replicas, "step {step}");
        for name in ["input wait", "callbacks", "all-reduce"] {
            ensure!(
                phases(name).len() == 1,
                "step {step}: {name} on {:?}",
                phases(name)
            );
        }
    }
    // Backups every 3 steps: after global steps 2, 5, 8 and 11; that of step 8 is in the
    // window.
    let backups: Vec<u64> = spans
        .iter()
        .filter(|s| s.0 == "backup")
        .map(|s| s.4)
        .collect();
    ensure!(backups == [8], "backups in steps {backups:?}");
    Ok(())
}
