//! `BucketExchange`: gradient buckets summed across the replicas of one process while their
//! backward passes go on (kandle's [`BucketReducer`]), with the strategy's [`CrossDeviceOps`].
//!
//! Buckets are summed one at a time and in order (bucket 0, of the last layers, first), by the
//! replica that hands in the last part of the next bucket, which goes on with any later bucket
//! already complete; no replica waits to hand a bucket in. The order is the same on every
//! device and every worker: NCCL's collectives must reach every device's stream in the same
//! order, and MPI's every worker, or two of them would wait on each other.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use kandle::strategy::buckets::BucketReducer;
use kandle::{Error, Result};

use crate::cross_device_ops::CrossDeviceOps;

/// A bucket's sum beyond this process (over the workers); called in bucket order, one bucket at
/// a time.
pub(crate) trait OuterBucketSum: Send + Sync {
    /// Bucket `bucket`'s total over every replica of every worker, on each local replica's
    /// device, from this process's `parts` (one per replica, in replica order). `local` sums
    /// parts over this process's replicas (the exchange's [`CrossDeviceOps`]), for a sum that
    /// crosses workers from the process's total ([`across_hosts`]); a collective over every
    /// device of every worker (NCCL) takes the parts as they are.
    fn all_reduce(
        &self,
        bucket: usize,
        parts: Vec<Tensor>,
        local: &dyn Fn(Vec<Tensor>) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>>;
}

/// A bucket's total through the host: `parts` summed over this process by `local`, that total
/// copied to the host and summed over the workers in place by `sum`, then copied to each
/// replica's device.
#[cfg_attr(
    not(any(feature = "mpi", test)),
    expect(dead_code, reason = "used by the multi-worker strategy")
)]
pub(crate) fn across_hosts(
    parts: Vec<Tensor>,
    local: &dyn Fn(Vec<Tensor>) -> Result<Vec<Tensor>>,
    sum: impl FnOnce(&mut Vec<f32>) -> Result<()>,
) -> Result<Vec<Tensor>> {
    let local = local(parts)?;
    let first = local
        .first()
        .ok_or_else(|| Error::invalid("a gradient bucket exchange without replicas"))?;
    let mut host = first
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    sum(&mut host)?;
    let len = host.len();
    let total = Tensor::from_vec(host, len, &Device::Cpu)?;
    local
        .iter()
        .map(|t| Ok(total.to_device(t.device())?))
        .collect()
}

/// The in-process reducer of gradient buckets (see [`kandle::strategy::buckets`]).
pub(crate) struct BucketExchange {
    state: Mutex<Exchange>,
    ready: Condvar,
    ops: CrossDeviceOps,
    devices: Vec<Device>,
    /// `replica 1 (cuda:1)`, for errors.
    labels: Vec<String>,
    timeout: Duration,
    /// Buckets handed in while a backward pass was running, over all steps.
    during_backward: AtomicUsize,
    /// Per replica, whether it is waiting for a bucket's total.
    waiting: Vec<AtomicBool>,
    /// The sum over the workers, when there are several.
    outer: Option<Arc<dyn OuterBucketSum>>,
}

/// One step's buckets.
#[derive(Default)]
struct Exchange {
    buckets: Vec<Round>,
    /// The bucket to sum next: buckets are summed in order.
    next: usize,
    /// Whether a replica is summing buckets now.
    summing: bool,
    /// Why the step failed, once a replica said so.
    failed: Option<String>,
}

/// One bucket of one step: the replicas' parts until all are in, then the totals.
#[derive(Default)]
struct Round {
    parts: Vec<Option<Tensor>>,
    totals: Option<std::result::Result<Vec<Tensor>, String>>,
    /// Replicas that took their total.
    taken: usize,
}

impl Round {
    /// Whether all `replicas` replicas handed their parts in.
    fn is_complete(&self, replicas: usize) -> bool {
        self.parts.len() == replicas && self.parts.iter().all(Option::is_some)
    }
}

impl BucketExchange {
    /// An exchange between replicas on `devices` (named `labels`), summing with `ops`, each
    /// wait bounded by `timeout`.
    pub(crate) fn new(
        devices: Vec<Device>,
        labels: Vec<String>,
        ops: CrossDeviceOps,
        timeout: Duration,
    ) -> Self {
        let n = devices.len();
        Self {
            state: Mutex::new(Exchange::default()),
            ready: Condvar::new(),
            ops,
            devices,
            labels,
            timeout,
            during_backward: AtomicUsize::new(0),
            waiting: (0..n).map(|_| AtomicBool::new(false)).collect(),
            outer: None,
        }
    }

    /// This exchange, each bucket's sum then summed over the workers by `outer`.
    pub(crate) fn with_outer(self, outer: Arc<dyn OuterBucketSum>) -> Self {
        Self {
            outer: Some(outer),
            ..self
        }
    }

    /// `parts` (one per replica) summed over the replicas and, with an outer sum, over the
    /// workers: the total on each replica's device.
    fn sum(&self, bucket: usize, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let local = |parts: Vec<Tensor>| self.ops.all_reduce(parts, &self.devices);
        match &self.outer {
            Some(outer) => outer.all_reduce(bucket, parts, &local),
            None => local(parts),
        }
    }

    /// Forgets what a step left behind (the parts of a step that failed), before the next.
    pub(crate) fn begin_step(&self) -> Result<()> {
        *self.lock()? = Exchange::default();
        Ok(())
    }

    /// Whether replica `replica` is waiting for a bucket's total (the others' backward passes).
    pub(crate) fn is_waiting(&self, replica: usize) -> bool {
        self.waiting
            .get(replica)
            .is_some_and(|w| w.load(Ordering::Relaxed))
    }

    /// Buckets handed in while a backward pass was running, over all steps.
    #[cfg(test)]
    pub(crate) fn handed_in_during_backward(&self) -> usize {
        self.during_backward.load(Ordering::Relaxed)
    }

    fn lock(&self) -> Result<MutexGuard<'_, Exchange>> {
        self.state
            .lock()
            .map_err(|_| Error::invalid("the gradient bucket exchange was poisoned by a panic"))
    }

    fn label(&self, replica: usize) -> String {
        self.labels
            .get(replica)
            .cloned()
            .unwrap_or_else(|| format!("replica {replica}"))
    }

    fn failure(&self, replica: usize, reason: &str) -> Error {
        Error::Replica {
            replica: self.label(replica),
            reason: format!("gradient buckets: {reason}"),
        }
    }

    /// Sums, in order, every bucket from the next one that every replica has handed in, then
    /// gives up the summing; `exchange` is locked with `summing` set by the caller.
    fn sum_ready<'a>(&'a self, mut exchange: MutexGuard<'a, Exchange>) -> Result<()> {
        let n = self.devices.len();
        loop {
            let bucket = exchange.next;
            let complete = exchange
                .buckets
                .get(bucket)
                .is_some_and(|r| r.totals.is_none() && r.is_complete(n));
            if !complete || exchange.failed.is_some() {
                exchange.summing = false;
                return Ok(());
            }
            let round = Self::round(&mut exchange, bucket, n);
            let parts: Vec<Tensor> = round.parts.iter_mut().filter_map(Option::take).collect();
            drop(exchange);
            let summed = {
                let _reduce = kandle::timeline::span("bucket all-reduce");
                self.sum(bucket, parts)
            };
            exchange = self.lock()?;
            exchange.next += 1;
            let round = Self::round(&mut exchange, bucket, n);
            round.totals = Some(match &summed {
                Ok(totals) => Ok(totals.clone()),
                Err(e) => Err(format!("summing bucket {bucket} failed: {e}")),
            });
            self.ready.notify_all();
            if let Err(e) = summed {
                exchange.summing = false;
                return Err(e);
            }
        }
    }

    /// The round of `bucket`, made when first asked for.
    fn round(exchange: &mut Exchange, bucket: usize, replicas: usize) -> &mut Round {
        if exchange.buckets.len() <= bucket {
            exchange.buckets.resize_with(bucket + 1, Round::default);
        }
        let round = &mut exchange.buckets[bucket];
        if round.parts.len() != replicas {
            round.parts.resize(replicas, None);
        }
        round
    }
}

impl BucketReducer for BucketExchange {
    fn submit(
        &self,
        replica: usize,
        bucket: usize,
        values: Tensor,
        during_backward: bool,
    ) -> Result<()> {
        let n = self.devices.len();
        if replica >= n {
            return Err(self.failure(replica, &format!("no such replica among {n}")));
        }
        if during_backward {
            self.during_backward.fetch_add(1, Ordering::Relaxed);
        }
        let mut exchange = self.lock()?;
        if let Some(reason) = &exchange.failed {
            return Err(self.failure(replica, reason));
        }
        let round = Self::round(&mut exchange, bucket, n);
        if round.parts[replica].is_some() || round.totals.is_some() {
            return Err(self.failure(
                replica,
                &format!("bucket {bucket} was handed in twice in one step"),
            ));
        }
        round.parts[replica] = Some(values);
        if exchange.summing {
            // The replica summing now takes this bucket too when its turn comes.
            return Ok(());
        }
        // Buckets are summed in order, each by the replica that completes it or the one that
        // summed the bucket before; the others go on with their backward passes meanwhile.
        exchange.summing = true;
        self.sum_ready(exchange)
    }

    fn total(&self, replica: usize, bucket: usize) -> Result<Tensor> {
        let n = self.devices.len();
        let exchange = self.lock()?;
        let flag = self.waiting.get(replica);
        flag.inspect(|w| w.store(true, Ordering::Relaxed));
        let waited = self.ready.wait_timeout_while(exchange, self.timeout, |e| {
            e.failed.is_none() && e.buckets.get(bucket).is_none_or(|r| r.totals.is_none())
        });
        flag.inspect(|w| w.store(false, Ordering::Relaxed));
        let (mut exchange, wait) = waited
            .map_err(|_| Error::invalid("the gradient bucket exchange was poisoned by a panic"))?;
        if let Some(reason) = &exchange.failed {
            return Err(self.failure(replica, reason));
        }
        if wait.timed_out() {
            let missing: Vec<String> = exchange
                .buckets
                .get(bucket)
                .map(|r| {
                    (0..n)
                        .filter(|&i| r.parts.get(i).is_none_or(Option::is_none))
                        .map(|i| self.label(i))
                        .collect()
                })
                .unwrap_or_else(|| (0..n).map(|i| self.label(i)).collect());
            return Err(self.failure(
                replica,
                &format!(
                    "{} did not hand in bucket {bucket} within {:.0} s",
                    missing.join(", "),
                    self.timeout.as_secs_f64()
                ),
            ));
        }
        let round = Self::round(&mut exchange, bucket, n);
        let total = match &round.totals {
            Some(Ok(totals)) => totals[replica].clone(),
            Some(Err(reason)) => return Err(self.failure(replica, reason)),
            None => unreachable!("the wait ends only with totals, a failure or a timeout"),
        };
        round.taken += 1;
        if round.taken == n {
            *round = Round::default();
        }
        Ok(total)
    }

    fn abort(&self, replica: usize, reason: &str) {
        let message = format!("{} failed: {reason}", self.label(replica));
        if let Ok(mut exchange) = self.state.lock() {
            exchange.failed.get_or_insert(message);
        }
        self.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn exchange(n: usize, timeout: Duration) -> Arc<BucketExchange> {
        Arc::new(BucketExchange::new(
            vec![Device::Cpu; n],
            (0..n).map(|i| format!("replica {i} (cpu)")).collect(),
            CrossDeviceOps::ReductionToOneDevice,
            timeout,
        ))
    }

    #[test]
    fn every_replica_gets_each_buckets_sum_over_several_steps() -> Result<()> {
        let x = exchange(3, Duration::from_secs(20));
        for step in 0..3 {
            x.begin_step()?;
            let handles: Vec<_> = (0..3)
                .map(|r| {
                    let x = Arc::clone(&x);
                    std::thread::spawn(move || -> Result<Vec<Vec<f32>>> {
                        // Replicas hand buckets in in different orders.
                        let order: Vec<usize> = match r {
                            1 => vec![1, 0],
                            _ => vec![0, 1],
                        };
                        for b in order {
                            let v = (r * 10 + b + step) as f32;
                            x.submit(r, b, Tensor::new(&[v, 1.0], &Device::Cpu)?, b == 0)?;
                        }
                        (0..2)
                            .map(|b| Ok(x.total(r, b)?.to_vec1::<f32>()?))
                            .collect()
                    })
                })
                .collect();
            for h in handles {
                let got = h.join().expect("replica thread")?;
                for (b, total) in got.iter().enumerate() {
                    let want = (0..3).map(|r| (r * 10 + b + step) as f32).sum::<f32>();
                    assert_eq!(total, &vec![want, 3.0], "step {step} bucket {b}");
                }
            }
        }
        assert_eq!(x.handed_in_during_backward(), 9);
        Ok(())
    }

    /// Records the buckets it sums over "workers" (adds 100 to each value).
    #[derive(Default)]
    struct RecordingOuter(Mutex<Vec<usize>>);

    impl OuterBucketSum for RecordingOuter {
        fn all_reduce(
            &self,
            bucket: usize,
            parts: Vec<Tensor>,
            local: &dyn Fn(Vec<Tensor>) -> Result<Vec<Tensor>>,
        ) -> Result<Vec<Tensor>> {
            self.0.lock().expect("not poisoned").push(bucket);
            super::across_hosts(parts, local, |values| {
                values.iter_mut().for_each(|v| *v += 100.0);
                Ok(())
            })
        }
    }

    #[test]
    fn buckets_cross_workers_in_order_whatever_order_they_complete_in() -> Result<()> {
        let outer = Arc::new(RecordingOuter::default());
        let x = Arc::new(
            BucketExchange::new(
                vec![Device::Cpu; 2],
                vec!["replica 0 (cpu)".into(), "replica 1 (cpu)".into()],
                CrossDeviceOps::ReductionToOneDevice,
                Duration::from_secs(20),
            )
            .with_outer(Arc::clone(&outer) as Arc<dyn OuterBucketSum>),
        );
        x.begin_step()?;
        // Bucket 2 completes first, then 1, then 0: they are summed 0, 1, 2.
        for (r, b) in [(0, 2), (1, 2), (0, 1), (1, 1), (0, 0)] {
            x.submit(r, b, Tensor::new(&[b as f32], &Device::Cpu)?, true)?;
        }
        assert!(outer.0.lock().expect("not poisoned").is_empty());
        x.submit(1, 0, Tensor::new(&[0f32], &Device::Cpu)?, true)?;
        assert_eq!(*outer.0.lock().expect("not poisoned"), vec![0, 1, 2]);
        for r in 0..2 {
            for b in 0..3 {
                let want = 2.0 * b as f32 + 100.0;
                assert_eq!(x.total(r, b)?.to_vec1::<f32>()?, vec![want]);
            }
        }
        Ok(())
    }

    #[test]
    fn a_failed_replica_ends_the_others_wait_with_its_reason() -> Result<()> {
        let x = exchange(2, Duration::from_secs(30));
        x.begin_step()?;
        let waiting = {
            let x = Arc::clone(&x);
            std::thread::spawn(move || -> Result<Tensor> {
                x.submit(0, 0, Tensor::new(&[1f32], &Device::Cpu)?, true)?;
                x.total(0, 0)
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        x.abort(1, "shape mismatch in layer `conv_3`");
        let err = waiting
            .join()
            .expect("replica thread")
            .expect_err("the wait must fail when a replica aborts")
            .to_string();
        assert!(
            err.contains("replica 1 (cpu) failed") && err.contains("conv_3"),
            "{err}"
        );
        // The next step starts clean.
        x.begin_step()?;
        x.submit(0, 0, Tensor::new(&[1f32], &Device::Cpu)?, false)?;
        x.submit(1, 0, Tensor::new(&[2f32], &Device::Cpu)?, false)?;
        assert_eq!(x.total(1, 0)?.to_vec1::<f32>()?, vec![3.0]);
        Ok(())
    }

    #[test]
    fn a_silent_replica_is_named_after_the_timeout() -> Result<()> {
        let x = exchange(2, Duration::from_millis(200));
        x.begin_step()?;
        x.submit(0, 0, Tensor::new(&[1f32], &Device::Cpu)?, true)?;
        let started = std::time::Instant::now();
        let err = x
            .total(0, 0)
            .expect_err("a missing bucket must time out")
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            err.contains("replica 1 (cpu) did not hand in bucket 0"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn a_bucket_handed_in_twice_is_an_error() -> Result<()> {
        let x = exchange(2, Duration::from_secs(5));
        x.begin_step()?;
        x.submit(0, 0, Tensor::new(&[1f32], &Device::Cpu)?, true)?;
        let err = x
            .submit(0, 0, Tensor::new(&[1f32], &Device::Cpu)?, true)
            .expect_err("a second hand-in must fail")
            .to_string();
        assert!(err.contains("handed in twice"), "{err}");
        Ok(())
    }
}
