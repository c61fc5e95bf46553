//! The `Timeline` callback under `MirroredStrategy::cpu(2)`: a Chrome trace of the window's
//! steps in which every phase (input wait, callbacks, each replica's forward and backward
//! passes and optimizer update, the all-reduce, backups) lies inside its step, each replica on
//! its own named lane; with gradient buckets, their sums start before the backward passes end.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{ensure, Context, Result};
use kandle::callbacks::{BackupAndRestore, SaveFreq, Timeline};
use kandle::data::digits;
use kandle::prelude::*;
use kandle_strategies::{MirroredStrategy, ReplicaOptions};

/// The timeline records one window at a time in the whole process: the tests take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_mirrored_step_s_phases_nest_inside_it_on_each_replica_s_lane() -> Result<()> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
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

    let (lanes, spans) = read_trace(&path)?;
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
    for (name, lane, start, duration, step) in &spans {
        let (lane, start, duration, step) = (*lane, *start, *duration, *step);
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

/// One span of a trace: its name, lane, start and duration (microseconds) and step.
type Span = (String, u64, f64, f64, u64);

/// The lanes (thread id to name) and the spans of the Chrome trace at `path`.
fn read_trace(path: &std::path::Path) -> Result<(BTreeMap<u64, String>, Vec<Span>)> {
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)?;
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
    let spans: Vec<Span> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                e["name"].as_str().unwrap_or("").to_string(),
                e["tid"].as_u64().unwrap_or(u64::MAX),
                e["ts"].as_f64().unwrap_or(f64::NAN),
                e["dur"].as_f64().unwrap_or(f64::NAN),
                e["args"]["step"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    Ok((lanes, spans))
}

/// With buckets of 64 bytes, the dense layer's bucket is summed (on a replica's lane) before
/// the replicas' backward passes have all ended: the sums overlap the passes.
#[test]
fn gradient_buckets_are_summed_while_the_backward_passes_run() -> Result<()> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let train = digits::load()?.subset(&(0..256).collect::<Vec<_>>())?;
    let cnn = Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Conv2D::new(8, 3).padding(Padding::Same))
        .add(BatchNormalization::new())
        .add(Activation::Relu)
        .add(Conv2D::new(8, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10))
        .add(Activation::Softmax);
    let options = ReplicaOptions::default().gradient_buckets(Some(64));
    let mut model = cnn.compile(
        Sgd::new(0.05),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        &MirroredStrategy::cpu(2)?.with_options(options),
    )?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("timeline.json");
    model.fit(
        &train,
        FitOptions {
            batch_size_per_replica: 16,
            verbosity: Verbosity::Silent,
            callbacks: vec![Box::new(Timeline::new(&path).steps(2..6))],
            ..Default::default()
        },
    )?;
    let (_, spans) = read_trace(&path)?;
    for step in 2..6u64 {
        let of = |name: &'static str| spans.iter().filter(move |s| s.0 == name && s.4 == step);
        let last_backward_end = of("backward")
            .map(|s| s.2 + s.3)
            .fold(f64::NEG_INFINITY, f64::max);
        let first_sum = of("bucket all-reduce")
            .map(|s| s.2)
            .fold(f64::INFINITY, f64::min);
        ensure!(
            of("bucket all-reduce").count() >= 4,
            "step {step}: {} bucket sums",
            of("bucket all-reduce").count()
        );
        ensure!(
            first_sum < last_backward_end,
            "step {step}: the first bucket's sum starts at {first_sum} us, after the backward \
             passes ended ({last_backward_end} us)"
        );
    }
    Ok(())
}
