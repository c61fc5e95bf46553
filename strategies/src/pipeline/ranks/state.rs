//! A stage's state (its variables and its optimizer's state) handed to the rank that asks for
//! it: the whole model's weights and optimizer state are every stage's, and each rank holds one.
//!
//! A rank asks the ranks of the other stages with a small request and each answers with its
//! stage's state as a training-state file's bytes. A rank answers in the middle of its own
//! steps (the links' waits, [`super::links`]) and between them, through a thread of its own
//! that answers whenever the stage is not in a step ([`StateServer`]): the chief writes
//! backups and checkpoints after a step, while the other stages may already wait in the next.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::Device;
use mpi::datatype::Equivalence;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::strategy::Replica;
use kandle::training_state::TrainingState;
use kandle::{Error, Result};

use crate::mpi::abort::abort_job;
use crate::mpi::poll::{Backoff, SendPace};
use crate::mpi::watchdog;
use crate::mpi::world::World;

/// The tag of a request for a stage's state, of the answer, and of a rank's word that it asks
/// no more.
const REQUEST: i32 = 0x5f01;
const STATE: i32 = 0x5f02;
const DONE: i32 = 0x5f03;

/// The state of the stage `replica` holds, on the CPU.
fn stage_state(replica: &Replica) -> Result<TrainingState> {
    let weights = replica
        .store()
        .weights()?
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    Ok(TrainingState {
        weights,
        optimizer: replica.optimizer_state()?.to_device(&Device::Cpu)?,
        ..TrainingState::default()
    })
}

/// Answers every request for this stage's state that has arrived.
pub(crate) fn answer_requests(
    comm: &SimpleCommunicator,
    replica: &Replica,
    timeout: Duration,
) -> Result<()> {
    while let Some((message, status)) = comm.any_process().immediate_matched_probe_with_tag(REQUEST)
    {
        let mut word = [0u64; 1];
        message.matched_receive_into(&mut word[..]);
        let bytes = stage_state(replica)?.to_bytes()?;
        send_bytes(comm, status.source_rank() as usize, &bytes, timeout);
    }
    Ok(())
}

/// Sends `bytes` to `rank`; a send not taken within `timeout` ends the job.
fn send_bytes(comm: &SimpleCommunicator, rank: usize, bytes: &[u8], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    mpi::request::scope(|scope| {
        let mut request = Some(
            comm.process_at_rank(rank as i32)
                .immediate_send_with_tag(scope, bytes, STATE),
        );
        let mut pace = SendPace::default();
        while let Some(pending) = request.take() {
            if let Err(pending) = pending.test() {
                if Instant::now() >= deadline {
                    let why = format!(
                        "{} did not take a pipeline stage's state within {}",
                        crate::mpi::worker_label(rank),
                        crate::mpi::seconds(timeout)
                    );
                    std::mem::forget(pending);
                    abort_job(comm, &why)
                }
                request = Some(pending);
                pace.wait();
            }
        }
    });
}

/// The states of the stages held by `ranks`, in order, asked for and waited on (each within
/// `timeout`). The MPI lock is taken for each poll only, so this process's own
/// [`StateServer`] answers the others meanwhile.
pub(crate) fn request_states(
    world: &World,
    ranks: &[usize],
    timeout: Duration,
) -> Result<Vec<TrainingState>> {
    world.point_to_point(|comm| {
        for &rank in ranks {
            comm.process_at_rank(rank as i32)
                .buffered_send_with_tag(&[0u64][..], REQUEST);
        }
        Ok(())
    })?;
    let deadline = Instant::now() + timeout;
    let mut states: Vec<Option<Vec<u8>>> = vec![None; ranks.len()];
    let mut backoff = Backoff::default();
    while states.iter().any(Option::is_none) {
        world.point_to_point(|comm| {
            for (slot, &rank) in states.iter_mut().zip(ranks) {
                if slot.is_some() {
                    continue;
                }
                if let Some((message, status)) = comm
                    .process_at_rank(rank as i32)
                    .immediate_matched_probe_with_tag(STATE)
                {
                    let n = status.count(u8::equivalent_datatype()).max(0) as usize;
                    let mut bytes = vec![0u8; n];
                    message.matched_receive_into(&mut bytes[..]);
                    *slot = Some(bytes);
                }
            }
            Ok(())
        })?;
        if let Some(at) = states.iter().position(Option::is_none) {
            if Instant::now() >= deadline {
                return Err(Error::Replica {
                    replica: crate::mpi::worker_label(ranks[at]),
                    reason: format!(
                        "did not send its pipeline stage's state within {}",
                        crate::mpi::seconds(timeout)
                    ),
                });
            }
            backoff.wait();
        }
    }
    states
        .into_iter()
        .flatten()
        .map(|bytes| TrainingState::from_bytes(&bytes))
        .collect()
}

/// A thread that answers requests for this rank's stage whenever no step holds the stage.
///
/// When the model is dropped, every rank tells the others it will ask nothing more and goes on
/// answering until each of them has said the same (or the time-out passes): a rank that
/// finished its own call first (a save, where only the chief gathers) must still answer the
/// chief's requests.
pub(crate) struct StateServer {
    world: Arc<World>,
    timeout: Duration,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StateServer {
    /// Starts answering for the stage in `replica`: on a thread of its own, and while this
    /// rank waits at a collective's rendezvous (where the chief's request may come when the
    /// chief writes a checkpoint and this rank has gone on to the next collective).
    pub(crate) fn start(
        world: Arc<World>,
        replica: Arc<Mutex<Replica>>,
        timeout: Duration,
    ) -> Result<Self> {
        let waiting = Arc::clone(&replica);
        watchdog::set_side_duty(Some(Arc::new(move |comm: &SimpleCommunicator| {
            // A step holds the stage through its collectives; the chief asks only between its
            // own steps, when no step here holds it.
            if let Ok(stage) = waiting.try_lock() {
                if let Err(e) = answer_requests(comm, &stage, timeout) {
                    log::warn!("pipeline stage state: {e}");
                }
            }
        })));
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let serving = Arc::clone(&world);
        let thread = std::thread::Builder::new()
            .name("kandle-pipeline-state".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    // The MPI lock first, then the stage if no step holds it: the order of
                    // the side duty above, which runs under the MPI lock. Holding the stage
                    // while waiting for the MPI lock left a rank waiting at a rendezvous
                    // unable to answer (its side duty could not take the stage), and the
                    // chief waiting for the state until its time-out. (The first look at the
                    // stage, let go at once, keeps this thread off the MPI lock during steps.)
                    if replica.try_lock().is_ok() {
                        let answered = serving.point_to_point(|comm| match replica.try_lock() {
                            Ok(stage) => answer_requests(comm, &stage, timeout),
                            Err(_) => Ok(()),
                        });
                        if let Err(e) = answered {
                            log::warn!("pipeline stage state: {e}");
                            return;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
            .map_err(|e| Error::Device(format!("cannot start the pipeline's state thread: {e}")))?;
        Ok(Self {
            world,
            timeout,
            stop,
            thread: Some(thread),
        })
    }

    /// Says this rank asks nothing more, and waits (answering meanwhile) until every other rank
    /// has said so too, or the time-out passes.
    fn finish_with_the_others(&self) {
        let rank = self.world.rank();
        let others: Vec<usize> = (0..self.world.size()).filter(|&r| r != rank).collect();
        let told = self.world.point_to_point(|comm| {
            for &other in &others {
                comm.process_at_rank(other as i32)
                    .buffered_send_with_tag(&[0u64][..], DONE);
            }
            Ok(())
        });
        if told.is_err() {
            return;
        }
        let deadline = Instant::now() + self.timeout;
        let mut waiting = others;
        while !waiting.is_empty() && Instant::now() < deadline {
            let heard = self.world.point_to_point(|comm| {
                waiting.retain(|&other| {
                    match comm
                        .process_at_rank(other as i32)
                        .immediate_matched_probe_with_tag(DONE)
                    {
                        Some((message, _)) => {
                            let mut word = [0u64; 1];
                            message.matched_receive_into(&mut word[..]);
                            false
                        }
                        None => true,
                    }
                });
                Ok(())
            });
            if heard.is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for StateServer {
    fn drop(&mut self) {
        self.finish_with_the_others();
        watchdog::set_side_duty(None);
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
