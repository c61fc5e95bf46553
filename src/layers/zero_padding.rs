//! `ZeroPadding2D`: rows and columns of zeros around each image, as Keras's layer of that name.

use candle_core::Tensor;

use super::{
    record_with_candle, shape_error, BuildContext, Built, FastPath, Layer, LayerSpec, ParamGrads,
    RecordRequest, Recorded,
};
use crate::Result;

/// Adds `top` and `bottom` rows and `left` and `right` columns of zeros to each `(C, H, W)`
/// image; its gradient is the gradient's inner part. Keras's `ZeroPadding2D`, with its
/// `((top, bottom), (left, right))` spelled out.
///
/// ```
/// use kandle::layers::{Sequential, ZeroPadding2D};
///
/// let net = Sequential::new().add(ZeroPadding2D::new(1, 2));
/// assert_eq!(net.summary(&[3, 8, 8])?.rows[0].output_shape, [3, 10, 12]);
/// let net = Sequential::new().add(ZeroPadding2D::sides((0, 1), (2, 0)));
/// assert_eq!(net.summary(&[3, 8, 8])?.rows[0].output_shape, [3, 9, 10]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroPadding2D {
    rows: (usize, usize),
    columns: (usize, usize),
}

impl ZeroPadding2D {
    /// `rows` of zeros above and below, `columns` left and right.
    pub fn new(rows: usize, columns: usize) -> Self {
        Self::sides((rows, rows), (columns, columns))
    }

    /// `(top, bottom)` rows and `(left, right)` columns of zeros.
    pub fn sides(rows: (usize, usize), columns: (usize, usize)) -> Self {
        Self { rows, columns }
    }
}

impl LayerSpec for ZeroPadding2D {
    fn kind(&self) -> &'static str {
        "zero_padding2d"
    }

    fn class_name(&self) -> &'static str {
        "ZeroPadding2D"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let &[c, h, w] = input_shape else {
            return Err(shape_error(
                ctx,
                "(batch, channels, height, width)",
                input_shape,
            ));
        };
        let (top, bottom) = self.rows;
        let (left, right) = self.columns;
        let output_shape = vec![c, top + h + bottom, left + w + right];
        Ok(Built::fast(*self, output_shape, Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

impl Layer for ZeroPadding2D {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        let (top, bottom) = self.rows;
        let (left, right) = self.columns;
        Ok(x.pad_with_zeros(2, top, bottom)?
            .pad_with_zeros(3, left, right)?)
    }
}

impl FastPath for ZeroPadding2D {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        if request.logits {
            return record_with_candle(self, x, true);
        }
        let (h, w) = (x.dim(2)?, x.dim(3)?);
        let (top, left) = (self.rows.0, self.columns.0);
        Ok(Recorded::new(
            self.forward_t(x, true)?,
            move |dy: Tensor, _grads: &mut ParamGrads, input_grad: bool| {
                if !input_grad {
                    return Ok(None);
                }
                Ok(Some(
                    dy.narrow(2, top, h)?.narrow(3, left, w)?.contiguous()?,
                ))
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use crate::layers::{
        BuildContext, Conv2D, FastPath, Layer, MaxPooling2D, Padding, ParamGrads, RecordRequest,
        Sequential, SequentialNet, ZeroPadding2D,
    };
    use crate::params::ParamStore;
    use crate::{ComputePath, Result};

    fn values(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    }

    #[test]
    fn pads_with_zeros_and_passes_back_the_inner_gradient() -> Result<()> {
        let pad = ZeroPadding2D::sides((1, 0), (0, 2));
        let x = Tensor::arange(1f32, 7., &Device::Cpu)?.reshape((1, 1, 2, 3))?;
        let y = pad.forward_t(&x, false)?;
        assert_eq!(y.dims(), &[1, 1, 3, 5]);
        let want = [0., 0., 0., 0., 0., 1., 2., 3., 0., 0., 4., 5., 6., 0., 0.];
        assert_eq!(values(&y)?, want);
        // The recorded gradient is candle's autograd's.
        let recorded = pad.forward_recorded(&x, RecordRequest::output())?;
        let dy = kandle_testing::random::seeded_normal(recorded.output.dims(), 1.0, 1)?;
        let dx = recorded
            .backward
            .backward(dy.clone(), &mut ParamGrads::new(), true)?
            .expect("an input gradient");
        let input = Var::from_tensor(&x)?;
        let autograd = (pad.forward_t(input.as_tensor(), true)? * &dy)?
            .sum_all()?
            .backward()?;
        let want = autograd
            .get(input.as_tensor())
            .expect("autograd's gradient");
        assert_eq!(values(&dx)?, values(want)?);
        Ok(())
    }

    fn build(
        net: Sequential,
        path: ComputePath,
        input: &[usize],
    ) -> Result<(SequentialNet, ParamStore)> {
        let ctx = BuildContext::new(&Device::Cpu, 3).with_compute_path(path);
        let (net, store, _) = net.build_in(ctx, input)?;
        Ok((net, store))
    }

    /// torchvision's ResNet stem (7x7, stride 2, padding 3), on kandle's kernels and on the
    /// device-generic path, against candle's own `conv2d` with `padding = 3`.
    #[test]
    fn explicit_convolution_padding_is_pytorchs() -> Result<()> {
        let stem = || {
            Sequential::new().add(
                Conv2D::new(4, 7)
                    .stride(2)
                    .padding(Padding::symmetric(3, 3)),
            )
        };
        let input = [2, 16, 16];
        let x = kandle_testing::random::seeded_normal(&[2, 2, 16, 16], 1.0, 2)?;
        for path in [ComputePath::Auto, ComputePath::DeviceGeneric] {
            let (net, store) = build(stem(), path, &input)?;
            let got = net.forward_t(&x, false)?;
            let weight = store
                .get("conv2d_1.weight")
                .expect("a weight")
                .var
                .as_tensor()
                .clone();
            let bias = store
                .get("conv2d_1.bias")
                .expect("a bias")
                .var
                .as_tensor()
                .clone();
            let want = x
                .conv2d(&weight, 3, 2, 1, 1)?
                .broadcast_add(&bias.reshape((1, 4, 1, 1))?)?;
            assert_eq!(got.dims(), &[2, 4, 8, 8]);
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff <= 1e-5 * scale,
                "{path:?}: differs by {diff} (scale {scale})"
            );
        }
        Ok(())
    }

    #[test]
    fn explicit_pooling_padding_agrees_across_paths_and_is_bounded() -> Result<()> {
        // torchvision's ResNet max pool: 3x3, stride 2, padding 1.
        let pool = || {
            Sequential::new().add(
                MaxPooling2D::new(3)
                    .stride(2)
                    .padding(Padding::symmetric(1, 1)),
            )
        };
        let input = [3, 9, 9];
        let x = kandle_testing::random::seeded_normal(&[2, 3, 9, 9], 1.0, 3)?;
        let (kernels, _) = build(pool(), ComputePath::Auto, &input)?;
        let (generic, _) = build(pool(), ComputePath::DeviceGeneric, &input)?;
        let got = kernels.forward_t(&x, false)?;
        assert_eq!(got.dims(), &[2, 3, 5, 5]);
        assert_eq!(values(&got)?, values(&generic.forward_t(&x, false)?)?);
        // The top-left window holds x[0..2, 0..2] and padding: its maximum is theirs.
        let corner = x
            .narrow(2, 0, 2)?
            .narrow(3, 0, 2)?
            .max_keepdim(2)?
            .max_keepdim(3)?;
        assert_eq!(
            values(&got.narrow(2, 0, 1)?.narrow(3, 0, 1)?)?,
            values(&corner)?
        );

        let wide = Sequential::new().add(MaxPooling2D::new(3).padding(Padding::symmetric(2, 0)));
        let err = wide
            .summary(&input)
            .expect_err("padding wider than half the window");
        assert!(
            err.to_string()
                .contains("more than half the 3x3 pooling window"),
            "{err}"
        );
        Ok(())
    }
}
