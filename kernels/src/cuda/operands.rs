//! What kandle's own CUDA kernels (batch normalisation, pooling) take and make: the dtypes they
//! run in, the checks of their tensors, the device addresses of operands and of new outputs,
//! and tensors made of buffers a kernel wrote.
//!
//! Every kernel exists in four dtypes, `<kernel>_<f32|f64|f16|bf16>`; half precision computes
//! in `f32`, and the per-channel statistics and parameters of `f32`, `f16` and `bf16` inputs are
//! `f32`, those of `f64` inputs `f64`. A tensor has at most `i32::MAX` values, so the kernels
//! index with 32 bits.

#![allow(unsafe_code)]

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice as S};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Layout, Shape, Storage, Tensor};

use crate::{Error, Result};

/// The suffix of a kernel's name for a dtype, `None` for a dtype the kernels do not take.
fn suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F64 => Some("f64"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// Whether the kernels take tensors of `dtype`.
pub(crate) fn supported_dtype(dtype: DType) -> bool {
    suffix(dtype).is_some()
}

/// The name of `kernel` for inputs of `dtype`.
pub(crate) fn kernel(op: &str, kernel: &str, dtype: DType) -> candle_core::Result<String> {
    match suffix(dtype) {
        Some(s) => Ok(format!("{kernel}_{s}")),
        None => candle_core::bail!("{op}: no CUDA kernel for {dtype:?}"),
    }
}

/// The dtype of the per-channel statistics and parameters for inputs of `dtype`.
pub(crate) fn stats_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// An error unless `x` is a tensor the kernels take: on a CUDA device, of a supported dtype,
/// with at most `i32::MAX` values. `cpu_kernel` names the CPU kernel for the same op.
pub(crate) fn check_input(op: &str, x: &Tensor, cpu_kernel: &str) -> Result<()> {
    if !x.device().is_cuda() {
        return Err(Error::invalid(format!(
            "{op}: kandle's CUDA kernels take tensors on a CUDA device, but the input {:?} is on \
             {:?} (on the CPU, {cpu_kernel} is the kernel)",
            x.dims(),
            x.device()
        )));
    }
    if !supported_dtype(x.dtype()) {
        return Err(Error::invalid(format!(
            "{op}: kandle's CUDA kernels take f32, f64, f16 or bf16 tensors, but the input {:?} \
             is {:?}",
            x.dims(),
            x.dtype()
        )));
    }
    if x.elem_count() > i32::MAX as usize {
        return Err(Error::invalid(format!(
            "{op}: the input {:?} has {} values, more than the kernels' {}",
            x.dims(),
            x.elem_count(),
            i32::MAX
        )));
    }
    Ok(())
}

/// `t` contiguous, or an error unless it is on `x`'s device, of `dtype` and of `dims`; `what`
/// names it in the error.
pub(crate) fn companion(
    op: &str,
    what: &str,
    t: &Tensor,
    x: &Tensor,
    dtype: DType,
    dims: &[usize],
) -> Result<Tensor> {
    if !t.device().same_device(x.device()) || t.dtype() != dtype || t.dims() != dims {
        return Err(Error::invalid(format!(
            "{op}: the {what} is {:?} {:?} on {:?}, but the input {:?} {:?} on {:?} needs \
             {dtype:?} {dims:?} on its device",
            t.dtype(),
            t.dims(),
            t.device(),
            x.dtype(),
            x.dims(),
            x.device()
        )));
    }
    Ok(t.contiguous()?)
}

/// The device address of the contiguous data of an operand `(s, l)` (of one of the kernels'
/// dtypes, or `u32`) and the guard to hold until the kernels that read it are queued; an error
/// for an operand with strides.
pub(crate) fn address<'a>(
    op: &str,
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, SyncOnDrop<'a>)> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!(
            "{op}: the operand {:?} with strides {:?} is not contiguous",
            l.dims(),
            l.stride()
        )
    };
    read_span(op, "operand", s, l, (start, end), stream)
}

/// The device address of value `start` of `s` (of one of the kernels' dtypes, or `u32`) and the
/// guard to hold until the kernels that read it are queued; an error unless the values up to
/// `end` lie in the storage. `what` and `l` name the operand in the error.
pub(crate) fn read_span<'a>(
    op: &str,
    what: &str,
    s: &'a CudaStorage,
    l: &Layout,
    (start, end): (usize, usize),
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, SyncOnDrop<'a>)> {
    let (ptr, guard, len) = match &s.slice {
        S::F32(v) => read(v, start, stream),
        S::F64(v) => read(v, start, stream),
        S::F16(v) => read(v, start, stream),
        S::BF16(v) => read(v, start, stream),
        S::U32(v) => read(v, start, stream),
        _ => candle_core::bail!("{op}: no CUDA kernel for {:?}", s.dtype()),
    };
    if end > len {
        candle_core::bail!("{op}: the {what} {:?} lies outside its storage", l.dims());
    }
    Ok((ptr, guard))
}

/// [`read_span`] of a storage the kernels write, with its write guard.
pub(crate) fn write_span<'a>(
    op: &str,
    what: &str,
    s: &'a mut CudaStorage,
    l: &Layout,
    (start, end): (usize, usize),
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, SyncOnDrop<'a>)> {
    let dtype = s.dtype();
    let (ptr, guard, len) = match &mut s.slice {
        S::F32(v) => write_at(v, start, stream),
        S::F64(v) => write_at(v, start, stream),
        S::F16(v) => write_at(v, start, stream),
        S::BF16(v) => write_at(v, start, stream),
        S::U32(v) => write_at(v, start, stream),
        _ => candle_core::bail!("{op}: no CUDA kernel for {dtype:?}"),
    };
    if end > len {
        candle_core::bail!("{op}: the {what} {:?} lies outside its storage", l.dims());
    }
    Ok((ptr, guard))
}

/// The device addresses of the operands `(s, l)`, in order, as [`address`] finds each, and their
/// guards to hold until the kernels that read them are queued.
pub(crate) fn addresses<'a, const N: usize>(
    op: &str,
    operands: [(&'a CudaStorage, &Layout); N],
    stream: &'a CudaStream,
) -> candle_core::Result<([u64; N], Vec<SyncOnDrop<'a>>)> {
    let mut pointers = [0; N];
    let mut guards = Vec::with_capacity(N);
    for (p, (s, l)) in pointers.iter_mut().zip(operands) {
        let (ptr, guard) = address(op, s, l, stream)?;
        *p = ptr;
        guards.push(guard);
    }
    Ok((pointers, guards))
}

/// The address of value `start` of `v`, its read guard and `v`'s length.
fn read<'a, T>(
    v: &'a CudaSlice<T>,
    start: usize,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>, usize) {
    let (ptr, guard) = v.device_ptr(stream);
    (ptr + (start * size_of::<T>()) as u64, guard, v.len())
}

/// A new buffer of `len` values of `dtype` (a kernels' dtype, `u32` or `f64`) on `dev`.
///
/// # Safety
///
/// The buffer is not initialised: a kernel must write every value before anything reads it.
pub(crate) unsafe fn uninit(dev: &CudaDevice, dtype: DType, len: usize) -> candle_core::Result<S> {
    // SAFETY: the caller's contract.
    unsafe {
        Ok(match dtype {
            DType::F32 => S::F32(dev.alloc(len)?),
            DType::F64 => S::F64(dev.alloc(len)?),
            DType::F16 => S::F16(dev.alloc(len)?),
            DType::BF16 => S::BF16(dev.alloc(len)?),
            DType::U32 => S::U32(dev.alloc(len)?),
            _ => candle_core::bail!("no CUDA buffer of {dtype:?} for kandle's kernels"),
        })
    }
}

/// The device address of a new buffer made by [`uninit`], and the guard to hold until the
/// kernels that write it are queued.
pub(crate) fn address_mut<'a>(
    s: &'a mut S,
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, SyncOnDrop<'a>)> {
    Ok(match s {
        S::F32(v) => write(v, stream),
        S::F64(v) => write(v, stream),
        S::F16(v) => write(v, stream),
        S::BF16(v) => write(v, stream),
        S::U32(v) => write(v, stream),
        _ => candle_core::bail!("no CUDA buffer of this dtype for kandle's kernels"),
    })
}

/// The address of `v` and its write guard.
fn write<'a, T: DeviceRepr>(
    v: &'a mut CudaSlice<T>,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    v.device_ptr_mut(stream)
}

/// The address of value `start` of `v`, its write guard and `v`'s length.
fn write_at<'a, T: DeviceRepr>(
    v: &'a mut CudaSlice<T>,
    start: usize,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>, usize) {
    let len = v.len();
    let (ptr, guard) = v.device_ptr_mut(stream);
    (ptr + (start * size_of::<T>()) as u64, guard, len)
}

/// A new output over `slice` on `dev`, as candle's storage.
pub(crate) fn storage(slice: S, dev: &CudaDevice) -> CudaStorage {
    CudaStorage {
        slice,
        device: dev.clone(),
    }
}

/// A tensor of `dims` over `slice` on `dev`, detached from any graph.
pub(crate) fn tensor(slice: S, dev: &CudaDevice, dims: &[usize]) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(storage(slice, dev)),
        Shape::from(dims.to_vec()),
        BackpropOp::none(),
        false,
    )
}

/// The error of every op's CPU forward: `cpu_kernel` is the CPU's kernel for the op.
pub(crate) fn on_cpu(op: &str, cpu_kernel: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: kandle's CUDA kernel runs on CUDA devices only; on the CPU, {cpu_kernel} is the \
         kernel"
    ))
}
