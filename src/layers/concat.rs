//! `Concat`: parallel branches over the same input, joined on the channel axis. Inception and
//! downsample modules are built from it.
//!
//! On the CPU, inference writes each branch's channels straight into the joined output and
//! training joins the branches' outputs with kandle's parallel copy. On a CUDA device, training
//! and inference allocate the joined output first and each branch writes its range of channels
//! there ([`ChannelPart`]; a fused BatchNorm's last kernel in place, other branches' outputs
//! copied in); either way, a branch whose backward pass reads a range of channels where it lies
//! gets its range of the joined gradient without a copy.

use candle_core::{DType, Device, Tensor};

use super::branches::{boxed_specs, branch_name, Branches, BranchesBackward};
use super::{
    record_with_candle, BuildContext, Built, ChannelPart, FastPath, Layer, LayerSpec, ParamGrads,
    RecordRequest, Recorded,
};
use crate::kernels::concat::{self, ConcatOutput};
use crate::Result;

/// Runs each branch on the same input and concatenates the outputs along channels (the first
/// non-batch axis). All other axes must agree. Unnamed branches are called `branch_1`,
/// `branch_2`, ...
#[derive(Debug, Clone)]
pub struct Concat {
    branches: Vec<Box<dyn LayerSpec>>,
}

impl Concat {
    /// Joins the given branches.
    pub fn new(branches: impl IntoIterator<Item = impl LayerSpec>) -> Self {
        Self {
            branches: boxed_specs(branches),
        }
    }
}

impl LayerSpec for Concat {
    fn kind(&self) -> &'static str {
        "concat"
    }

    fn class_name(&self) -> &'static str {
        "Concatenate"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let built = Branches::build(&self.branches, ctx, input_shape)?;
        let mut output_shape = built.shapes[0].clone();
        for (i, shape) in built.shapes.iter().enumerate().skip(1) {
            let agree = !shape.is_empty()
                && shape.len() == output_shape.len()
                && shape[1..] == output_shape[1..];
            if !agree {
                return Err(crate::Error::Shape {
                    layer: ctx.path(),
                    expected: format!(
                        "branches whose outputs agree on all but channels, but `{}` gives {}",
                        branch_name(&self.branches, 0),
                        crate::error::shape_with_batch(&built.shapes[0])
                    ),
                    got: format!(
                        "{} from `{}`",
                        crate::error::shape_with_batch(shape),
                        branch_name(&self.branches, i)
                    ),
                });
            }
            output_shape[0] += shape[0];
        }
        let layer = ConcatLayer {
            branches: built.branches,
            channels: built.shapes.iter().map(|s| s[0]).collect(),
            output_shape: output_shape.clone(),
            kernels: ctx.compute_path().uses_kernels(),
            compute: ctx.compute_dtype(),
        };
        Ok(Built::fast(layer, output_shape, built.rows))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct ConcatLayer {
    branches: Branches,
    /// The channels of each branch's output.
    channels: Vec<usize>,
    /// The joined output's shape, without the batch axis.
    output_shape: Vec<usize>,
    /// Whether two `f32` CPU parts are joined (and their gradients cut) by
    /// [`crate::kernels::concat`] rather than candle's single-threaded copies.
    kernels: bool,
    /// The dtype the layers compute in, which branches over an input of that dtype give.
    compute: DType,
}

/// The branches' outputs joined along channels, by kandle's kernel when `kernels` allows and
/// it takes them.
pub(crate) fn join_channels(outs: &[Tensor], kernels: bool) -> Result<Tensor> {
    match outs {
        [a, b] if kernels && concat::supported(a, b) => Ok(concat::concat_channels(a, b)?),
        _ => Ok(Tensor::cat(outs, 1)?),
    }
}

/// Channels `offset .. offset + channels` of the gradient `dy`, contiguous.
pub(crate) fn channel_part(
    dy: &Tensor,
    offset: usize,
    channels: usize,
    kernels: bool,
) -> Result<Tensor> {
    if kernels && dy.device().is_cpu() && dy.dtype() == candle_core::DType::F32 {
        return Ok(concat::channel_slice(dy, offset, channels)?);
    }
    Ok(dy.narrow(1, offset, channels)?.contiguous()?)
}

/// A new joined output of `dims` on `device`, for branches to write their channels into: on a
/// CUDA device not filled first.
fn joined_output(dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return Ok(crate::kernels::cuda::channel_buffer(dims, dtype, device)?);
    }
    Ok(Tensor::zeros(dims, dtype, device)?)
}

impl ConcatLayer {
    /// The offset of each branch's channels in the joined output.
    fn offsets(&self) -> Vec<usize> {
        self.channels
            .iter()
            .scan(0, |offset, &channels| {
                *offset += channels;
                Some(*offset - channels)
            })
            .collect()
    }

    /// Whether each branch writes its channels into the joined output allocated first, in
    /// training and inference (on a CUDA device, branches computing in the input's dtype),
    /// rather than the branches' outputs being joined.
    fn joins_in_place_on_device(&self, x: &Tensor) -> bool {
        self.kernels && self.channels.len() > 1 && x.device().is_cuda() && x.dtype() == self.compute
    }

    /// A new joined output for the input `x`, not filled on a CUDA device.
    fn joined_output(&self, x: &Tensor) -> Result<Tensor> {
        let mut dims = vec![x.dim(0)?];
        dims.extend(&self.output_shape);
        joined_output(&dims, x.dtype(), x.device())
    }

    /// Each branch's range of channels of `joined`.
    fn parts<'a>(&'a self, joined: &'a Tensor) -> Vec<ChannelPart<'a>> {
        let layer = self.branches.path();
        self.offsets()
            .into_iter()
            .zip(&self.channels)
            .map(|(offset, &channels)| ChannelPart::new(joined, offset, channels, layer))
            .collect()
    }

    /// The recorded training forward with the joined output allocated first and each branch
    /// writing its channels into it ([`FastPath::forward_recorded_into`]).
    fn record_in_place(&self, x: &Tensor) -> Result<Recorded> {
        let joined = self.joined_output(x)?;
        let backward = self.branches.record_into(x, &self.parts(&joined))?;
        Ok(self.recorded(joined, backward))
    }

    /// Inference's forward pass with the joined output allocated first and each branch
    /// writing its channels into it ([`FastPath::forward_inference_into`]), or its output
    /// copied there where it cannot.
    fn infer_in_place(&self, x: &Tensor) -> Result<Tensor> {
        let joined = self.joined_output(x)?;
        for (branch, part) in self.branches.layers().iter().zip(self.parts(&joined)) {
            if branch.forward_inference_into(x, &part)?.is_none() {
                part.write(&branch.forward_t(x, false)?)?;
            }
        }
        Ok(joined)
    }

    /// The joined output `y` with the backward pass that cuts its gradient into the branches'
    /// parts.
    fn recorded(&self, y: Tensor, backward: BranchesBackward) -> Recorded {
        let kernels = self.kernels;
        let offsets = self.offsets();
        let channels = self.channels.clone();
        Recorded::new(
            y,
            move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                // Each branch gets its channels of the gradient: a view where the branch
                // reads it in place, a copy otherwise.
                let part = |i: usize, view: bool| match view {
                    true => Ok(dy.narrow(1, offsets[i], channels[i])?),
                    false => channel_part(&dy, offsets[i], channels[i], kernels),
                };
                backward.backward(part, grads, input_grad)
            },
        )
    }

    /// Inference's forward pass on the CPU: the output allocated first, and each branch
    /// writing its channels straight into it (or its output copied there, where it cannot).
    fn forward_in_place(&self, x: &Tensor) -> Result<Tensor> {
        let mut dims = vec![x.dim(0)?];
        dims.extend(&self.output_shape);
        let mut out = ConcatOutput::new(&dims)?;
        let mut offset = 0;
        for (branch, &channels) in self.branches.layers().iter().zip(&self.channels) {
            let mut slot = out.part(offset, channels)?;
            if !branch.forward_into(x, None, &mut slot)? {
                slot.copy_from(&branch.forward_t(x, false)?)?;
            }
            offset += channels;
        }
        Ok(out.into_tensor()?)
    }
}

impl Layer for ConcatLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let in_place = self.kernels && x.device().is_cpu() && x.dtype() == DType::F32;
        if !train && in_place && self.channels.len() > 1 {
            return self.forward_in_place(x);
        }
        if !train && self.joins_in_place_on_device(x) {
            return self.infer_in_place(x);
        }
        join_channels(&self.branches.forward_t(x, train)?, self.kernels)
    }
}

impl FastPath for ConcatLayer {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        if request.logits {
            return record_with_candle(self, x, true);
        }
        if self.joins_in_place_on_device(x) {
            return self.record_in_place(x);
        }
        let (outs, backward) = self.branches.record(x)?;
        let y = join_channels(&outs, self.kernels)?;
        Ok(self.recorded(y, backward))
    }
}

#[cfg(test)]
mod tests {
    use crate::layers::{FastPath, RecordRequest};
    use candle_core::{Device, Tensor};

    use crate::layers::{
        Activation, AveragePooling2D, BatchNormalization, BuildContext, Concat, Conv2D, Layer,
        LayerSpecExt, MaxPooling2D, Padding, Sequential, SequentialNet,
    };
    use crate::params::ParamStore;
    use crate::{ComputePath, Result};

    const INPUT: [usize; 3] = [16, 9, 9];

    fn module(conv: Conv2D) -> Sequential {
        Sequential::new()
            .add(conv)
            .add(BatchNormalization::new())
            .add(Activation::Relu)
    }

    /// An inception-like module (a 1x1 branch, whose kernel adds the other branch's input
    /// gradient in place, beside Winograd's 3x3), then a strided convolution beside a max pool.
    fn build(path: ComputePath) -> Result<(SequentialNet, ParamStore)> {
        let net = Sequential::new()
            .add(Concat::new([
                module(Conv2D::new(12, 1)),
                module(Conv2D::new(16, 3).padding(Padding::Same)),
            ]))
            .add(Concat::new([
                module(Conv2D::new(10, 3).stride(2)).boxed(),
                MaxPooling2D::new(3).stride(2).boxed(),
            ]));
        let ctx = BuildContext::new(&Device::Cpu, 9).with_compute_path(path);
        let (net, store, _) = net.build_in(ctx, &INPUT)?;
        Ok((net, store))
    }

    fn relative_difference(a: &Tensor, b: &Tensor) -> Result<f32> {
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
        Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
    }

    #[test]
    fn branches_written_into_the_joined_output_train_as_joined_branches() -> Result<()> {
        // What a CUDA device runs (the joined output allocated first, each branch writing its
        // channels), here with every branch copying its output in: a module whose ReLU the
        // BatchNorm absorbed (an identity after the writer), a module ending in a dropout that
        // changes the written output again, a max pool, and a bare convolution. The output and
        // every gradient are those of the branches joined after the fact, bit for bit.
        use super::{Branches, ConcatLayer};
        use crate::layers::{Dropout, LayerSpec, ParamGrads};

        let specs: Vec<Box<dyn LayerSpec>> = vec![
            module(Conv2D::new(6, 1)).boxed(),
            module(Conv2D::new(5, 3).padding(Padding::Same))
                .add(Dropout::new(0.5))
                .boxed(),
            MaxPooling2D::new(3)
                .stride(1)
                .padding(Padding::Same)
                .boxed(),
            Conv2D::new(4, 1).boxed(),
        ];
        let mut ctx = BuildContext::new(&Device::Cpu, 5);
        let built = Branches::build(&specs, &mut ctx, &INPUT)?;
        let channels: Vec<usize> = built.shapes.iter().map(|s| s[0]).collect();
        let mut output_shape = built.shapes[0].clone();
        output_shape[0] = channels.iter().sum();
        let layer = ConcatLayer {
            branches: built.branches,
            channels,
            output_shape,
            kernels: true,
            compute: candle_core::DType::F32,
        };
        let store = ctx.into_store();
        let (vars, start) = (store.trainable_vars(), store.weights()?);
        let x = kandle_testing::random::seeded_uniform(&[3, 16, 9, 9], 6)?;
        let dy = kandle_testing::random::seeded_uniform(&[3, 31, 9, 9], 7)?;
        let mut runs = Vec::new();
        for in_place in [false, true] {
            // The dropout draws the same mask in both runs, from the same position.
            store.assign(&start)?;
            let recorded = match in_place {
                false => layer.forward_recorded(&x, RecordRequest::output())?,
                true => layer.record_in_place(&x)?,
            };
            let mut grads = ParamGrads::new();
            let dx = recorded.backward.backward(dy.clone(), &mut grads, true)?;
            let mut all = vec![recorded.output, dx.expect("an input gradient")];
            for var in &vars {
                all.push(grads.take(var.as_tensor()).expect("a variable's gradient"));
            }
            runs.push(all);
        }
        // Inference: the branches' outputs (a BatchNorm folded into the convolution before it
        // on the CPU) joined after the fact.
        runs[0].push(super::join_channels(
            &layer.branches.forward_t(&x, false)?,
            false,
        )?);
        runs[1].push(layer.infer_in_place(&x)?);
        for (i, (got, want)) in runs[1].iter().zip(&runs[0]).enumerate() {
            let (got, want) = (got.flatten_all()?, want.flatten_all()?);
            assert_eq!(got.to_vec1::<f32>()?, want.to_vec1::<f32>()?, "tensor {i}");
        }
        Ok(())
    }

    #[test]
    fn branch_gradients_summed_in_place_match_autograd() -> Result<()> {
        crate::layers::branches::assert_recorded_matches_autograd(build, &INPUT)
    }

    #[test]
    fn inference_writes_branches_in_place_like_the_layers_apart() -> Result<()> {
        // Branches that write their channels in place (folded modules, a convolution with its
        // own ReLU, a max pool) beside ones that cannot (an average pool, a nested concat),
        // at 9x9 and at the 4x4 a strided module leaves.
        let build = |path: ComputePath| -> Result<(SequentialNet, ParamStore)> {
            let net = Sequential::new()
                .add(Concat::new([
                    module(Conv2D::new(12, 1)).boxed(),
                    AveragePooling2D::new(3)
                        .stride(1)
                        .padding(Padding::Same)
                        .boxed(),
                    module(Conv2D::new(16, 3).padding(Padding::Same)).boxed(),
                    Conv2D::new(5, 1).activation(Activation::Relu).boxed(),
                ]))
                .add(Concat::new([
                    module(Conv2D::new(10, 3).stride(2)).boxed(),
                    Concat::new([Conv2D::new(3, 3).stride(2), Conv2D::new(2, 3).stride(2)]).boxed(),
                    MaxPooling2D::new(3).stride(2).boxed(),
                ]));
            let ctx = BuildContext::new(&Device::Cpu, 4).with_compute_path(path);
            let (net, store, _) = net.build_in(ctx, &INPUT)?;
            Ok((net, store))
        };
        let (in_place, store) = build(ComputePath::Auto)?;
        let (apart, apart_store) = build(ComputePath::DeviceGeneric)?;
        crate::layers::fold::move_variables(&store, &apart_store)?;
        let x = kandle_testing::random::seeded_normal(&[3, INPUT[0], INPUT[1], INPUT[2]], 1.0, 1)?;
        let got = in_place.forward_t(&x, false)?;
        let want = apart.forward_t(&x, false)?;
        assert_eq!(got.dims(), &[3, 10 + 5 + 16 + 12 + 16 + 5, 4, 4]);
        assert_eq!(got.dims(), want.dims());
        let err = relative_difference(&got, &want)?;
        assert!(err < 1e-5, "relative error {err}");
        Ok(())
    }

    #[test]
    fn only_direct_convolutions_add_in_place() -> Result<()> {
        let x = kandle_testing::random::seeded_normal(&[2, INPUT[0], INPUT[1], INPUT[2]], 1.0, 2)?;
        let adds = |conv: Conv2D| -> Result<bool> {
            let ctx = BuildContext::new(&Device::Cpu, 0);
            let (net, _, _) = module(conv).build_in(ctx, &INPUT)?;
            Ok(net
                .forward_recorded(&x, RecordRequest::output())?
                .backward
                .adds_in_place())
        };
        assert!(adds(Conv2D::new(4, 1))?);
        assert!(adds(Conv2D::new(4, 3).stride(2))?);
        // Winograd's input gradient adds in a pass of its own.
        assert!(!adds(Conv2D::new(16, 3).padding(Padding::Same))?);
        Ok(())
    }

    /// A branch ending in BatchNorm (and the ReLU it absorbed) reads its channels of the
    /// concatenation's gradient in place; a max pool, a ReLU of its own and candle's
    /// BatchNorm get a copy.
    #[test]
    fn batch_norm_branches_take_their_gradient_in_place() -> Result<()> {
        let x = kandle_testing::random::seeded_normal(&[2, INPUT[0], INPUT[1], INPUT[2]], 1.0, 3)?;
        let takes = |branch: Sequential, path: ComputePath| -> Result<bool> {
            let ctx = BuildContext::new(&Device::Cpu, 0).with_compute_path(path);
            let (net, _, _) = branch.build_in(ctx, &INPUT)?;
            Ok(net
                .forward_recorded(&x, RecordRequest::output())?
                .backward
                .takes_channel_views())
        };
        let conv = || Conv2D::new(4, 1);
        assert!(takes(module(conv()), ComputePath::Auto)?);
        assert!(!takes(module(conv()), ComputePath::DeviceGeneric)?);
        let pool = Sequential::new().add(MaxPooling2D::new(3).stride(2));
        assert!(!takes(pool, ComputePath::Auto)?);
        let relu_alone = Sequential::new().add(conv()).add(Activation::Relu);
        assert!(!takes(relu_alone, ComputePath::Auto)?);
        Ok(())
    }
}
