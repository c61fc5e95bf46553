//! The MPI job both MPI strategies run in (the `mpi` feature):
//! [`MultiWorkerMirroredStrategy`](crate::MultiWorkerMirroredStrategy) and
//! [`ParameterServerStrategy`](crate::ParameterServerStrategy) share one world per process and
//! the same ways of waiting for, naming and giving up on the other ranks.
//!
//! - [`world`]: MPI initialisation (once per process), rank and size, the guarded collectives
//!   (all-reduce, broadcast and gather, and a guard for NCCL's) and the lock that point-to-point
//!   protocols run under;
//! - [`watchdog`]: the heartbeat protocol that makes a dead or stalled worker fail the others
//!   within the timeout, with an error naming it, and the `Vigil` that watches a started
//!   collective;
//! - [`abort`]: ending the whole job when a started MPI operation cannot complete;
//! - [`poll`]: how a rank paces its polls while it waits.

pub(crate) mod abort;
pub(crate) mod poll;
pub(crate) mod watchdog;
pub(crate) mod world;

use std::time::Duration;

/// A worker's name in messages: `worker 0 (chief)`, `worker 1`.
pub(crate) fn worker_label(rank: usize) -> String {
    if rank == 0 {
        "worker 0 (chief)".into()
    } else {
        format!("worker {rank}")
    }
}

/// A duration in whole seconds, for messages: `60 s`.
pub(crate) fn seconds(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}
