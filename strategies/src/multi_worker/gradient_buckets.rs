//! Gradient buckets across workers: [`CrossWorkerBuckets`], the [`OuterBucketSum`] that the
//! strategy gives each worker's bucket exchange, so that every bucket of gradients is summed
//! over every replica of every worker while the backward passes go on (Horovod's overlap of the
//! all-reduce with the backward pass).
//!
//! Inside a worker the local replicas' parts of a bucket are summed first; the replica that
//! sums them then hands the worker's total to [`CrossWorkerBuckets`], which sums it over the
//! workers with one guarded MPI all-reduce on the host. Buckets cross workers one at a time and
//! in bucket order on every worker (the exchange sees to it), each a collective of its own
//! phase, so a worker that stalls or dies is named within the timeout as at the end of a step.
//! A worker without samples in a step hands in zeros for every bucket when its (empty) step
//! ends, and so joins the same collectives in the same order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kandle::{Error, Result};

use crate::bucket_exchange::OuterBucketSum;
use crate::mpi::watchdog::Phase;
use crate::mpi::world::World;

/// Sums gradient buckets over the workers, one guarded MPI all-reduce each.
pub(crate) struct CrossWorkerBuckets {
    world: Arc<World>,
    timeout: Duration,
    /// The training step under way, from 1, for the collectives' phases.
    step: AtomicU64,
}

impl CrossWorkerBuckets {
    /// Sums over `world`, each bucket guarded with `timeout`.
    pub(crate) fn new(world: Arc<World>, timeout: Duration) -> Self {
        Self {
            world,
            timeout,
            step: AtomicU64::new(0),
        }
    }

    /// Starts training step `step`.
    pub(crate) fn begin_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }
}

impl OuterBucketSum for CrossWorkerBuckets {
    fn all_reduce_sum(&self, bucket: usize, values: &mut Vec<f32>) -> Result<()> {
        let bucket = u32::try_from(bucket)
            .map_err(|_| Error::invalid(format!("gradient bucket {bucket} out of range")))?;
        let phase = Phase::Bucket {
            step: self.step.load(Ordering::Relaxed),
            bucket,
        };
        self.world.all_reduce_sum(values, phase, self.timeout)
    }
}
