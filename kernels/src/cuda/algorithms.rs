//! cuDNN's convolution algorithms: the search for one, its workspace, and its launch.
//!
//! A convolution runs one of three operations ([`Kind`]): the forward pass, the input's
//! gradient (cuDNN's "backward data") or the kernel's (its "backward filter"), each with its
//! own algorithms. [`candidates`] lists an operation's algorithms, fastest first, either
//! measured on the call's own buffers (`cudnnFindConvolution*AlgorithmEx`) or ranked by cuDNN's
//! heuristics (`cudnnGetConvolution*Algorithm_v7`); [`choose`] keeps the first that succeeded,
//! fits the workspace limit, is deterministic when asked, and runs in the math the dtype
//! allows (FMA only for `f32` with TF32 off, as PyTorch asserts). [`workspace_size`] and
//! [`launch`] take the chosen [`Algo`].
//!
//! Every function here is a thin, checked call into cuDNN on descriptors and buffers the caller
//! made for the same convolution; `plan` and `ops` own them.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};

use candle_core::cuda_backend::cudarc::cudnn::{result, sys};
use candle_core::DType;

use super::descriptors::{cudnn_error, ConvDescriptors, Handle};
use super::params::{AlgoSearch, Algorithms};

/// One of a convolution's three operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// `y = x * w`.
    Forward,
    /// `dx` from `dy` and `w` (cuDNN's backward data).
    InputGrad,
    /// `dw` from `x` and `dy` (cuDNN's backward filter).
    KernelGrad,
}

/// An algorithm of one of the three operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    InputGrad(sys::cudnnConvolutionBwdDataAlgo_t),
    KernelGrad(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// An algorithm cuDNN offered, with what it said about it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Candidate {
    pub algo: Algo,
    /// Measured milliseconds (a benchmark) or -1 (heuristics).
    pub time_ms: f32,
    /// Workspace bytes it needs.
    pub memory: usize,
    pub deterministic: bool,
    pub math: sys::cudnnMathType_t,
}

/// Device addresses of a convolution's three tensors, in the roles of the forward pass: the
/// input `x` (or its gradient), the kernel `w` (or its gradient) and the output `y` (or its
/// gradient). The operation writes one of them and reads the other two.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buffers {
    pub x: u64,
    pub w: u64,
    pub y: u64,
}

/// A workspace's address and size in bytes (null and zero for none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Workspace {
    pub ptr: u64,
    pub bytes: usize,
}

/// A perf result of one of the three operations.
trait Perf: Copy {
    fn candidate(&self) -> Option<Candidate>;
}

macro_rules! perf {
    ($perf:ty, $variant:ident) => {
        impl Perf for $perf {
            fn candidate(&self) -> Option<Candidate> {
                (self.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS).then_some(Candidate {
                    algo: Algo::$variant(self.algo),
                    time_ms: self.time,
                    memory: self.memory,
                    deterministic: self.determinism == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                    math: self.mathType,
                })
            }
        }
    };
}
perf!(sys::cudnnConvolutionFwdAlgoPerf_t, Forward);
perf!(sys::cudnnConvolutionBwdDataAlgoPerf_t, InputGrad);
perf!(sys::cudnnConvolutionBwdFilterAlgoPerf_t, KernelGrad);

/// How many algorithms each operation has (cuDNN's `*_ALGO_COUNT`).
const FORWARD_ALGOS: usize =
    sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize;
const INPUT_GRAD_ALGOS: usize =
    sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as usize;
const KERNEL_GRAD_ALGOS: usize =
    sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as usize;

/// Runs `query` on an array of `N` perf results and keeps the successful ones it returned, in
/// cuDNN's order (fastest first).
fn collect<P: Perf, const N: usize>(
    call: &str,
    query: impl FnOnce(c_int, *mut c_int, *mut P) -> sys::cudnnStatus_t,
) -> candle_core::Result<Vec<Candidate>> {
    // SAFETY: every perf struct is plain C data (enums whose zero is a valid value, numbers);
    // all-zero bits are a valid value of each, and cuDNN overwrites the ones it returns.
    let mut perf: [P; N] = unsafe { std::mem::zeroed() };
    let mut returned: c_int = 0;
    query(N as c_int, &mut returned, perf.as_mut_ptr())
        .result()
        .map_err(|e| cudnn_error(call, e))?;
    let returned = usize::try_from(returned).unwrap_or(0).min(N);
    Ok(perf[..returned]
        .iter()
        .filter_map(Perf::candidate)
        .collect())
}

/// The operation's algorithms that cuDNN reports as usable, fastest first: measured on
/// `buffers` with `workspace` when the search is a benchmark (the output buffer is
/// overwritten), ranked by heuristics otherwise.
///
/// # Safety
/// `descriptors` must describe `kind` on tensors of `buffers`' sizes and dtype on `handle`'s
/// device, and `workspace` must hold `bytes` bytes there.
pub(crate) unsafe fn candidates(
    handle: &Handle,
    d: &ConvDescriptors,
    kind: Kind,
    search: AlgoSearch,
    buffers: Buffers,
    workspace: Workspace,
) -> candle_core::Result<Vec<Candidate>> {
    let h = handle.raw();
    let (x, w, y) = (
        buffers.x as *mut c_void,
        buffers.w as *mut c_void,
        buffers.y as *mut c_void,
    );
    let (ws, bytes) = (workspace.ptr as *mut c_void, workspace.bytes);
    // SAFETY (every call below): the handle and descriptors are live; the buffers and the
    // workspace are device memory of the sizes the descriptors say (the caller's contract);
    // the perf array holds the count passed.
    match (kind, search) {
        (Kind::Forward, AlgoSearch::Benchmark) => collect::<_, FORWARD_ALGOS>(
            "cudnnFindConvolutionForwardAlgorithmEx",
            |n, r, p| unsafe {
                sys::cudnnFindConvolutionForwardAlgorithmEx(
                    h,
                    d.x(),
                    x,
                    d.w(),
                    w,
                    d.conv(),
                    d.y(),
                    y,
                    n,
                    r,
                    p,
                    ws,
                    bytes,
                )
            },
        ),
        (Kind::Forward, AlgoSearch::Heuristic) => collect::<_, FORWARD_ALGOS>(
            "cudnnGetConvolutionForwardAlgorithm_v7",
            |n, r, p| unsafe {
                sys::cudnnGetConvolutionForwardAlgorithm_v7(
                    h,
                    d.x(),
                    d.w(),
                    d.conv(),
                    d.y(),
                    n,
                    r,
                    p,
                )
            },
        ),
        (Kind::InputGrad, AlgoSearch::Benchmark) => collect::<_, INPUT_GRAD_ALGOS>(
            "cudnnFindConvolutionBackwardDataAlgorithmEx",
            |n, r, p| unsafe {
                sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                    h,
                    d.w(),
                    w,
                    d.y(),
                    y,
                    d.conv(),
                    d.x(),
                    x,
                    n,
                    r,
                    p,
                    ws,
                    bytes,
                )
            },
        ),
        (Kind::InputGrad, AlgoSearch::Heuristic) => collect::<_, INPUT_GRAD_ALGOS>(
            "cudnnGetConvolutionBackwardDataAlgorithm_v7",
            |n, r, p| unsafe {
                sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                    h,
                    d.w(),
                    d.y(),
                    d.conv(),
                    d.x(),
                    n,
                    r,
                    p,
                )
            },
        ),
        (Kind::KernelGrad, AlgoSearch::Benchmark) => collect::<_, KERNEL_GRAD_ALGOS>(
            "cudnnFindConvolutionBackwardFilterAlgorithmEx",
            |n, r, p| unsafe {
                sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                    h,
                    d.x(),
                    x,
                    d.y(),
                    y,
                    d.conv(),
                    d.w(),
                    w,
                    n,
                    r,
                    p,
                    ws,
                    bytes,
                )
            },
        ),
        (Kind::KernelGrad, AlgoSearch::Heuristic) => collect::<_, KERNEL_GRAD_ALGOS>(
            "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
            |n, r, p| unsafe {
                sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                    h,
                    d.x(),
                    d.y(),
                    d.conv(),
                    d.w(),
                    n,
                    r,
                    p,
                )
            },
        ),
    }
}

/// Whether an algorithm running in `math` keeps to what `dtype` and `settings` allow: `f32`
/// with TF32 off runs in FMA math only (no tensor cores, which would round the products to
/// TF32); other dtypes take what cuDNN offers.
pub(crate) fn math_allowed(
    dtype: DType,
    settings: &Algorithms,
    math: sys::cudnnMathType_t,
) -> bool {
    dtype != DType::F32 || settings.allow_tf32 || math == sys::cudnnMathType_t::CUDNN_FMA_MATH
}

/// The first candidate (the fastest) that fits `settings` and the `workspace` bytes there are.
pub(crate) fn choose(
    candidates: &[Candidate],
    dtype: DType,
    settings: &Algorithms,
    workspace: usize,
) -> Option<Candidate> {
    candidates.iter().copied().find(|c| {
        c.memory <= workspace.min(settings.workspace_limit)
            && (c.deterministic || !settings.deterministic)
            && math_allowed(dtype, settings, c.math)
    })
}

/// The workspace bytes `algo` needs on these descriptors (in their current math type).
pub(crate) fn workspace_size(
    handle: &Handle,
    d: &ConvDescriptors,
    algo: Algo,
) -> candle_core::Result<usize> {
    let h = handle.raw();
    // SAFETY: the handle and descriptors are live; each call writes one `usize`.
    unsafe {
        match algo {
            Algo::Forward(a) => {
                result::get_convolution_forward_workspace_size(h, d.x(), d.w(), d.conv(), d.y(), a)
            }
            Algo::InputGrad(a) => result::get_convolution_backward_data_workspace_size(
                h,
                d.w(),
                d.y(),
                d.conv(),
                d.x(),
                a,
            ),
            Algo::KernelGrad(a) => result::get_convolution_backward_filter_workspace_size(
                h,
                d.x(),
                d.y(),
                d.conv(),
                d.w(),
                a,
            ),
        }
    }
    .map_err(|e| {
        cudnn_error(
            &format!("cudnnGetConvolution*WorkspaceSize for {algo:?}"),
            e,
        )
    })
}

/// Queues `algo` on the handle's stream: writes the operation's output buffer (with `beta =
/// 0`: its old contents are never read) from the other two.
///
/// # Safety
/// `descriptors` must describe the operation of `algo` on tensors of `buffers`' sizes and
/// `dtype` on `handle`'s device; the two inputs must not overlap the output; `workspace` must
/// hold at least [`workspace_size`] bytes; and all of them must stay allocated until the
/// stream has run the operation.
pub(crate) unsafe fn launch(
    handle: &Handle,
    d: &ConvDescriptors,
    algo: Algo,
    dtype: DType,
    buffers: Buffers,
    workspace: Workspace,
) -> candle_core::Result<()> {
    // Scaling factors are `double` for `f64` data and `float` for every other dtype.
    let (one_f64, zero_f64, one_f32, zero_f32) = (1f64, 0f64, 1f32, 0f32);
    let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
        (&one_f64 as *const f64 as _, &zero_f64 as *const f64 as _)
    } else {
        (&one_f32 as *const f32 as _, &zero_f32 as *const f32 as _)
    };
    let h = handle.raw();
    let (x, w, y) = (
        buffers.x as *mut c_void,
        buffers.w as *mut c_void,
        buffers.y as *mut c_void,
    );
    let (ws, bytes) = (workspace.ptr as *mut c_void, workspace.bytes);
    // SAFETY: the caller's contract; alpha and beta point to scalars of the type cuDNN reads
    // for `dtype`, alive for the call (cuDNN reads them before returning).
    unsafe {
        match algo {
            Algo::Forward(a) => result::convolution_forward(
                h,
                alpha,
                d.x(),
                x,
                d.w(),
                w,
                d.conv(),
                a,
                ws,
                bytes,
                beta,
                d.y(),
                y,
            ),
            Algo::InputGrad(a) => result::convolution_backward_data(
                h,
                alpha,
                d.w(),
                w,
                d.y(),
                y,
                d.conv(),
                a,
                ws,
                bytes,
                beta,
                d.x(),
                x,
            ),
            Algo::KernelGrad(a) => result::convolution_backward_filter(
                h,
                alpha,
                d.x(),
                x,
                d.y(),
                y,
                d.conv(),
                a,
                ws,
                bytes,
                beta,
                d.w(),
                w,
            ),
        }
    }
    .map_err(|e| cudnn_error(&format!("cuDNN convolution {algo:?}"), e))
}
