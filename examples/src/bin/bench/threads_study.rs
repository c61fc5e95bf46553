//! Two replicas on one CPU: MiniGoogLeNet's training step under `MirroredStrategy::cpu(2)` and
//! `CentralStorageStrategy::cpu(2)` against `OneDeviceStrategy::cpu()` at the same global batch,
//! with three thread budgets: none (both replicas queue their parallel work on rayon's global
//! pool), a pool of all the cores for each replica (twice as many busy threads as cores), and
//! the default (the cores divided between the replicas).

use anyhow::Result;
use kandle::{OneDeviceStrategy, Strategy};
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy, ReplicaOptions, ReplicaThreads};
use serde_json::{json, Value};

use crate::model::train_step_time;
use crate::timing::Timer;
use crate::workload::Workload;

/// Runs the study at global batch `batch` on `cores` threads and prints its table; returns the
/// rows for `--json`.
pub fn run(batch: usize, cores: usize, timer: Timer) -> Result<Value> {
    let budget = |t: ReplicaThreads| match t {
        ReplicaThreads::Shared => "shared global pool".to_string(),
        ReplicaThreads::Fixed(n) => format!("a pool of {n} each"),
        ReplicaThreads::Auto => "default (cores / replicas each)".to_string(),
    };
    let mut configs: Vec<(String, String, Box<dyn Strategy>)> = vec![(
        "one_device".into(),
        "all cores".into(),
        Box::new(OneDeviceStrategy::cpu()),
    )];
    let budgets = [
        ReplicaThreads::Shared,
        ReplicaThreads::Fixed(cores),
        ReplicaThreads::Auto,
    ];
    for threads in budgets {
        let options = ReplicaOptions::default().threads_per_replica(threads);
        configs.push((
            "mirrored x2".into(),
            budget(threads),
            Box::new(MirroredStrategy::cpu(2)?.with_options(options)),
        ));
        configs.push((
            "central_storage x2".into(),
            budget(threads),
            Box::new(CentralStorageStrategy::cpu(2)?.with_options(options)),
        ));
    }
    let mut rows = Vec::new();
    let mut one_device = None;
    for (name, threads, strategy) in configs {
        eprintln!("kandle: threads study, {name}, {threads}");
        let step = train_step_time(
            (Workload::mini_googlenet(), kandle::DTypePolicy::float32()),
            strategy.as_ref(),
            &candle_core::Device::Cpu,
            batch,
            timer,
        )?;
        let base = *one_device.get_or_insert(step);
        rows.push((name, threads, step, base / step));
    }
    println!(
        "| strategy | threads per replica | step ms (global batch {batch}) | images/s | \
         speed vs one device |"
    );
    println!("|---|---|---|---|---|");
    for (name, threads, step, speed) in &rows {
        println!(
            "| {name} | {threads} | {:.1} | {:.1} | {speed:.2} |",
            step * 1e3,
            batch as f64 / step
        );
    }
    Ok(Value::Array(
        rows.into_iter()
            .map(|(strategy, threads, step, speed)| {
                json!({"strategy": strategy, "threads_per_replica": threads,
                       "step_s": step, "speed_vs_one_device": speed})
            })
            .collect(),
    ))
}
