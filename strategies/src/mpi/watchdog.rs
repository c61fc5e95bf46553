//! Liveness across workers: before every collective, each worker proves it has reached the same
//! point, so a worker that died or stalls is named within a bounded time instead of hanging
//! everyone inside MPI.
//!
//! The protocol, for the `n`-th guarded operation of the process (every worker runs the same
//! sequence):
//! 1. every worker but the chief sends a *heartbeat* `[n, phase]` to the chief with a buffered
//!    send (`MPI_Bsend`: it never waits for the receiver);
//! 2. the chief polls (`MPI_Improbe` with short sleeps) for every worker's heartbeat until
//!    `timeout` after it got there itself. A worker whose heartbeat is missing fails the chief
//!    with `worker 1: did not reach training step 57 within 60 s`; one that reports another
//!    phase (the workers disagree on the number of steps) fails it too;
//! 3. then the chief sends *go* to every worker, or, on a failure, *abort* with the culprit's
//!    rank to the workers that did report, so they fail with the same diagnosis;
//! 4. a worker waits for the chief's answer for twice the timeout (the chief may itself spend one
//!    timeout waiting for another worker); without one it fails naming `worker 0 (chief)`. On
//!    *go* it sends *ready* and enters the collective;
//! 5. the chief waits for every *ready*, with the same deadline, before it enters the collective
//!    too. A worker that stopped while it waited for *go* (the longest wait of a fast worker) is
//!    named here: `did not join its collective`.
//!
//! The collective itself is non-blocking and watched by a [`Vigil`] against a deadline, answering
//! pings meanwhile: an MPI request through [`complete`], an NCCL all-reduce on the GPU by
//! polling its completion event and the communicators' asynchronous errors. A worker can still
//! stop in the short window between *ready* and the end of the collective; then the collective
//! cannot complete. The worker whose deadline passes pings the others ([`unresponsive`]) to name
//! those that do not answer; as MPI cannot cancel a collective, an MPI one ends the job with
//! `MPI_Abort`, while NCCL communicators are aborted and the step returns the error.

use std::fmt;
use std::time::{Duration, Instant};

use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::{Error, Result};

use super::poll::Backoff;
use super::{seconds, worker_label};

/// Tag of a worker's heartbeat to the chief: `[operation, phase kind, step]`.
const HEARTBEAT: i32 = 0x4b01;
/// Tag of the chief's go-ahead: `[operation, 0, 0]`.
const GO: i32 = 0x4b02;
/// Tag of the chief's notice that a worker failed the rendezvous: `[operation, culprit, why]`.
const ABORT: i32 = 0x4b03;
/// Tag of a worker's last word before it enters the collective: `[operation, 0, 0]`.
const READY: i32 = 0x4b04;
/// Tags of the liveness check run when a collective does not complete: `[operation, 0, 0]`.
const PING: i32 = 0x4b05;
const PONG: i32 = 0x4b06;

/// Why an abort was sent, in the notice's third word.
const LATE: u64 = 1;
const DISAGREES: u64 = 2;

/// How long a worker whose collective did not complete waits for the others to answer a ping.
const PING_WAIT: Duration = Duration::from_secs(2);

/// Where a worker is when it reaches a guarded collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The checks and the chief's weight broadcast when a model is distributed.
    Distribute,
    /// The creation of the NCCL communicators that join every worker's GPUs.
    NcclSetup,
    /// Training step `n` of a model, from 1.
    Train(u64),
    /// Exchange `round` (from 1) of batch-norm statistics, or of their gradients, within
    /// training step `step` (SyncBatchNorm across workers).
    BatchNorm {
        /// The training step, from 1.
        step: u64,
        /// The exchange within the step, from 1.
        round: u32,
    },
    /// The sum across workers of gradient bucket `bucket` (from 0) within training step `step`.
    Bucket {
        /// The training step, from 1.
        step: u64,
        /// The bucket, from 0 (the last layers' first).
        bucket: u32,
    },
    /// Evaluation step `n` of a model, from 1.
    Test(u64),
    /// The check, when `fit` starts, that every worker resumes from the same backup.
    Resume,
    /// A direct call of
    /// [`MultiWorkerMirroredStrategy::all_reduce_sum`](crate::MultiWorkerMirroredStrategy::all_reduce_sum),
    /// outside any model.
    Direct,
}

/// Phase kinds in the first word of an encoded phase; a batch-norm round or a gradient bucket
/// sits above the low byte.
const KIND_BITS: u32 = 8;

impl Phase {
    fn encode(self) -> [u64; 2] {
        match self {
            Phase::Distribute => [0, 0],
            Phase::Train(n) => [1, n],
            Phase::Test(n) => [2, n],
            Phase::Direct => [3, 0],
            Phase::BatchNorm { step, round } => [4 | (u64::from(round) << KIND_BITS), step],
            Phase::NcclSetup => [5, 0],
            Phase::Resume => [6, 0],
            Phase::Bucket { step, bucket } => [7 | (u64::from(bucket) << KIND_BITS), step],
        }
    }

    fn decode(words: [u64; 2]) -> Option<Self> {
        let round = u32::try_from(words[0] >> KIND_BITS).ok()?;
        match (words[0] & ((1 << KIND_BITS) - 1), words[1]) {
            (0, _) => Some(Phase::Distribute),
            (1, n) => Some(Phase::Train(n)),
            (2, n) => Some(Phase::Test(n)),
            (3, _) => Some(Phase::Direct),
            (4, step) => Some(Phase::BatchNorm { step, round }),
            (5, _) => Some(Phase::NcclSetup),
            (6, _) => Some(Phase::Resume),
            (7, step) => Some(Phase::Bucket {
                step,
                bucket: round,
            }),
            _ => None,
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Distribute => f.write_str("the distribution of the model"),
            Phase::NcclSetup => f.write_str("the NCCL setup"),
            Phase::Train(n) => write!(f, "training step {n}"),
            Phase::BatchNorm { step, round } => {
                write!(f, "batch-norm exchange {round} of training step {step}")
            }
            Phase::Bucket { step, bucket } => {
                write!(
                    f,
                    "the sum of gradient bucket {bucket} of training step {step}"
                )
            }
            Phase::Test(n) => write!(f, "evaluation step {n}"),
            Phase::Direct => f.write_str("a direct all-reduce"),
            Phase::Resume => f.write_str("the check of the backup to resume from"),
        }
    }
}

/// Blocks until every worker has reached operation `sequence` at `phase`, or fails naming the
/// one that has not (see the module documentation).
pub(crate) fn rendezvous(
    comm: &SimpleCommunicator,
    sequence: u64,
    phase: Phase,
    timeout: Duration,
) -> Result<()> {
    if comm.size() <= 1 {
        return Ok(());
    }
    if comm.rank() == 0 {
        chief_gathers(comm, sequence, phase, timeout)
    } else {
        worker_reports(comm, sequence, phase, timeout)
    }
}

/// A worker that failed a gather: its rank, why (for the abort notice), and the error.
type Failure = (i32, u64, Error);

/// The chief collects one `tag` message from every worker until `timeout` passes. `check`
/// judges each message; the first complaint, or the first worker still missing at the deadline,
/// is the failure. Returns which workers answered.
fn gather(
    comm: &SimpleCommunicator,
    tag: i32,
    timeout: Duration,
    missing: impl Fn(usize) -> Error,
    check: impl Fn(i32, [u64; 3]) -> Option<Error>,
) -> (Vec<bool>, Option<Failure>) {
    let size = comm.size();
    let deadline = Instant::now() + timeout;
    let mut arrived = vec![false; size as usize];
    arrived[0] = true;
    let mut backoff = Backoff::default();
    while arrived.iter().any(|a| !a) {
        let mut progressed = false;
        for rank in 1..size {
            if arrived[rank as usize] {
                continue;
            }
            let Some((message, _)) = comm
                .process_at_rank(rank)
                .immediate_matched_probe_with_tag(tag)
            else {
                continue;
            };
            let mut words = [0u64; 3];
            message.matched_receive_into(&mut words[..]);
            arrived[rank as usize] = true;
            progressed = true;
            if let Some(error) = check(rank, words) {
                return (arrived, Some((rank, DISAGREES, error)));
            }
        }
        if progressed {
            continue;
        }
        if Instant::now() >= deadline {
            let late = arrived.iter().position(|a| !a).unwrap_or(1);
            return (arrived, Some((late as i32, LATE, missing(late))));
        }
        backoff.wait();
    }
    (arrived, None)
}

/// Names the workers after `first` that have not arrived either, for an error message.
fn also_missing(arrived: &[bool], first: usize) -> String {
    let others: Vec<String> = arrived
        .iter()
        .enumerate()
        .skip(first + 1)
        .filter(|(_, a)| !**a)
        .map(|(r, _)| r.to_string())
        .collect();
    if others.is_empty() {
        String::new()
    } else {
        format!(" (nor did worker(s) {})", others.join(", "))
    }
}

fn chief_gathers(
    comm: &SimpleCommunicator,
    sequence: u64,
    phase: Phase,
    timeout: Duration,
) -> Result<()> {
    let size = comm.size();
    let wait = seconds(timeout);
    let (arrived, failure) = gather(
        comm,
        HEARTBEAT,
        timeout,
        |late| Error::Replica {
            replica: worker_label(late),
            reason: format!("did not reach {phase} within {wait}"),
        },
        |rank, words| {
            let theirs = Phase::decode([words[1], words[2]]);
            (words[0] != sequence || theirs != Some(phase)).then(|| {
                let at = theirs.map_or_else(|| "an unknown phase".to_string(), |p| p.to_string());
                Error::Replica {
                    replica: worker_label(rank as usize),
                    reason: format!(
                        "reached {at} (operation {}) while the chief is at {phase} \
                         (operation {sequence}): the workers ran different steps",
                        words[0]
                    ),
                }
            })
        },
    );
    if let Some((culprit, why, error)) = failure {
        // Everyone who reported waits for an answer (a late culprit does not).
        for rank in 1..size {
            if arrived[rank as usize] {
                comm.process_at_rank(rank)
                    .buffered_send_with_tag(&[sequence, culprit as u64, why][..], ABORT);
            }
        }
        return Err(match (error, why) {
            (Error::Replica { replica, reason }, LATE) => Error::Replica {
                replica,
                reason: reason + &also_missing(&arrived, culprit as usize),
            },
            (error, _) => error,
        });
    }
    for rank in 1..size {
        comm.process_at_rank(rank)
            .buffered_send_with_tag(&[sequence, 0, 0][..], GO);
    }
    // A worker that stopped while it waited for the go-ahead is caught here, before the chief
    // commits to a collective that could not complete.
    let (arrived, failure) = gather(
        comm,
        READY,
        timeout,
        |late| Error::Replica {
            replica: worker_label(late),
            reason: format!("reached {phase} but did not join its collective within {wait}"),
        },
        |rank, words| {
            (words[0] != sequence).then(|| Error::Replica {
                replica: worker_label(rank as usize),
                reason: format!(
                    "confirmed operation {} while the chief is at {phase} (operation {sequence})",
                    words[0]
                ),
            })
        },
    );
    match failure {
        None => Ok(()),
        Some((culprit, _, Error::Replica { replica, reason })) => Err(Error::Replica {
            replica,
            reason: reason + &also_missing(&arrived, culprit as usize),
        }),
        Some((_, _, error)) => Err(error),
    }
}

/// Tags of other protocols that the chief may send a worker waiting at a rendezvous (a
/// pipeline's requests for a stage's state, and its activations and gradients): left for
/// their handler, never taken for the watchdog's.
pub(crate) const SIDE_TAGS: std::ops::RangeInclusive<i32> = 0x5f00..=0x7fff;

fn is_side_tag(tag: i32) -> bool {
    SIDE_TAGS.contains(&tag)
}

/// What a worker does for another protocol while it waits at a rendezvous (a pipeline stage
/// answers the chief's requests for its state), set by the model that needs it.
type SideDuty = std::sync::Arc<dyn Fn(&SimpleCommunicator) + Send + Sync>;

static SIDE_DUTY: std::sync::Mutex<Option<SideDuty>> = std::sync::Mutex::new(None);

/// Sets (or clears) what this process does for another protocol while it waits at a
/// rendezvous.
pub(crate) fn set_side_duty(duty: Option<SideDuty>) {
    if let Ok(mut slot) = SIDE_DUTY.lock() {
        *slot = duty;
    }
}

fn run_side_duty(comm: &SimpleCommunicator) {
    let duty = SIDE_DUTY.lock().ok().and_then(|slot| slot.clone());
    if let Some(duty) = duty {
        duty(comm);
    }
}

fn worker_reports(
    comm: &SimpleCommunicator,
    sequence: u64,
    phase: Phase,
    timeout: Duration,
) -> Result<()> {
    let [kind, step] = phase.encode();
    let chief = comm.process_at_rank(0);
    chief.buffered_send_with_tag(&[sequence, kind, step][..], HEARTBEAT);
    let patience = timeout * 2;
    let deadline = Instant::now() + patience;
    let mut backoff = Backoff::default();
    loop {
        // The chief's messages of other protocols (a pipeline's request for this rank's
        // state) wait for their own handler, which runs meanwhile.
        let ours = [GO, ABORT]
            .into_iter()
            .find_map(|tag| chief.immediate_matched_probe_with_tag(tag))
            .or_else(|| match chief.immediate_probe() {
                Some(status) if !is_side_tag(status.tag()) => {
                    chief.immediate_matched_probe_with_tag(status.tag())
                }
                _ => None,
            });
        if ours.is_none() {
            run_side_duty(comm);
        }
        if let Some((message, status)) = ours {
            let mut words = [0u64; 3];
            message.matched_receive_into(&mut words[..]);
            return match status.tag() {
                GO if words[0] == sequence => {
                    chief.buffered_send_with_tag(&[sequence, 0, 0][..], READY);
                    Ok(())
                }
                ABORT => {
                    let culprit = words[1] as usize;
                    Err(Error::Replica {
                        replica: worker_label(culprit),
                        reason: if words[2] == LATE {
                            format!(
                                "did not reach {phase} within {} (reported by the chief)",
                                seconds(timeout)
                            )
                        } else {
                            format!(
                                "was not at {phase} with the others: the workers ran different \
                                 steps (reported by the chief)"
                            )
                        },
                    })
                }
                tag => Err(Error::Replica {
                    replica: worker_label(0),
                    reason: format!(
                        "sent message tag {tag:#x} for operation {} while this worker waits at \
                         {phase} (operation {sequence})",
                        words[0]
                    ),
                }),
            };
        }
        if Instant::now() >= deadline {
            return Err(Error::Replica {
                replica: worker_label(0),
                reason: format!(
                    "did not reach {phase} within {} (twice the timeout, as the chief may wait \
                     one timeout for another worker)",
                    seconds(patience)
                ),
            });
        }
        backoff.wait();
    }
}

/// Watches a collective once it has started, whether MPI's or NCCL's: each [`wait`](Self::wait)
/// answers the other workers' pings and sleeps a little, until the deadline. The deadline is the
/// timeout for the chief, which starts a collective last, and twice that for the others, who may
/// start it while the chief still waits up to a timeout for another worker to confirm.
pub(crate) struct Vigil<'c> {
    comm: &'c SimpleCommunicator,
    sequence: u64,
    deadline: Instant,
    patience: Duration,
    backoff: Backoff,
}

impl<'c> Vigil<'c> {
    /// A vigil over operation `sequence`, started now.
    pub(crate) fn new(comm: &'c SimpleCommunicator, sequence: u64, timeout: Duration) -> Self {
        let patience = if comm.rank() == 0 {
            timeout
        } else {
            timeout * 2
        };
        Self {
            comm,
            sequence,
            deadline: Instant::now() + patience,
            patience,
            backoff: Backoff::default(),
        }
    }

    /// Answers pending pings and waits a little; `false` once the deadline has passed.
    pub(crate) fn wait(&mut self) -> bool {
        answer_pings(self.comm);
        if Instant::now() >= self.deadline {
            return false;
        }
        self.backoff.wait();
        true
    }

    /// The communicator the vigil answers pings on.
    pub(crate) fn communicator(&self) -> &'c SimpleCommunicator {
        self.comm
    }

    /// How long the collective was given, for messages (`60 s`).
    pub(crate) fn patience(&self) -> String {
        seconds(self.patience)
    }

    /// After the deadline: the workers that do not answer a ping (see [`unresponsive`]), or a
    /// sentence saying that every worker still answers.
    pub(crate) fn diagnosis(&self) -> String {
        let silent = unresponsive(self.comm, self.sequence);
        if silent.is_empty() {
            "every worker still answers, so the collective itself is stuck".to_string()
        } else {
            format!("{} stopped answering during it", silent.join(", "))
        }
    }
}

/// Polls a non-blocking MPI collective until it completes or the vigil ends. On time-out the
/// request is handed back unfinished: MPI still owns its buffers, so the caller must end the job
/// without dropping it (after naming the culprit with [`Vigil::diagnosis`]).
pub(crate) fn complete<'a, D: ?Sized, S: Scope<'a>>(
    vigil: &mut Vigil<'_>,
    mut request: Request<'a, D, S>,
) -> std::result::Result<(), Request<'a, D, S>> {
    loop {
        match request.test() {
            Ok(_) => return Ok(()),
            Err(pending) => request = pending,
        }
        if !vigil.wait() {
            return Err(request);
        }
    }
}

/// Answers every ping waiting for this worker.
fn answer_pings(comm: &SimpleCommunicator) {
    while let Some((message, status)) = comm.any_process().immediate_matched_probe_with_tag(PING) {
        let mut words = [0u64; 3];
        message.matched_receive_into(&mut words[..]);
        comm.process_at_rank(status.source_rank())
            .buffered_send_with_tag(&words[..], PONG);
    }
}

/// After a collective did not complete: pings every other worker and returns, as labels, those
/// that do not answer within a couple of seconds (stopped, or dead without mpirun noticing).
fn unresponsive(comm: &SimpleCommunicator, sequence: u64) -> Vec<String> {
    let me = comm.rank();
    let size = comm.size();
    for rank in (0..size).filter(|&r| r != me) {
        comm.process_at_rank(rank)
            .buffered_send_with_tag(&[sequence, 0, 0][..], PING);
    }
    let mut answered: Vec<bool> = (0..size).map(|r| r == me).collect();
    let deadline = Instant::now() + PING_WAIT;
    let mut backoff = Backoff::default();
    while answered.iter().any(|a| !a) && Instant::now() < deadline {
        answer_pings(comm);
        for rank in 0..size {
            if answered[rank as usize] {
                continue;
            }
            if let Some((message, _)) = comm
                .process_at_rank(rank)
                .immediate_matched_probe_with_tag(PONG)
            {
                let mut words = [0u64; 3];
                message.matched_receive_into(&mut words[..]);
                answered[rank as usize] = true;
            }
        }
        backoff.wait();
    }
    answered
        .iter()
        .enumerate()
        .filter(|(_, a)| !**a)
        .map(|(r, _)| worker_label(r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_round_trip_and_read_well() {
        for p in [
            Phase::Distribute,
            Phase::NcclSetup,
            Phase::Train(57),
            Phase::BatchNorm {
                step: 57,
                round: 300,
            },
            Phase::Test(3),
            Phase::Direct,
            Phase::Resume,
            Phase::Bucket { step: 9, bucket: 4 },
        ] {
            assert_eq!(Phase::decode(p.encode()), Some(p));
        }
        assert_eq!(Phase::decode([9, 9]), None);
        assert_eq!(Phase::Train(57).to_string(), "training step 57");
        assert_eq!(
            Phase::BatchNorm { step: 4, round: 2 }.to_string(),
            "batch-norm exchange 2 of training step 4"
        );
        assert_eq!(
            Phase::Bucket { step: 9, bucket: 4 }.to_string(),
            "the sum of gradient bucket 4 of training step 9"
        );
        assert_eq!(worker_label(0), "worker 0 (chief)");
        assert_eq!(worker_label(1), "worker 1");
    }
}
