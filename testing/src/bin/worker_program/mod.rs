//! What the worker programs behind the MPI tests (`kandle-mpi-check`, `kandle-ps-check`) share:
//! the run of `main` (kandle's log on stderr, each error printed as one line, the exit status),
//! the command line (the options both take, [`Common`], numbers and time-outs), and the tasks
//! both run under their strategy ([`tasks`]).

use std::process::ExitCode;
use std::time::Duration;

use kandle::{Error, Result};

pub mod tasks;

/// Runs a worker program named `name`: installs a logger that prints kandle's diagnostics on
/// stderr (where the tests read them), parses the arguments (an error: status 2) and runs (an
/// error: status 1). An error is printed as one line `name: error`.
pub fn main<A>(
    name: &str,
    parse: impl FnOnce() -> Result<A>,
    run: impl FnOnce(&A) -> std::result::Result<(), String>,
) -> ExitCode {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            report(name, &e);
            return ExitCode::from(2);
        }
    };
    // `run` drops the strategy before returning; after a failed step that skips MPI_Finalize,
    // so the process exits at once, and mpirun ends the other ranks.
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(name, &e);
            ExitCode::FAILURE
        }
    }
}

/// The task and the options both worker programs take.
#[derive(Debug)]
pub struct Common {
    /// The task to run (the one argument that is not an option).
    pub task: String,
    /// `--timeout-secs T`: the strategy's time-out.
    pub timeout_secs: Option<f64>,
    /// `--out FILE`: where the chief writes its result.
    pub out: Option<String>,
    /// `--model plain|bn|graph|three-in-two-out` (default `plain`).
    pub model: String,
    /// `--samples S`: digits in the equivalence run.
    pub samples: usize,
    /// `--accumulate K`: the equivalence run in micro-batches, gradients accumulated over `K`.
    pub accumulate: usize,
    /// `--dtype-policy P`: the equivalence run's dtype policy.
    pub dtype_policy: kandle::DTypePolicy,
    /// `--epochs E`.
    pub epochs: Option<usize>,
    /// `--min-accuracy A` (default 0.97).
    pub min_accuracy: f64,
    /// `--stall-worker R`: the worker that stalls.
    pub stall_worker: Option<usize>,
    /// `--stall-after-steps K`: it stalls before step `K + 1`.
    pub stall_after_steps: usize,
    /// `--fail`: the stalling worker fails with an error instead.
    pub fail: bool,
    /// `--state FILE`: where `resume` saves the training state.
    pub state: Option<String>,
    /// `--dir DIR`: `backup`'s directory.
    pub dir: Option<String>,
    /// `--every N`: `backup` takes a backup every N steps.
    pub every: Option<usize>,
    /// `--keep-backups`: `backup` leaves its backup when it completes.
    pub keep_backups: bool,
    /// `--step-millis MS`: `backup` pauses after each step.
    pub step_millis: u64,
}

impl Default for Common {
    fn default() -> Self {
        Self {
            task: String::new(),
            timeout_secs: None,
            out: None,
            model: "plain".into(),
            samples: crate::equivalence_run::SAMPLES,
            accumulate: 1,
            dtype_policy: kandle::DTypePolicy::float32(),
            epochs: None,
            min_accuracy: 0.97,
            stall_worker: None,
            stall_after_steps: 0,
            fail: false,
            state: None,
            dir: None,
            every: None,
            keep_backups: false,
            step_millis: 0,
        }
    }
}

impl Common {
    /// `--out FILE`, which the task needs.
    pub fn out(&self) -> Result<&str> {
        self.path("--out", &self.out)
    }

    /// The path option `name` (with its `value`), which the task needs.
    pub fn path<'a>(&self, name: &str, value: &'a Option<String>) -> Result<&'a str> {
        value
            .as_deref()
            .ok_or_else(|| Error::invalid(format!("{} needs {name} PATH", self.task)))
    }

    /// `--timeout-secs`, or the strategies' default of 60 s.
    pub fn timeout(&self) -> Result<Duration> {
        self.timeout_secs
            .map_or(Ok(Duration::from_secs(60)), timeout)
    }

    /// The equivalence run's network that `--model` names.
    pub fn equivalence_model(&self) -> Result<kandle::Network> {
        match self.model.as_str() {
            "plain" => Ok(crate::equivalence_run::plain_cnn().into()),
            "bn" => Ok(crate::equivalence_run::bn_cnn().into()),
            "graph" => Ok(crate::equivalence_run::graph_cnn().into()),
            "three-in-two-out" => Ok(crate::equivalence_run::three_in_two_out().into()),
            other => Err(Error::invalid(format!(
                "--model: `{other}` is not plain, bn, graph or three-in-two-out"
            ))),
        }
    }
}

/// Reads the command line: the common options and the task into the returned [`Common`], a
/// program's own options through `accept(own, option, value)`, which returns `Ok(false)` for
/// an option it does not know and reads an option's values with `value()`. `tasks` names the
/// tasks, for the error when none is given.
pub fn parse<T>(
    own: &mut T,
    mut accept: impl FnMut(&mut T, &str, &mut dyn FnMut() -> Result<String>) -> Result<bool>,
    tasks: &str,
) -> Result<Common> {
    let mut common = Common::default();
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| Error::invalid(format!("{arg} needs a value")))
        };
        match arg.as_str() {
            "--timeout-secs" => common.timeout_secs = Some(number(&arg, value()?)?),
            "--out" => common.out = Some(value()?),
            "--model" => common.model = value()?,
            "--samples" => common.samples = number(&arg, value()?)?,
            "--accumulate" => common.accumulate = number(&arg, value()?)?,
            "--dtype-policy" => common.dtype_policy = value()?.parse()?,
            "--epochs" => common.epochs = Some(number(&arg, value()?)?),
            "--min-accuracy" => common.min_accuracy = number(&arg, value()?)?,
            "--stall-worker" => common.stall_worker = Some(number(&arg, value()?)?),
            "--stall-after-steps" => common.stall_after_steps = number(&arg, value()?)?,
            "--fail" => common.fail = true,
            "--state" => common.state = Some(value()?),
            "--dir" => common.dir = Some(value()?),
            "--every" => common.every = Some(number(&arg, value()?)?),
            "--keep-backups" => common.keep_backups = true,
            "--step-millis" => common.step_millis = number(&arg, value()?)?,
            task if !task.starts_with('-') && common.task.is_empty() => common.task = task.into(),
            other => {
                if !accept(own, other, &mut value)? {
                    return Err(Error::invalid(format!("unknown argument `{other}`")));
                }
            }
        }
    }
    if common.task.is_empty() {
        return Err(Error::invalid(format!("no task given: {tasks}")));
    }
    Ok(common)
}

/// The value of option `name` as a number.
pub fn number<T: std::str::FromStr>(name: &str, v: String) -> Result<T> {
    v.parse()
        .map_err(|_| Error::invalid(format!("{name}: `{v}` is not a valid number")))
}

/// `--timeout-secs` as a duration.
pub fn timeout(secs: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(secs)
        .map_err(|e| Error::invalid(format!("--timeout-secs {secs}: {e}")))
}

/// Prints an error on stderr in one write, so that the lines of several ranks, which `mpirun`
/// forwards to one stream, do not interleave.
fn report(name: &str, error: &dyn std::fmt::Display) {
    use std::io::Write;
    let line = format!("{name}: {error}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// kandle's diagnostics (the `log` facade) on stderr.
struct StderrLogger;

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("[{}] {}", record.level(), record.args());
        }
    }

    fn flush(&self) {}
}

static LOGGER: StderrLogger = StderrLogger;
