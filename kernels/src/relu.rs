//! The ReLU on the CPU as an op of its own, for the ReLUs no other kernel fuses (after a sum of
//! branches, a dense layer, an activation layer): `x < 0 ? 0 : x` over an `f32` tensor in one
//! parallel, vectorised pass. A NaN stays NaN, as in PyTorch (candle's `relu`, `max(x, 0)`,
//! makes it zero), and `-inf` becomes zero; `scalar` is the rule the convolution's and
//! BatchNorm's fused ReLUs follow too. The backward pass, registered with candle, passes the
//! output gradient where `x < 0` is false (where `x >= 0`, as candle's ReLU passes it, and at
//! a NaN, as PyTorch's `threshold_backward` does) and gives zero elsewhere, whatever the output
//! gradient holds there.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use super::output;
use super::planes::f32_data;
use super::replay::Replay1;
use super::simd::vectorized;
use crate::{Error, Result};

const OP: &str = "relu";
const GRAD_OP: &str = "relu_grad";

/// Values per unit of parallel work.
const CHUNK: usize = 4096;

/// `x < 0 ? 0 : x`: zero for negative values and `-inf`, `x` itself for the rest (NaN, `+inf`,
/// both zeros).
#[inline(always)]
pub(crate) fn scalar(x: f32) -> f32 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// Whether the kernel can run on `x`: an `f32` CPU tensor.
pub fn supported(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// The ReLU of the `f32` CPU tensor `x` (see the module's documentation), differentiable.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    check(x)?;
    Ok(x.contiguous()?.apply_op1(Relu)?)
}

/// [`relu`], kept for calling its backward pass directly.
pub fn relu_replay(x: &Tensor) -> Result<Replay1> {
    check(x)?;
    Ok(Replay1::apply(&x.contiguous()?, Relu)?)
}

fn check(x: &Tensor) -> Result<()> {
    match supported(x) {
        true => Ok(()),
        false => Err(Error::invalid(format!(
            "{OP}: expected an f32 CPU tensor, got {:?} {:?} on {:?}",
            x.dtype(),
            x.dims(),
            x.device()
        ))),
    }
}

/// `f(a[i], b[i])` for every `i`, in chunks in parallel, each compiled for the widest vector
/// instructions the kernels may use. `a` and `b` are as long.
fn map(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync + Send) -> Vec<f32> {
    let f = &f;
    let mut out = output::by_plane(a.len(), 1, CHUNK, |i, _, plane| {
        let (a, b) = (&a[i * CHUNK..][..CHUNK], &b[i * CHUNK..][..CHUNK]);
        vectorized(
            #[inline(always)]
            || plane.zip_with(a, b, f),
        )
    });
    // The values past the last whole chunk, which `by_plane` zeroes.
    let tail = a.len() / CHUNK * CHUNK;
    for ((o, &x), &y) in out[tail..].iter_mut().zip(&a[tail..]).zip(&b[tail..]) {
        *o = f(x, y);
    }
    out
}

/// The ReLU as a custom op, its backward registered.
struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_data(OP, s, l)?;
        let y = map(x, x, |v, _| scalar(v));
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if dy.dims() != x.dims() {
            candle_core::bail!(
                "{GRAD_OP}: an output gradient {:?} for an input {:?}",
                dy.dims(),
                x.dims()
            );
        }
        let dy = dy.to_dtype(DType::F32)?.contiguous()?;
        Ok(Some(x.contiguous()?.apply_op2_no_bwd(&dy, &Grad)?))
    }
}

/// The input gradient `(x, dy)` to `x < 0 ? 0 : dy`.
struct Grad;

impl CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        GRAD_OP
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        dys: &CpuStorage,
        dyl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, dy) = (f32_data(GRAD_OP, xs, xl)?, f32_data(GRAD_OP, dys, dyl)?);
        let dx = map(x, dy, |v, g| if v < 0.0 { 0.0 } else { g });
        Ok((CpuStorage::F32(dx), xl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::simd::Width;
    use crate::test_support::{bits, SPECIAL_VALUES};

    /// `len` values that cycle through [`SPECIAL_VALUES`] and numbers around zero.
    fn values(len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| match i % 11 {
                k @ 0..=7 => SPECIAL_VALUES[k],
                k => (i * 7919 % 199) as f32 / 99.0 - 1.0 + k as f32 * 0.01,
            })
            .collect()
    }

    /// Every width gives [`scalar`]'s bits, a NaN kept, over whole chunks and a tail, in
    /// parallel; the op's gradient is `dy` where `x < 0` is false, zero elsewhere even where
    /// `dy` is NaN, through candle's autograd and the replay alike.
    #[test]
    fn keeps_nans_and_passes_their_gradient_at_every_width() -> anyhow::Result<()> {
        let len = 3 * CHUNK + 37;
        let x = values(len);
        let want: Vec<f32> = x.iter().map(|&v| scalar(v)).collect();
        assert!(want[0].is_nan() && want[1] == 0.0 && want[2] == f32::INFINITY);
        for width in Width::available() {
            let got = width.run(
                #[inline(always)]
                || map(&x, &x, |v, _| scalar(v)),
            );
            assert_eq!(bits(&got), bits(&want), "{width:?}");
        }
        let xv = Var::from_vec(x.clone(), len, &Device::Cpu)?;
        let y = relu(&xv)?;
        assert_eq!(bits(&y.to_vec1::<f32>()?), bits(&want));
        let dy: Vec<f32> = (0..len)
            .map(|i| if i % 5 == 0 { f32::NAN } else { i as f32 })
            .collect();
        let want_dx: Vec<f32> = x
            .iter()
            .zip(&dy)
            .map(|(&v, &g)| if v < 0.0 { 0.0 } else { g })
            .collect();
        let dy = Tensor::from_vec(dy, len, &Device::Cpu)?;
        let grads = (y * &dy)?.sum_all()?.backward()?;
        let dx = grads
            .get(&xv)
            .ok_or_else(|| anyhow::anyhow!("no gradient"))?;
        assert_eq!(bits(&dx.to_vec1::<f32>()?), bits(&want_dx));
        let replay = relu_replay(xv.as_tensor())?;
        let dx = replay
            .backward(&dy)?
            .ok_or_else(|| anyhow::anyhow!("no gradient"))?;
        assert_eq!(bits(&dx.to_vec1::<f32>()?), bits(&want_dx));
        Ok(())
    }

    #[test]
    fn refuses_other_types_and_devices_naming_the_op() -> anyhow::Result<()> {
        let x = Tensor::ones(4, DType::F64, &Device::Cpu)?;
        let err = relu(&x).expect_err("f64").to_string();
        assert!(err.contains("relu") && err.contains("F64"), "{err}");
        Ok(())
    }
}
