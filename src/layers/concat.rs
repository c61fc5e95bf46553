//! `Concat`: parallel branches over the same input, joined on the channel axis. Inception and
//! downsample modules are built from it.

use candle_core::Tensor;

use super::{
    missing_input_grad, BuildContext, Built, Layer, LayerSpec, ParamGrads, Recorded, SummaryRow,
};
use crate::kernels::concat;
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
        let mut rows = Vec::with_capacity(self.branches.len());
        let mut out: Option<Vec<usize>> = None;
        for (i, spec) in self.branches.iter().enumerate() {
            let name = spec
                .name()
                .map(str::to_string)
                .unwrap_or_else(|| format!("branch_{}", i + 1));
            let built = ctx.scoped(&name, |ctx| spec.build(ctx, input_shape))?;
            let shape = built.output_shape.clone();
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
        Ok(Built {
            layer: Box::new(ConcatLayer {
                path: ctx.path(),
                branches: layers,
                kernels: ctx.compute_path().uses_kernels(),
            }),
            output_shape: out.unwrap_or_default(),
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
    /// Whether two `f32` CPU parts are joined (and their gradients cut) by
    /// [`crate::kernels::concat`] rather than candle's single-threaded copies.
    kernels: bool,
}

/// The branches' outputs joined along channels, by kandle's kernel when `kernels` allows and
/// it takes them.
fn join(outs: &[Tensor], kernels: bool) -> Result<Tensor> {
    match outs {
        [a, b] if kernels && concat::supported(a, b) => concat::concat_channels(a, b),
        _ => Ok(Tensor::cat(outs, 1)?),
    }
}

/// Channels `offset .. offset + channels` of the gradient `dy`, contiguous.
fn channels_of(dy: &Tensor, offset: usize, channels: usize, kernels: bool) -> Result<Tensor> {
    if kernels && dy.device().is_cpu() && dy.dtype() == candle_core::DType::F32 {
        return concat::channel_slice(dy, offset, channels);
    }
    Ok(dy.narrow(1, offset, channels)?.contiguous()?)
}

impl Layer for ConcatLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
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
                // sum of the branches'.
                let mut dx: Option<Tensor> = None;
                let mut offset = 0;
                for (channels, backward) in branches {
                    let part = channels_of(&dy, offset, channels, kernels)?;
                    offset += channels;
                    let Some(d) = backward.backward(part, grads, input_grad)? else {
                        continue;
                    };
                    dx = Some(match dx {
                        None => d,
                        Some(sum) => sum.add(&d)?,
                    });
                }
                match dx {
                    None if input_grad => Err(missing_input_grad(&path)),
                    dx => Ok(dx),
                }
            },
        ))
    }
}
