//! `World`: this process's handle on `MPI_COMM_WORLD`, shared by every
//! [`MultiWorkerMirroredStrategy`](crate::MultiWorkerMirroredStrategy) and
//! [`ParameterServerStrategy`](crate::ParameterServerStrategy) of the process.
//!
//! MPI is initialised once per process, at thread level `MPI_THREAD_SERIALIZED`: any thread may
//! call MPI, one at a time. A mutex around the [`Universe`] enforces that, so the world is
//! `Send + Sync` while the MPI handles themselves never leave the lock.
//!
//! Every collective is *guarded*: before it runs, the [`super::watchdog`] protocol makes sure
//! that every worker has reached the same point, within the timeout, and names the one that has
//! not. The collective itself is non-blocking and polled against the same deadline, so a worker
//! that stops in the middle of it cannot hang the others either (see [`World::all_reduce_sum`]).
//! Collectives outside MPI (NCCL's) are guarded the same way through
//! `World::guarded_external`.
//!
//! When the last handle is dropped, MPI is finalised, unless a guarded operation failed: then the
//! job is broken, `MPI_Finalize` could wait forever for a peer that will never come, so it is
//! skipped and the process is left to exit with the error (`mpirun` then ends the other workers).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;

use kandle::{Error, Result};

use super::abort::complete_or_abort;
use super::watchdog::{self, Phase, Vigil};

/// Bytes attached for buffered sends: the watchdog's small messages go out with `MPI_Bsend`,
/// which never waits for the receiver.
const SEND_BUFFER_BYTES: usize = 1 << 20;

/// The one world of this process, while a strategy holds it.
static WORLD: Mutex<Weak<World>> = Mutex::new(Weak::new());

/// Set once MPI has been initialised in this process (it cannot be initialised twice).
static INITIALISED: AtomicBool = AtomicBool::new(false);

/// What the MPI lock protects: the universe, and the state of the guarded collectives.
struct Inner {
    universe: Option<Universe>,
    /// Number of guarded operations so far; every worker runs the same sequence.
    sequence: u64,
    /// The receive side of the last all-reduce, swapped with the caller's buffer so that
    /// steps reuse both allocations.
    scratch: Vec<f32>,
}

/// This process's place in `MPI_COMM_WORLD`.
pub(crate) struct World {
    inner: Mutex<Inner>,
    rank: usize,
    size: usize,
    /// Set when a guarded operation failed: the world is unusable and must not be finalised.
    broken: AtomicBool,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("broken", &self.broken.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl World {
    /// The process's world, initialising MPI on first use. Every strategy of the process shares
    /// it. Fails if MPI was already finalised (after the last strategy was dropped) or cannot
    /// give `MPI_THREAD_SERIALIZED`.
    pub(crate) fn get() -> Result<Arc<World>> {
        let mut slot = WORLD
            .lock()
            .map_err(|_| Error::Device("the MPI world lock was poisoned by a panic".into()))?;
        if let Some(world) = slot.upgrade() {
            return Ok(world);
        }
        if INITIALISED.swap(true, Ordering::SeqCst) {
            return Err(Error::Device(
                "MPI was already initialised and finalised in this process (every \
                 MultiWorkerMirroredStrategy and ParameterServerStrategy was dropped); create \
                 the strategy once and keep it for the life of the program"
                    .into(),
            ));
        }
        let (mut universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| {
                Error::Device(
                    "MPI was initialised outside kandle; MultiWorkerMirroredStrategy or \
                     ParameterServerStrategy must initialise it"
                        .into(),
                )
            })?;
        if level < Threading::Serialized {
            return Err(Error::Device(format!(
                "the MPI library provides thread level {level:?}; kandle's MPI strategies \
                 need Serialized or Multiple"
            )));
        }
        universe.set_buffer_size(SEND_BUFFER_BYTES);
        let world = universe.world();
        let (rank, size) = (world.rank(), world.size());
        let world = Arc::new(World {
            inner: Mutex::new(Inner {
                universe: Some(universe),
                sequence: 0,
                scratch: Vec::new(),
            }),
            rank: usize::try_from(rank)
                .map_err(|_| Error::Device(format!("MPI gave a negative rank {rank}")))?,
            size: usize::try_from(size)
                .map_err(|_| Error::Device(format!("MPI gave a negative size {size}")))?,
            broken: AtomicBool::new(false),
        });
        *slot = Arc::downgrade(&world);
        Ok(world)
    }

    /// This worker's rank in `MPI_COMM_WORLD`.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Number of workers in `MPI_COMM_WORLD`.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Takes the MPI lock, refusing work once the world is broken.
    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(Error::Replica {
                replica: format!("worker {}", self.rank),
                reason: "an earlier multi-worker step failed, so the MPI world is unusable; \
                         end the process (return the error from main)"
                    .into(),
            });
        }
        self.inner
            .lock()
            .map_err(|_| Error::Device("the MPI world lock was poisoned by a panic".into()))
    }

    /// Runs `f` under the MPI lock with the world communicator and the next sequence number,
    /// marking the world broken if it fails.
    fn guarded<R>(
        &self,
        f: impl FnOnce(&SimpleCommunicator, u64, &mut Vec<f32>) -> Result<R>,
    ) -> Result<R> {
        let mut inner = self.lock()?;
        let inner = &mut *inner;
        let Some(universe) = &inner.universe else {
            return Err(Error::Device("MPI is finalised".into()));
        };
        inner.sequence += 1;
        let result = f(&universe.world(), inner.sequence, &mut inner.scratch);
        if result.is_err() {
            self.broken.store(true, Ordering::SeqCst);
        }
        result
    }

    /// Sums `data` element-wise over all workers, in place, once every worker has reached
    /// `phase` (checked by the watchdog within `timeout`).
    ///
    /// The all-reduce itself is `MPI_Iallreduce`, polled against a second `timeout`. If it has
    /// not completed by then, a worker stopped in the middle of it: MPI cannot cancel a
    /// collective or release its buffers, so the workers that stopped answering are named on
    /// stderr and the job is ended with `MPI_Abort` rather than hanging.
    pub(crate) fn all_reduce_sum(
        &self,
        data: &mut Vec<f32>,
        phase: Phase,
        timeout: Duration,
    ) -> Result<()> {
        self.guarded(|comm, sequence, scratch| {
            watchdog::rendezvous(comm, sequence, phase, timeout)?;
            // The all-reduce overwrites every element: only a longer buffer needs new space.
            scratch.resize(data.len(), 0.0);
            let mut vigil = Vigil::new(comm, sequence, timeout);
            mpi::request::scope(|scope| {
                let request = comm.immediate_all_reduce_into(
                    scope,
                    &data[..],
                    &mut scratch[..],
                    SystemOperation::sum(),
                );
                complete_or_abort(&mut vigil, request, phase, "all-reduce");
            });
            std::mem::swap(data, scratch);
            Ok(())
        })
    }

    /// Replaces `data` on every worker with the chief's, once every worker has reached `phase`.
    /// Like [`World::all_reduce_sum`], a broadcast that starts but cannot finish aborts the job.
    pub(crate) fn broadcast_from_chief<T: Equivalence>(
        &self,
        data: &mut [T],
        phase: Phase,
        timeout: Duration,
    ) -> Result<()> {
        self.guarded(|comm, sequence, _| {
            watchdog::rendezvous(comm, sequence, phase, timeout)?;
            let mut vigil = Vigil::new(comm, sequence, timeout);
            let chief = comm.process_at_rank(0);
            mpi::request::scope(|scope| {
                let request = chief.immediate_broadcast_into(scope, data);
                complete_or_abort(&mut vigil, request, phase, "broadcast");
            });
            Ok(())
        })
    }

    /// Every worker's `values` (all of one length), in rank order, once every worker has reached
    /// `phase`. Like [`World::all_reduce_sum`], a gather that starts but cannot finish aborts the
    /// job.
    pub(crate) fn all_gather(
        &self,
        values: &[u64],
        phase: Phase,
        timeout: Duration,
    ) -> Result<Vec<u64>> {
        self.guarded(|comm, sequence, _| {
            watchdog::rendezvous(comm, sequence, phase, timeout)?;
            let mut all = vec![0u64; values.len() * self.size];
            let mut vigil = Vigil::new(comm, sequence, timeout);
            mpi::request::scope(|scope| {
                let request = comm.immediate_all_gather_into(scope, values, &mut all[..]);
                complete_or_abort(&mut vigil, request, phase, "gather");
            });
            Ok(all)
        })
    }

    /// Runs a collective that does not go through MPI (NCCL's, on the GPU) as a guarded
    /// operation: once every worker has reached `phase`, `collective` runs with a [`Vigil`] to
    /// poll with, which answers the other workers' pings and ends at the collective's deadline.
    /// An error from it marks the world broken, like any failed guarded operation.
    #[cfg(feature = "nccl")]
    pub(crate) fn guarded_external<R>(
        &self,
        phase: Phase,
        timeout: Duration,
        collective: impl FnOnce(&mut Vigil<'_>) -> Result<R>,
    ) -> Result<R> {
        self.guarded(|comm, sequence, _| {
            watchdog::rendezvous(comm, sequence, phase, timeout)?;
            collective(&mut Vigil::new(comm, sequence, timeout))
        })
    }

    /// Runs `f` under the MPI lock with the world communicator, for point-to-point messages
    /// (the parameter servers' protocol, a pipeline's activations), marking the world broken
    /// if it fails. `f` must not leave a message half sent: a send it cannot complete ends the
    /// job ([`abort_job`](super::abort::abort_job)). Unlike a collective it is not numbered:
    /// ranks exchange as many messages as they need between collectives.
    pub(crate) fn point_to_point<R>(
        &self,
        f: impl FnOnce(&SimpleCommunicator) -> Result<R>,
    ) -> Result<R> {
        let inner = self.lock()?;
        let Some(universe) = &inner.universe else {
            return Err(Error::Device("MPI is finalised".into()));
        };
        let result = f(&universe.world());
        if result.is_err() {
            self.broken.store(true, Ordering::SeqCst);
        }
        result
    }

    /// Marks the world unusable: it will not be finalised, so the process can exit at once.
    pub(crate) fn mark_broken(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let universe = match self.inner.get_mut() {
            Ok(inner) => inner.universe.take(),
            Err(poisoned) => poisoned.into_inner().universe.take(),
        };
        if self.broken.load(Ordering::SeqCst) || std::thread::panicking() {
            // A peer may never reach MPI_Finalize (nor deliver what the buffered sends wait
            // for): skip it, and let the process exit with its error.
            std::mem::forget(universe);
        } else {
            drop(universe);
        }
    }
}
