//! Wall-clock timing: warm-up runs, then the median of timed runs.

use std::time::Instant;

use anyhow::Result;

/// How many runs to discard and how many to time.
#[derive(Debug, Clone, Copy)]
pub struct Timer {
    /// Untimed runs first (caches, allocator, lazily built pools).
    pub warmup: usize,
    /// Timed runs; the median is reported.
    pub iters: usize,
}

impl Timer {
    /// The median wall time of `f` in seconds.
    pub fn median<F: FnMut() -> Result<()>>(&self, mut f: F) -> Result<f64> {
        for _ in 0..self.warmup {
            f()?;
        }
        let mut samples = Vec::with_capacity(self.iters.max(1));
        for _ in 0..self.iters.max(1) {
            let start = Instant::now();
            f()?;
            samples.push(start.elapsed().as_secs_f64());
        }
        Ok(median(samples))
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
