//! Shared pieces of the example binaries: choosing a strategy and its devices from the command
//! line, so every binary switches strategies the same way; the CIFAR-10 networks
//! ([`CifarModel`]); measuring training throughput
//! ([`throughput`]); the scaling model and picture of the `scaling` binary
//! ([`scaling_model`], [`scaling_plot`]); and a small CIFAR-format set for the benchmarks and
//! the binaries' tests ([`cifar10_fixture`], shared with kandle's own tests).

mod cifar_model;
pub use cifar_model::CifarModel;
pub use kandle_testing::cifar10_fixture;
pub mod scaling_model;
pub mod scaling_plot;
pub mod throughput;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use candle_core::Device;
use clap::ValueEnum;
use kandle::Strategy;
use kandle_strategies::pipeline::{PipelineStrategy, Schedule, StageSplit};
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy, ReplicaOptions};

/// The value parser of a flag that counts something and must be at least 1 (a batch size, a
/// number of replicas, steps or repetitions): `0` is refused with an error that names the flag,
/// instead of being quietly raised to 1.
///
/// ```
/// use clap::Parser;
///
/// #[derive(Parser)]
/// struct Args {
///     #[arg(long, value_parser = kandle_examples::at_least_one())]
///     batch_size: usize,
/// }
///
/// let err = Args::try_parse_from(["prog", "--batch-size", "0"]).err().unwrap().to_string();
/// assert!(err.contains("--batch-size") && err.contains("0"), "{err}");
/// assert_eq!(Args::try_parse_from(["prog", "--batch-size", "3"]).unwrap().batch_size, 3);
/// ```
pub fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// What every example binary does first, since a library leaves both to the program: install a
/// logger for kandle's diagnostics (the `log` facade: warnings about skipped steps, early
/// stopping, learning-rate changes; `RUST_LOG` sets the level, `info` by default), and tune the
/// C allocator for training on the CPU ([`kandle::keep_freed_memory`]).
pub fn init() {
    let env = env_logger::Env::default().default_filter_or("info");
    // A second call (a test calling two binaries' code) keeps the first logger.
    let _ = env_logger::Builder::from_env(env)
        .format_timestamp(None)
        .format_target(false)
        .try_init();
    kandle::keep_freed_memory();
}

/// `--backup-dir`, `--backup-every-steps` and `--grace-seconds`, as every training binary takes
/// them.
#[derive(clap::Args, Debug, Clone)]
pub struct BackupArgs {
    /// Back the training state up in this directory, and resume from it when a backup is there
    /// (run the same command again after a crash or a preemption).
    #[arg(long)]
    pub backup_dir: Option<std::path::PathBuf>,
    /// With --backup-dir: back up every this many steps (0: at the end of each epoch).
    #[arg(long, default_value_t = 0)]
    pub backup_every_steps: usize,
    /// After SIGTERM or SIGINT (which stop training after the current step, with a backup
    /// there), exit anyway once this many seconds have passed. Default: wait for the step.
    #[arg(long)]
    pub grace_seconds: Option<f64>,
}

impl BackupArgs {
    /// The `BackupAndRestore` callback these flags ask for, after printing where training
    /// resumes when a backup is there: the program's first line of output, printed by the
    /// chief only (`strategy`'s worker 0), so a multi-worker job says it once.
    pub fn callback(&self, strategy: &dyn Strategy) -> Option<kandle::callbacks::BackupAndRestore> {
        use kandle::callbacks::{BackupAndRestore, SaveFreq};
        let dir = self.backup_dir.as_ref()?;
        let backup = BackupAndRestore::new(dir).save_freq(match self.backup_every_steps {
            0 => SaveFreq::Epoch,
            n => SaveFreq::Steps(n),
        });
        if let Some(line) = backup.pending().filter(|_| strategy.worker().is_chief()) {
            println!("{line}");
        }
        Some(backup)
    }

    /// The stop signal `fit` takes: SIGTERM and SIGINT stop training after the current step
    /// (a second one at once), with `--grace-seconds` as the longest wait.
    pub fn stop_signal(&self) -> kandle::Result<kandle::preemption::StopSignal> {
        let grace = match self.grace_seconds {
            Some(s) if !(s.is_finite() && s >= 0.0) => {
                return Err(kandle::Error::invalid(format!(
                    "--grace-seconds {s}: give a number of seconds, 0 or more"
                )))
            }
            other => other.map(std::time::Duration::from_secs_f64),
        };
        kandle::preemption::StopSignal::on_signals(grace)
    }
}

/// After `fit`: when a stop signal ended it, says where (and, on a backup, that the same
/// command resumes there) on the chief, and ends the process with
/// [`kandle::preemption::EXIT_PREEMPTED`] on every worker, skipping what the program would do
/// after training (the time left is the scheduler's grace period).
pub fn exit_if_preempted(history: &kandle::callbacks::History, chief: bool) {
    let Some(preempted) = &history.preempted else {
        return;
    };
    if chief {
        let resume = match preempted.backed_up {
            true => "; run the same command to resume",
            false => "",
        };
        println!("preempted: {preempted}{resume}");
    }
    std::process::exit(kandle::preemption::EXIT_PREEMPTED);
}

/// `--tensorboard`, `--timeline` and `--timeline-steps`, as every training binary takes them.
#[derive(clap::Args, Debug, Clone)]
pub struct MonitorArgs {
    /// Write TensorBoard logs here (train and validation event files, per-epoch scalars and
    /// each variable's histogram); watch them with: tensorboard --logdir DIR.
    #[arg(long)]
    pub tensorboard: Option<std::path::PathBuf>,
    /// Write a Chrome trace of a window of steps here (open it in Perfetto or
    /// chrome://tracing): where each step's time goes, per replica.
    #[arg(long)]
    pub timeline: Option<std::path::PathBuf>,
    /// The global steps --timeline records, as FIRST..END (END excluded).
    #[arg(long, default_value = "10..20", value_parser = parse_steps)]
    pub timeline_steps: std::ops::Range<usize>,
}

impl MonitorArgs {
    /// The callbacks these flags ask for.
    pub fn callbacks(&self) -> Vec<Box<dyn kandle::callbacks::Callback>> {
        use kandle::callbacks::{Callback, TensorBoard, Timeline};
        let mut callbacks = Vec::new();
        if let Some(dir) = &self.tensorboard {
            callbacks.push(TensorBoard::new(dir).histogram_freq(1).boxed());
        }
        if let Some(path) = &self.timeline {
            callbacks.push(
                Timeline::new(path)
                    .steps(self.timeline_steps.clone())
                    .boxed(),
            );
        }
        callbacks
    }
}

/// `FIRST..END`, a range of steps.
fn parse_steps(text: &str) -> Result<std::ops::Range<usize>, String> {
    let bad = || format!("`{text}`: give the steps as FIRST..END, e.g. 100..120");
    let (first, end) = text.split_once("..").ok_or_else(bad)?;
    let (first, end): (usize, usize) = (
        first.trim().parse().map_err(|_| bad())?,
        end.trim().parse().map_err(|_| bad())?,
    );
    if first >= end {
        return Err(format!("`{text}`: the window is empty"));
    }
    Ok(first..end)
}

/// `--gradient-accumulation-steps` and `--dtype-policy`, as every training binary takes them.
#[derive(clap::Args, Debug, Clone)]
pub struct PrecisionArgs {
    /// Sum the gradients of this many batches before each update: an effective batch this many
    /// times --batch-size, in the memory of one.
    #[arg(long, default_value_t = 1, value_parser = at_least_one())]
    pub gradient_accumulation_steps: usize,
    /// float32, mixed_float16 (half-precision compute with a dynamic loss scale) or
    /// mixed_bfloat16; mixed policies compute in half precision on GPUs, and the CPU's kernels
    /// stay float32.
    #[arg(long, default_value = "float32")]
    pub dtype_policy: kandle::DTypePolicy,
}

impl PrecisionArgs {
    /// `model` under the chosen policy.
    pub fn apply(&self, model: kandle::Model) -> kandle::Result<kandle::Model> {
        model.with_dtype_policy(self.dtype_policy)
    }
}

/// The strategies a binary can run under (`--strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StrategyKind {
    /// One device.
    OneDevice,
    /// A replica per device, gradients all-reduced.
    Mirrored,
    /// Variables on the CPU, replicas compute gradients.
    CentralStorage,
    /// Mirrored inside each mpirun worker, all-reduced across workers (feature mpi).
    MultiWorker,
    /// Variables on parameter-server ranks of the mpirun job, workers push gradients and pull
    /// weights (feature mpi; set up with --num-ps, --sync or --async, and --max-staleness).
    ParameterServer,
    /// Model parallelism: the model cut into stages, one per device, micro-batches pipelined
    /// through them (set up with --stages, --micro-batches, --schedule and --stage-starts).
    Pipeline,
}

/// `--stages`, `--micro-batches`, `--schedule` and `--stage-starts`: how `--strategy pipeline`
/// runs, as every training binary takes them.
#[derive(clap::Args, Debug, Clone)]
pub struct PipelineArgs {
    /// With --strategy pipeline: the number of stages, one per device (GPUs when built with
    /// the cuda feature and that many are visible, else CPU stages on threads of their own).
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// With --strategy pipeline: micro-batches per batch.
    #[arg(long, default_value_t = 4)]
    pub micro_batches: usize,
    /// With --strategy pipeline: gpipe (all forwards, then all backwards) or 1f1b (one
    /// forward, one backward: fewer activations held).
    #[arg(long, default_value = "1f1b")]
    pub schedule: Schedule,
    /// With --strategy pipeline: the layers that start stages 1, 2 and so on, comma-separated
    /// (default: stages balanced by each layer's measured time).
    #[arg(long, value_delimiter = ',')]
    pub stage_starts: Vec<String>,
    /// With --strategy pipeline under mpirun (feature mpi): replicas of every stage, the ranks
    /// a mesh of stages x replicas (mpirun -n S*R); --stages is then the ranks' count over R.
    #[arg(long, default_value_t = 1)]
    pub replicas_per_stage: usize,
}

impl Default for PipelineArgs {
    fn default() -> Self {
        Self {
            stages: 2,
            micro_batches: 4,
            schedule: Schedule::default(),
            stage_starts: Vec::new(),
            replicas_per_stage: 1,
        }
    }
}

impl PipelineArgs {
    /// The pipeline these flags describe: under `mpirun` (with the `mpi` feature) one stage per
    /// rank, else `--stages` stages on this process's devices.
    pub fn strategy(&self) -> Result<PipelineStrategy> {
        let split = match self.stage_starts.is_empty() {
            true => StageSplit::default(),
            false => StageSplit::at(self.stage_starts.iter().cloned()),
        };
        let strategy = match under_mpirun() {
            true => self.over_ranks()?,
            false => {
                if self.replicas_per_stage != 1 {
                    bail!("--replicas-per-stage makes a mesh of MPI ranks: run under mpirun");
                }
                PipelineStrategy::new(devices(self.stages)?)?
            }
        };
        Ok(strategy
            .micro_batches(self.micro_batches)
            .schedule(self.schedule)
            .split(split))
    }

    #[cfg(feature = "mpi")]
    fn over_ranks(&self) -> Result<PipelineStrategy> {
        Ok(PipelineStrategy::from_env()?.replicas_per_stage(self.replicas_per_stage)?)
    }

    #[cfg(not(feature = "mpi"))]
    fn over_ranks(&self) -> Result<PipelineStrategy> {
        bail!(
            "--strategy pipeline under mpirun needs the mpi feature: cargo build --release -p \
             kandle-examples --features mpi"
        )
    }
}

/// Whether this process was started by Open MPI's `mpirun`.
fn under_mpirun() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some()
}

/// Builds the chosen strategy over `replicas` devices (per worker, for multi-worker), with the
/// parameter-server flags `ps` and the pipeline flags `pipeline` where the strategy takes them.
pub fn build_strategy_with(
    kind: StrategyKind,
    replicas: usize,
    ps: &PsArgs,
    pipeline: &PipelineArgs,
) -> Result<Arc<dyn Strategy>> {
    match kind {
        StrategyKind::Pipeline => {
            if replicas != 1 {
                bail!(
                    "--strategy pipeline places one copy of the model over --stages devices; \
                     drop --replicas/--gpus or set it to 1"
                );
            }
            Ok(Arc::new(pipeline.strategy()?))
        }
        _ => ps.build_strategy(kind, replicas),
    }
}

/// `--num-ps`, `--sync` / `--async` and `--max-staleness`: how `--strategy parameter-server`
/// runs, as every training binary takes them.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PsArgs {
    /// With --strategy parameter-server: the number of parameter servers, the last ranks of the
    /// mpirun job (default: KANDLE_NUM_PS, else 1).
    #[arg(long)]
    pub num_ps: Option<usize>,
    /// With --strategy parameter-server: synchronous updates (one per global batch, as one
    /// device would train).
    #[arg(long, conflicts_with_all = ["asynchronous", "max_staleness"])]
    pub sync: bool,
    /// With --strategy parameter-server: asynchronous updates (the default).
    #[arg(long = "async", id = "asynchronous")]
    pub asynchronous: bool,
    /// With --strategy parameter-server: apply no update more than this many updates stale
    /// (asynchronous).
    #[arg(long)]
    pub max_staleness: Option<u64>,
}

impl PsArgs {
    /// [`build_strategy`], with these flags for `--strategy parameter-server`.
    pub fn build_strategy(&self, kind: StrategyKind, replicas: usize) -> Result<Arc<dyn Strategy>> {
        match kind {
            StrategyKind::ParameterServer => {
                if replicas != 1 {
                    bail!(
                        "--strategy parameter-server runs one CPU replica per worker; drop \
                         --replicas/--gpus or set it to 1"
                    );
                }
                parameter_server(self, None)
            }
            _ => build_strategy(kind, replicas),
        }
    }
}

/// The devices for `replicas` replicas: the first `replicas` GPUs when kandle was built with
/// `cuda` and that many are visible, otherwise `replicas` CPU replicas.
pub fn devices(replicas: usize) -> Result<Vec<Device>> {
    if replicas == 0 {
        bail!("at least one replica is needed");
    }
    let gpus = kandle::devices::gpus()?;
    if gpus.len() >= replicas {
        return Ok(gpus.into_iter().take(replicas).collect());
    }
    if cfg!(feature = "cuda") {
        bail!(
            "{replicas} GPU(s) requested but {} visible (CUDA_VISIBLE_DEVICES={})",
            gpus.len(),
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        );
    }
    Ok(vec![Device::Cpu; replicas])
}

/// Builds the chosen strategy over `replicas` devices (per worker, for multi-worker).
pub fn build_strategy(kind: StrategyKind, replicas: usize) -> Result<Arc<dyn Strategy>> {
    build_strategy_on(kind, devices(replicas)?, None)
}

/// Builds the chosen strategy with one replica on each of `devices` (per worker, for
/// multi-worker). `timeout` replaces the strategy's default bound on how long a replica or
/// worker may take to answer (60 s), for machines so loaded that a step can take longer.
pub fn build_strategy_on(
    kind: StrategyKind,
    devices: Vec<Device>,
    timeout: Option<Duration>,
) -> Result<Arc<dyn Strategy>> {
    let replicas = devices.len();
    if replicas == 0 {
        bail!("at least one replica is needed");
    }
    Ok(match kind {
        StrategyKind::OneDevice => {
            if replicas != 1 {
                bail!("--strategy one-device runs one replica; use --gpus 1 or another strategy");
            }
            Arc::new(kandle::OneDeviceStrategy::new(devices[0].clone()))
        }
        StrategyKind::Mirrored => {
            Arc::new(MirroredStrategy::new(devices)?.with_options(replica_options(timeout)))
        }
        StrategyKind::CentralStorage => {
            Arc::new(CentralStorageStrategy::new(devices)?.with_options(replica_options(timeout)))
        }
        StrategyKind::MultiWorker => multi_worker(devices, timeout)?,
        StrategyKind::Pipeline => {
            Arc::new(PipelineStrategy::new(devices)?.with_options(replica_options(timeout)))
        }
        StrategyKind::ParameterServer => {
            if devices.iter().any(|d| !d.is_cpu()) || replicas != 1 {
                bail!("--strategy parameter-server runs one CPU replica per worker");
            }
            parameter_server(&PsArgs::default(), timeout)?
        }
    })
}

/// The replicas' options: the defaults, with `timeout` when given.
fn replica_options(timeout: Option<Duration>) -> ReplicaOptions {
    let options = ReplicaOptions::default();
    match timeout {
        Some(t) => options.timeout(t),
        None => options,
    }
}

#[cfg(feature = "mpi")]
fn parameter_server(ps: &PsArgs, timeout: Option<Duration>) -> Result<Arc<dyn Strategy>> {
    let mut strategy = kandle_strategies::ParameterServerStrategy::from_env()?;
    if let Some(n) = ps.num_ps {
        strategy = strategy.num_ps(n);
    }
    if ps.sync {
        strategy = strategy.synchronous();
    }
    if let Some(k) = ps.max_staleness {
        strategy = strategy.max_staleness(k);
    }
    if let Some(t) = timeout {
        strategy = strategy.timeout(t);
    }
    Ok(Arc::new(strategy))
}

#[cfg(not(feature = "mpi"))]
fn parameter_server(_ps: &PsArgs, _timeout: Option<Duration>) -> Result<Arc<dyn Strategy>> {
    bail!(
        "--strategy parameter-server needs the `mpi` feature: cargo build --release -p \
         kandle-examples --features mpi, then mpirun -n W+P <binary> --strategy parameter-server \
         --num-ps P"
    )
}

#[cfg(feature = "mpi")]
fn multi_worker(devices: Vec<Device>, timeout: Option<Duration>) -> Result<Arc<dyn Strategy>> {
    let strategy =
        kandle_strategies::MultiWorkerMirroredStrategy::from_env()?.local_devices(devices)?;
    Ok(Arc::new(strategy.with_options(replica_options(timeout))))
}

#[cfg(not(feature = "mpi"))]
fn multi_worker(_devices: Vec<Device>, _timeout: Option<Duration>) -> Result<Arc<dyn Strategy>> {
    bail!(
        "--strategy multi-worker needs the `mpi` feature: \
         cargo build --release -p kandle-examples --features mpi, then mpirun -n W <binary>"
    )
}
