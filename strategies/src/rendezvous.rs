//! `Rendezvous`: the in-process [`ReplicaGroup`] behind `SyncBatchNorm` for replicas of one
//! process: each round, every participating replica adds its vector and all receive the sum.
//!
//! A strategy that spans processes installs an [`OuterSum`]: the last replica of the process to
//! arrive at a round sums the process's total with the other processes' before every local
//! replica receives it, so batch normalisation sees the statistics of the global batch.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kandle::strategy::ReplicaGroup;
use kandle::{Error, Result};

/// A sum beyond this process, run once per round on the process's total by the last local
/// replica to arrive, before any local replica receives it.
pub(crate) trait OuterSum: Send + Sync {
    /// Replaces `values` with their element-wise sum over every process, in place.
    fn all_reduce_sum(&self, values: &mut Vec<f32>) -> Result<()>;
}

struct Round {
    /// Which replicas take part in the current step.
    active: Vec<bool>,
    sum: Vec<f32>,
    arrived: usize,
    /// Incremented each time a round completes.
    generation: u64,
    /// The last round's total, or why it failed.
    result: std::result::Result<Vec<f32>, String>,
}

/// Sums vectors across the replicas of one process.
pub struct Rendezvous {
    state: Mutex<Round>,
    ready: Condvar,
    timeout: Duration,
    outer: Option<Arc<dyn OuterSum>>,
}

/// How many timeouts a replica waits for a round with an [`OuterSum`]: the sum across processes
/// is itself bounded by the watchdog (up to twice the timeout), which then names the culprit.
#[cfg(any(test, feature = "mpi"))]
pub(crate) const OUTER_PATIENCE: u32 = 3;

impl Rendezvous {
    /// A group of `replicas` replicas, all active, waiting at most `timeout` per round.
    pub fn new(replicas: usize, timeout: Duration) -> Self {
        Self {
            state: Mutex::new(Round {
                active: vec![true; replicas],
                sum: Vec::new(),
                arrived: 0,
                generation: 0,
                result: Ok(Vec::new()),
            }),
            ready: Condvar::new(),
            timeout,
            outer: None,
        }
    }

    /// The same group, whose every round also sums across processes with `outer`. Replicas
    /// then wait up to three timeouts for a round, so that the error of the sum across processes
    /// (which names a late process) arrives first.
    #[cfg(any(test, feature = "mpi"))]
    pub(crate) fn with_outer(mut self, outer: Arc<dyn OuterSum>) -> Self {
        self.outer = Some(outer);
        self.timeout *= OUTER_PATIENCE;
        self
    }

    /// Sets which replicas take part in the next step's rounds (those with samples).
    pub fn set_active(&self, active: &[bool]) -> Result<()> {
        let mut s = self.lock()?;
        s.active = active.to_vec();
        s.arrived = 0;
        s.sum.clear();
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Round>> {
        self.state
            .lock()
            .map_err(|_| Error::invalid("replica rendezvous poisoned by a panic"))
    }
}

impl ReplicaGroup for Rendezvous {
    fn all_reduce_sum(&self, replica: usize, values: Vec<f32>) -> Result<Vec<f32>> {
        let mut s = self.lock()?;
        if !s.active.get(replica).copied().unwrap_or(false) {
            return Err(Error::invalid(format!(
                "replica {replica} is not active in this step"
            )));
        }
        if s.arrived == 0 {
            s.sum = values;
        } else if s.sum.len() != values.len() {
            return Err(Error::invalid(format!(
                "replica {replica} sent {} values to a round of {}",
                values.len(),
                s.sum.len()
            )));
        } else {
            for (a, v) in s.sum.iter_mut().zip(values) {
                *a += v;
            }
        }
        s.arrived += 1;
        let expected = s.active.iter().filter(|a| **a).count();
        if s.arrived == expected {
            let mut total = std::mem::take(&mut s.sum);
            s.arrived = 0;
            let result = match &self.outer {
                None => Ok(total),
                Some(outer) => {
                    // The other replicas wait on the condition variable meanwhile.
                    drop(s);
                    let summed = outer.all_reduce_sum(&mut total).map(|()| total);
                    s = self.lock()?;
                    summed
                }
            };
            s.result = match &result {
                Ok(total) => Ok(total.clone()),
                Err(e) => Err(e.to_string()),
            };
            s.generation += 1;
            self.ready.notify_all();
            return result;
        }
        let generation = s.generation;
        let (s, wait) = self
            .ready
            .wait_timeout_while(s, self.timeout, |s| s.generation == generation)
            .map_err(|_| Error::invalid("replica rendezvous poisoned by a panic"))?;
        if wait.timed_out() {
            return Err(Error::Replica {
                replica: format!("replica {replica}"),
                reason: format!(
                    "the other replicas did not reach the batch-norm synchronisation within {:.0} s",
                    self.timeout.as_secs_f64()
                ),
            });
        }
        s.result.clone().map_err(|reason| Error::Replica {
            replica: format!("replica {replica}"),
            reason: format!("the batch-norm synchronisation across processes failed: {reason}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn sums_over_threads_for_several_rounds_and_times_out() -> Result<()> {
        let group = Arc::new(Rendezvous::new(3, Duration::from_secs(5)));
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let g = Arc::clone(&group);
                std::thread::spawn(move || -> Result<Vec<Vec<f32>>> {
                    (0..4)
                        .map(|round| g.all_reduce_sum(i, vec![i as f32, round as f32]))
                        .collect()
                })
            })
            .collect();
        for h in handles {
            let rounds = h.join().map_err(|_| Error::invalid("thread panicked"))??;
            for (round, r) in rounds.iter().enumerate() {
                assert_eq!(r, &vec![3.0, 3.0 * round as f32]);
            }
        }
        let lonely = Rendezvous::new(2, Duration::from_millis(50));
        let err = lonely
            .all_reduce_sum(0, vec![1.0])
            .expect_err("must time out")
            .to_string();
        assert!(err.contains("did not reach"), "{err}");
        Ok(())
    }

    /// Stands for a second process holding the same values: adds them once more, or fails.
    struct Twin {
        calls: AtomicUsize,
        fail: bool,
    }

    impl OuterSum for Twin {
        fn all_reduce_sum(&self, values: &mut Vec<f32>) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.fail {
                return Err(Error::invalid("worker 1 is gone"));
            }
            for v in values.iter_mut() {
                *v *= 2.0;
            }
            Ok(())
        }
    }

    /// Runs `rounds` rounds on 2 replicas of a group summing across processes with `twin`.
    fn two_replicas(twin: &Arc<Twin>, rounds: usize) -> Vec<Result<Vec<Vec<f32>>>> {
        let outer = Arc::clone(twin) as Arc<dyn OuterSum>;
        let group = Arc::new(Rendezvous::new(2, Duration::from_secs(5)).with_outer(outer));
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let g = Arc::clone(&group);
                std::thread::spawn(move || -> Result<Vec<Vec<f32>>> {
                    (0..rounds)
                        .map(|round| g.all_reduce_sum(i, vec![1.0 + i as f32, round as f32]))
                        .collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| Error::invalid("thread panicked"))?)
            .collect()
    }

    #[test]
    fn an_outer_sum_runs_once_per_round_and_its_failure_reaches_every_replica() -> Result<()> {
        let twin = Arc::new(Twin {
            calls: AtomicUsize::new(0),
            fail: false,
        });
        for rounds in two_replicas(&twin, 3) {
            let rounds = rounds?;
            for (round, r) in rounds.iter().enumerate() {
                assert_eq!(r, &vec![6.0, 4.0 * round as f32]);
            }
        }
        assert_eq!(twin.calls.load(Ordering::SeqCst), 3);

        let broken = Arc::new(Twin {
            calls: AtomicUsize::new(0),
            fail: true,
        });
        for result in two_replicas(&broken, 1) {
            let err = result.expect_err("the outer sum failed").to_string();
            assert!(err.contains("worker 1 is gone"), "{err}");
        }
        assert_eq!(broken.calls.load(Ordering::SeqCst), 1);
        Ok(())
    }
}
