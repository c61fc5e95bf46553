//! Training over parameter servers, on MPI (the `mpi` feature): [`ParameterServerStrategy`].
//!
//! `mpirun -n W+P <binary>` starts W workers (ranks `0..W`, the chief is rank 0) and P
//! parameter servers (the last P ranks). Every rank runs the same program; on a server, `fit`,
//! `evaluate` and `predict` serve the workers until they end theirs, and return.
//!
//! - [`partition`](crate::partition): the greedy placement of whole variables on the servers,
//!   balanced by size;
//! - `shards`: what each server holds, and how a step buffer is cut for it;
//! - `protocol`: every message between workers and servers, typed, and its encoding on the
//!   wire (one MPI message each);
//! - `transport`: the polled, deadline-bound sends and receives both sides use;
//! - `server`: a server's shard, its optimizer state, what it knows of each worker, and the
//!   loop that applies pushes (synchronously, or asynchronously with an optional staleness
//!   bound);
//! - `worker`: a worker's copy of the model and its pushes and pulls;
//! - `strategy`: the strategy and the model it distributes.
//!
//! Both sides run in the process's one MPI world, shared with any other MPI strategy, and wait
//! for, name and give up on the other ranks as the crate's `mpi` module does.

mod protocol;
mod server;
mod shards;
mod strategy;
mod transport;
mod worker;

pub use strategy::{ParameterServerStrategy, NUM_PS_ENV};

use crate::mpi::worker_label;

/// Which ranks are workers and which are servers: workers first, servers last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Roles {
    /// Number of workers (ranks `0..workers`).
    pub(crate) workers: usize,
    /// Number of parameter servers (ranks `workers..workers + servers`).
    pub(crate) servers: usize,
}

impl Roles {
    /// The MPI rank of server `index`.
    pub(crate) fn server_rank(&self, index: usize) -> usize {
        self.workers + index
    }

    /// The server index of MPI rank `rank`, if it is a server.
    pub(crate) fn server_index(&self, rank: usize) -> Option<usize> {
        (rank >= self.workers && rank < self.workers + self.servers).then(|| rank - self.workers)
    }

    /// `parameter server 1 (rank 3)`.
    pub(crate) fn server_label(&self, index: usize) -> String {
        format!(
            "parameter server {index} (rank {})",
            self.server_rank(index)
        )
    }

    /// The name of any rank in messages: a worker's or a server's.
    pub(crate) fn label(&self, rank: usize) -> String {
        match self.server_index(rank) {
            Some(s) => self.server_label(s),
            None => worker_label(rank),
        }
    }
}
