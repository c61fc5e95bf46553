//! The pipeline across the processes of an MPI job (the `mpi` feature): each rank holds one
//! stage of one pipeline, and with several replicas per stage the ranks form a 2-D mesh,
//! stages x replicas, each stage's gradients summed over its replicas.
//!
//! Rank `r` of `S x R` holds stage `r / R` of replica column `r % R`, so the chief (rank 0)
//! holds the first stage of the first column. A column's ranks read the same part of every
//! global batch (its `1 / R`), pass its micro-batches' activations and gradients to each other
//! ([`links`]), and every rank then joins one all-reduce: with one column, of the step's loss
//! and metric sums, its sample count and whether any stage's gradients were not finite; with
//! several, of every stage's whole step buffer (each rank fills its stage's part), so the
//! replicas of a stage sum their gradients and moving statistics and all apply the same update.
//! The chief gathers the weights and the optimizer's state of the whole model from the stages
//! when asked ([`state`]): checkpoints, backups and saved states hold every stage, written by
//! the chief; on the other ranks `weights` and `optimizer_state` give their own stage's.
//!
//! Every rank builds the whole model once, on the CPU but for its own stage, to learn every
//! stage's variables, and keeps only its stage.

mod links;
mod state;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use candle_core::{Device, Tensor};
use kandle::data::{shard_range, Batch};
use kandle::layers::{Summary, SummaryRow};
use kandle::optimizers::NamedOptimizerState;
use kandle::params::{ParamStore, Weights};
use kandle::strategy::step::StepTotals;
use kandle::strategy::{
    DistributedModel, ModelSpec, Replica, StagePlacement, StepStats, WorkerHooks,
};
use kandle::{Error, Result};

use super::model::{check_known, micro_batches, summary_of, Settings};
use super::schedule::Pass;
use super::split::{placements, StageSplit};
use super::stage_run::{run_stage, Done, StageError, StageJob, Work};
use super::{PipelineReport, StageReport};
use crate::mpi::watchdog::Phase;
use crate::mpi::world::World;
use links::{RankLinks, MAX_MICRO_BATCHES};
use state::{request_states, StateServer};

/// Where this process sits in the mesh of a pipeline over MPI ranks.
#[derive(Debug, Clone)]
pub(crate) struct Ranks {
    pub(crate) world: Arc<World>,
    /// Replicas of every stage (the mesh's columns).
    pub(crate) replicas: usize,
    /// The device this rank's stage runs on.
    pub(crate) device: Device,
}

impl Ranks {
    pub(crate) fn stages(&self) -> usize {
        self.world.size() / self.replicas
    }

    pub(crate) fn stage(&self) -> usize {
        self.world.rank() / self.replicas
    }

    pub(crate) fn column(&self) -> usize {
        self.world.rank() % self.replicas
    }

    fn rank_of(&self, stage: usize, column: usize) -> usize {
        stage * self.replicas + column
    }

    /// Fails unless the job's ranks make a mesh of whole stages.
    pub(crate) fn check(&self) -> Result<()> {
        let size = self.world.size();
        if self.replicas == 0 || !size.is_multiple_of(self.replicas) {
            return Err(Error::invalid(format!(
                "a pipeline of {} replicas per stage needs a multiple of {} ranks, and mpirun \
                 started {size}",
                self.replicas, self.replicas
            )));
        }
        Ok(())
    }
}

/// Distributes `spec` over the ranks: the chief cuts the model (the others learn where from
/// it), every rank builds its stage.
pub(crate) fn distribute(
    ranks: &Ranks,
    spec: &ModelSpec,
    split: &StageSplit,
    settings: Settings,
    report: Arc<Mutex<Option<PipelineReport>>>,
) -> Result<Box<dyn DistributedModel>> {
    ranks.check()?;
    let stages = ranks.stages();
    if settings.micro_batches > MAX_MICRO_BATCHES {
        return Err(Error::invalid(format!(
            "a pipeline over MPI ranks takes at most {MAX_MICRO_BATCHES} micro-batches"
        )));
    }
    let on_cpu = vec![Device::Cpu; stages];
    // The chief cuts the model (a balanced split measures time, which differs between ranks);
    // word 0 says whether it could.
    let mut words = vec![0u64; stages + 1];
    let mut cut = None;
    if ranks.world.rank() == 0 {
        match placements(spec, &on_cpu, split) {
            Ok((found, whole)) => {
                words[0] = 1;
                for (w, p) in words[1..].iter_mut().zip(&found) {
                    *w = p.first_layer as u64;
                }
                cut = Some(Ok(whole));
            }
            Err(e) => cut = Some(Err(e)),
        }
    }
    ranks
        .world
        .broadcast_from_chief(&mut words, Phase::Distribute, settings.timeout)?;
    if let Some(Err(e)) = cut {
        return Err(e);
    }
    if words[0] != 1 {
        return Err(Error::invalid(
            "the chief could not cut the model into stages (its error says why)",
        ));
    }
    let whole = match cut {
        Some(Ok(whole)) => whole,
        _ => spec.network.summary(&spec.input_shapes[0])?,
    };
    let stage = ranks.stage();
    let placements: Vec<StagePlacement> = words[1..]
        .iter()
        .enumerate()
        .map(|(s, &first)| StagePlacement {
            first_layer: first as usize,
            device: if s == stage {
                ranks.device.clone()
            } else {
                Device::Cpu
            },
        })
        .collect();
    let all = Replica::stages(spec, &placements)?;
    let places: Vec<String> = (0..stages)
        .map(|s| match ranks.replicas {
            1 => format!("rank {s}"),
            r => format!("ranks {}..{}", s * r, s * r + r - 1),
        })
        .collect();
    let summary = summary_of(&all, &places, whole, &settings);
    let layers = spec.network.stage_layers(&spec.input_shapes)?;
    let shapes = stage_shapes(&layers, &placements, &spec.input_shapes[0]);
    let lengths: Vec<(usize, usize)> = all
        .iter()
        .map(|r| (r.layout().grads.len(), r.layout().len()))
        .collect();
    let names: Vec<Vec<String>> = all
        .iter()
        .map(|r| r.store().iter().map(|p| p.name.clone()).collect())
        .collect();
    let Some(own) = all.into_iter().nth(stage) else {
        return Err(Error::invalid("a rank without a stage"));
    };
    check_agreement(ranks, &lengths, settings.timeout)?;
    let store = own.store().clone();
    let replica = Arc::new(Mutex::new(own));
    let server = StateServer::start(
        Arc::clone(&ranks.world),
        Arc::clone(&replica),
        settings.timeout,
    )?;
    Ok(Box::new(RankModel {
        ranks: ranks.clone(),
        replica,
        store,
        names,
        lengths,
        output_shape: shapes[stages - 1].1.clone(),
        shapes: shapes[stage].clone(),
        summary,
        settings,
        report,
        steps: 0,
        _server: server,
    }))
}

/// Each stage's input and output shapes, one sample's.
fn stage_shapes(
    layers: &[SummaryRow],
    placements: &[StagePlacement],
    input: &[usize],
) -> Vec<(Vec<usize>, Vec<usize>)> {
    placements
        .iter()
        .enumerate()
        .map(|(s, p)| {
            let end = placements
                .get(s + 1)
                .map_or(layers.len(), |n| n.first_layer);
            let takes = match p.first_layer {
                0 => input.to_vec(),
                f => layers[f - 1].output_shape.clone(),
            };
            (takes, layers[end - 1].output_shape.clone())
        })
        .collect()
}

/// Fails, on every rank alike, unless every rank cut the model into the same stages.
fn check_agreement(ranks: &Ranks, lengths: &[(usize, usize)], timeout: Duration) -> Result<()> {
    let mine: Vec<u64> = lengths.iter().map(|&(_, l)| l as u64).collect();
    let all = ranks.world.all_gather(&mine, Phase::Distribute, timeout)?;
    for (rank, theirs) in all.chunks(mine.len()).enumerate() {
        if theirs != mine {
            return Err(Error::Replica {
                replica: crate::mpi::worker_label(rank),
                reason: format!(
                    "built stages of {theirs:?} values where this rank built {mine:?}: every \
                     rank must run the same model"
                ),
            });
        }
    }
    Ok(())
}

/// One rank's stage of a pipeline over MPI ranks.
struct RankModel {
    ranks: Ranks,
    replica: Arc<Mutex<Replica>>,
    /// A handle on the stage's variables (sharing storage with the replica).
    store: ParamStore,
    /// Every stage's variable names, in order.
    names: Vec<Vec<String>>,
    /// Every stage's gradient and step-buffer lengths.
    lengths: Vec<(usize, usize)>,
    /// This stage's input and output shapes, one sample's.
    shapes: (Vec<usize>, Vec<usize>),
    /// The model's output, one sample's.
    output_shape: Vec<usize>,
    summary: Summary,
    settings: Settings,
    report: Arc<Mutex<Option<PipelineReport>>>,
    /// Collectives so far, for the watchdog's phases.
    steps: u64,
    _server: StateServer,
}

impl RankModel {
    fn stage(&self) -> Result<MutexGuard<'_, Replica>> {
        lock(&self.replica)
    }

    fn is_last(&self) -> bool {
        self.ranks.stage() + 1 == self.ranks.stages()
    }

    /// Runs `work` on this column's `batch` through this rank's stage, `replica` (held for the
    /// whole call, so that the state this rank answers with is never that of a step half done).
    fn run(&self, replica: &Replica, batch: &Batch, work: Work) -> Result<Done> {
        let parts = micro_batches(batch, self.settings.micro_batches)?;
        let (stage, stages, column) =
            (self.ranks.stage(), self.ranks.stages(), self.ranks.column());
        let passes = match work.is_inference() {
            true => (0..parts.len()).map(Pass::Forward).collect(),
            false => self.settings.schedule.passes(stage, stages, parts.len()),
        };
        let micro_sizes = parts.iter().map(Batch::len).collect();
        let job = StageJob {
            passes,
            parts,
            samples: batch.len(),
            work,
        };
        let mut links = RankLinks::new(
            &self.ranks.world,
            replica,
            stage.checked_sub(1).map(|s| self.ranks.rank_of(s, column)),
            (stage + 1 < stages).then(|| self.ranks.rank_of(stage + 1, column)),
            micro_sizes,
            self.shapes.clone(),
            replica.device().clone(),
            self.settings.timeout,
        );
        let start = std::time::Instant::now();
        let done = match run_stage(replica, job, &mut links) {
            Ok(done) => done,
            Err(StageError::Own(e)) => {
                self.ranks.world.mark_broken();
                return Err(Error::Replica {
                    replica: format!("pipeline stage {stage} (rank {})", self.ranks.world.rank()),
                    reason: e.to_string(),
                });
            }
            Err(StageError::NeighbourStopped) => {
                self.ranks.world.mark_broken();
                return Err(Error::invalid("a pipeline stage lost its neighbour"));
            }
        };
        if work == Work::Step {
            let report = PipelineReport {
                step: start.elapsed(),
                micro_batches: self.settings.micro_batches,
                stages: vec![StageReport {
                    busy: done.busy,
                    waiting: done.waiting,
                    peak_in_flight: done.peak_in_flight,
                }],
            };
            if let Ok(mut slot) = self.report.lock() {
                *slot = Some(report);
            }
        }
        Ok(done.done)
    }

    /// Sums `values` over every rank (a guarded all-reduce).
    fn all_reduce(&mut self, values: &mut Vec<f32>, test: bool) -> Result<()> {
        self.steps += 1;
        let phase = match test {
            true => Phase::Test(self.steps),
            false => Phase::Train(self.steps),
        };
        self.ranks
            .world
            .all_reduce_sum(values, phase, self.settings.timeout)
    }

    /// `[sums..., samples]` from the last stage's ranks summed over every rank, `width` sums.
    fn global_sums(
        &mut self,
        sums: Option<Vec<f64>>,
        samples: usize,
        width: usize,
    ) -> Result<(Vec<f64>, usize)> {
        let mut values = vec![0f32; width + 1];
        if let (true, Some(sums)) = (self.is_last(), sums) {
            for (v, s) in values.iter_mut().zip(&sums) {
                *v = *s as f32;
            }
            values[width] = samples as f32;
        }
        self.all_reduce(&mut values, true)?;
        let total = values[width].round().max(0.0) as usize;
        Ok((
            values[..width].iter().map(|&v| f64::from(v)).collect(),
            total,
        ))
    }
}

/// The stage, for a call that runs it.
fn lock(replica: &Mutex<Replica>) -> Result<MutexGuard<'_, Replica>> {
    replica
        .lock()
        .map_err(|_| Error::invalid("a pipeline stage was poisoned by a panic"))
}

impl WorkerHooks for RankModel {
    fn all_gather_workers(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        self.ranks
            .world
            .all_gather(values, Phase::Resume, self.settings.timeout)
    }
}

impl DistributedModel for RankModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        let held = Arc::clone(&self.replica);
        let mut replica = lock(&held)?;
        let Done::Step(buffer) = self.run(&replica, batch, Work::Step)? else {
            return Err(Error::invalid("a pipeline stage gave no step buffer"));
        };
        let layout = Arc::clone(replica.layout());
        let own = layout.read(&buffer.fused)?;
        let host: Vec<f32> = buffer.fused.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
        let stage = self.ranks.stage();
        let (totals, total) = if self.ranks.replicas == 1 {
            let width = layout.num_stats;
            let mut values = vec![0f32; width + 2];
            if self.is_last() {
                for (v, s) in values.iter_mut().zip(&own.sums) {
                    *v = *s as f32;
                }
                values[width] = own.samples as f32;
            }
            values[width + 1] = f32::from(u8::from(!own.finite));
            self.all_reduce(&mut values, false)?;
            let totals = StepTotals {
                sums: values[..width].iter().map(|&v| f64::from(v)).collect(),
                samples: values[width].round().max(0.0) as usize,
                finite: values[width + 1] == 0.0,
            };
            (totals, buffer.fused.clone())
        } else {
            let offsets: Vec<usize> = self
                .lengths
                .iter()
                .scan(0, |at, &(_, len)| {
                    let start = *at;
                    *at += len;
                    Some(start)
                })
                .collect();
            let whole: usize = self.lengths.iter().map(|&(_, len)| len).sum();
            let mut values = vec![0f32; whole + 1];
            values[offsets[stage]..offsets[stage] + host.len()].copy_from_slice(&host);
            values[whole] = f32::from(u8::from(!own.finite));
            self.all_reduce(&mut values, false)?;
            let last = self.lengths.len() - 1;
            let (grads, _) = self.lengths[last];
            let width = layout.num_stats;
            let at = offsets[last] + grads;
            let totals = StepTotals {
                sums: values[at..at + width]
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect(),
                samples: values[at + width].round().max(0.0) as usize,
                finite: values[whole] == 0.0,
            };
            let mine = values[offsets[stage]..offsets[stage] + host.len()].to_vec();
            let len = mine.len();
            let device = buffer.fused.device().clone();
            (
                totals,
                Tensor::from_vec(mine, len, &Device::Cpu)?.to_device(&device)?,
            )
        };
        replica.finish_step(&total, &totals, &buffer.statistics_before, lr)?;
        Ok(totals.into_stats())
    }

    fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        self.sums_of(batch, Work::Accumulate)
    }

    fn test_step(&mut self, batch: &Batch) -> Result<StepStats> {
        self.sums_of(batch, Work::Evaluate)
    }

    fn predict_step(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let [x] = inputs else {
            return Err(Error::invalid(format!(
                "a pipelined model takes one input but was given {}",
                inputs.len()
            )));
        };
        let n = x.dim(0)?;
        let part = shard_range(n, self.ranks.column(), self.ranks.replicas);
        let batch = Batch {
            inputs: vec![x.narrow(0, part.start, part.len())?],
            targets: Vec::new(),
            weights: None,
        };
        let held = Arc::clone(&self.replica);
        let replica = lock(&held)?;
        let done = self.run(&replica, &batch, Work::Predict)?;
        let sample = self.output_shape.clone();
        let width: usize = sample.iter().product();
        let mut values = vec![0f32; n * width];
        if let Done::Outputs(micro) = done {
            let mut row = part.start;
            for outputs in micro {
                let y = outputs
                    .first()
                    .ok_or_else(|| Error::invalid("a pipeline's last stage gave no output"))?;
                let rows = y.dim(0)?;
                let flat = y.flatten_all()?.to_vec1::<f32>()?;
                values[row * width..(row + rows) * width].copy_from_slice(&flat);
                row += rows;
            }
        }
        self.all_reduce(&mut values, true)?;
        let mut dims = vec![n];
        dims.extend(sample);
        Ok(vec![Tensor::from_vec(values, dims, &Device::Cpu)?])
    }

    fn weights(&self) -> Result<Weights> {
        let mut all = Weights::new();
        for (_, state) in self.other_states()? {
            all.extend(state.weights);
        }
        for (name, t) in self.store.weights()? {
            all.insert(name, t.to_device(&Device::Cpu)?);
        }
        Ok(all)
    }

    fn summary(&self) -> &Summary {
        &self.summary
    }

    fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        check_known(weights, |name| {
            self.names
                .iter()
                .any(|stage| stage.iter().any(|n| n == name))
        })?;
        let own: Weights = weights
            .iter()
            .filter(|(name, _)| self.store.get(name).is_some())
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        self.store
            .check_compatible(&own)
            .map_err(|reason| Error::invalid(format!("cannot set weights: {reason}")))?;
        self.store.assign(&own)
    }

    fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        let own = self.stage()?.optimizer_state()?.to_device(&Device::Cpu)?;
        let others = self.other_states()?.into_iter().map(|(_, s)| s.optimizer);
        NamedOptimizerState::join(std::iter::once(own).chain(others))
    }

    fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        let names: Vec<String> = self
            .store
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.name.clone())
            .collect();
        self.stage()?
            .load_optimizer_state(&state.restricted_to(&names))
    }
}

impl RankModel {
    /// The loss and metric sums of `work` (a gradient accumulation or an evaluation) on this
    /// column's `batch`, over every column.
    fn sums_of(&mut self, batch: &Batch, work: Work) -> Result<StepStats> {
        let held = Arc::clone(&self.replica);
        let replica = lock(&held)?;
        let sums = match self.run(&replica, batch, work)? {
            Done::Sums(sums) => Some(sums),
            _ => None,
        };
        let width = replica.layout().num_stats;
        let (sums, samples) = self.global_sums(sums, batch.len(), width)?;
        Ok(StepStats {
            samples,
            sums,
            applied: false,
        })
    }

    /// On the chief, the states of the other stages, from their first column's ranks (which,
    /// after a step of the chief's, wait for the chief's next activations and answer
    /// meanwhile); none on the other ranks, which hold their own stage only. Only the chief
    /// asks: two ranks answering each other at once would each hold its MPI lock in a send
    /// the other cannot take.
    fn other_states(&self) -> Result<Vec<(usize, kandle::training_state::TrainingState)>> {
        if self.ranks.world.rank() != 0 {
            return Ok(Vec::new());
        }
        let stage = self.ranks.stage();
        let others: Vec<usize> = (0..self.ranks.stages()).filter(|&s| s != stage).collect();
        let ranks: Vec<usize> = others.iter().map(|&s| self.ranks.rank_of(s, 0)).collect();
        let states = request_states(&self.ranks.world, &ranks, self.settings.timeout)?;
        Ok(others.into_iter().zip(states).collect())
    }
}
