//! Sliding-window geometry shared by convolutions and pooling: `same`, `valid` and explicit
//! padding, output sizes, and strided subsampling.

use candle_core::Tensor;

use super::{shape_error, BuildContext};
use crate::Result;

/// How a convolution or pooling window treats the borders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Padding {
    /// No padding: only full windows, output `floor((in - k) / s) + 1`.
    #[default]
    Valid,
    /// Pad so that the output is `ceil(in / s)`, splitting the padding as TensorFlow does (the
    /// extra row or column, if any, goes at the bottom/right).
    Same,
    /// These many rows and columns on each side, as PyTorch's `padding=(ph, pw)` (symmetric:
    /// [`Padding::symmetric`]) or Keras's `ZeroPadding2D(((top, bottom), (left, right)))` before
    /// a `valid` window; output `floor((in + before + after - k) / s) + 1`. A 7x7 stride-2
    /// convolution with `symmetric(3, 3)` is torchvision's ResNet stem, where `Same` would pad
    /// `(2, 3)`.
    Explicit {
        /// Rows above.
        top: usize,
        /// Rows below.
        bottom: usize,
        /// Columns on the left.
        left: usize,
        /// Columns on the right.
        right: usize,
    },
}

impl Padding {
    /// `rows` above and below, `columns` left and right (PyTorch's `padding=(rows, columns)`).
    ///
    /// ```
    /// use kandle::layers::{Conv2D, LayerSpecExt, Padding, Sequential};
    ///
    /// // torchvision's ResNet stem: 224x224 to 112x112.
    /// let stem = Sequential::new().add(Conv2D::new(64, 7).stride(2).padding(Padding::symmetric(3, 3)));
    /// assert_eq!(stem.summary(&[3, 224, 224])?.rows[0].output_shape, [64, 112, 112]);
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn symmetric(rows: usize, columns: usize) -> Self {
        Padding::Explicit {
            top: rows,
            bottom: rows,
            left: columns,
            right: columns,
        }
    }

    /// Output size and `(before, after)` padding along one axis; `explicit` is this axis's
    /// `(before, after)` of [`Padding::Explicit`].
    fn resolve_axis(
        self,
        input: usize,
        kernel: usize,
        stride: usize,
        explicit: (usize, usize),
    ) -> Option<(usize, usize, usize)> {
        match self {
            Padding::Valid => (input >= kernel).then(|| ((input - kernel) / stride + 1, 0, 0)),
            Padding::Same => {
                let out = input.div_ceil(stride);
                let total = ((out - 1) * stride + kernel).saturating_sub(input);
                (out > 0).then_some((out, total / 2, total - total / 2))
            }
            Padding::Explicit { .. } => {
                let (before, after) = explicit;
                let padded = input + before + after;
                (padded >= kernel).then(|| ((padded - kernel) / stride + 1, before, after))
            }
        }
    }

    /// The `((top, bottom), (left, right))` rows and columns of [`Padding::Explicit`]; zeros
    /// for `Valid` and `Same`, whose padding depends on the input.
    pub fn explicit(self) -> ((usize, usize), (usize, usize)) {
        match self {
            Padding::Explicit {
                top,
                bottom,
                left,
                right,
            } => ((top, bottom), (left, right)),
            _ => ((0, 0), (0, 0)),
        }
    }
}

/// Where a `kh x kw` window with strides `(sh, sw)` lands on a `(C, H, W)` input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    /// Output height and width.
    pub out: (usize, usize),
    /// Padding: top, bottom, left, right.
    pub pad: (usize, usize, usize, usize),
}

impl Window {
    /// The geometry for `input_shape`, or a shape error naming the layer being built (`what` is
    /// `convolution` or `pool`).
    pub(crate) fn resolve(
        ctx: &BuildContext,
        input_shape: &[usize],
        (kh, kw): (usize, usize),
        (sh, sw): (usize, usize),
        padding: Padding,
        what: &str,
    ) -> Result<Self> {
        let &[_, h, w] = input_shape else {
            return Err(shape_error(
                ctx,
                "(batch, channels, height, width)",
                input_shape,
            ));
        };
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: window size and strides must be positive",
                ctx.path()
            )));
        }
        let (rows, columns) = padding.explicit();
        let (Some((oh, pt, pb)), Some((ow, pl, pr))) = (
            padding.resolve_axis(h, kh, sh, rows),
            padding.resolve_axis(w, kw, sw, columns),
        ) else {
            let (min_h, min_w) = (
                kh.saturating_sub(rows.0 + rows.1),
                kw.saturating_sub(columns.0 + columns.1),
            );
            return Err(shape_error(
                ctx,
                &format!(
                    "(batch, channels, >={min_h}, >={min_w}) for a {kh}x{kw} {what} padded {padding:?}"
                ),
                input_shape,
            ));
        };
        // As PyTorch: a pool's explicit padding is at most half its window, so that every
        // window holds an element of the input.
        let half = |pad: usize, k: usize| pad <= k / 2;
        let pool = what == "pool" && matches!(padding, Padding::Explicit { .. });
        if pool && !(half(pt, kh) && half(pb, kh) && half(pl, kw) && half(pr, kw)) {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: padding {padding:?} is more than half the {kh}x{kw} pooling window, \
                 so some windows would hold padding alone",
                ctx.path()
            )));
        }
        Ok(Self {
            out: (oh, ow),
            pad: (pt, pb, pl, pr),
        })
    }
}

/// Keeps every `step`-th element along `dim`, starting from the first.
pub(crate) fn subsample(x: &Tensor, dim: usize, step: usize) -> candle_core::Result<Tensor> {
    if step == 1 {
        return Ok(x.clone());
    }
    let len = x.dim(dim)?;
    let out = len.div_ceil(step);
    let padded = x.pad_with_zeros(dim, 0, out * step - len)?;
    let mut dims = padded.dims().to_vec();
    dims[dim] = out;
    dims.insert(dim + 1, step);
    padded
        .reshape(dims)?
        .narrow(dim + 1, 0, 1)?
        .squeeze(dim + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_padding_matches_tensorflow_sizes() {
        let none = (0, 0);
        assert_eq!(Padding::Same.resolve_axis(32, 3, 1, none), Some((32, 1, 1)));
        assert_eq!(Padding::Same.resolve_axis(32, 3, 2, none), Some((16, 0, 1)));
        assert_eq!(Padding::Same.resolve_axis(7, 2, 1, none), Some((7, 0, 1)));
        assert_eq!(
            Padding::Valid.resolve_axis(32, 3, 2, none),
            Some((15, 0, 0))
        );
        assert_eq!(Padding::Valid.resolve_axis(2, 3, 1, none), None);
    }

    #[test]
    fn explicit_padding_matches_pytorch_sizes() {
        // torchvision's ResNet stem and its max pool: 224 -> 112 -> 56.
        let stem = Padding::symmetric(3, 3);
        assert_eq!(stem.resolve_axis(224, 7, 2, (3, 3)), Some((112, 3, 3)));
        assert_eq!(
            Padding::Same.resolve_axis(224, 7, 2, (0, 0)),
            Some((112, 2, 3))
        );
        assert_eq!(
            Padding::symmetric(1, 1).resolve_axis(112, 3, 2, (1, 1)),
            Some((56, 1, 1))
        );
        assert_eq!(Padding::symmetric(0, 0).explicit(), ((0, 0), (0, 0)));
        let sides = Padding::Explicit {
            top: 1,
            bottom: 2,
            left: 3,
            right: 4,
        };
        assert_eq!(sides.explicit(), ((1, 2), (3, 4)));
        assert_eq!(sides.resolve_axis(1, 5, 1, (1, 2)), None);
    }
}
