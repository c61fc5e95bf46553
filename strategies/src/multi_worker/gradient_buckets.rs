//! Gradient buckets across workers: [`CrossWorkerBuckets`], the [`OuterBucketSum`] that the
//! strategy gives each worker's bucket exchange, so that every bucket of gradients is summed
//! over every replica of every worker while the backward passes go on (Horovod's and PyTorch
//! DDP's overlap of the all-reduce with the backward pass).
//!
//! Over MPI, the local replicas' parts of a bucket are summed first; the replica that sums them
//! then hands the worker's total to one guarded MPI all-reduce on the host. Over NCCL, one
//! guarded NCCL all-reduce over every GPU of every worker (the step buffer's clique) sums the
//! replicas' parts where they are, local and remote at once, with no host staging. Buckets
//! cross workers one at a time and in bucket order on every worker (the exchange sees to it),
//! each a collective of its own phase, so a worker that stalls or dies is named within the
//! timeout as at the end of a step. A worker without samples in a step hands in zeros for every
//! bucket when its (empty) step ends, and so joins the same collectives in the same order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
#[cfg(feature = "nccl")]
use std::sync::Mutex;
use std::time::Duration;

use candle_core::Tensor;
use kandle::{Error, Result};

#[cfg(feature = "nccl")]
use super::nccl::Clique;
use crate::bucket_exchange::{across_hosts, OuterBucketSum};
use crate::mpi::watchdog::Phase;
use crate::mpi::world::World;

/// How the buckets cross workers.
pub(crate) enum Route {
    /// Each worker's total through the host, with MPI.
    Mpi,
    /// Every replica's part on its GPU, with the NCCL clique of every worker's GPUs (shared with
    /// the step buffer's all-reduce).
    #[cfg(feature = "nccl")]
    Nccl(Arc<Mutex<Clique>>),
}

/// Sums gradient buckets over the workers, one guarded all-reduce each.
pub(crate) struct CrossWorkerBuckets {
    world: Arc<World>,
    timeout: Duration,
    route: Route,
    /// The training step under way, from 1, for the collectives' phases.
    step: AtomicU64,
}

impl CrossWorkerBuckets {
    /// Sums over `world` along `route`, each bucket guarded with `timeout`.
    pub(crate) fn new(world: Arc<World>, timeout: Duration, route: Route) -> Self {
        Self {
            world,
            timeout,
            route,
            step: AtomicU64::new(0),
        }
    }

    /// Starts training step `step`.
    pub(crate) fn begin_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }
}

impl OuterBucketSum for CrossWorkerBuckets {
    fn all_reduce(
        &self,
        bucket: usize,
        parts: Vec<Tensor>,
        local: &dyn Fn(Vec<Tensor>) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let bucket = u32::try_from(bucket)
            .map_err(|_| Error::invalid(format!("gradient bucket {bucket} out of range")))?;
        let phase = Phase::Bucket {
            step: self.step.load(Ordering::Relaxed),
            bucket,
        };
        match &self.route {
            Route::Mpi => across_hosts(parts, local, |values| {
                self.world.all_reduce_sum(values, phase, self.timeout)
            }),
            #[cfg(feature = "nccl")]
            Route::Nccl(clique) => {
                let mut clique = clique.lock().map_err(|_| {
                    Error::invalid("the NCCL communicators were poisoned by a panic")
                })?;
                self.world.guarded_external(phase, self.timeout, |vigil| {
                    clique.all_reduce(&parts, vigil, phase)
                })
            }
        }
    }
}
