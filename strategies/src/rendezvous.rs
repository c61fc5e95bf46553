//! `Rendezvous`: the in-process [`ReplicaGroup`] behind `SyncBatchNorm` for replicas of one
//! process: each round, every participating replica adds its vector and all receive the sum.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use kandle::cross_replica::ReplicaGroup;
use kandle::{Error, Result};

struct Round {
    /// Which replicas take part in the current step.
    active: Vec<bool>,
    sum: Vec<f32>,
    arrived: usize,
    /// Incremented each time a round completes.
    generation: u64,
    result: Vec<f32>,
}

/// Sums vectors across the replicas of one process.
pub struct Rendezvous {
    state: Mutex<Round>,
    ready: Condvar,
    timeout: Duration,
}

impl Rendezvous {
    /// A group of `replicas` replicas, all active, waiting at most `timeout` per round.
    pub fn new(replicas: usize, timeout: Duration) -> Self {
        Self {
            state: Mutex::new(Round {
                active: vec![true; replicas],
                sum: Vec::new(),
                arrived: 0,
                generation: 0,
                result: Vec::new(),
            }),
            ready: Condvar::new(),
            timeout,
        }
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
            return Err(Error::invalid(format!("replica {replica} is not active in this step")));
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
            s.result = std::mem::take(&mut s.sum);
            s.arrived = 0;
            s.generation += 1;
            self.ready.notify_all();
            return Ok(s.result.clone());
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
        Ok(s.result.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn sums_over_threads_for_several_rounds_and_times_out() -> Result<()> {
        let group = Arc::new(Rendezvous::new(3, Duration::from_secs(5)));
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let g = Arc::clone(&group);
                std::thread::spawn(move || -> Result<Vec<Vec<f32>>> {
                    (0..4).map(|round| g.all_reduce_sum(i, vec![i as f32, round as f32])).collect()
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
        let err = lonely.all_reduce_sum(0, vec![1.0]).expect_err("must time out").to_string();
        assert!(err.contains("did not reach"), "{err}");
        Ok(())
    }
}
