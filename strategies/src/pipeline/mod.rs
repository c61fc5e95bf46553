//! `PipelineStrategy`: model parallelism. The model (a `Sequential`, or a functional model of
//! one input and one output, cut where one tensor flows between its layers) is cut into
//! consecutive stages, each on its own device (its variables live only there), and every global
//! batch is split into
//! micro-batches that flow through the stages on a [`Schedule`], so that the stages work on
//! different micro-batches at once.
//!
//! Each stage sums its variables' gradients over a step's micro-batches and applies them once,
//! so a step updates the weights as one device would on the whole batch (for a model without
//! batch statistics). Batch normalisation computes its statistics per micro-batch, as GPipe
//! does: a step equals one device's step with gradient accumulation over the same
//! micro-batches (`FitOptions::accumulation_steps`), and each micro-batch's forward pass moves
//! the moving statistics on in turn.
//!
//! On the CPU each stage runs on a thread of its own with its own share of the cores, so two
//! stages really overlap; on CUDA each stage runs on its GPU and its activations are copied
//! from device to device. The idle share of a step is the pipeline's bubble, `(S - 1) / (M +
//! S - 1)` for `S` stages of equal cost and `M` micro-batches ([`ideal_idle_fraction`]);
//! [`PipelineStrategy::last_step`] reports what each stage did in the last step.
//!
//! ```
//! use kandle::prelude::*;
//! use kandle_strategies::pipeline::{PipelineStrategy, Schedule, StageSplit};
//!
//! let strategy = PipelineStrategy::cpu(2)? // the one line that changes
//!     .micro_batches(4)
//!     .schedule(Schedule::OneFOneB)
//!     .split(StageSplit::at(["dense_2"]));
//! let net = Sequential::new()
//!     .add(Flatten)
//!     .add(Dense::new(32).activation(Activation::Relu))
//!     .add(Dense::new(10))
//!     .add(Activation::Softmax);
//! let mut model = net.compile(Sgd::new(0.1), SparseCategoricalCrossentropy::new(), [Accuracy], &strategy)?;
//! let (train, _) = kandle::data::digits::load()?.train_test_split(0.9, 0)?;
//! let options = FitOptions { batch_size_per_replica: 32, verbosity: Verbosity::Silent, ..Default::default() };
//! model.fit(&train, options)?;
//! let report = strategy.last_step().expect("a step ran");
//! assert_eq!(report.stages.len(), 2);
//! # Ok::<(), kandle::Error>(())
//! ```

mod channels;
mod model;
#[cfg(feature = "mpi")]
mod ranks;
mod schedule;
mod split;
mod stage_run;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::Device;
use kandle::strategy::{DistributedModel, ModelSpec, Strategy, WorkerInfo};
use kandle::{Error, Result};

pub use schedule::{ideal_idle_fraction, Schedule};
pub use split::{Balance, StageSplit};

use crate::replica_set::{all_gpus, replica_devices, ReplicaOptions};

const NAME: &str = "PipelineStrategy";

/// Model parallelism: the model's stages on several devices, pipelined with micro-batches.
/// See the [module](self) documentation.
#[derive(Debug, Clone)]
pub struct PipelineStrategy {
    devices: Vec<Device>,
    micro_batches: usize,
    schedule: Schedule,
    split: StageSplit,
    options: ReplicaOptions,
    report: Arc<Mutex<Option<PipelineReport>>>,
    /// Over the ranks of an MPI job rather than this process's devices.
    #[cfg(feature = "mpi")]
    ranks: Option<ranks::Ranks>,
}

impl PipelineStrategy {
    /// One stage per device, in order. Defaults: 4 micro-batches, [`Schedule::OneFOneB`], the
    /// stages balanced by measured time ([`StageSplit::default`]).
    pub fn new(devices: Vec<Device>) -> Result<Self> {
        Ok(Self {
            devices: replica_devices(devices, NAME)?,
            micro_batches: 4,
            schedule: Schedule::default(),
            split: StageSplit::default(),
            options: ReplicaOptions::default(),
            report: Arc::new(Mutex::new(None)),
            #[cfg(feature = "mpi")]
            ranks: None,
        })
    }

    /// Joins the MPI job this process was launched in (`mpirun -n S <binary>`, the `mpi`
    /// feature): one stage per rank, in rank order, on the CPU (see
    /// [`local_device`](Self::local_device)); with
    /// [`replicas_per_stage`](Self::replicas_per_stage) `R`, `mpirun -n S*R` makes a mesh of
    /// `S` stages by `R` data-parallel replicas. Every rank runs the same program; the chief
    /// (rank 0, the first stage) logs and writes files, and gathers the other stages' weights
    /// and optimizer state when it saves them.
    #[cfg(feature = "mpi")]
    pub fn from_env() -> Result<Self> {
        let mut strategy = Self::new(vec![Device::Cpu])?;
        strategy.ranks = Some(ranks::Ranks {
            world: crate::mpi::world::World::get()?,
            replicas: 1,
            device: Device::Cpu,
        });
        Ok(strategy)
    }

    /// Over MPI ranks ([`from_env`](Self::from_env)): `replicas` replicas of every stage, the
    /// ranks a mesh of stages x replicas (rank `r` holds stage `r / replicas` of replica
    /// `r % replicas`); each replica reads its part of every global batch, and each stage's
    /// replicas sum their gradients. Fails when the ranks are not a multiple of `replicas`, or
    /// outside an MPI job.
    #[cfg(feature = "mpi")]
    pub fn replicas_per_stage(mut self, replicas: usize) -> Result<Self> {
        let Some(ranks) = self.ranks.as_mut() else {
            return Err(Error::invalid(
                "replicas_per_stage is for a pipeline over MPI ranks: start from \
                 PipelineStrategy::from_env()",
            ));
        };
        ranks.replicas = replicas;
        ranks.check()?;
        Ok(self)
    }

    /// Over MPI ranks ([`from_env`](Self::from_env)): the device this rank's stage runs on
    /// (default the CPU).
    #[cfg(feature = "mpi")]
    pub fn local_device(mut self, device: Device) -> Self {
        if let Some(ranks) = self.ranks.as_mut() {
            ranks.device = device.clone();
        }
        self.devices = vec![device];
        self
    }

    /// `stages` stages on the CPU, each on a thread of its own with its share of the cores.
    pub fn cpu(stages: usize) -> Result<Self> {
        Self::new(vec![Device::Cpu; stages])
    }

    /// One stage on every visible GPU.
    pub fn all_gpus() -> Result<Self> {
        Self::new(all_gpus(NAME)?)
    }

    /// Splits every global batch into `micro_batches` micro-batches (at least 1; a batch of
    /// fewer samples runs one micro-batch per sample). Micro-batches that do not divide the
    /// batch differ in size by at most one sample.
    pub fn micro_batches(self, micro_batches: usize) -> Self {
        Self {
            micro_batches,
            ..self
        }
    }

    /// The order of the stages' forward and backward passes.
    pub fn schedule(self, schedule: Schedule) -> Self {
        Self { schedule, ..self }
    }

    /// Where the model is cut into stages.
    pub fn split(self, split: StageSplit) -> Self {
        Self { split, ..self }
    }

    /// The stages' time-out (how long a step waits for a stage before failing with an error
    /// naming it) and threads per stage (`threads_per_replica`). Whole-batch statistics
    /// across stages (`sync_batch_norm`) are not offered: each micro-batch normalises with its
    /// own statistics.
    pub fn with_options(self, options: ReplicaOptions) -> Self {
        Self { options, ..self }
    }

    /// The micro-batches each batch is split into (fewer for a batch of fewer samples).
    pub fn micro_batches_per_batch(&self) -> usize {
        self.micro_batches
    }

    /// The devices, one stage each.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// What each stage did in the last training step of the model this strategy built, if
    /// one ran. Over MPI ranks, what this rank's stage did.
    pub fn last_step(&self) -> Option<PipelineReport> {
        self.report.lock().ok().and_then(|r| r.clone())
    }
}

impl Strategy for PipelineStrategy {
    fn name(&self) -> &str {
        "pipeline"
    }

    /// One: a pipeline trains one copy of the model, whose stages all see the whole batch; over
    /// MPI ranks, the replicas of every stage.
    fn num_replicas_in_sync(&self) -> usize {
        #[cfg(feature = "mpi")]
        if let Some(ranks) = &self.ranks {
            return ranks.replicas;
        }
        1
    }

    /// The rank among the job's ranks, over MPI.
    fn worker(&self) -> WorkerInfo {
        #[cfg(feature = "mpi")]
        if let Some(ranks) = &self.ranks {
            return WorkerInfo {
                rank: ranks.world.rank(),
                size: ranks.world.size(),
            };
        }
        WorkerInfo::default()
    }

    /// The ranks of one replica (all of a column's stages) read the same part of each batch.
    fn data_shard(&self) -> Option<(usize, usize)> {
        #[cfg(feature = "mpi")]
        if let Some(ranks) = &self.ranks {
            return (ranks.replicas > 1).then(|| (ranks.column(), ranks.replicas));
        }
        None
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        if self.micro_batches == 0 {
            return Err(Error::invalid(
                "a pipeline needs at least one micro-batch per batch",
            ));
        }
        if self.options.sync_batch_norm {
            return Err(Error::invalid(
                "PipelineStrategy does not synchronise batch statistics: each micro-batch \
                 normalises with its own (set sync_batch_norm to false)",
            ));
        }
        let settings = model::Settings {
            micro_batches: self.micro_batches,
            schedule: self.schedule,
            timeout: self.options.timeout,
            threads: self.options.threads_per_replica,
        };
        #[cfg(feature = "mpi")]
        if let Some(ranks) = &self.ranks {
            let report = Arc::clone(&self.report);
            return ranks::distribute(ranks, spec, &self.split, settings, report);
        }
        let (placements, whole) = split::placements(spec, &self.devices, &self.split)?;
        Ok(Box::new(model::PipelineModel::build(
            spec,
            &placements,
            whole,
            settings,
            Arc::clone(&self.report),
        )?))
    }
}

/// What each stage of a pipeline did in one training step.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineReport {
    /// The step's wall time, from the first stage's start to the last stage's end.
    pub step: Duration,
    /// The micro-batches the step ran.
    pub micro_batches: usize,
    /// Each stage's share, in order.
    pub stages: Vec<StageReport>,
}

/// One stage's share of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct StageReport {
    /// Time spent computing (forward and backward passes, the loss, sending).
    pub busy: Duration,
    /// Time spent waiting for another stage's activations or gradients.
    pub waiting: Duration,
    /// The most micro-batches it held forwarded and not yet backwarded.
    pub peak_in_flight: usize,
}

impl PipelineReport {
    /// The share of the stages' time in the step that they spent not computing: `1 -` the
    /// summed busy time over (stages x the step's wall time).
    pub fn idle_fraction(&self) -> f64 {
        let busy: f64 = self.stages.iter().map(|s| s.busy.as_secs_f64()).sum();
        let whole = self.step.as_secs_f64() * self.stages.len() as f64;
        match whole > 0.0 {
            true => (1.0 - busy / whole).max(0.0),
            false => 0.0,
        }
    }
}
