//! Seeded random tensors for tests: the same seed gives the same values on every run and
//! machine, so a test that trains on them, or compares two paths within a tolerance, fails
//! (or passes) the same way wherever it runs and a failure can be replayed.
//!
//! candle's `Tensor::randn` on the CPU draws from the thread's generator, which cannot be
//! seeded: a test on its values sees other data on every run.

use candle_core::{Device, Result, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A float32 tensor of `dims` on the CPU, uniform on `[-1, 1)`, drawn from `seed`.
///
/// ```
/// let a = kandle_testing::random::seeded_uniform(&[2, 3], 5).unwrap();
/// let b = kandle_testing::random::seeded_uniform(&[2, 3], 5).unwrap();
/// assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
/// ```
pub fn seeded_uniform(dims: &[usize], seed: u64) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: usize = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    Tensor::from_vec(values, dims, &Device::Cpu)
}

/// A float32 tensor of `dims` on the CPU, normal with mean 0 and standard deviation `std`,
/// drawn from `seed` (Box–Muller in float64, rounded once).
///
/// ```
/// let x = kandle_testing::random::seeded_normal(&[10_000], 1.0, 3).unwrap();
/// let mean = x.mean_all().unwrap().to_scalar::<f32>().unwrap();
/// assert!(mean.abs() < 0.05);
/// ```
pub fn seeded_normal(dims: &[usize], std: f64, seed: u64) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: usize = dims.iter().product();
    let mut values = Vec::with_capacity(n + 1);
    while values.len() < n {
        // `1 - u` lies in (0, 1], so its logarithm is finite.
        let radius = (-2.0 * (1.0 - rng.random::<f64>()).ln()).sqrt() * std;
        let angle = std::f64::consts::TAU * rng.random::<f64>();
        values.push((radius * angle.cos()) as f32);
        values.push((radius * angle.sin()) as f32);
    }
    values.truncate(n);
    Tensor::from_vec(values, dims, &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_repeat_and_differ() -> Result<()> {
        let a = seeded_normal(&[3, 5], 1.0, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let b = seeded_normal(&[3, 5], 1.0, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let c = seeded_normal(&[3, 5], 1.0, 2)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(a, b);
        assert_ne!(a, c);
        Ok(())
    }

    #[test]
    fn normal_moments_and_uniform_range() -> Result<()> {
        let n = 100_000;
        let x = seeded_normal(&[n], 2.0, 9)?.to_vec1::<f32>()?;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        // Five standard errors: the mean's is 2 / sqrt(n), the variance's 4 * sqrt(2 / n).
        assert!(mean.abs() < 5.0 * 2.0 / (n as f64).sqrt(), "{mean}");
        assert!(
            (var - 4.0).abs() < 5.0 * 4.0 * (2.0 / n as f64).sqrt(),
            "{var}"
        );
        let u = seeded_uniform(&[n], 9)?.to_vec1::<f32>()?;
        assert!(u.iter().all(|v| (-1.0..1.0).contains(v)));
        assert_eq!(seeded_normal(&[7], 1.0, 0)?.dims(), [7]);
        Ok(())
    }
}
