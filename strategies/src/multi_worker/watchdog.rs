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
//!    timeout waiting for another worker); without one it fails naming `worker 0 (chief)`.
//!
//! Only after *go* does the collective run, itself non-blocking and polled against a deadline by
//! [`complete`].

use std::fmt;
use std::time::{Duration, Instant};

use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::{Error, Result};

/// Tag of a worker's heartbeat to the chief.
const HEARTBEAT: i32 = 0x4b01;
/// Tag of the chief's go-ahead.
const GO: i32 = 0x4b02;
/// Tag of the chief's notice that a worker failed the rendezvous.
const ABORT: i32 = 0x4b03;

/// Why an abort was sent, in the notice's third word.
const LATE: u64 = 1;
const DISAGREES: u64 = 2;

/// Where a worker is when it reaches a guarded collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The chief's weights being broadcast when a model is distributed.
    Distribute,
    /// Training step `n` of a model, from 1.
    Train(u64),
    /// Evaluation step `n` of a model, from 1.
    Test(u64),
}

impl Phase {
    fn encode(self) -> [u64; 2] {
        match self {
            Phase::Distribute => [0, 0],
            Phase::Train(n) => [1, n],
            Phase::Test(n) => [2, n],
        }
    }

    fn decode(words: [u64; 2]) -> Option<Self> {
        match words {
            [0, _] => Some(Phase::Distribute),
            [1, n] => Some(Phase::Train(n)),
            [2, n] => Some(Phase::Test(n)),
            _ => None,
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Distribute => f.write_str("the initial weight broadcast"),
            Phase::Train(n) => write!(f, "training step {n}"),
            Phase::Test(n) => write!(f, "evaluation step {n}"),
        }
    }
}

/// Sleeps a little longer each time, from a yield to 2 ms, so waiting costs little CPU (the
/// other workers may share the cores) and little latency.
struct Backoff(u32);

impl Backoff {
    fn wait(&mut self) {
        if self.0 < 8 {
            std::thread::yield_now();
        } else {
            let micros = 50u64 << (self.0 - 8).min(5);
            std::thread::sleep(Duration::from_micros(micros.min(2000)));
        }
        self.0 = self.0.saturating_add(1);
    }
}

fn worker_label(rank: usize) -> String {
    if rank == 0 {
        "worker 0 (chief)".into()
    } else {
        format!("worker {rank}")
    }
}

fn seconds(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
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

fn chief_gathers(
    comm: &SimpleCommunicator,
    sequence: u64,
    phase: Phase,
    timeout: Duration,
) -> Result<()> {
    let size = comm.size();
    let deadline = Instant::now() + timeout;
    let mut arrived = vec![false; size as usize];
    arrived[0] = true;
    let mut backoff = Backoff(0);
    let mut failure: Option<(i32, u64, Error)> = None;
    while failure.is_none() && arrived.iter().any(|a| !a) {
        let mut progressed = false;
        for rank in 1..size {
            if arrived[rank as usize] {
                continue;
            }
            let Some((message, _)) = comm
                .process_at_rank(rank)
                .immediate_matched_probe_with_tag(HEARTBEAT)
            else {
                continue;
            };
            let mut words = [0u64; 3];
            message.matched_receive_into(&mut words[..]);
            arrived[rank as usize] = true;
            progressed = true;
            let theirs = Phase::decode([words[1], words[2]]);
            if words[0] != sequence || theirs != Some(phase) {
                let at = theirs.map_or_else(|| "an unknown phase".to_string(), |p| p.to_string());
                failure = Some((
                    rank,
                    DISAGREES,
                    Error::Replica {
                        replica: worker_label(rank as usize),
                        reason: format!(
                            "reached {at} (operation {}) while the chief is at {phase} \
                             (operation {sequence}): the workers ran different steps",
                            words[0]
                        ),
                    },
                ));
                break;
            }
        }
        if failure.is_some() || progressed {
            continue;
        }
        if Instant::now() >= deadline {
            let late = arrived.iter().position(|a| !a).unwrap_or(1);
            let others: Vec<String> = arrived
                .iter()
                .enumerate()
                .skip(late + 1)
                .filter(|(_, a)| !**a)
                .map(|(r, _)| r.to_string())
                .collect();
            let also = if others.is_empty() {
                String::new()
            } else {
                format!(" (nor did worker(s) {})", others.join(", "))
            };
            failure = Some((
                late as i32,
                LATE,
                Error::Replica {
                    replica: worker_label(late),
                    reason: format!("did not reach {phase} within {}{also}", seconds(timeout)),
                },
            ));
            break;
        }
        backoff.wait();
    }
    match failure {
        None => {
            for rank in 1..size {
                comm.process_at_rank(rank)
                    .buffered_send_with_tag(&[sequence, 0, 0][..], GO);
            }
            Ok(())
        }
        Some((culprit, why, error)) => {
            for rank in 1..size {
                // Everyone who reported is waiting for an answer (a late culprit is not).
                if arrived[rank as usize] {
                    comm.process_at_rank(rank)
                        .buffered_send_with_tag(&[sequence, culprit as u64, why][..], ABORT);
                }
            }
            Err(error)
        }
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
    let mut backoff = Backoff(0);
    loop {
        if let Some((message, status)) = chief.immediate_matched_probe() {
            let mut words = [0u64; 3];
            message.matched_receive_into(&mut words[..]);
            return match status.tag() {
                GO if words[0] == sequence => Ok(()),
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

/// Polls a non-blocking collective until it completes or `deadline` passes. On time-out the
/// request is handed back unfinished: MPI still owns its buffers, so the caller must end the
/// job without dropping it.
pub(crate) fn complete<'a, D: ?Sized, S: Scope<'a>>(
    mut request: Request<'a, D, S>,
    deadline: Instant,
) -> std::result::Result<(), Request<'a, D, S>> {
    let mut backoff = Backoff(0);
    loop {
        match request.test() {
            Ok(_) => return Ok(()),
            Err(pending) => request = pending,
        }
        if Instant::now() >= deadline {
            return Err(request);
        }
        backoff.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_round_trip_and_read_well() {
        for p in [Phase::Distribute, Phase::Train(57), Phase::Test(3)] {
            assert_eq!(Phase::decode(p.encode()), Some(p));
        }
        assert_eq!(Phase::decode([9, 9]), None);
        assert_eq!(Phase::Train(57).to_string(), "training step 57");
        assert_eq!(worker_label(0), "worker 0 (chief)");
        assert_eq!(worker_label(1), "worker 1");
    }
}
