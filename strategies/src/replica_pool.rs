//! `ReplicaPool`: one thread per replica, each owning its replica, driven by jobs from the
//! coordinating thread. A replica that panics, or does not answer within the timeout, ends the
//! call with an error naming it; it never hangs the caller.
//!
//! Each replica's work runs inside its own rayon thread pool when it has a thread budget
//! ([`ReplicaThreads`]), so replicas sharing the CPU do not each spread over every core: candle's
//! parallel CPU ops, its matrix multiplications and kandle's kernels all size themselves by the
//! rayon pool they run in.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::Device;
use kandle::strategy::Replica;
use kandle::{Error, Result};

/// How many threads each replica's CPU work may use.
///
/// Several replicas on one CPU each run their forward and backward passes at the same time. If
/// every replica used all the cores, the cores would be oversubscribed and the replicas would
/// slow each other down; a budget gives each replica its own rayon pool instead. Candle's
/// element-wise ops use a separate fixed pool of `CANDLE_NUM_THREADS` threads (default: the
/// cores), shared by all replicas, which no budget changes.
///
/// ```
/// use kandle_strategies::{MirroredStrategy, ReplicaOptions, ReplicaThreads};
///
/// let default = MirroredStrategy::cpu(2)?; // ReplicaThreads::Auto: cores / 2 threads each
/// let one_each =
///     MirroredStrategy::cpu(2)?.with_options(ReplicaOptions::default().threads_per_replica(1));
/// let shared = MirroredStrategy::cpu(2)?
///     .with_options(ReplicaOptions::default().threads_per_replica(ReplicaThreads::Shared));
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplicaThreads {
    /// The default: the threads of the rayon pool the model is built in (the global pool: the
    /// machine's logical cores, or `RAYON_NUM_THREADS`) divided evenly among the CPU replicas,
    /// at least one each. GPU replicas, whose work runs on their devices, share the global pool.
    #[default]
    Auto,
    /// Exactly this many threads for every replica (at least 1).
    Fixed(usize),
    /// No budget: every replica uses rayon's global pool, as a single-device model does.
    Shared,
}

impl From<usize> for ReplicaThreads {
    fn from(threads: usize) -> Self {
        ReplicaThreads::Fixed(threads)
    }
}

impl ReplicaThreads {
    /// The pool size of each replica on `devices`; `None` where a replica uses the global pool.
    pub(crate) fn pool_sizes(self, devices: &[Device]) -> Result<Vec<Option<usize>>> {
        Ok(match self {
            ReplicaThreads::Shared => vec![None; devices.len()],
            ReplicaThreads::Fixed(0) => {
                return Err(Error::invalid(
                    "threads_per_replica must be at least 1 (or ReplicaThreads::Shared)",
                ))
            }
            ReplicaThreads::Fixed(n) => vec![Some(n); devices.len()],
            ReplicaThreads::Auto => {
                let on_cpu = devices.iter().filter(|d| d.is_cpu()).count().max(1);
                let each = (rayon::current_num_threads() / on_cpu).max(1);
                devices.iter().map(|d| d.is_cpu().then_some(each)).collect()
            }
        })
    }
}

type Job = Box<dyn FnOnce(&mut Replica) + Send>;

struct Worker {
    label: String,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// Replicas running on their own threads.
pub struct ReplicaPool {
    workers: Vec<Worker>,
    timeout: Duration,
    broken: Option<String>,
    /// Whether a replica is waiting on the others (in a gradient bucket exchange).
    waiting: Option<Arc<dyn Fn(usize) -> bool + Send + Sync>>,
}

impl ReplicaPool {
    /// Starts one thread per replica. `labels` name them in errors (e.g. `replica 1 (cuda:1)`).
    /// Replica `i` runs its work in a rayon pool of `threads[i]` threads of its own, or in the
    /// global pool where that is `None`.
    pub fn new(
        replicas: Vec<Replica>,
        labels: Vec<String>,
        timeout: Duration,
        threads: &[Option<usize>],
    ) -> Result<Self> {
        let workers = replicas
            .into_iter()
            .zip(labels)
            .enumerate()
            .map(|(i, (mut replica, label))| {
                let cannot_start = |what: &str, e: &dyn std::fmt::Display| Error::Replica {
                    replica: label.clone(),
                    reason: format!("cannot start its {what}: {e}"),
                };
                let pool = threads
                    .get(i)
                    .copied()
                    .flatten()
                    .map(|n| {
                        rayon::ThreadPoolBuilder::new()
                            .num_threads(n)
                            // The pool's threads carry the replica's name: they do its work.
                            .thread_name(move |_| format!("kandle-replica-{i}"))
                            .build()
                    })
                    .transpose()
                    .map_err(|e| cannot_start("thread pool", &e))?;
                let (tx, rx): (Sender<Job>, Receiver<Job>) = mpsc::channel();
                let thread = std::thread::Builder::new()
                    .name(format!("kandle-replica-{i}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            match &pool {
                                Some(pool) => pool.install(|| job(&mut replica)),
                                None => job(&mut replica),
                            }
                        }
                    })
                    .map_err(|e| cannot_start("thread", &e))?;
                Ok(Worker {
                    label,
                    jobs: Some(tx),
                    thread: Some(thread),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            workers,
            timeout,
            broken: None,
            waiting: None,
        })
    }

    /// Runs `f(i, replica_i, input_i)` on every replica in parallel and returns the results in
    /// replica order. Fails with the first error, naming the replica, if a replica errs, panics
    /// or does not answer in time; after a panic or a time-out the pool refuses further work.
    pub fn run<T, R, F>(&mut self, inputs: Vec<T>, f: F) -> Result<Vec<R>>
    where
        T: Send + 'static,
        R: Send + 'static,
        F: Fn(usize, &mut Replica, T) -> Result<R> + Send + Sync + 'static,
    {
        if let Some(reason) = &self.broken {
            return Err(Error::Replica {
                replica: "replicas".into(),
                reason: format!("an earlier step failed ({reason}); rebuild the model"),
            });
        }
        let f = Arc::new(f);
        let (tx, rx) = mpsc::channel::<(usize, std::thread::Result<Result<R>>)>();
        for (i, (worker, input)) in self.workers.iter().zip(inputs).enumerate() {
            let f = Arc::clone(&f);
            let tx = tx.clone();
            let job: Job = Box::new(move |replica| {
                let out = catch_unwind(AssertUnwindSafe(|| f(i, replica, input)));
                let _ = tx.send((i, out));
            });
            let sent = worker
                .jobs
                .as_ref()
                .is_some_and(|jobs| jobs.send(job).is_ok());
            if !sent {
                return Err(self.fail(i, "its thread has stopped".into()));
            }
        }
        drop(tx);
        let mut results: Vec<Option<R>> = (0..self.workers.len()).map(|_| None).collect();
        let deadline = Instant::now() + self.timeout;
        let mut first_error = None;
        for _ in 0..self.workers.len() {
            let wait = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok((i, Ok(Ok(r)))) => results[i] = Some(r),
                Ok((i, Ok(Err(e)))) => {
                    first_error.get_or_insert(self.labelled(i, e));
                }
                Ok((i, Err(panic))) => {
                    let msg = kandle::strategy::panic_message(panic.as_ref());
                    return Err(self.fail(i, format!("panicked: {msg}")));
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    let silent = self.silent(&results);
                    let secs = self.timeout.as_secs_f64();
                    return Err(self.fail(silent, format!("did not answer within {secs:.0} s")));
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// Tells the pool which replicas are waiting on the others (`waiting(i)`), so that a step
    /// that times out names a replica that is not.
    pub(crate) fn set_waiting(&mut self, waiting: Arc<dyn Fn(usize) -> bool + Send + Sync>) {
        self.waiting = Some(waiting);
    }

    /// The replica a timed-out step names: the first without a result that is not waiting on
    /// the others, else the first without a result.
    fn silent<R>(&self, results: &[Option<R>]) -> usize {
        let without: Vec<usize> = (0..results.len())
            .filter(|&i| results[i].is_none())
            .collect();
        let busy = without
            .iter()
            .copied()
            .find(|&i| self.waiting.as_ref().is_none_or(|waiting| !waiting(i)));
        busy.or(without.first().copied()).unwrap_or_default()
    }

    /// `e`, a replica's error, naming the replica once: an error that names it already (an
    /// exchange between the replicas reports its failures so, the batch-norm rendezvous by its
    /// index alone, as `replica 0`) takes the pool's label, any other is wrapped in it.
    fn labelled(&self, replica: usize, e: Error) -> Error {
        let label = &self.workers[replica].label;
        match e {
            Error::Replica {
                replica: named,
                reason,
            } if named == *label || label.starts_with(&format!("{named} (")) => Error::Replica {
                replica: label.clone(),
                reason,
            },
            other => Error::Replica {
                replica: label.clone(),
                reason: other.to_string(),
            },
        }
    }

    fn fail(&mut self, replica: usize, reason: String) -> Error {
        let label = self.workers[replica].label.clone();
        self.broken = Some(format!("{label} {reason}"));
        Error::Replica {
            replica: label,
            reason,
        }
    }
}

impl Drop for ReplicaPool {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.jobs.take();
        }
        // A healthy pool's threads exit as soon as their job channel closes. A replica stuck in
        // a step is left detached rather than joined, so dropping never hangs.
        if self.broken.is_none() {
            for w in &mut self.workers {
                if let Some(t) = w.thread.take() {
                    let _ = t.join();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kandle::layers::{Dense, Flatten, Sequential};
    use kandle::losses::MeanSquaredError;
    use kandle::optimizers::Sgd;
    use kandle::strategy::ModelSpec;

    fn replicas(n: usize) -> Result<Vec<Replica>> {
        let spec = ModelSpec {
            network: Sequential::new().add(Flatten).add(Dense::new(2)).into(),
            input_shapes: vec![vec![3]],
            optimizer: Box::new(Sgd::new(0.1)),
            loss: kandle::Objective::new(MeanSquaredError),
            metrics: ().into(),
            seed: 0,
            compute_path: kandle::ComputePath::Auto,
            dtype_policy: kandle::DTypePolicy::default(),
        };
        (0..n).map(|_| Replica::new(&spec, &Device::Cpu)).collect()
    }

    fn pool_sizes_seen(threads: &[Option<usize>]) -> Result<Vec<usize>> {
        let labels = (0..threads.len()).map(|i| format!("replica {i}")).collect();
        let mut pool = ReplicaPool::new(
            replicas(threads.len())?,
            labels,
            Duration::from_secs(30),
            threads,
        )?;
        pool.run(vec![(); threads.len()], |_, _, ()| {
            Ok(rayon::current_num_threads())
        })
    }

    #[test]
    fn an_error_names_its_replica_once() -> Result<()> {
        let labels = vec!["replica 0 (cpu)".to_string(), "replica 1 (cpu)".to_string()];
        let mut pool = ReplicaPool::new(replicas(2)?, labels, Duration::from_secs(30), &[])?;
        let named = pool.run(vec![(); 2], |i, _, ()| match i {
            0 => Err::<(), _>(Error::Replica {
                replica: "replica 0 (cpu)".into(),
                reason: "gradient buckets: replica 1 (cpu) failed: no data".into(),
            }),
            _ => Ok(()),
        });
        let message = named.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            message,
            "replica 0 (cpu): gradient buckets: replica 1 (cpu) failed: no data"
        );
        // The batch-norm rendezvous names a replica by its index alone.
        let by_index = pool.run(vec![(); 2], |i, _, ()| match i {
            1 => Err::<(), _>(Error::Replica {
                replica: "replica 1".into(),
                reason: "the other replicas did not reach the batch-norm synchronisation".into(),
            }),
            _ => Ok(()),
        });
        let message = by_index.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            message,
            "replica 1 (cpu): the other replicas did not reach the batch-norm synchronisation"
        );
        let plain = pool.run(vec![(); 2], |i, _, ()| match i {
            1 => Err::<(), _>(Error::invalid("bad batch")),
            _ => Ok(()),
        });
        let message = plain.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.starts_with("replica 1 (cpu): "), "{message}");
        assert!(message.contains("bad batch"), "{message}");
        Ok(())
    }

    #[test]
    fn each_replica_runs_in_a_pool_of_its_budget() -> Result<()> {
        assert_eq!(pool_sizes_seen(&[Some(1), Some(3)])?, vec![1, 3]);
        let global = rayon::current_num_threads();
        assert_eq!(pool_sizes_seen(&[None, Some(2)])?, vec![global, 2]);
        Ok(())
    }

    #[test]
    fn budgets_divide_the_cores_among_cpu_replicas() -> Result<()> {
        let cores = rayon::current_num_threads();
        let cpu = vec![Device::Cpu; 2];
        let half = (cores / 2).max(1);
        assert_eq!(ReplicaThreads::Auto.pool_sizes(&cpu)?, vec![Some(half); 2]);
        assert_eq!(ReplicaThreads::from(3).pool_sizes(&cpu)?, vec![Some(3); 2]);
        assert_eq!(ReplicaThreads::Shared.pool_sizes(&cpu)?, vec![None; 2]);
        let err = ReplicaThreads::Fixed(0)
            .pool_sizes(&cpu)
            .expect_err("zero threads must be refused")
            .to_string();
        assert!(err.contains("at least 1"), "{err}");
        Ok(())
    }
}
