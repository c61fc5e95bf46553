//! What a cuDNN convolution is asked to do, and the checks of its shapes.
//!
//! [`Conv2dParams`] is the public description: strides, `(top, bottom, left, right)` zero
//! padding as the CPU kernel takes it, dilation, groups, and how cuDNN's algorithm is chosen
//! ([`Algorithms`]). cuDNN pads symmetrically only, so [`Conv2dParams::split`] cuts the padding
//! into the symmetric part cuDNN applies ([`Window`]) and the excess on one side
//! ([`Excess`]) that the public functions add to the input as zeros first. [`Geometry`] is one
//! convolution's three shapes, checked once, with errors naming the op and what it got.

use candle_core::DType;

/// How cuDNN's algorithm for a convolution is chosen: searched once per device, operation,
/// shapes, window, dtype and these settings, then cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Algorithms {
    /// How the candidates are ranked.
    pub search: AlgoSearch,
    /// Deterministic algorithms only: the same inputs give the same bits on every call (no
    /// atomic additions in a different order). Slower for some gradients.
    pub deterministic: bool,
    /// Lets `f32` convolutions run on tensor cores in TF32 (10 bits of mantissa in the
    /// products) on Ampere and newer GPUs. Off by default: `f32` convolutions use FMA math
    /// (`CUDNN_FMA_MATH`), as PyTorch does with TF32 off.
    pub allow_tf32: bool,
    /// The most workspace, in bytes, an algorithm may ask for; algorithms that need more are
    /// left out of the search.
    pub workspace_limit: usize,
}

impl Default for Algorithms {
    fn default() -> Self {
        Self {
            search: AlgoSearch::Benchmark,
            deterministic: false,
            allow_tf32: false,
            workspace_limit: 1 << 30,
        }
    }
}

/// How the candidate algorithms are ranked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlgoSearch {
    /// Each candidate is run once on the call's own tensors and the fastest kept
    /// (`cudnnFindConvolution*AlgorithmEx`, PyTorch's `cudnn.benchmark = True`): the first call
    /// of a shape takes longer, the next ones run the measured best.
    Benchmark,
    /// cuDNN's heuristics rank the candidates without running them
    /// (`cudnnGetConvolution*Algorithm_v7`): no search time, not always the fastest.
    Heuristic,
}

/// A 2-D convolution's window and how its algorithm is chosen. `Default` is a stride-1,
/// unpadded, undilated, ungrouped convolution with [`Algorithms::default`]; set the fields
/// that differ with struct-update syntax:
///
/// ```
/// use kandle_kernels::cuda::Conv2dParams;
/// let params = Conv2dParams {
///     stride: (2, 2),
///     padding: (1, 1, 1, 1),
///     ..Default::default()
/// };
/// assert_eq!(params.groups, 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    /// `(vertical, horizontal)` strides.
    pub stride: (usize, usize),
    /// Zero padding `(top, bottom, left, right)`, as the CPU kernel
    /// ([`conv2d`](crate::conv2d::conv2d)) takes it.
    pub padding: (usize, usize, usize, usize),
    /// `(vertical, horizontal)` spacing of the kernel's taps; `(1, 1)` is a plain convolution.
    pub dilation: (usize, usize),
    /// Channel groups: the input's `C` and the output's `O` channels are cut into `groups`
    /// parts, part `g` of the output seeing part `g` of the input only; the kernel is
    /// `(O, C / groups, kh, kw)`.
    pub groups: usize,
    /// How cuDNN's algorithm is chosen.
    pub algorithms: Algorithms,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Self {
            stride: (1, 1),
            padding: (0, 0, 0, 0),
            dilation: (1, 1),
            groups: 1,
            algorithms: Algorithms::default(),
        }
    }
}

impl Conv2dParams {
    /// The symmetric window cuDNN applies, and the padding left over on one side of each
    /// dimension, which the caller adds to the input as zeros.
    pub(crate) fn split(&self) -> (Window, Excess) {
        let (top, bottom, left, right) = self.padding;
        let window = Window {
            stride: [self.stride.0, self.stride.1],
            pad: [top.min(bottom), left.min(right)],
            dilation: [self.dilation.0, self.dilation.1],
            groups: self.groups,
            algorithms: self.algorithms,
        };
        let excess = Excess {
            top: top - top.min(bottom),
            bottom: bottom - top.min(bottom),
            left: left - left.min(right),
            right: right - left.min(right),
        };
        (window, excess)
    }
}

/// The padding cuDNN cannot apply (it pads both sides alike): what one side has beyond the
/// other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Excess {
    pub top: usize,
    pub bottom: usize,
    pub left: usize,
    pub right: usize,
}

impl Excess {
    /// Whether there is none.
    pub fn is_none(&self) -> bool {
        *self == Excess::default()
    }

    /// An input's dimensions `[n, c, h, w]` with the excess added (saturating: a size that
    /// large fails [`Geometry::new`]'s checks).
    pub fn padded(&self, [n, c, h, w]: [usize; 4]) -> [usize; 4] {
        let h = h.saturating_add(self.top).saturating_add(self.bottom);
        let w = w.saturating_add(self.left).saturating_add(self.right);
        [n, c, h, w]
    }
}

/// What cuDNN is told about a convolution besides its tensors: symmetric padding, strides,
/// dilation, groups and the algorithm settings. Part of the algorithm cache's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Window {
    pub stride: [usize; 2],
    pub pad: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
    pub algorithms: Algorithms,
}

/// One convolution's shapes: the input `x (N, C, H, W)`, the kernel `w (O, C / groups, kh,
/// kw)` and the output `y (N, O, Ho, Wo)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Geometry {
    pub x: [usize; 4],
    pub w: [usize; 4],
    pub y: [usize; 4],
}

impl Geometry {
    /// The convolution of an `x_dims` input (already padded by any [`Excess`]) with a `w_dims`
    /// kernel through `window`, or an error naming `op` and what does not fit.
    pub fn new(
        op: &str,
        x_dims: &[usize],
        w_dims: &[usize],
        window: &Window,
    ) -> std::result::Result<Self, String> {
        let x = dims4(op, "input", x_dims)?;
        let w = dims4(op, "kernel", w_dims)?;
        let ([n, c, h, wd], [o, wc, kh, kw]) = (x, w);
        let g = window.groups;
        let [sh, sw] = window.stride;
        let [dh, dw] = window.dilation;
        if [n, c, h, wd, o, wc, kh, kw].contains(&0) || [g, sh, sw, dh, dw].contains(&0) {
            return Err(format!(
                "{op}: the input {x_dims:?} and kernel {w_dims:?} must have non-zero sizes, \
                 and strides {:?}, dilation {:?} and groups {g} must be non-zero",
                window.stride, window.dilation
            ));
        }
        if wc * g != c || o % g != 0 {
            return Err(format!(
                "{op}: the input {x_dims:?} has {c} channels and the kernel {w_dims:?} {o} \
                 outputs of {wc} channels, which do not fit {g} group(s): the kernel must be \
                 (O, C / groups, kh, kw) with O a multiple of the groups"
            ));
        }
        let [ph, pw] = window.pad;
        // Saturating: sizes that large fail the checks below rather than overflow.
        let (hp, wp) = (
            h.saturating_add(ph.saturating_mul(2)),
            wd.saturating_add(pw.saturating_mul(2)),
        );
        let (ekh, ekw) = (
            dh.saturating_mul(kh - 1).saturating_add(1),
            dw.saturating_mul(kw - 1).saturating_add(1),
        );
        if hp < ekh || wp < ekw {
            return Err(format!(
                "{op}: the input {x_dims:?} padded to {hp}x{wp} is smaller than the kernel \
                 {w_dims:?}'s {ekh}x{ekw} window at dilation {:?}",
                window.dilation
            ));
        }
        let y = [n, o, (hp - ekh) / sh + 1, (wp - ekw) / sw + 1];
        for (what, dims) in [("input", x), ("kernel", w), ("output", y)] {
            let len = dims.iter().try_fold(1usize, |len, &d| len.checked_mul(d));
            if len.is_none_or(|len| len > i32::MAX as usize)
                || dims.iter().any(|&d| d > i32::MAX as usize)
            {
                return Err(format!(
                    "{op}: the {what} {dims:?} has more than 2^31 - 1 values, more than \
                     cuDNN's convolutions take"
                ));
            }
        }
        Ok(Self { x, w, y })
    }

    /// An error unless `dims` is the output's shape (an output gradient's check).
    pub fn check_output(&self, op: &str, dims: &[usize]) -> std::result::Result<(), String> {
        if dims != self.y {
            return Err(format!(
                "{op}: the output gradient {dims:?} does not match the convolution's output \
                 {:?} (input {:?}, kernel {:?})",
                self.y, self.x, self.w
            ));
        }
        Ok(())
    }
}

/// The four dimensions of `dims`, or an error naming `op` and the tensor.
pub(crate) fn dims4(
    op: &str,
    what: &str,
    dims: &[usize],
) -> std::result::Result<[usize; 4], String> {
    <[usize; 4]>::try_from(dims)
        .map_err(|_| format!("{op}: the {what} must have 4 dimensions, got shape {dims:?}"))
}

/// The dtypes cuDNN's convolutions take here: `f32` and `f64`, and `f16` and `bf16` with
/// `f32` accumulation.
pub(crate) fn supported_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}
