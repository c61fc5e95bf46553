//! SyncBatchNorm across workers: [`CrossWorkerSum`], the [`OuterSum`] that the strategy installs
//! into each worker's in-process `Rendezvous`.
//!
//! Batch normalisation sums its per-channel statistics (sums with the sample count, then
//! centred squares) over the replica group in the forward pass, and the gradients of those sums
//! in the backward pass (`kandle::strategy::ReplicaGroup`). Inside a worker the local replicas meet in the
//! rendezvous; the last to arrive hands the worker's total to [`CrossWorkerSum`], which sums it
//! over the workers with one guarded MPI all-reduce on the host, so every replica of every worker
//! normalises with the statistics of the whole global batch. The exchanges are small (a few
//! values per channel), and each is a guarded collective: a worker that stalls is named within
//! the timeout, as at the end of a step.
//!
//! Every worker must run the same exchanges in the same order. A worker whose part of a short
//! last batch is empty runs no forward pass, so it *stands in*: it joins as many exchanges, of
//! the same lengths, as the previous step with samples had, each with zeros (no samples, no
//! gradient), which is what it would have contributed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kandle::{Error, Result};

use crate::mpi::watchdog::Phase;
use crate::mpi::world::World;
use crate::rendezvous::OuterSum;

/// The exchanges of the current step and the lengths of those of the last step with samples.
#[derive(Debug, Default)]
struct Exchanges {
    /// The training step, from 1.
    step: u64,
    /// Whether this worker has samples in the current step.
    has_samples: bool,
    /// The lengths of the current step's exchanges so far.
    current: Vec<usize>,
    /// The lengths of the exchanges of the last step in which this worker had samples.
    last: Option<Vec<usize>>,
}

/// Sums batch-norm statistics over the workers, once per exchange.
pub(crate) struct CrossWorkerSum {
    world: Arc<World>,
    timeout: Duration,
    exchanges: Mutex<Exchanges>,
}

impl CrossWorkerSum {
    /// Sums over `world`, each exchange guarded with `timeout`.
    pub(crate) fn new(world: Arc<World>, timeout: Duration) -> Self {
        Self {
            world,
            timeout,
            exchanges: Mutex::new(Exchanges::default()),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Exchanges>> {
        self.exchanges
            .lock()
            .map_err(|_| Error::invalid("the batch-norm exchange state was poisoned by a panic"))
    }

    /// Starts training step `step`, in which this worker has samples or not.
    pub(crate) fn begin_step(&self, step: u64, has_samples: bool) -> Result<()> {
        let mut ex = self.lock()?;
        if ex.has_samples {
            ex.last = Some(std::mem::take(&mut ex.current));
        }
        ex.current.clear();
        ex.step = step;
        ex.has_samples = has_samples;
        Ok(())
    }

    /// For a worker without samples in this step: joins the exchanges the other workers run,
    /// contributing zeros (see the module documentation). Fails if no earlier step showed what
    /// they are.
    pub(crate) fn stand_in(&self) -> Result<()> {
        let (step, lengths) = {
            let ex = self.lock()?;
            (ex.step, ex.last.clone())
        };
        let lengths = lengths.ok_or_else(|| {
            Error::invalid(format!(
                "worker {}: no samples in training step {step} and no earlier step of this \
                 model, so it cannot join the other workers' SyncBatchNorm exchanges; give every \
                 worker samples in the first step (a global batch of at least one sample per \
                 worker), or set drop_remainder",
                self.world.rank()
            ))
        })?;
        for len in lengths {
            self.all_reduce_sum(&mut vec![0.0; len])?;
        }
        Ok(())
    }
}

impl OuterSum for CrossWorkerSum {
    fn all_reduce_sum(&self, values: &mut Vec<f32>) -> Result<()> {
        let phase = {
            let mut ex = self.lock()?;
            ex.current.push(values.len());
            Phase::BatchNorm {
                step: ex.step,
                round: u32::try_from(ex.current.len()).unwrap_or(u32::MAX),
            }
        };
        self.world.all_reduce_sum(values, phase, self.timeout)
    }
}
