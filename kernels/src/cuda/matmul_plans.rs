//! What each CUDA device keeps between the products of [`dense`](super::dense) on cuBLASLt: one
//! cuBLASLt handle, one workspace, and a plan per product (its descriptor, the three matrix
//! layouts and the algorithm cuBLASLt's heuristic picked), made once per [`Key`] and looked up
//! by every later call, where cudarc's own cuBLASLt call makes all of them again each time.
//!
//! Each plan computes `D = op(A) B` in column-major terms, with the bias in its epilogue: `A` is the weight
//! (`units x inner`, row-major, read transposed), `B` the input (`batch x inner`, row-major) and
//! `D` the output (`batch x units`, row-major), so the bias, one value per row of `D`'s
//! column-major view, is one value per unit. `f32` runs with FMA math (`CUBLAS_COMPUTE_32F`, no
//! TF32), `f16` and `bf16` accumulate in `f32`.
//!
//! The state lives behind its own mutex, held for the whole of a call (the plan's lookup or
//! making, then the launch, which queues work on the stream and returns): cuBLASLt's handles may
//! be used from any thread but by one at a time. There is one state per device and stream
//! ([`StreamKey`](super::stream_key::StreamKey)).

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::cuda_backend::cudarc::cublaslt::{result, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use candle_core::cuda_backend::CudaDevice;
use candle_core::DType;

use super::stream_key::PerStream;

/// Bytes of each device's cuBLASLt workspace: products of a Dense layer's sizes need far less.
const WORKSPACE_BYTES: usize = 4 << 20;

/// The largest alignment cuBLASLt's algorithms ask of a matrix, in bytes.
const MAX_ALIGNMENT: u32 = 256;

/// What one product's plan is made for and looked up by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    /// `f32`, `f16` or `bf16`.
    pub dtype: DType,
    /// Rows of the input and of the output.
    pub batch: usize,
    /// Columns of the input and of the weight.
    pub inner: usize,
    /// Rows of the weight, columns of the output.
    pub units: usize,
    /// Whether the epilogue adds a bias.
    pub bias: bool,
    /// The alignment in bytes of the weight, the input and the output (at most 256): an
    /// algorithm is picked for what it can rely on.
    pub alignments: [u32; 3],
}

/// The alignment in bytes of a device address, as cuBLASLt's preferences count it.
pub(crate) fn alignment(ptr: u64) -> u32 {
    match ptr {
        0 => MAX_ALIGNMENT,
        p => (1u32 << p.trailing_zeros().min(8)).min(MAX_ALIGNMENT),
    }
}

/// The device addresses of one product's operands.
pub(crate) struct Operands {
    pub weight: u64,
    pub input: u64,
    pub output: u64,
    pub bias: Option<u64>,
}

/// A cuBLASLt failure as a candle error naming the call.
fn failed(call: &str, e: result::CublasError) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt {call} failed: {:?}", e.0))
}

/// A cuBLASLt handle, destroyed when dropped.
struct Handle(sys::cublasLtHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from `cublasLtCreate` and is not used again. A failure to
        // destroy it leaks it, which is all that can be done in a drop.
        let _ = unsafe { result::destroy_handle(self.0) };
    }
}

/// A matmul descriptor, destroyed when dropped.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: as `Handle`'s.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}

/// A matrix layout, destroyed when dropped.
struct MatrixLayout(sys::cublasLtMatrixLayout_t);

impl MatrixLayout {
    /// A column-major `rows x cols` matrix of `dtype` whose columns lie `ld` values apart.
    fn new(
        dtype: sys::cudaDataType,
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> candle_core::Result<Self> {
        let raw = result::create_matrix_layout(dtype, rows as u64, cols as u64, ld as i64)
            .map_err(|e| failed("cublasLtMatrixLayoutCreate", e))?;
        Ok(Self(raw))
    }
}

impl Drop for MatrixLayout {
    fn drop(&mut self) {
        // SAFETY: as `Handle`'s.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

/// A preference of the heuristic, destroyed when dropped.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: as `Handle`'s.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

/// One product's descriptor, layouts and algorithm.
struct Plan {
    desc: Desc,
    weight: MatrixLayout,
    input: MatrixLayout,
    output: MatrixLayout,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// One device's (and stream's) handle, workspace and plans.
struct DeviceState {
    handle: Handle,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    plans: HashMap<Key, Plan>,
}

// SAFETY: the raw cuBLASLt handle, descriptors and layouts are not tied to the thread that
// made them; cuBLASLt allows a handle to be used from any thread as long as no two use it at
// once, and a `DeviceState` is only ever reached through its `Mutex`. The stream and workspace
// are cudarc types that are `Send` already.
unsafe impl Send for DeviceState {}

/// Every device's and stream's state.
static DEVICES: PerStream<DeviceState> = PerStream::new();

/// The state of `dev` (on this thread, for a per-thread stream), made with a new handle and
/// workspace the first time.
fn state(dev: &CudaDevice) -> candle_core::Result<Arc<Mutex<DeviceState>>> {
    DEVICES.get(dev, || {
        let stream = dev.cuda_stream();
        bind(&stream)?;
        let handle = Handle(result::create_handle().map_err(|e| failed("cublasLtCreate", e))?);
        let workspace = dev.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        Ok(DeviceState {
            handle,
            stream,
            workspace,
            plans: HashMap::new(),
        })
    })
}

/// Makes `stream`'s device current on this thread, as cuBLASLt's calls need.
fn bind(stream: &CudaStream) -> candle_core::Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
}

/// cuBLASLt's type of `dtype`'s values; `None` for a dtype the products do not take.
pub(crate) fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType_t::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType_t::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType_t::CUDA_R_16BF),
        _ => None,
    }
}

/// Sets a descriptor attribute to `value`.
///
/// # Safety
/// `T` must be the type cuBLASLt documents for `attr`.
unsafe fn set_desc<T>(
    desc: &Desc,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> candle_core::Result<()> {
    // SAFETY: `value` is valid for reads of `size_of::<T>()` bytes during the call, and the
    // caller vouches for the type.
    unsafe {
        result::set_matmul_desc_attribute(
            desc.0,
            attr,
            value as *const T as *const c_void,
            size_of::<T>(),
        )
    }
    .map_err(|e| failed("cublasLtMatmulDescSetAttribute", e))
}

/// Sets a preference attribute to `value`.
///
/// # Safety
/// As [`set_desc`]'s.
unsafe fn set_pref<T>(
    pref: &Pref,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
) -> candle_core::Result<()> {
    // SAFETY: as in `set_desc`.
    unsafe {
        result::set_matmul_pref_attribute(
            pref.0,
            attr,
            value as *const T as *const c_void,
            size_of::<T>(),
        )
    }
    .map_err(|e| failed("cublasLtMatmulPreferenceSetAttribute", e))
}

impl DeviceState {
    /// A new plan for `key`: its descriptor and layouts, and the algorithm cuBLASLt's heuristic
    /// ranks first for them within the workspace, for operands of `key`'s alignments; `bias` is
    /// the bias's address, which the descriptor holds.
    fn plan(&self, key: &Key, bias: Option<u64>) -> candle_core::Result<Plan> {
        let Some(dtype) = data_type(key.dtype) else {
            candle_core::bail!("cuBLASLt dense: no product of {:?}", key.dtype)
        };
        let desc = Desc(
            result::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(|e| failed("cublasLtMatmulDescCreate", e))?,
        );
        // `CUBLAS_OP_T`, a `cublasOperation_t` (an `int32_t`), which cuBLASLt does not export.
        let transposed: i32 = 1;
        let epilogue = match key.bias {
            true => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            false => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
        };
        // SAFETY: the attributes' types are those cuBLASLt documents: an `int32_t` operation, a
        // `cublasLtEpilogue_t`, and a device pointer for the bias.
        unsafe {
            set_desc(
                &desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transposed,
            )?;
            set_desc(
                &desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epilogue,
            )?;
            if let Some(bias) = bias {
                set_desc(
                    &desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias,
                )?;
            }
        }
        let (b, k, u) = (key.batch, key.inner, key.units);
        let weight = MatrixLayout::new(dtype, k, u, k)?;
        let input = MatrixLayout::new(dtype, k, b, k)?;
        let output = MatrixLayout::new(dtype, u, b, u)?;
        let pref = Pref(
            result::create_matmul_pref()
                .map_err(|e| failed("cublasLtMatmulPreferenceCreate", e))?,
        );
        let [a_align, b_align, d_align] = key.alignments;
        // SAFETY: the preferences' types are those cuBLASLt documents: `u64` bytes of
        // workspace, `u32` alignments in bytes.
        unsafe {
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &(WORKSPACE_BYTES as u64),
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                &a_align,
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                &b_align,
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                &d_align,
            )?;
            set_pref(
                &pref,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                &d_align,
            )?;
        }
        // SAFETY: every handle is live; the heuristic reads descriptors only.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(
                self.handle.0,
                desc.0,
                weight.0,
                input.0,
                output.0,
                output.0,
                pref.0,
            )
        }
        .map_err(|e| {
            candle_core::Error::Msg(format!(
                "cuBLASLt has no algorithm for the dense product {key:?}: {:?}",
                e.0
            ))
        })?;
        Ok(Plan {
            desc,
            weight,
            input,
            output,
            algo: heuristic.algo,
        })
    }
}

/// Runs the product `key` on `dev` over `operands`: its plan looked up, or made and kept, then
/// launched on the device's stream, writing the output.
///
/// # Safety
/// `operands` must hold device memory of `dev` for `key`'s matrices (contiguous, row-major, in
/// `key.dtype`, aligned as `key.alignments` say) and, when `key.bias`, the bias of
/// `key.units` values; the output must not overlap the others; all stay allocated until the
/// stream has run the product.
pub(crate) unsafe fn run(
    dev: &CudaDevice,
    key: &Key,
    operands: Operands,
) -> candle_core::Result<()> {
    if key.bias != operands.bias.is_some() {
        candle_core::bail!("cuBLASLt dense: the plan's bias and the operands' disagree");
    }
    let state = state(dev)?;
    let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
    bind(&state.stream)?;
    if !state.plans.contains_key(key) {
        let plan = state.plan(key, operands.bias)?;
        state.plans.insert(*key, plan);
    }
    let DeviceState {
        handle,
        stream,
        workspace,
        plans,
    } = &mut *state;
    let Some(plan) = plans.get(key) else {
        candle_core::bail!("cuBLASLt dense: the plan of {key:?} was not kept");
    };
    if let Some(bias) = operands.bias {
        // SAFETY: the bias pointer attribute is a device pointer.
        unsafe {
            set_desc(
                &plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &bias,
            )
        }?;
    }
    let (alpha, beta) = (1f32, 0f32);
    let (ws, _written) = workspace.device_ptr_mut(stream);
    // SAFETY: the plan was made for `key`, which the caller's operands fit; alpha and beta are
    // `f32`, the descriptor's scale type; the workspace holds `WORKSPACE_BYTES`, the most the
    // heuristic was allowed, and lives as long as the state; beta is zero, so `C` (the output)
    // is not read.
    unsafe {
        result::matmul(
            handle.0,
            plan.desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            operands.weight as *const c_void,
            plan.weight.0,
            operands.input as *const c_void,
            plan.input.0,
            operands.output as *const c_void,
            plan.output.0,
            operands.output as *mut c_void,
            plan.output.0,
            &plan.algo,
            ws as *mut c_void,
            WORKSPACE_BYTES,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| failed("cublasLtMatmul", e))
}
