//! Stopping a run cleanly when its machine is taken away.
//!
//! Cluster schedulers (Slurm, Kubernetes) and spot machines send SIGTERM and give a grace
//! period before they kill; a user at a terminal presses Ctrl-C (SIGINT). A [`StopSignal`]
//! given to `fit` ([`FitOptions::stop_signal`](crate::FitOptions::stop_signal)) turns the first
//! such signal into a request: `fit` finishes the step it is in, writes the
//! [`BackupAndRestore`](crate::callbacks::BackupAndRestore) backup at that step (atomically, as
//! every backup), runs `on_train_end` and returns the history so far, marked
//! [`preempted`](crate::callbacks::History::preempted). Running the same program again
//! resumes at that step. A second signal ends the process at once (status 128 + the signal's
//! number, as a shell reports a process killed by it); the last whole backup stays.
//!
//! Under `mpirun` the workers agree: a signal received by any one of them stops every worker
//! after the same step, and one backup is written, through the reduction the workers already
//! share (see [`WorkerHooks::all_gather_workers`](crate::strategy::WorkerHooks)).
//!
//! The library installs nothing by itself: a program asks for the signals with
//! [`StopSignal::on_signals`]; [`StopSignal::new`] gives a signal only the program raises
//! ([`StopSignal::request`]), for tests and for programs with their own notion of preemption
//! (a cloud's metadata notice, say).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{Error, Result};

/// The exit status the example programs use after a preemption, so a job script can tell a
/// clean stop that will resume from a failure: 75, `EX_TEMPFAIL` ("try again later").
pub const EXIT_PREEMPTED: i32 = 75;

/// Where a `fit` stopped for a [`StopSignal`]: a backup written there resumes at `step` of
/// `epoch` (both counted from 0; `step` is the number of steps done in that epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preempted {
    /// The epoch the run stopped in.
    pub epoch: usize,
    /// Steps of that epoch done.
    pub step: usize,
    /// What raised the signal (`SIGTERM`, ...).
    pub reason: String,
    /// Whether a backup was written there (a `BackupAndRestore` callback was given).
    pub backed_up: bool,
}

impl std::fmt::Display for Preempted {
    /// `stopped by SIGTERM at epoch 2 step 17 (a backup was written there)`, epochs counted
    /// from 1 as in the progress lines.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped by {} at epoch {} step {} ({})",
            self.reason,
            self.epoch + 1,
            self.step,
            match self.backed_up {
                true => "a backup was written there",
                false => "no backup: give fit a BackupAndRestore callback to resume",
            }
        )
    }
}

/// A request to stop at the end of the current step, raised by a signal or by the program.
/// Cheap to clone: every clone sees the same request.
///
/// ```
/// use kandle::preemption::StopSignal;
///
/// let stop = StopSignal::new();
/// assert!(!stop.requested());
/// stop.clone().request();
/// assert!(stop.requested());
/// assert_eq!(stop.reason(), Some("requested by the program".to_string()));
/// ```
#[derive(Clone, Debug, Default)]
pub struct StopSignal {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    requested: AtomicBool,
    /// The signal that raised the request, 0 when the program did.
    signal: AtomicI32,
}

impl StopSignal {
    /// A signal only [`Self::request`] raises.
    pub fn new() -> Self {
        Self::default()
    }

    /// A signal raised by the process's first SIGTERM or SIGINT. A second one ends the process
    /// at once with status 128 + its number. With `grace`, the process also ends that long
    /// after the first signal if it is still running then (a step or a backup that hangs, a
    /// worker that never answers), so it leaves before the scheduler's own kill.
    ///
    /// Unix only; elsewhere an error. Each call listens on its own thread; a program needs one.
    pub fn on_signals(grace: Option<Duration>) -> Result<Self> {
        let stop = Self::new();
        listen(stop.clone(), grace)?;
        Ok(stop)
    }

    /// Raises the request (what the first signal does).
    pub fn request(&self) {
        self.inner.requested.store(true, Ordering::SeqCst);
    }

    /// Whether the request was raised.
    pub fn requested(&self) -> bool {
        self.inner.requested.load(Ordering::SeqCst)
    }

    /// What raised the request (`SIGTERM`, `SIGINT`, or the program), when it was raised.
    pub fn reason(&self) -> Option<String> {
        if !self.requested() {
            return None;
        }
        Some(match self.inner.signal.load(Ordering::SeqCst) {
            0 => "requested by the program".to_string(),
            n => signal_name(n),
        })
    }
}

#[cfg(unix)]
fn signal_name(n: i32) -> String {
    match n {
        signal_hook::consts::SIGTERM => "SIGTERM".into(),
        signal_hook::consts::SIGINT => "SIGINT".into(),
        n => format!("signal {n}"),
    }
}

#[cfg(not(unix))]
fn signal_name(n: i32) -> String {
    format!("signal {n}")
}

#[cfg(unix)]
fn listen(stop: StopSignal, grace: Option<Duration>) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use signal_hook::iterator::Signals;

    let mut signals = Signals::new([SIGTERM, SIGINT])
        .map_err(|e| Error::invalid(format!("cannot listen for SIGTERM and SIGINT: {e}")))?;
    std::thread::Builder::new()
        .name("kandle-stop-signal".into())
        .spawn(move || {
            for signal in signals.forever() {
                if stop.requested() {
                    // The second signal: no more waiting.
                    std::process::exit(128 + signal);
                }
                stop.inner.signal.store(signal, Ordering::SeqCst);
                stop.request();
                log::warn!("{}: stopping after the current step", signal_name(signal));
                if let Some(grace) = grace {
                    std::thread::spawn(move || {
                        std::thread::sleep(grace);
                        eprintln!(
                            "still running {:.0} s after {}: exiting",
                            grace.as_secs_f64(),
                            signal_name(signal)
                        );
                        std::process::exit(128 + signal);
                    });
                }
            }
        })
        .map_err(|e| Error::invalid(format!("cannot start the signal thread: {e}")))?;
    Ok(())
}

#[cfg(not(unix))]
fn listen(_stop: StopSignal, _grace: Option<Duration>) -> Result<()> {
    Err(Error::invalid(
        "StopSignal::on_signals listens for Unix signals; on this platform call \
         StopSignal::request from the program",
    ))
}
