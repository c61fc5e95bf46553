//! `PipelineModel`: the stages of a pipeline on their threads, and a step's micro-batches
//! flowing through them over channels.
//!
//! Each call sends every stage one job: its passes in its schedule's order, the channel from
//! the stage before (activations in, gradients out) and to the stage after (activations out,
//! gradients in), and the micro-batches' inputs (the first stage) or targets (the last). A
//! stage that fails drops its channels, so its neighbours stop too instead of waiting; the
//! error that is returned is the stage's own, not a neighbour's.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use kandle::data::{shard_range, Batch};
use kandle::layers::{StageSummary, Summary};
use kandle::optimizers::NamedOptimizerState;
use kandle::params::{ParamStore, Weights};
use kandle::strategy::step::{StepLayout, StepTotals};
use kandle::strategy::{
    DistributedModel, ModelSpec, Replica, StagePlacement, StepStats, WorkerHooks,
};
use kandle::{Error, Result};

use super::channels::ChannelLinks;
use super::schedule::{Pass, Schedule};
use super::stage_run::{run_stage, Done, StageDone, StageError, StageJob, Work};
use super::{PipelineReport, StageReport};
use crate::replica_pool::{ReplicaPool, ReplicaThreads};
use crate::replica_set::cpu_weights;

/// How a pipeline runs its stages.
pub(crate) struct Settings {
    pub(crate) micro_batches: usize,
    pub(crate) schedule: Schedule,
    pub(crate) timeout: Duration,
    pub(crate) threads: ReplicaThreads,
}

/// The stages of a model, each on its thread and device.
pub(crate) struct PipelineModel {
    pool: ReplicaPool,
    /// Handles on each stage's variables (sharing storage with the stage threads).
    stores: Vec<ParamStore>,
    layouts: Vec<Arc<StepLayout>>,
    summary: Summary,
    settings: Settings,
    report: Arc<Mutex<Option<PipelineReport>>>,
}

impl PipelineModel {
    /// Builds the stages of `spec` as `placements` say (`whole`: the whole model's summary),
    /// each on a thread of its own.
    pub(crate) fn build(
        spec: &ModelSpec,
        placements: &[StagePlacement],
        whole: Summary,
        settings: Settings,
        report: Arc<Mutex<Option<PipelineReport>>>,
    ) -> Result<Self> {
        let stages = Replica::stages(spec, placements)?;
        let devices: Vec<Device> = placements.iter().map(|p| p.device.clone()).collect();
        let places: Vec<String> = devices.iter().map(kandle::devices::label).collect();
        let summary = summary_of(&stages, &places, whole, &settings);
        let stores = stages.iter().map(|s| s.store().clone()).collect();
        let layouts = stages.iter().map(|s| Arc::clone(s.layout())).collect();
        let labels = devices
            .iter()
            .enumerate()
            .map(|(s, d)| format!("pipeline stage {s} ({})", kandle::devices::label(d)))
            .collect();
        let threads = settings.threads.pool_sizes(&devices)?;
        let pool = ReplicaPool::new(stages, labels, settings.timeout, &threads)?;
        Ok(Self {
            pool,
            stores,
            layouts,
            summary,
            settings,
            report,
        })
    }

    fn stages(&self) -> usize {
        self.stores.len()
    }

    fn micro_batches(&self, batch: &Batch) -> Result<Vec<Batch>> {
        micro_batches(batch, self.settings.micro_batches)
    }

    /// Runs `work` on `batch` through every stage; returns each stage's result and the wall
    /// time.
    fn run(&mut self, batch: &Batch, work: Work) -> Result<(Vec<StageDone>, Duration)> {
        let parts = self.micro_batches(batch)?;
        let stages = self.stages();
        let micro = parts.len();
        let jobs: Vec<(StageJob, ChannelLinks)> = ChannelLinks::chain(stages)
            .into_iter()
            .enumerate()
            .map(|(s, links)| {
                let passes = match work.is_inference() {
                    true => (0..micro).map(Pass::Forward).collect(),
                    false => self.settings.schedule.passes(s, stages, micro),
                };
                let ends = s == 0 || s + 1 == stages;
                let job = StageJob {
                    passes,
                    parts: if ends { parts.clone() } else { Vec::new() },
                    samples: batch.len(),
                    work,
                };
                (job, links)
            })
            .collect();
        let start = Instant::now();
        let results = self.pool.run(jobs, |_, replica, (job, mut links)| {
            Ok(run_stage(replica, job, &mut links))
        })?;
        let wall = start.elapsed();
        Ok((stage_results(results)?, wall))
    }

    fn record(&self, done: &[StageDone], wall: Duration, micro_batches: usize) {
        let report = PipelineReport {
            step: wall,
            micro_batches,
            stages: done
                .iter()
                .map(|d| StageReport {
                    busy: d.busy,
                    waiting: d.waiting,
                    peak_in_flight: d.peak_in_flight,
                })
                .collect(),
        };
        if let Ok(mut slot) = self.report.lock() {
            *slot = Some(report);
        }
    }

    /// The last stage's sums, from a job that gives them.
    fn last_sums(done: Vec<StageDone>) -> Result<Vec<f64>> {
        match done.into_iter().last().map(|d| d.done) {
            Some(Done::Sums(sums)) => Ok(sums),
            _ => Err(Error::invalid("the pipeline's last stage gave no sums")),
        }
    }
}

/// `batch` as `count` micro-batches, or one per sample for a smaller batch (none for an empty
/// one), differing in size by at most one sample.
pub(crate) fn micro_batches(batch: &Batch, count: usize) -> Result<Vec<Batch>> {
    let n = batch.len();
    let count = count.min(n);
    (0..count)
        .map(|i| {
            let r = shard_range(n, i, count);
            batch.narrow(r.start, r.len())
        })
        .collect()
}

/// Each stage's result, or the first stage's own error (naming the stage): a stage that
/// stopped because a neighbour did is not the cause.
pub(crate) fn stage_results(
    results: Vec<std::result::Result<StageDone, StageError>>,
) -> Result<Vec<StageDone>> {
    let mut done = Vec::with_capacity(results.len());
    let mut neighbour_stopped = None;
    for (s, result) in results.into_iter().enumerate() {
        match result {
            Ok(d) => done.push(d),
            Err(StageError::Own(e)) => {
                return Err(Error::Replica {
                    replica: format!("pipeline stage {s}"),
                    reason: e.to_string(),
                })
            }
            Err(StageError::NeighbourStopped) => {
                neighbour_stopped.get_or_insert(s);
            }
        }
    }
    match neighbour_stopped {
        Some(s) => Err(Error::Replica {
            replica: format!("pipeline stage {s}"),
            reason: "a neighbouring stage stopped without an error".into(),
        }),
        None => Ok(done),
    }
}

/// Fails, naming them, when `weights` hold variables that are `known` to no stage (mixed
/// precision's loss scale aside, which a model without a loss scale ignores).
pub(crate) fn check_known(weights: &Weights, known: impl Fn(&str) -> bool) -> Result<()> {
    let unknown: Vec<&str> = weights
        .keys()
        .map(String::as_str)
        .filter(|n| !known(n) && *n != kandle::mixed_precision::LOSS_SCALE)
        .collect();
    match unknown.is_empty() {
        true => Ok(()),
        false => Err(Error::invalid(format!(
            "cannot set weights: the model has no variable named {}",
            unknown.join(", ")
        ))),
    }
}

/// The whole model's summary with a row per stage, each stage's device (or place) as `places`
/// say.
pub(crate) fn summary_of(
    stages: &[Replica],
    places: &[String],
    mut whole: Summary,
    settings: &Settings,
) -> Summary {
    let count = stages.len();
    (whole.trainable, whole.non_trainable) = (0, 0);
    for (s, (stage, place)) in stages.iter().zip(places).enumerate() {
        let own = stage.summary();
        whole.trainable += own.trainable;
        whole.non_trainable += own.non_trainable;
        let first = own.rows.first().map(|r| r.name.clone()).unwrap_or_default();
        let last = own.rows.last().map(|r| r.name.clone()).unwrap_or_default();
        whole.stages.push(StageSummary {
            device: place.clone(),
            layers: (first, last),
            params: own.total(),
            activation_bytes_per_sample: own
                .rows
                .iter()
                .map(|r| r.output_shape.iter().product::<usize>() * 4)
                .sum(),
            micro_batches_held: settings.schedule.held(s, count, settings.micro_batches),
        });
    }
    whole
}

impl WorkerHooks for PipelineModel {}

impl DistributedModel for PipelineModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        let (done, wall) = self.run(batch, Work::Step)?;
        self.record(&done, wall, self.micro_batches(batch)?.len());
        let mut buffers = Vec::with_capacity(done.len());
        for d in done {
            match d.done {
                Done::Step(buffer) => buffers.push(buffer),
                _ => return Err(Error::invalid("a pipeline stage gave no step buffer")),
            }
        }
        let mut reads = Vec::with_capacity(buffers.len());
        for (buffer, layout) in buffers.iter().zip(&self.layouts) {
            reads.push(layout.read(&buffer.fused)?);
        }
        let last = reads
            .last()
            .cloned()
            .ok_or_else(|| Error::invalid("no stage"))?;
        // The samples of every micro-batch accumulated since the last step, and this batch's.
        let totals = Arc::new(StepTotals {
            sums: last.sums,
            samples: last.samples,
            finite: reads.iter().all(|r| r.finite),
        });
        let shared = Arc::clone(&totals);
        let inputs = buffers
            .into_iter()
            .map(|b| (b.fused, b.statistics_before))
            .collect();
        self.pool.run(inputs, move |_, replica, (total, before)| {
            replica.finish_step(&total, &shared, &before, lr)
        })?;
        Ok((*totals).clone().into_stats())
    }

    fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        let (done, _) = self.run(batch, Work::Accumulate)?;
        Ok(StepStats {
            samples: batch.len(),
            sums: Self::last_sums(done)?,
            applied: false,
        })
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        let (done, _) = self.run(batch, Work::Evaluate)?;
        Ok(StepStats {
            samples: batch.len(),
            sums: Self::last_sums(done)?,
            applied: false,
        })
    }

    fn predict_step(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let [x] = inputs else {
            return Err(Error::invalid(format!(
                "a Sequential model takes one input but was given {}",
                inputs.len()
            )));
        };
        let batch = Batch {
            inputs: vec![x.clone()],
            targets: Vec::new(),
            weights: None,
        };
        let (done, _) = self.run(&batch, Work::Predict)?;
        let Some(Done::Outputs(micro)) = done.into_iter().last().map(|d| d.done) else {
            return Err(Error::invalid("the pipeline's last stage gave no outputs"));
        };
        let outputs = micro.first().map_or(0, Vec::len);
        (0..outputs)
            .map(|o| {
                let parts: Vec<&Tensor> = micro.iter().map(|ys| &ys[o]).collect();
                Ok(Tensor::cat(&parts, 0)?)
            })
            .collect()
    }

    fn weights(&self) -> Result<Weights> {
        let mut all = Weights::new();
        for store in &self.stores {
            all.extend(cpu_weights(store)?);
        }
        Ok(all)
    }

    fn summary(&self) -> &Summary {
        &self.summary
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        let parts: Vec<Weights> = self
            .stores
            .iter()
            .map(|store| {
                weights
                    .iter()
                    .filter(|(name, _)| store.get(name).is_some())
                    .map(|(n, t)| (n.clone(), t.clone()))
                    .collect()
            })
            .collect();
        check_known(weights, |name| {
            self.stores.iter().any(|s| s.get(name).is_some())
        })?;
        for (store, part) in self.stores.iter().zip(&parts) {
            store
                .check_compatible(part)
                .map_err(|reason| Error::invalid(format!("cannot set weights: {reason}")))?;
        }
        for (store, part) in self.stores.iter().zip(&parts) {
            store.assign(part)?;
        }
        Ok(())
    }

    fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        let stages = self.stages();
        let parts = self.pool.run(vec![(); stages], |_, replica, ()| {
            replica.optimizer_state()?.to_device(&Device::Cpu)
        })?;
        NamedOptimizerState::join(parts)
    }

    fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        let parts: Vec<NamedOptimizerState> = self
            .stores
            .iter()
            .map(|store| {
                let names: Vec<String> = store
                    .iter()
                    .filter(|p| p.trainable)
                    .map(|p| p.name.clone())
                    .collect();
                let part = state.restricted_to(&names);
                part.to_positional(&names, &store.trainable_vars())?;
                Ok(part)
            })
            .collect::<Result<_>>()?;
        let known: usize = parts
            .iter()
            .map(|p| p.slots.values().map(|w| w.len()).sum::<usize>())
            .sum();
        let given: usize = state.slots.values().map(|w| w.len()).sum();
        if known != given {
            return Err(Error::invalid(
                "cannot load the optimizer state: it holds variables the model does not have",
            ));
        }
        self.pool.run(parts, |_, replica, part| {
            replica.load_optimizer_state(&part)
        })?;
        Ok(())
    }
}
