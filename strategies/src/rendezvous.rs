//! `Rendezvous`: the in-process [`ReplicaGroup`] behind `SyncBatchNorm` for replicas of one
//! process: each round, every participating replica hands in its part and all receive the sum.
//!
//! Parts are summed in replica order, whatever order the replicas arrive in, so the statistics
//! do not depend on the threads' timing. A rendezvous made with
//! [`summing_tensors`](Rendezvous::summing_tensors) sums tensors where they lie, with the
//! strategy's [`CrossDeviceOps`] (NCCL between GPUs, or candle's sum on a device the replicas
//! share): the last replica to arrive enqueues the sum and nobody waits for a GPU, so a CUDA step
//! is not drained at every exchange. Otherwise vectors are summed on the host.
//!
//! A strategy that spans processes installs an [`OuterSum`]: the last replica of the process to
//! arrive at a round sums the process's total with the other processes' before every local
//! replica receives it, so batch normalisation sees the statistics of the global batch.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use kandle::strategy::ReplicaGroup;
use kandle::{Error, Result};

use crate::cross_device_ops::CrossDeviceOps;

/// A sum beyond this process, run once per round on the process's total by the last local
/// replica to arrive, before any local replica receives it.
pub(crate) trait OuterSum: Send + Sync {
    /// Replaces `values` with their element-wise sum over every process, in place.
    fn all_reduce_sum(&self, values: &mut Vec<f32>) -> Result<()>;
}

/// A replica's part of a round, or its share of the total.
enum Part {
    Values(Vec<f32>),
    Tensor(Tensor),
}

struct Round {
    /// Which replicas take part in the current step.
    active: Vec<bool>,
    /// The current round's parts so far, by replica.
    parts: Vec<Option<Part>>,
    arrived: usize,
    /// Incremented each time a round completes.
    generation: u64,
    /// The last round's totals, by replica, each taken by its replica; or why the round failed.
    totals: std::result::Result<Vec<Option<Part>>, String>,
}

/// Sums vectors or tensors across the replicas of one process.
pub struct Rendezvous {
    state: Mutex<Round>,
    ready: Condvar,
    timeout: Duration,
    outer: Option<Arc<dyn OuterSum>>,
    /// How tensors are summed, and each replica's device.
    tensors: Option<(CrossDeviceOps, Vec<Device>)>,
}

/// How many timeouts a replica waits for a round with an [`OuterSum`]: the sum across processes
/// is itself bounded by the watchdog (up to twice the timeout), which then names the culprit.
#[cfg(any(test, feature = "mpi"))]
pub(crate) const OUTER_PATIENCE: u32 = 3;

impl Rendezvous {
    /// A group of `replicas` replicas, all active, summing vectors on the host, waiting at most
    /// `timeout` per round.
    pub fn new(replicas: usize, timeout: Duration) -> Self {
        Self {
            state: Mutex::new(Round {
                active: vec![true; replicas],
                parts: empty(replicas),
                arrived: 0,
                generation: 0,
                totals: Ok(Vec::new()),
            }),
            ready: Condvar::new(),
            timeout,
            outer: None,
            tensors: None,
        }
    }

    /// The same group, summing tensors where they lie with `ops`, replica `i`'s on
    /// `devices[i]` (see the module documentation).
    pub(crate) fn summing_tensors(mut self, ops: CrossDeviceOps, devices: &[Device]) -> Self {
        self.tensors = Some((ops, devices.to_vec()));
        self
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
        s.parts = empty(active.len());
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Round>> {
        self.state
            .lock()
            .map_err(|_| Error::invalid("replica rendezvous poisoned by a panic"))
    }

    /// Hands in `replica`'s part of the round and returns its share of the total, once every
    /// active replica has handed in its part. The last to arrive sums the parts.
    fn meet(&self, replica: usize, part: Part) -> Result<Part> {
        let mut s = self.lock()?;
        if !s.active.get(replica).copied().unwrap_or(false) {
            return Err(Error::invalid(format!(
                "replica {replica} is not active in this step"
            )));
        }
        if s.parts[replica].replace(part).is_some() {
            return Err(Error::invalid(format!(
                "replica {replica} joined a batch-norm round twice"
            )));
        }
        s.arrived += 1;
        let expected = s.active.iter().filter(|a| **a).count();
        if s.arrived == expected {
            let active = s.active.clone();
            let parts = std::mem::replace(&mut s.parts, empty(active.len()));
            s.arrived = 0;
            // The other replicas wait on the condition variable meanwhile.
            drop(s);
            let totals = self.sum(parts, &active);
            s = self.lock()?;
            s.totals = totals.map_err(|e| e.to_string());
            s.generation += 1;
            self.ready.notify_all();
            return take(&mut s, replica);
        }
        let generation = s.generation;
        let (mut s, wait) = self
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
        take(&mut s, replica)
    }

    /// The round's totals by replica (`None` for inactive replicas): `parts` summed in replica
    /// order.
    fn sum(&self, parts: Vec<Option<Part>>, active: &[bool]) -> Result<Vec<Option<Part>>> {
        let mut values = Vec::new();
        let mut tensors = Vec::new();
        for (i, part) in parts.into_iter().enumerate() {
            match part {
                Some(Part::Values(v)) => values.push((i, v)),
                Some(Part::Tensor(t)) => tensors.push((i, t)),
                None => {}
            }
        }
        if !values.is_empty() && !tensors.is_empty() {
            return Err(Error::invalid(
                "a batch-norm round got vectors from some replicas and tensors from others",
            ));
        }
        if tensors.is_empty() {
            let total = self.sum_values(values)?;
            return shares(active, |_| Ok(Part::Values(total.clone())));
        }
        let mut totals = self.sum_tensors(tensors, active)?.into_iter();
        shares(active, |_| {
            totals
                .next()
                .map(Part::Tensor)
                .ok_or_else(|| Error::invalid("the cross-device sum returned too few tensors"))
        })
    }

    fn sum_values(&self, values: Vec<(usize, Vec<f32>)>) -> Result<Vec<f32>> {
        let mut parts = values.into_iter();
        let mut total = parts.next().map(|(_, v)| v).unwrap_or_default();
        for (i, v) in parts {
            if v.len() != total.len() {
                return Err(Error::invalid(format!(
                    "replica {i} sent {} values to a round of {}",
                    v.len(),
                    total.len()
                )));
            }
            for (a, v) in total.iter_mut().zip(v) {
                *a += v;
            }
        }
        if let Some(outer) = &self.outer {
            outer.all_reduce_sum(&mut total)?;
        }
        Ok(total)
    }

    /// The sum of `tensors` (each active replica's, by index) with the group's ops, an inactive
    /// replica adding zeros on its device; the totals of the active replicas, in order.
    fn sum_tensors(&self, tensors: Vec<(usize, Tensor)>, active: &[bool]) -> Result<Vec<Tensor>> {
        let Some((ops, devices)) = &self.tensors else {
            return Err(Error::invalid(
                "this batch-norm group sums vectors on the host, not tensors",
            ));
        };
        let dims = tensors[0].1.dims().to_vec();
        let mut buffers: Vec<Tensor> = Vec::with_capacity(devices.len());
        let mut given = tensors.into_iter().peekable();
        for (i, device) in devices.iter().enumerate() {
            match given.next_if(|(j, _)| *j == i) {
                Some((_, t)) if t.dims() != dims => {
                    return Err(Error::invalid(format!(
                        "replica {i} sent a {:?} tensor to a round of {dims:?}",
                        t.dims()
                    )))
                }
                Some((_, t)) => buffers.push(t),
                None => buffers.push(Tensor::zeros(dims.as_slice(), DType::F32, device)?),
            }
        }
        let totals = ops.all_reduce(buffers, devices)?;
        Ok(totals
            .into_iter()
            .zip(active)
            .filter(|(_, a)| **a)
            .map(|(t, _)| t)
            .collect())
    }
}

/// No parts yet, for `replicas` replicas.
fn empty(replicas: usize) -> Vec<Option<Part>> {
    (0..replicas).map(|_| None).collect()
}

/// A share for each active replica, made by `share`, `None` for each inactive one.
fn shares(
    active: &[bool],
    mut share: impl FnMut(usize) -> Result<Part>,
) -> Result<Vec<Option<Part>>> {
    active
        .iter()
        .enumerate()
        .map(|(i, a)| a.then(|| share(i)).transpose())
        .collect()
}

/// `replica`'s share of the last round's total, or the round's failure.
fn take(s: &mut Round, replica: usize) -> Result<Part> {
    match &mut s.totals {
        Ok(totals) => totals
            .get_mut(replica)
            .and_then(Option::take)
            .ok_or_else(|| Error::invalid(format!("replica {replica} has no share of the round"))),
        Err(reason) => Err(Error::Replica {
            replica: format!("replica {replica}"),
            reason: format!("the batch-norm synchronisation failed: {reason}"),
        }),
    }
}

impl ReplicaGroup for Rendezvous {
    fn all_reduce_sum(&self, replica: usize, values: Vec<f32>) -> Result<Vec<f32>> {
        match self.meet(replica, Part::Values(values))? {
            Part::Values(total) => Ok(total),
            Part::Tensor(_) => Err(Error::invalid(
                "a batch-norm round of vectors gave a tensor",
            )),
        }
    }

    fn sums_tensors(&self) -> bool {
        self.tensors.is_some() && self.outer.is_none()
    }

    fn all_reduce_sum_tensor(&self, replica: usize, x: &Tensor) -> Result<Tensor> {
        match self.meet(replica, Part::Tensor(x.clone()))? {
            Part::Tensor(total) => Ok(total),
            Part::Values(_) => Err(Error::invalid("a batch-norm round of tensors gave vectors")),
        }
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

    /// Runs one round of `parts` (by replica, `None` for an inactive one), each replica on its
    /// own thread, replica `i` arriving after `delays[i]` milliseconds.
    fn one_round(
        group: &Arc<Rendezvous>,
        parts: Vec<Option<Part>>,
        delays: &[u64],
    ) -> Vec<Result<Part>> {
        let active: Vec<bool> = parts.iter().map(Option::is_some).collect();
        group.set_active(&active).expect("set the active replicas");
        let handles: Vec<_> = parts
            .into_iter()
            .enumerate()
            .filter_map(|(i, p)| p.map(|p| (i, p)))
            .map(|(i, part)| {
                let g = Arc::clone(group);
                let delay = Duration::from_millis(delays[i]);
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    g.meet(i, part)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a replica thread panicked"))
            .collect()
    }

    fn values(part: Result<Part>) -> Result<Vec<f32>> {
        match part? {
            Part::Values(v) => Ok(v),
            Part::Tensor(t) => Ok(t.to_vec1()?),
        }
    }

    /// `1 + 1e8 - 1e8` is 0 in f32 in replica order, and 1 in the order the replicas arrive
    /// (`-1e8 + 1e8 + 1`).
    #[test]
    fn parts_are_summed_in_replica_order_whatever_order_they_arrive_in() -> Result<()> {
        let cpu = Device::Cpu;
        let host = Arc::new(Rendezvous::new(3, Duration::from_secs(5)));
        let tensors = Arc::new(Rendezvous::new(3, Duration::from_secs(5)).summing_tensors(
            CrossDeviceOps::ReductionToOneDevice,
            &[cpu.clone(), cpu.clone(), cpu.clone()],
        ));
        let numbers = [1f32, 1e8, -1e8];
        // Replica 2 arrives first, then 1, then 0.
        let delays = [200, 100, 0];
        for part in one_round(
            &host,
            numbers
                .iter()
                .map(|v| Some(Part::Values(vec![*v])))
                .collect(),
            &delays,
        ) {
            assert_eq!(values(part)?, vec![0.0]);
        }
        let parts = numbers
            .iter()
            .map(|v| Ok(Some(Part::Tensor(Tensor::new(&[*v], &cpu)?))))
            .collect::<Result<Vec<_>>>()?;
        for part in one_round(&tensors, parts, &delays) {
            assert_eq!(values(part)?, vec![0.0]);
        }
        Ok(())
    }

    /// Tensors are summed by the group's ops; an inactive replica adds zeros and receives
    /// nothing; a tensor of another shape fails the round for every replica.
    #[test]
    fn tensors_are_summed_where_they_lie_over_the_active_replicas() -> Result<()> {
        let cpu = Device::Cpu;
        let devices = vec![cpu.clone(); 3];
        for ops in [
            CrossDeviceOps::ReductionToOneDevice,
            CrossDeviceOps::HierarchicalCopy,
        ] {
            let group =
                Arc::new(Rendezvous::new(3, Duration::from_secs(5)).summing_tensors(ops, &devices));
            assert!(group.sums_tensors());
            let part = |v: [f32; 2]| -> Result<Option<Part>> {
                Ok(Some(Part::Tensor(Tensor::new(&v, &cpu)?)))
            };
            let shares = one_round(
                &group,
                vec![part([1.0, 2.0])?, None, part([10.0, 20.0])?],
                &[0; 3],
            );
            assert_eq!(shares.len(), 2);
            for share in shares {
                assert_eq!(values(share)?, vec![11.0, 22.0], "{ops:?}");
            }
            let odd = Some(Part::Tensor(Tensor::new(&[1f32, 2.0, 3.0], &cpu)?));
            for share in one_round(
                &group,
                vec![part([1.0, 2.0])?, odd, part([1.0, 2.0])?],
                &[0; 3],
            ) {
                let err = values(share).expect_err("shapes differ").to_string();
                assert!(
                    err.contains("replica 1 sent a [3] tensor to a round of [2]"),
                    "{err}"
                );
            }
            // The group goes on after a failed round.
            let shares = one_round(
                &group,
                vec![part([1.0, 1.0])?, part([2.0, 2.0])?, part([3.0, 3.0])?],
                &[0; 3],
            );
            for share in shares {
                assert_eq!(values(share)?, vec![6.0, 6.0], "{ops:?}");
            }
        }
        // A group with a sum across processes sums vectors only.
        let outer = Arc::new(Twin {
            calls: AtomicUsize::new(0),
            fail: false,
        }) as Arc<dyn OuterSum>;
        let crossing = Rendezvous::new(2, Duration::from_secs(5))
            .summing_tensors(CrossDeviceOps::ReductionToOneDevice, &devices[..2])
            .with_outer(outer);
        assert!(!crossing.sums_tensors());
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
