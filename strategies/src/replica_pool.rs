//! `ReplicaPool`: one thread per replica, each owning its replica, driven by jobs from the
//! coordinating thread. A replica that panics, or does not answer within the timeout, ends the
//! call with an error naming it; it never hangs the caller.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kandle::replica::Replica;
use kandle::{Error, Result};

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
}

impl ReplicaPool {
    /// Starts one thread per replica. `labels` name them in errors (e.g. `replica 1 (cuda:1)`).
    pub fn new(replicas: Vec<Replica>, labels: Vec<String>, timeout: Duration) -> Result<Self> {
        let workers = replicas
            .into_iter()
            .zip(labels)
            .enumerate()
            .map(|(i, (mut replica, label))| {
                let (tx, rx): (Sender<Job>, Receiver<Job>) = mpsc::channel();
                let thread = std::thread::Builder::new()
                    .name(format!("kandle-replica-{i}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            job(&mut replica);
                        }
                    })
                    .map_err(|e| Error::Replica {
                        replica: label.clone(),
                        reason: format!("cannot start its thread: {e}"),
                    })?;
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
                    first_error.get_or_insert(Error::Replica {
                        replica: self.workers[i].label.clone(),
                        reason: e.to_string(),
                    });
                }
                Ok((i, Err(panic))) => {
                    let msg = kandle::panic_message(panic.as_ref());
                    return Err(self.fail(i, format!("panicked: {msg}")));
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    let silent = results.iter().position(Option::is_none).unwrap_or_default();
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
