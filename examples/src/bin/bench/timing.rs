//! Wall-clock timing: warm-up runs, then the median (or the fastest) of timed runs.
//!
//! Whole training steps report the median. Single ops report the fastest run: they last
//! milliseconds, and on a shared machine one preempted thread stalls a whole parallel op, which
//! only ever adds time.

use std::time::Instant;

use anyhow::Result;

/// How many runs to discard and how many to time.
#[derive(Debug, Clone, Copy)]
pub struct Timer {
    /// Untimed runs first (caches, allocator, lazily built pools).
    pub warmup: usize,
    /// Timed runs.
    pub iters: usize,
}

impl Timer {
    /// The median wall time of `f` in seconds.
    pub fn median<F: FnMut() -> Result<()>>(&self, f: F) -> Result<f64> {
        Ok(median(self.samples(f)?))
    }

    /// The fastest wall time of `f` in seconds.
    pub fn fastest<F: FnMut() -> Result<()>>(&self, f: F) -> Result<f64> {
        Ok(self.samples(f)?.into_iter().fold(f64::INFINITY, f64::min))
    }

    fn samples<F: FnMut() -> Result<()>>(&self, mut f: F) -> Result<Vec<f64>> {
        for _ in 0..self.warmup {
            f()?;
        }
        let mut samples = Vec::with_capacity(self.iters.max(1));
        for _ in 0..self.iters.max(1) {
            let start = Instant::now();
            f()?;
            samples.push(start.elapsed().as_secs_f64());
        }
        Ok(samples)
    }
}

/// The median, averaging the two middle values of an even count (as Python's `statistics`).
pub fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => samples[n / 2],
        _ => (samples[n / 2 - 1] + samples[n / 2]) / 2.0,
    }
}
