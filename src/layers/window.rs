//! Sliding-window geometry shared by convolutions and pooling: `same`/`valid` padding, output
//! sizes, and strided subsampling.

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
}

impl Padding {
    /// Output size and `(before, after)` padding along one axis.
    pub(crate) fn resolve(
        self,
        input: usize,
        kernel: usize,
        stride: usize,
    ) -> Option<(usize, usize, usize)> {
        match self {
            Padding::Valid => (input >= kernel).then(|| ((input - kernel) / stride + 1, 0, 0)),
            Padding::Same => {
                let out = input.div_ceil(stride);
                let total = ((out - 1) * stride + kernel).saturating_sub(input);
                (out > 0).then_some((out, total / 2, total - total / 2))
            }
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
        let (Some((oh, pt, pb)), Some((ow, pl, pr))) =
            (padding.resolve(h, kh, sh), padding.resolve(w, kw, sw))
        else {
            return Err(shape_error(
                ctx,
                &format!("(batch, channels, >={kh}, >={kw}) for a {kh}x{kw} valid {what}"),
                input_shape,
            ));
        };
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
        assert_eq!(Padding::Same.resolve(32, 3, 1), Some((32, 1, 1)));
        assert_eq!(Padding::Same.resolve(32, 3, 2), Some((16, 0, 1)));
        assert_eq!(Padding::Same.resolve(7, 2, 1), Some((7, 0, 1)));
        assert_eq!(Padding::Valid.resolve(32, 3, 2), Some((15, 0, 0)));
        assert_eq!(Padding::Valid.resolve(2, 3, 1), None);
    }
}
