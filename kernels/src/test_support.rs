//! What the kernel tests, and kandle's tests of the layers that call the kernels, share: seeded
//! random tensors, gradients of a weighted sum, and closeness checks that name what differs.
//! Only in this crate's tests and with the `test-support` feature.

use candle_core::{Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Values a ReLU must treat as PyTorch does: NaN, the infinities, both zeros, and numbers on
/// either side of zero.
pub const SPECIAL_VALUES: [f32; 8] = [
    f32::NAN,
    f32::NEG_INFINITY,
    f32::INFINITY,
    -0.0,
    0.0,
    -2.5,
    3.0,
    -f32::MIN_POSITIVE,
];

/// The bits of `values`, to compare NaNs and signed zeros exactly.
pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// A seeded `f32` tensor of `shape` with values uniform in `[offset - 1, offset + 1)`.
pub fn random(shape: &[usize], seed: u64, offset: f32) -> anyhow::Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| offset + rng.random_range(-1f32..1f32))
        .collect();
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
}

/// A seeded variable like [`random`].
pub fn random_var(shape: &[usize], seed: u64, offset: f32) -> anyhow::Result<Var> {
    Ok(Var::from_tensor(&random(shape, seed, offset)?)?)
}

/// `sum(y * weights)`, with seeded random weights, so that every output gets its own gradient.
pub fn weighted_sum(y: &Tensor, seed: u64) -> anyhow::Result<Tensor> {
    let w = random(y.dims(), seed, 0.0)?.to_dtype(y.dtype())?;
    Ok((y * w)?.sum_all()?)
}

/// The gradients of `loss` with respect to each of `vars`, as `f32` (zeros where none flows).
pub fn gradients(loss: &Tensor, vars: &[&Tensor]) -> anyhow::Result<Vec<Tensor>> {
    let grads = loss.backward()?;
    vars.iter()
        .map(|v| {
            Ok(match grads.get(v) {
                Some(g) => g.to_dtype(candle_core::DType::F32)?,
                None => v.zeros_like()?.to_dtype(candle_core::DType::F32)?,
            })
        })
        .collect()
}

/// The largest absolute difference between `a` and `b`, which must have the same shape.
pub fn max_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    anyhow::ensure!(
        a.dims() == b.dims(),
        "shapes {:?} vs {:?}",
        a.dims(),
        b.dims()
    );
    let a = a.to_dtype(candle_core::DType::F32)?.flatten_all()?;
    let b = b.to_dtype(candle_core::DType::F32)?.flatten_all()?;
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

/// Fails naming `what` when `got` and `want` differ by more than `tol` times the largest
/// magnitude in `want` (or `tol` itself, if `want` is small).
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) -> anyhow::Result<()> {
    let diff = max_diff(got, want)?;
    let scale = want
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .abs()?
        .max(0)?
        .to_scalar::<f32>()?
        .max(1.0);
    anyhow::ensure!(
        diff <= tol * scale,
        "{what}: max difference {diff} exceeds {tol} x {scale} (shape {:?})",
        want.dims()
    );
    Ok(())
}

/// The median wall time of `reps` runs of `f`, in milliseconds, after one warm-up run.
pub fn median_ms(reps: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = std::time::Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// A scalar whose backward pass hands a fixed gradient to its input: the root of a timed
/// backward pass that adds no work of its own beyond candle's gradient accumulation.
struct InjectGradient(Tensor);

impl candle_core::CustomOp1 for InjectGradient {
    fn name(&self) -> &'static str {
        "inject-gradient"
    }

    fn cpu_fwd(
        &self,
        _storage: &candle_core::CpuStorage,
        _layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        Ok((candle_core::CpuStorage::F32(vec![0.0]), ().into()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}

/// The median times, in milliseconds, of a forward pass (of variables it captures) and of the
/// backward pass from its output given a fixed random output gradient.
pub fn fwd_bwd_ms(
    reps: usize,
    forward: impl Fn() -> anyhow::Result<Tensor>,
) -> anyhow::Result<(f64, f64)> {
    let fwd = median_ms(reps, || forward().map(drop))?;
    let mut bwd_times = Vec::with_capacity(reps);
    let mut dy: Option<Tensor> = None;
    for i in 0..=reps {
        let y = forward()?;
        let dy = match &dy {
            Some(d) => d.clone(),
            None => dy.insert(random(y.dims(), 7, 0.0)?).clone(),
        };
        let root = y.apply_op1(InjectGradient(dy))?;
        let start = std::time::Instant::now();
        let grads = root.backward()?;
        let took = start.elapsed().as_secs_f64() * 1e3;
        drop(grads);
        if i > 0 {
            bwd_times.push(took);
        }
    }
    bwd_times.sort_by(f64::total_cmp);
    Ok((fwd, bwd_times[bwd_times.len() / 2]))
}
