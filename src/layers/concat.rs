//! `Concat`: parallel branches over the same input, joined on the channel axis. Inception and
//! downsample modules are built from it.

use candle_core::{DType, Tensor};

use super::{
    missing_input_grad, BuildContext, Built, Layer, LayerSpec, ParamGrads, Recorded, SummaryRow,
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
    pub fn new<I, L>(branches: I) -> Self
    where
        I: IntoIterator<Item = L>,
        L: LayerSpec,
    {
        Self {
            branches: branches
                .into_iter()
                .map(|b| Box::new(b) as Box<dyn LayerSpec>)
                .collect(),
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
        if self.branches.is_empty() {
            return Err(crate::Error::invalid(format!(
                "layer `{}` has no branches",
                ctx.path()
            )));
        }
        let mut layers = Vec::with_capacity(self.branches.len());
        let mut channels = Vec::with_capacity(self.branches.len());
        let mut rows = Vec::with_capacity(self.branches.len());
        let mut out: Option<Vec<usize>> = None;
        for (i, spec) in self.branches.iter().enumerate() {
            let name = spec
                .name()
                .map(str::to_string)
                .unwrap_or_else(|| format!("branch_{}", i + 1));
            let built = ctx.scoped(&name, |ctx| spec.build(ctx, input_shape))?;
            let shape = built.output_shape.clone();
            channels.push(shape.first().copied().unwrap_or(0));
            out = Some(match out {
                None => shape.clone(),
                Some(mut acc) => {
                    if acc.len() != shape.len() || acc.is_empty() || acc[1..] != shape[1..] {
                        return Err(crate::Error::Shape {
                            layer: ctx.path(),
                            expected: format!(
                                "branches whose outputs agree on all but channels, but `{}` gives {}",
                                self.branch_name(0),
                                crate::error::shape_with_batch(&acc)
                            ),
                            got: format!("{} from `{name}`", crate::error::shape_with_batch(&shape)),
                        });
                    }
                    acc[0] += shape[0];
                    acc
                }
            });
            let (trainable, non_trainable) = ctx.count_in(&name);
            rows.push(SummaryRow {
                name,
                kind: spec.kind().to_string(),
                class_name: spec.class_name().to_string(),
                output_shape: shape,
                trainable,
                non_trainable,
                children: built.children,
            });
            layers.push(built.layer);
        }
        let output_shape = out.unwrap_or_default();
        Ok(Built {
            layer: Box::new(ConcatLayer {
                path: ctx.path(),
                branches: layers,
                channels,
                output_shape: output_shape.clone(),
                kernels: ctx.compute_path().uses_kernels(),
            }),
            output_shape,
            children: rows,
        })
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

impl Concat {
    fn branch_name(&self, i: usize) -> String {
        self.branches[i]
            .name()
            .map(str::to_string)
            .unwrap_or_else(|| format!("branch_{}", i + 1))
    }
}

struct ConcatLayer {
    path: String,
    branches: Vec<Box<dyn Layer>>,
    /// The channels of each branch's output.
    channels: Vec<usize>,
    /// The joined output's shape, without the batch axis.
    output_shape: Vec<usize>,
    /// Whether two `f32` CPU parts are joined (and their gradients cut) by
    /// [`crate::kernels::concat`] rather than candle's single-threaded copies.
    kernels: bool,
}

/// The branches' outputs joined along channels, by kandle's kernel when `kernels` allows and
/// it takes them.
fn join(outs: &[Tensor], kernels: bool) -> Result<Tensor> {
    match outs {
        [a, b] if kernels && concat::supported(a, b) => Ok(concat::concat_channels(a, b)?),
        _ => Ok(Tensor::cat(outs, 1)?),
    }
}

/// Channels `offset .. offset + channels` of the gradient `dy`, contiguous.
fn channels_of(dy: &Tensor, offset: usize, channels: usize, kernels: bool) -> Result<Tensor> {
    if kernels && dy.device().is_cpu() && dy.dtype() == candle_core::DType::F32 {
        return Ok(concat::channel_slice(dy, offset, channels)?);
    }
    Ok(dy.narrow(1, offset, channels)?.contiguous()?)
}

impl ConcatLayer {
    /// Inference's forward pass on the CPU: the output allocated first, and each branch
    /// writing its channels straight into it (or its output copied there, where it cannot).
    fn forward_in_place(&self, x: &Tensor) -> Result<Tensor> {
        let mut dims = vec![x.dim(0)?];
        dims.extend(&self.output_shape);
        let mut out = ConcatOutput::new(&dims)?;
        let mut offset = 0;
        for (branch, &channels) in self.branches.iter().zip(&self.channels) {
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
        if !train && in_place && self.branches.len() > 1 {
            return self.forward_in_place(x);
        }
        let outs = self
            .branches
            .iter()
            .map(|b| b.forward_t(x, train))
            .collect::<Result<Vec<_>>>()?;
        join(&outs, self.kernels)
    }

    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
        let mut outs = Vec::with_capacity(self.branches.len());
        let mut branches = Vec::with_capacity(self.branches.len());
        for branch in &self.branches {
            let recorded = branch.forward_recorded(x)?;
            branches.push((recorded.output.dim(1)?, recorded.backward));
            outs.push(recorded.output);
        }
        let y = join(&outs, self.kernels)?;
        let path = self.path.clone();
        let kernels = self.kernels;
        Ok(Recorded::new(
            y,
            move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                // Each branch gets its channels of the gradient; the input's gradient is the
                // sum of the branches'. A branch that adds the others' sum as it writes its
                // own gradient goes last, saving the sum a pass.
                let mut parts: Vec<_> = branches
                    .into_iter()
                    .scan(0, |offset, (channels, backward)| {
                        *offset += channels;
                        Some((*offset - channels, channels, backward))
                    })
                    .collect();
                let adds = parts.iter().rposition(|(_, _, b)| b.adds_in_place());
                let last = adds.filter(|_| input_grad && parts.len() > 1);
                let adder = last.map(|i| parts.remove(i));
                let mut dx: Option<Tensor> = None;
                for (offset, channels, backward) in parts {
                    let part = channels_of(&dy, offset, channels, kernels)?;
                    let Some(d) = backward.backward(part, grads, input_grad)? else {
                        continue;
                    };
                    dx = Some(match dx {
                        None => d,
                        Some(sum) => sum.add(&d)?,
                    });
                }
                if let Some((offset, channels, backward)) = adder {
                    let part = channels_of(&dy, offset, channels, kernels)?;
                    dx = match dx {
                        Some(sum) => Some(backward.backward_adding(part, grads, sum)?),
                        None => backward.backward(part, grads, input_grad)?,
                    };
                }
                match dx {
                    None if input_grad => Err(missing_input_grad(&path)),
                    dx => Ok(dx),
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use crate::layers::{
        Activation, AveragePooling2D, BatchNormalization, BuildContext, Concat, Conv2D, Layer,
        LayerSpecExt, MaxPooling2D, Padding, ParamGrads, Sequential, SequentialNet,
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
    fn branch_gradients_summed_in_place_match_autograd() -> Result<()> {
        let (recorded, store) = build(ComputePath::Auto)?;
        let (generic, generic_store) = build(ComputePath::DeviceGeneric)?;
        generic_store.assign(&store.weights()?)?;
        let x = Tensor::randn(0f32, 1., (3, INPUT[0], INPUT[1], INPUT[2]), &Device::Cpu)?;

        let run = recorded.forward_recorded(&x)?;
        let dy = Tensor::randn(0f32, 1., run.output.dims(), &Device::Cpu)?;
        let mut grads = ParamGrads::new();
        let dx = run.backward.backward(dy.clone(), &mut grads, true)?;
        let dx = dx.expect("an input gradient");

        let input = Var::from_tensor(&x)?;
        let y = generic.forward_t(input.as_tensor(), true)?;
        let autograd = (y * &dy)?.sum_all()?.backward()?;
        let want = autograd
            .get(input.as_tensor())
            .expect("autograd's input gradient");
        let err = relative_difference(&dx, want)?;
        assert!(err < 1e-4, "input gradient: relative error {err}");
        // A convolution's bias before a BatchNorm has a zero gradient that rounding makes
        // noise: the kernels are compared.
        let compared = |p: &&crate::params::Param| p.trainable && !p.name.ends_with("bias");
        for (p, q) in store
            .iter()
            .zip(generic_store.iter())
            .filter(|(p, _)| compared(p))
        {
            let got = grads.take(p.var.as_tensor()).expect("a parameter gradient");
            let want = autograd
                .get(q.var.as_tensor())
                .expect("autograd's gradient");
            let err = relative_difference(&got, want)?;
            assert!(err < 1e-4, "{}: relative error {err}", p.name);
        }
        Ok(())
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
        let x = Tensor::randn(0f32, 1., (3, INPUT[0], INPUT[1], INPUT[2]), &Device::Cpu)?;
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
        let x = Tensor::randn(0f32, 1., (2, INPUT[0], INPUT[1], INPUT[2]), &Device::Cpu)?;
        let adds = |conv: Conv2D| -> Result<bool> {
            let ctx = BuildContext::new(&Device::Cpu, 0);
            let (net, _, _) = module(conv).build_in(ctx, &INPUT)?;
            Ok(net.forward_recorded(&x)?.backward.adds_in_place())
        };
        assert!(adds(Conv2D::new(4, 1))?);
        assert!(adds(Conv2D::new(4, 3).stride(2))?);
        // Winograd's input gradient adds in a pass of its own.
        assert!(!adds(Conv2D::new(16, 3).padding(Padding::Same))?);
        Ok(())
    }
}
