//! What the tests of kandle's CUDA batch normalisation and pooling kernels share
//! (`cuda_batch_norm.rs`, `cuda_pooling.rs`): the GPU, values read back from it, comparisons
//! that treat NaNs and infinities as values, gradients of a weighted sum, and the check of an
//! error naming the op.

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use kandle_kernels::test_support::random;

/// The GPU, or an error saying the tests need one (they are `#[ignore]`d, and `gpu/check.sh`
/// runs them with `--include-ignored` on a GPU machine).
pub fn gpu() -> Result<Device> {
    Device::new_cuda(0).context("this test needs a CUDA GPU (gpu/check.sh runs it there)")
}

/// A tensor's values as `f32` on the host.
pub fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Fails naming `what` unless `got` and `want` have the same shape, NaNs and infinities in the
/// same places, and every other pair of values within `tol` times the largest finite magnitude
/// of `want` (or `tol` itself, if that is below one).
pub fn assert_matches(what: &str, got: &Tensor, want: &Tensor, tol: f32) -> Result<()> {
    ensure!(
        got.dims() == want.dims(),
        "{what}: shape {:?}, expected {:?}",
        got.dims(),
        want.dims()
    );
    let (got, want) = (host(got)?, host(want)?);
    let scale = want
        .iter()
        .filter(|v| v.is_finite())
        .fold(1f32, |m, v| m.max(v.abs()));
    let mut worst = (0f32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        if w.is_finite() && g.is_finite() {
            if (g - w).abs() > worst.0 {
                worst = ((g - w).abs(), i);
            }
        } else {
            ensure!(
                g.is_nan() && w.is_nan() || g == w,
                "{what}: value {i} is {g}, expected {w}"
            );
        }
    }
    let (diff, at) = worst;
    ensure!(
        diff <= tol * scale,
        "{what}: difference {diff} at value {at} ({} against {}) exceeds {tol} x {scale}",
        got[at],
        want[at]
    );
    Ok(())
}

/// `sum(y * weights)` on `y`'s device, with seeded random weights rounded to `rounding` first,
/// so that a run in half precision and its `f32` reference get the same output gradient.
pub fn weighted_sum(y: &Tensor, seed: u64, rounding: DType) -> Result<Tensor> {
    let w = random(y.dims(), seed, 0.0)?
        .to_dtype(rounding)?
        .to_dtype(y.dtype())?
        .to_device(y.device())?;
    Ok((y * w)?.sum_all()?)
}

/// The gradient of `loss` for each of `vars`, as `f32` on the host.
pub fn gradients(loss: &Tensor, vars: &[&Var]) -> Result<Vec<Tensor>> {
    let grads = loss.backward()?;
    vars.iter()
        .map(|v| {
            let g = grads.get(v.as_tensor()).context("no gradient")?;
            Ok(g.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
        })
        .collect()
}

/// Fails unless `result` is an [`kandle_kernels::Error::InvalidInput`] whose message holds
/// every one of `parts` (the op's name among them).
pub fn assert_invalid<T>(result: kandle_kernels::Result<T>, parts: &[&str]) -> Result<()> {
    match result {
        Err(kandle_kernels::Error::InvalidInput(msg)) => {
            for part in parts {
                ensure!(
                    msg.contains(part),
                    "the error {msg:?} does not name {part:?}"
                );
            }
            Ok(())
        }
        Err(e) => anyhow::bail!("expected an invalid input naming {parts:?}, got {e}"),
        Ok(_) => anyhow::bail!("expected an invalid input naming {parts:?}, got a result"),
    }
}
