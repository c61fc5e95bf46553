//! What the worker programs behind the MPI tests (`kandle-mpi-check`, `kandle-ps-check`) share:
//! the run of `main` (kandle's log on stderr, each error printed as one line, the exit status),
//! and the parsing of numbers and time-outs from the command line.

use std::process::ExitCode;
use std::time::Duration;

use kandle::{Error, Result};

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
