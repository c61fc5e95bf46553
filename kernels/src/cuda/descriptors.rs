//! cuDNN's handle and a convolution's descriptors, owned: created once, destroyed on drop.
//!
//! cudarc's safe cuDNN types keep their raw handles private, so the algorithm search
//! (`cudnnFindConvolution*AlgorithmEx` and the `_v7` heuristics, which its safe API lacks)
//! cannot reach them. These wrappers hold the raw pointers from `cudarc::cudnn::result` and
//! hand them to `algorithms` and `plan`, which call cuDNN directly. A [`Handle`] is bound to
//! one device's stream; [`ConvDescriptors`] describe one convolution's three tensors (`NCHW`,
//! contiguous) and its window, with the compute type and math its dtype calls for.

#![allow(unsafe_code)]

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cudnn::{result, sys, CudnnError};
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::DType;

use super::params::{Geometry, Window};

/// A cuDNN handle whose work runs on `stream` (candle's stream of one device).
pub(crate) struct Handle {
    raw: sys::cudnnHandle_t,
    stream: Arc<CudaStream>,
}

impl Handle {
    /// A new handle on `stream`'s device, its work queued on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> candle_core::Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
        let raw = result::create_handle().map_err(|e| cudnn_error("cudnnCreate", e))?;
        let handle = Self { raw, stream };
        // SAFETY: `raw` is the handle just created and not destroyed; the stream is alive as
        // long as the handle, which holds it.
        unsafe { result::set_stream(raw, handle.stream.cu_stream() as sys::cudaStream_t) }
            .map_err(|e| cudnn_error("cudnnSetStream", e))?;
        Ok(handle)
    }

    /// The raw handle, for a cuDNN call while `self` is borrowed.
    pub fn raw(&self) -> sys::cudnnHandle_t {
        self.raw
    }

    /// The stream the handle's work runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // cuDNN frees the handle's resources in the current context: make it the device's.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle was created by `cudnnCreate` and is destroyed once, here. A
        // failure cannot be reported from a drop and leaks the handle at worst.
        let _ = unsafe { result::destroy_handle(self.raw) };
    }
}

/// cuDNN's element type for a dtype, the type it accumulates in, and the math it may use:
/// `f32` with FMA math unless TF32 is allowed, `f64` as it is, `f16` and `bf16` on tensor
/// cores with `f32` accumulation. `None` for dtypes cuDNN's convolutions do not take.
pub(crate) fn types(
    dtype: DType,
    allow_tf32: bool,
) -> Option<(
    sys::cudnnDataType_t,
    sys::cudnnDataType_t,
    sys::cudnnMathType_t,
)> {
    use sys::cudnnDataType_t as D;
    use sys::cudnnMathType_t as M;
    Some(match dtype {
        DType::F32 if allow_tf32 => (
            D::CUDNN_DATA_FLOAT,
            D::CUDNN_DATA_FLOAT,
            M::CUDNN_DEFAULT_MATH,
        ),
        DType::F32 => (D::CUDNN_DATA_FLOAT, D::CUDNN_DATA_FLOAT, M::CUDNN_FMA_MATH),
        DType::F64 => (
            D::CUDNN_DATA_DOUBLE,
            D::CUDNN_DATA_DOUBLE,
            M::CUDNN_DEFAULT_MATH,
        ),
        DType::F16 => (
            D::CUDNN_DATA_HALF,
            D::CUDNN_DATA_FLOAT,
            M::CUDNN_TENSOR_OP_MATH,
        ),
        DType::BF16 => (
            D::CUDNN_DATA_BFLOAT16,
            D::CUDNN_DATA_FLOAT,
            M::CUDNN_TENSOR_OP_MATH,
        ),
        _ => return None,
    })
}

/// A 4-D `NCHW` tensor descriptor.
struct TensorDescriptor(sys::cudnnTensorDescriptor_t);

impl TensorDescriptor {
    fn new(data_type: sys::cudnnDataType_t, dims: [usize; 4]) -> candle_core::Result<Self> {
        let desc = Self(
            result::create_tensor_descriptor()
                .map_err(|e| cudnn_error("cudnnCreateTensorDescriptor", e))?,
        );
        let format = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        // SAFETY: `desc.0` was just created and is destroyed only when `desc` drops.
        unsafe { result::set_tensor4d_descriptor(desc.0, format, data_type, c_ints(dims)?) }
            .map_err(|e| cudnn_error(&format!("cudnnSetTensor4dDescriptor {dims:?}"), e))?;
        Ok(desc)
    }
}

impl Drop for TensorDescriptor {
    fn drop(&mut self) {
        // SAFETY: created by `cudnnCreateTensorDescriptor`, destroyed once, here.
        let _ = unsafe { result::destroy_tensor_descriptor(self.0) };
    }
}

/// A 4-D `(O, C / groups, kh, kw)` filter descriptor.
struct FilterDescriptor(sys::cudnnFilterDescriptor_t);

impl FilterDescriptor {
    fn new(data_type: sys::cudnnDataType_t, dims: [usize; 4]) -> candle_core::Result<Self> {
        let desc = Self(
            result::create_filter_descriptor()
                .map_err(|e| cudnn_error("cudnnCreateFilterDescriptor", e))?,
        );
        let format = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        // SAFETY: `desc.0` was just created and is destroyed only when `desc` drops.
        unsafe { result::set_filter4d_descriptor(desc.0, data_type, format, c_ints(dims)?) }
            .map_err(|e| cudnn_error(&format!("cudnnSetFilter4dDescriptor {dims:?}"), e))?;
        Ok(desc)
    }
}

impl Drop for FilterDescriptor {
    fn drop(&mut self) {
        // SAFETY: created by `cudnnCreateFilterDescriptor`, destroyed once, here.
        let _ = unsafe { result::destroy_filter_descriptor(self.0) };
    }
}

/// A convolution descriptor: symmetric padding, strides, dilation, groups, the compute type
/// and the math type.
struct ConvolutionDescriptor(sys::cudnnConvolutionDescriptor_t);

impl ConvolutionDescriptor {
    fn new(
        window: &Window,
        compute: sys::cudnnDataType_t,
        math: sys::cudnnMathType_t,
    ) -> candle_core::Result<Self> {
        let desc = Self(
            result::create_convolution_descriptor()
                .map_err(|e| cudnn_error("cudnnCreateConvolutionDescriptor", e))?,
        );
        let [ph, pw] = c_ints(window.pad)?;
        let [sh, sw] = c_ints(window.stride)?;
        let [dh, dw] = c_ints(window.dilation)?;
        let [groups] = c_ints([window.groups])?;
        let mode = sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
        // SAFETY: `desc.0` was just created and is destroyed only when `desc` drops.
        unsafe {
            result::set_convolution2d_descriptor(desc.0, ph, pw, sh, sw, dh, dw, mode, compute)
                .map_err(|e| {
                    cudnn_error(&format!("cudnnSetConvolution2dDescriptor {window:?}"), e)
                })?;
            result::set_convolution_group_count(desc.0, groups)
                .map_err(|e| cudnn_error("cudnnSetConvolutionGroupCount", e))?;
        }
        desc.set_math(math)?;
        Ok(desc)
    }

    fn set_math(&self, math: sys::cudnnMathType_t) -> candle_core::Result<()> {
        // SAFETY: `self.0` is a live descriptor (destroyed only on drop).
        unsafe { result::set_convolution_math_type(self.0, math) }
            .map_err(|e| cudnn_error("cudnnSetConvolutionMathType", e))
    }
}

impl Drop for ConvolutionDescriptor {
    fn drop(&mut self) {
        // SAFETY: created by `cudnnCreateConvolutionDescriptor`, destroyed once, here.
        let _ = unsafe { result::destroy_convolution_descriptor(self.0) };
    }
}

/// One convolution's descriptors: the input `x`, the kernel `w`, the output `y` (the same
/// for its gradients `dx`, `dw`, `dy`) and the convolution itself.
pub(crate) struct ConvDescriptors {
    x: TensorDescriptor,
    w: FilterDescriptor,
    y: TensorDescriptor,
    conv: ConvolutionDescriptor,
    /// The math type asked for; an algorithm's own replaces it once chosen.
    pub math: sys::cudnnMathType_t,
}

impl ConvDescriptors {
    /// The descriptors of `geometry` through `window` in `dtype`, or an error for a dtype
    /// cuDNN's convolutions do not take.
    pub fn new(geometry: &Geometry, window: &Window, dtype: DType) -> candle_core::Result<Self> {
        let Some((data, compute, math)) = types(dtype, window.algorithms.allow_tf32) else {
            candle_core::bail!("cuDNN convolutions take f32, f64, f16 and bf16, not {dtype:?}");
        };
        Ok(Self {
            x: TensorDescriptor::new(data, geometry.x)?,
            w: FilterDescriptor::new(data, geometry.w)?,
            y: TensorDescriptor::new(data, geometry.y)?,
            conv: ConvolutionDescriptor::new(window, compute, math)?,
            math,
        })
    }

    /// The input's (or input gradient's) descriptor.
    pub fn x(&self) -> sys::cudnnTensorDescriptor_t {
        self.x.0
    }

    /// The kernel's (or kernel gradient's) descriptor.
    pub fn w(&self) -> sys::cudnnFilterDescriptor_t {
        self.w.0
    }

    /// The output's (or output gradient's) descriptor.
    pub fn y(&self) -> sys::cudnnTensorDescriptor_t {
        self.y.0
    }

    /// The convolution's descriptor.
    pub fn conv(&self) -> sys::cudnnConvolutionDescriptor_t {
        self.conv.0
    }

    /// Sets the math type the chosen algorithm runs with (cuDNN picks an algorithm's kernels by
    /// the algorithm and the descriptor's math type together).
    pub fn set_math(&mut self, math: sys::cudnnMathType_t) -> candle_core::Result<()> {
        self.conv.set_math(math)?;
        self.math = math;
        Ok(())
    }
}

/// `values` as C ints, or an error for one that does not fit (cuDNN's descriptors take
/// `int`).
fn c_ints<const N: usize>(values: [usize; N]) -> candle_core::Result<[std::ffi::c_int; N]> {
    let mut out = [0; N];
    for (o, &v) in out.iter_mut().zip(&values) {
        *o = std::ffi::c_int::try_from(v).map_err(|_| {
            candle_core::Error::Msg(format!("cuDNN takes sizes up to 2^31 - 1, got {values:?}"))
        })?;
    }
    Ok(out)
}

/// A candle error for a failed cuDNN call, naming the call.
pub(crate) fn cudnn_error(call: &str, err: CudnnError) -> candle_core::Error {
    candle_core::Error::Msg(format!("{call} failed: {:?}", err.0))
}
