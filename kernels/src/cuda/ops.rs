//! The three cuDNN convolutions as candle custom ops on candle's own CUDA storage.
//!
//! [`Forward`] (`y = x * w`, its backward running the other two), [`InputGrad`] (`dx` from
//! `dy` and `w`) and [`KernelGrad`] (`dw` from `x` and `dy`) take contiguous `NCHW` operands of
//! one dtype on one device, allocate their output on that device, and hand the three device
//! addresses to the device's cache (`cache::run`), which launches on candle's stream of the
//! device. Their CPU forward is an error that points to the CPU kernel.

#![allow(unsafe_code)]

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice as S};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, Layout, Shape, Tensor};

use super::algorithms::{Buffers, Kind};
use super::cache::{self, Key};
use super::params::{supported_dtype, Geometry, Window};

/// The forward op's name, in candle's graph and in errors.
pub(crate) const FORWARD: &str = "cudnn_conv2d";
/// The input gradient op's name.
pub(crate) const INPUT_GRAD: &str = "cudnn_conv2d_input_grad";
/// The kernel gradient op's name.
pub(crate) const KERNEL_GRAD: &str = "cudnn_conv2d_kernel_grad";

/// `y = x * w` through cuDNN: operands `(x, w)`; differentiable in both.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Forward {
    pub window: Window,
}

/// The input's gradient through cuDNN: operands `(dy, w)`, the input `x_dims`; not
/// differentiable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InputGrad {
    pub window: Window,
    pub x_dims: [usize; 4],
}

/// The kernel's gradient, summed over the batch, through cuDNN: operands `(x, dy)`, the kernel
/// `w_dims`; not differentiable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelGrad {
    pub window: Window,
    pub w_dims: [usize; 4],
}

/// The error of every op's CPU forward.
fn on_cpu(op: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: the cuDNN convolution runs on CUDA devices only; on the CPU, \
         kandle_kernels::conv2d is the convolution kernel"
    ))
}

impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        FORWARD
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(FORWARD))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let geometry = Geometry::new(FORWARD, xl.dims(), wl.dims(), &self.window)
            .map_err(candle_core::Error::Msg)?;
        execute(
            FORWARD,
            Kind::Forward,
            geometry,
            &self.window,
            (x, xl),
            (w, wl),
        )
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, w, dy) = (x.contiguous()?, w.contiguous()?, dy.contiguous()?);
        let dims = |t: &Tensor| -> candle_core::Result<[usize; 4]> {
            let (a, b, c, d) = t.dims4()?;
            Ok([a, b, c, d])
        };
        let input = InputGrad {
            window: self.window,
            x_dims: dims(&x)?,
        };
        let kernel = KernelGrad {
            window: self.window,
            w_dims: dims(&w)?,
        };
        let dx = dy.apply_op2_no_bwd(&w, &input)?;
        let dw = x.apply_op2_no_bwd(&dy, &kernel)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp2 for InputGrad {
    fn name(&self) -> &'static str {
        INPUT_GRAD
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(INPUT_GRAD))
    }

    fn cuda_fwd(
        &self,
        dy: &CudaStorage,
        dyl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let geometry = Geometry::new(INPUT_GRAD, &self.x_dims, wl.dims(), &self.window)
            .and_then(|g| g.check_output(INPUT_GRAD, dyl.dims()).map(|()| g))
            .map_err(candle_core::Error::Msg)?;
        execute(
            INPUT_GRAD,
            Kind::InputGrad,
            geometry,
            &self.window,
            (dy, dyl),
            (w, wl),
        )
    }
}

impl CustomOp2 for KernelGrad {
    fn name(&self) -> &'static str {
        KERNEL_GRAD
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(KERNEL_GRAD))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        dy: &CudaStorage,
        dyl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let geometry = Geometry::new(KERNEL_GRAD, xl.dims(), &self.w_dims, &self.window)
            .and_then(|g| g.check_output(KERNEL_GRAD, dyl.dims()).map(|()| g))
            .map_err(candle_core::Error::Msg)?;
        execute(
            KERNEL_GRAD,
            Kind::KernelGrad,
            geometry,
            &self.window,
            (x, xl),
            (dy, dyl),
        )
    }
}

/// Runs operation `kind` of the convolution `geometry` on its two operands `a` and `b` (in the
/// op's order) and returns its new output: checks that both are one supported dtype on one
/// device, then dispatches on the dtype.
fn execute(
    op: &str,
    kind: Kind,
    geometry: Geometry,
    window: &Window,
    (a, al): (&CudaStorage, &Layout),
    (b, bl): (&CudaStorage, &Layout),
) -> candle_core::Result<(CudaStorage, Shape)> {
    let dev = &a.device;
    if b.device.id() != dev.id() {
        candle_core::bail!(
            "{op}: the operands are on two devices, {:?} and {:?}",
            dev,
            b.device
        );
    }
    let dtype = a.dtype();
    if b.dtype() != dtype || !supported_dtype(dtype) {
        candle_core::bail!(
            "{op}: cuDNN's convolutions take two operands of one dtype among f32, f64, f16 and \
             bf16, got {dtype:?} and {:?}",
            b.dtype()
        );
    }
    let key = Key {
        kind,
        dtype,
        geometry,
        window: *window,
    };
    let out = match kind {
        Kind::Forward => geometry.y,
        Kind::InputGrad => geometry.x,
        Kind::KernelGrad => geometry.w,
    };
    let len = out.iter().product();
    let slice = match (&a.slice, &b.slice) {
        (S::F32(a), S::F32(b)) => S::F32(typed(op, dev, &key, (a, al), (b, bl), len)?),
        (S::F64(a), S::F64(b)) => S::F64(typed(op, dev, &key, (a, al), (b, bl), len)?),
        (S::F16(a), S::F16(b)) => S::F16(typed(op, dev, &key, (a, al), (b, bl), len)?),
        (S::BF16(a), S::BF16(b)) => S::BF16(typed(op, dev, &key, (a, al), (b, bl), len)?),
        _ => candle_core::bail!("{op}: unsupported storage {dtype:?}"),
    };
    let storage = CudaStorage {
        slice,
        device: dev.clone(),
    };
    Ok((storage, Shape::from(out.to_vec())))
}

/// [`execute`] for one element type: a new output of `len` values, written by the cached plan
/// of `key` from the operands' contiguous data.
fn typed<T: DeviceRepr>(
    op: &str,
    dev: &CudaDevice,
    key: &Key,
    (a, al): (&CudaSlice<T>, &Layout),
    (b, bl): (&CudaSlice<T>, &Layout),
    len: usize,
) -> candle_core::Result<CudaSlice<T>> {
    let (a, b) = (contiguous(op, a, al)?, contiguous(op, b, bl)?);
    let stream = dev.cuda_stream();
    // SAFETY: cuDNN writes every value of the output (`beta = 0`: the old contents are
    // never read) before anything else can read it on this stream.
    let mut out = unsafe { dev.alloc::<T>(len) }?;
    // The guards make the stream wait for other streams' writes to the operands, and record
    // this one's use of them when dropped, after the launch.
    let (pa, read_a) = a.device_ptr(&stream);
    let (pb, read_b) = b.device_ptr(&stream);
    let (po, written) = out.device_ptr_mut(&stream);
    let buffers = match key.kind {
        Kind::Forward => Buffers {
            x: pa,
            w: pb,
            y: po,
        },
        Kind::InputGrad => Buffers {
            x: po,
            w: pb,
            y: pa,
        },
        Kind::KernelGrad => Buffers {
            x: pa,
            w: po,
            y: pb,
        },
    };
    // SAFETY: the operands hold `key`'s input tensors (their shapes checked against the
    // geometry, contiguous, of `key.dtype`), the output is a new allocation of the third
    // tensor's size, all on `dev`; candle keeps the operands alive while the op runs and
    // frees them in stream order after.
    unsafe { cache::run(dev, key, buffers) }?;
    drop((read_a, read_b, written));
    Ok(out)
}

/// The contiguous data of an operand, or an error for one with strides (the public functions
/// make their operands contiguous first).
fn contiguous<'a, T>(
    op: &str,
    s: &'a CudaSlice<T>,
    l: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) if end <= s.len() => Ok(s.slice(start..end)),
        _ => candle_core::bail!(
            "{op}: the operand {:?} with strides {:?} is not contiguous; call .contiguous() \
             first",
            l.dims(),
            l.stride()
        ),
    }
}
