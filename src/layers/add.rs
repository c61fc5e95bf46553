//! `Add`: parallel branches over the same input, summed. With an [`Identity`](super::Identity)
//! branch it is a residual block; a ReLU after it is absorbed into the sum's step, so the
//! recorded pass keeps one output and one gradient mask for both.

use candle_core::Tensor;

use super::branches::{boxed_specs, branch_name, Branches};
use super::{
    record_with_candle, relu, BuildContext, Built, FastPath, Layer, LayerSpec, ParamGrads,
    RecordRequest, Recorded, ReluRecord,
};
use crate::Result;

/// Runs each branch on the same input and adds the outputs, which must all have one shape (as
/// Keras's `Add` layer requires of its inputs). Unnamed branches are called `branch_1`,
/// `branch_2`, ...
///
/// ```
/// use kandle::layers::{
///     Activation, Add, BatchNormalization, Conv2D, Identity, LayerSpecExt, Padding, Sequential,
/// };
///
/// // A residual block: relu(x + bn(conv(relu(bn(conv(x)))))).
/// let residual = Sequential::new()
///     .add(Conv2D::new(8, 3).padding(Padding::Same).use_bias(false))
///     .add(BatchNormalization::new())
///     .add(Activation::Relu)
///     .add(Conv2D::new(8, 3).padding(Padding::Same).use_bias(false))
///     .add(BatchNormalization::new());
/// let block = Sequential::new()
///     .add(Add::new([residual.boxed(), Identity.boxed()]))
///     .add(Activation::Relu);
/// let summary = block.summary(&[8, 6, 6])?;
/// assert_eq!(summary.rows[0].output_shape, [8, 6, 6]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Add {
    branches: Vec<Box<dyn LayerSpec>>,
}

impl Add {
    /// Sums the given branches.
    pub fn new(branches: impl IntoIterator<Item = impl LayerSpec>) -> Self {
        Self {
            branches: boxed_specs(branches),
        }
    }
}

impl LayerSpec for Add {
    fn kind(&self) -> &'static str {
        "add"
    }

    fn class_name(&self) -> &'static str {
        "Add"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let built = Branches::build(&self.branches, ctx, input_shape)?;
        let first = &built.shapes[0];
        if let Some(i) = built.shapes.iter().position(|shape| shape != first) {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: branches `{}` and `{}` give {} and {}, which do not add (an Add \
                 needs one output shape)",
                ctx.path(),
                branch_name(&self.branches, 0),
                branch_name(&self.branches, i),
                crate::error::shape_with_batch(first),
                crate::error::shape_with_batch(&built.shapes[i]),
            )));
        }
        let output_shape = first.clone();
        let layer = AddLayer {
            branches: built.branches,
            relu: false,
            kernels: ctx.compute_path().uses_kernels(),
        };
        Ok(Built::fast(layer, output_shape, built.rows))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct AddLayer {
    branches: Branches,
    /// Whether the ReLU after the sum is applied here ([`FastPath::fuse_relu`]).
    relu: bool,
    /// Whether that ReLU may run on the CPU kernel (see [`crate::ComputePath::uses_kernels`]).
    kernels: bool,
}

/// The sum of `outs`, which are not empty (a merge layer has branches).
fn sum(outs: Vec<Tensor>) -> Result<Tensor> {
    let mut outs = outs.into_iter();
    let first = outs
        .next()
        .ok_or_else(|| crate::Error::invalid("a sum of no branches"))?;
    outs.try_fold(first, |acc, out| Ok(acc.add(&out)?))
}

impl AddLayer {
    /// The sum, and the ReLU after it when this layer absorbed one.
    fn output(&self, sum: Tensor) -> Result<Tensor> {
        Ok(if self.relu {
            relu(&sum, self.kernels)?
        } else {
            sum
        })
    }
}

impl Layer for AddLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.output(sum(self.branches.forward_t(x, train)?)?)
    }
}

impl FastPath for AddLayer {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        if request.logits {
            return record_with_candle(self, x, true);
        }
        let (outs, backward) = self.branches.record(x)?;
        let sum = sum(outs)?;
        let (y, relu) = match self.relu {
            true => ReluRecord::relu(&sum, self.kernels).map(|(y, r)| (y, Some(r)))?,
            false => (sum, None),
        };
        Ok(Recorded::new(
            y,
            // Every branch gets the whole gradient, shared rather than copied.
            move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                let dy = match &relu {
                    Some(relu) => relu.backward(&dy)?,
                    None => dy,
                };
                backward.backward(|_, _| Ok(dy.clone()), grads, input_grad)
            },
        ))
    }

    fn fuse_relu(&mut self) -> bool {
        self.relu = true;
        true
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use crate::layers::{
        Activation, Add, BatchNormalization, BuildContext, Conv2D, FastPath, Identity, Layer,
        LayerSpecExt, MaxPooling2D, Padding, ParamGrads, RecordRequest, Sequential, SequentialNet,
    };
    use crate::params::ParamStore;
    use crate::{ComputePath, Result};

    const INPUT: [usize; 3] = [16, 9, 9];

    fn conv_bn(conv: Conv2D) -> Sequential {
        Sequential::new()
            .add(conv.use_bias(false))
            .add(BatchNormalization::new())
    }

    /// Two residual blocks: an identity shortcut beside Winograd's 3x3 convolutions, then a
    /// 1x1 projection (whose kernel adds the other branch's input gradient in place) beside
    /// the same.
    fn build(path: ComputePath) -> Result<(SequentialNet, ParamStore)> {
        let residual = || {
            conv_bn(Conv2D::new(16, 3).padding(Padding::Same))
                .add(Activation::Relu)
                .add(Conv2D::new(16, 3).padding(Padding::Same))
        };
        let net = Sequential::new()
            .add(Add::new([residual().boxed(), Identity.boxed()]))
            .add(Activation::Relu)
            .add(Add::new([
                conv_bn(Conv2D::new(16, 1)).boxed(),
                residual().boxed(),
            ]))
            .add(Activation::Relu);
        let ctx = BuildContext::new(&Device::Cpu, 5).with_compute_path(path);
        let (net, store, _) = net.build_in(ctx, &INPUT)?;
        Ok((net, store))
    }

    #[test]
    fn residual_gradients_match_autograd() -> Result<()> {
        crate::layers::branches::assert_recorded_matches_autograd(build, &INPUT)
    }

    #[test]
    fn the_relu_after_a_sum_is_absorbed_and_keeps_its_row() -> Result<()> {
        let (net, _) = build(ComputePath::Auto)?;
        let names: Vec<&str> = net.layer_names().collect();
        assert_eq!(names, ["add_1", "relu_1", "add_2", "relu_2"]);
        assert_eq!(net.passing_through(), [false, true, false, true]);
        let (apart, _) = build(ComputePath::DeviceGeneric)?;
        let x = kandle_testing::random::seeded_normal(&[2, INPUT[0], INPUT[1], INPUT[2]], 1.0, 1)?;
        for net in [&net, &apart] {
            let y = net.forward_t(&x, false)?;
            assert_eq!(
                y.lt(0f32)?.max_all()?.to_scalar::<u8>()?,
                0,
                "a ReLU output"
            );
        }
        Ok(())
    }

    #[test]
    fn an_identity_shortcut_passes_the_gradient_itself() -> Result<()> {
        let ctx = BuildContext::new(&Device::Cpu, 0);
        let (net, _, _) = Sequential::new().add(Identity).build_in(ctx, &[4])?;
        let x = kandle_testing::random::seeded_normal(&[2, 4], 1.0, 2)?;
        let run = net.forward_recorded(&x, RecordRequest::output())?;
        assert_eq!(run.output.id(), x.id(), "the output is the input");
        let dy = kandle_testing::random::seeded_normal(&[2, 4], 1.0, 3)?;
        let dx = run
            .backward
            .backward(dy.clone(), &mut ParamGrads::new(), true)?;
        assert_eq!(dx.map(|d| d.id()), Some(dy.id()), "no copy of the gradient");
        Ok(())
    }

    #[test]
    fn branches_of_other_shapes_are_refused_with_both_named() -> Result<()> {
        let net = Sequential::new().add(
            Add::new([
                Conv2D::new(16, 3).padding(Padding::Same).boxed(),
                MaxPooling2D::new(2).named("pool").boxed(),
            ])
            .named("block"),
        );
        let err = net
            .summary(&INPUT)
            .expect_err("shapes that do not add")
            .to_string();
        for part in [
            "`block`",
            "`branch_1`",
            "(batch, 16, 9, 9)",
            "`pool`",
            "(batch, 16, 4, 4)",
        ] {
            assert!(err.contains(part), "`{part}` missing from: {err}");
        }
        let err = Sequential::new()
            .add(Add::new(Vec::<Identity>::new()))
            .summary(&INPUT)
            .expect_err("no branches")
            .to_string();
        assert!(err.contains("has no branches"), "{err}");
        Ok(())
    }
}
