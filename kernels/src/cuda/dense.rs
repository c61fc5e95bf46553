//! A Dense layer's product on cuBLASLt: `x W^T + b` in one matmul whose epilogue adds the bias,
//! where candle runs a GEMM and a broadcast add. Plans are made once per shape
//! ([`super::matmul_plans`]).
//!
//! A ReLU after the product stays a kernel of its own: cuBLASLt's ReLU epilogue is
//! `max(x, 0)`, which does not promise to keep a NaN, where PyTorch's ReLU propagates it (and
//! kandle's ReLU kernel, whose gradient passes at zero, does too).
//!
//! The backward pass (registered with candle's autograd) is candle's: two GEMMs and the bias's
//! sum over the batch.

#![allow(unsafe_code)]

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::matmul_plans::{self, alignment, data_type, Key, Operands};
use super::operands::{address, address_mut, on_cpu, storage, uninit};
use crate::{Error, Result};

const OP: &str = "dense (cuBLASLt)";
const CPU_KERNEL: &str = "candle's matmul";

/// Whether [`dense`] takes tensors of `dtype`: `f32`, `f16` or `bf16`.
pub fn dense_supported(dtype: DType) -> bool {
    data_type(dtype).is_some()
}

/// `x W^T + b` of `x (batch, inner)`, `w (units, inner)` (PyTorch's layout) and the optional
/// bias `b (units)`, as one cuBLASLt matmul with the bias in its epilogue: a new
/// `(batch, units)` tensor. `f32` runs with FMA math (no TF32); `f16` and `bf16` accumulate in
/// `f32`. Differentiable in all three through candle's autograd.
///
/// Errors when the tensors are not on one CUDA device in one dtype among `f32`, `f16` and
/// `bf16`, or their shapes do not fit one another.
///
/// ```no_run
/// # fn main() -> kandle_kernels::Result<()> {
/// use candle_core::{Device, Tensor};
/// use kandle_kernels::cuda;
///
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1., (64, 256), &dev)?;
/// let w = Tensor::randn(0f32, 1., (10, 256), &dev)?;
/// let b = Tensor::zeros(10, candle_core::DType::F32, &dev)?;
/// let y = cuda::dense(&x, &w, Some(&b))?;
/// assert_eq!(y.dims(), &[64, 10]);
/// # Ok(()) }
/// ```
pub fn dense(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (batch, units) = check(x, w, bias)?;
    if batch == 0 || units == 0 || x.dim(1)? == 0 {
        // Nothing for cuBLASLt to multiply: the bias (or zeros) for every row.
        let y = Tensor::zeros((batch, units), x.dtype(), x.device())?;
        return Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        });
    }
    let op = Dense;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    Ok(match bias {
        Some(b) => x.apply_op3(&w, &aligned(b)?, op)?,
        None => x.apply_op2(&w, op)?,
    })
}

/// The bias contiguous and starting on 16 bytes, as the epilogue reads it (cuBLASLt's
/// preferences give the matrices' alignments, not the bias's): a copy of a bias that starts
/// elsewhere in its buffer.
fn aligned(b: &Tensor) -> Result<Tensor> {
    let b = b.contiguous()?;
    let offset = b.layout().start_offset() * b.dtype().size_in_bytes();
    Ok(match offset % 16 {
        0 => b,
        _ => b.force_contiguous()?,
    })
}

/// The output's dimensions, or an error naming what does not fit.
fn check(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<(usize, usize)> {
    if !x.device().is_cuda() || !dense_supported(x.dtype()) {
        return Err(Error::invalid(format!(
            "{OP}: takes f32, f16 or bf16 tensors on a CUDA device, but the input is {:?} on \
             {:?}",
            x.dtype(),
            x.device()
        )));
    }
    let &[batch, inner] = x.dims() else {
        return Err(Error::invalid(format!(
            "{OP}: the input is {:?}, where (batch, features) is needed",
            x.dims()
        )));
    };
    let same = |t: &Tensor| t.dtype() == x.dtype() && t.device().same_device(x.device());
    let units = match w.dims() {
        &[units, k] if k == inner && same(w) => units,
        _ => {
            return Err(Error::invalid(format!(
                "{OP}: the weight is {:?} {:?} on {:?}, where the input {:?} {:?} needs \
                 (units, {inner}) of its dtype on its device",
                w.dtype(),
                w.dims(),
                w.device(),
                x.dtype(),
                x.dims()
            )))
        }
    };
    if let Some(b) = bias {
        if b.dims() != [units] || !same(b) {
            return Err(Error::invalid(format!(
                "{OP}: the bias is {:?} {:?} on {:?}, where a weight of {units} units needs \
                 ({units}) of the input's dtype {:?} on its device",
                b.dtype(),
                b.dims(),
                b.device(),
                x.dtype()
            )));
        }
    }
    Ok((batch, units))
}

/// The op: operands `(x, w)` or `(x, w, b)`.
struct Dense;

impl Dense {
    /// The product of contiguous operands on their device.
    fn forward(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (&[batch, inner], &[units, _]) = (xl.dims(), wl.dims()) else {
            candle_core::bail!("{OP}: operands {:?} and {:?}", xl.dims(), wl.dims())
        };
        let dev = &x.device;
        let stream = dev.cuda_stream();
        let dtype = x.dtype();
        let (input, _x) = address(OP, x, xl, &stream)?;
        let (weight, _w) = address(OP, w, wl, &stream)?;
        let bias = bias
            .map(|(b, bl)| address(OP, b, bl, &stream))
            .transpose()?;
        // SAFETY: the product writes every value of the output before anything reads it.
        let mut y = unsafe { uninit(dev, dtype, batch * units) }?;
        {
            let (output, _y) = address_mut(&mut y, &stream)?;
            let key = Key {
                dtype,
                batch,
                inner,
                units,
                bias: bias.is_some(),
                alignments: [alignment(weight), alignment(input), alignment(output)],
            };
            let operands = Operands {
                weight,
                input,
                output,
                bias: bias.as_ref().map(|(ptr, _)| *ptr),
            };
            // SAFETY: the operands are contiguous device memory of `dev` of `key`'s shapes and
            // dtype (checked by `dense` and the layouts above), the output is new, and the
            // guards keep every buffer's stream order until the product is queued.
            unsafe { matmul_plans::run(dev, &key, operands) }?;
        }
        Ok((storage(y, dev), Shape::from((batch, units))))
    }

    /// The gradients of `x` and `w` from the output's gradient `dy`.
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((dy.matmul(w)?, dy.t()?.matmul(x)?))
    }
}

impl CustomOp2 for Dense {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(OP, CPU_KERNEL))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.forward((x, xl), (w, wl), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.backward(x, w, dy)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for Dense {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(OP, CPU_KERNEL))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.forward((x, xl), (w, wl), Some((b, bl)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.backward(x, w, dy)?;
        Ok((Some(dx), Some(dw), Some(dy.sum(0)?)))
    }
}
