//! What layers with several branches over one input share: building the branches in scopes
//! named after them, running them, and the backward pass that sums their input gradients.
//!
//! A merge layer ([`Concat`](super::Concat), [`Add`](super::Add)) adds only how it joins the
//! branches' outputs and which part of its output gradient each branch gets. The input's
//! gradient is the sum of the branches': the first branch's gradient is taken as it is (no
//! zero-filled accumulator), and a branch whose kernel can add the others' sum while writing
//! its own (a 1x1 convolution) goes last and does so, saving the sum a pass.

use candle_core::Tensor;

use super::{
    build_child, missing_input_grad, Backward, BuildContext, ChannelPart, FastPath, LayerSpec,
    ParamGrads, RecordRequest, SummaryRow,
};
use crate::Result;

/// The branches of a merge layer, built for one input shape.
pub(crate) struct Branches {
    /// The merge layer's full name, for errors.
    path: String,
    layers: Vec<Box<dyn FastPath>>,
}

/// [`Branches`] with each branch's output shape and summary row.
pub(crate) struct BuiltBranches {
    pub(crate) branches: Branches,
    /// Each branch's output shape, without the batch axis.
    pub(crate) shapes: Vec<Vec<usize>>,
    /// Each branch's summary row.
    pub(crate) rows: Vec<SummaryRow>,
}

/// The recipes of `branches`, boxed: what a merge layer's constructor keeps.
pub(crate) fn boxed_specs<I, L>(branches: I) -> Vec<Box<dyn LayerSpec>>
where
    I: IntoIterator<Item = L>,
    L: LayerSpec,
{
    branches
        .into_iter()
        .map(|b| Box::new(b) as Box<dyn LayerSpec>)
        .collect()
}

/// The name of branch `i` of `specs`: the user's, or `branch_<i + 1>`.
pub(crate) fn branch_name(specs: &[Box<dyn LayerSpec>], i: usize) -> String {
    specs[i]
        .name()
        .map(str::to_string)
        .unwrap_or_else(|| format!("branch_{}", i + 1))
}

impl Branches {
    /// Builds `specs` for inputs of `input_shape`, each in a scope named after it; a merge
    /// layer without branches is an error naming it.
    pub(crate) fn build(
        specs: &[Box<dyn LayerSpec>],
        ctx: &mut BuildContext,
        input_shape: &[usize],
    ) -> Result<BuiltBranches> {
        if specs.is_empty() {
            return Err(crate::Error::invalid(format!(
                "layer `{}` has no branches",
                ctx.path()
            )));
        }
        let mut layers = Vec::with_capacity(specs.len());
        let mut shapes = Vec::with_capacity(specs.len());
        let mut rows = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            let name = branch_name(specs, i);
            let child = build_child(ctx, spec.as_ref(), &name, input_shape)?;
            rows.push(child.row);
            shapes.push(child.output_shape);
            layers.push(child.layer);
        }
        let branches = Branches {
            path: ctx.path(),
            layers,
        };
        Ok(BuiltBranches {
            branches,
            shapes,
            rows,
        })
    }

    /// The built branches, in order.
    pub(crate) fn layers(&self) -> &[Box<dyn FastPath>] {
        &self.layers
    }

    /// Every branch's output for `x`.
    pub(crate) fn forward_t(&self, x: &Tensor, train: bool) -> Result<Vec<Tensor>> {
        self.layers.iter().map(|b| b.forward_t(x, train)).collect()
    }

    /// The full name of the layer the branches belong to.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// Every branch's recorded training forward for `x`: the outputs, and the backward pass.
    pub(crate) fn record(&self, x: &Tensor) -> Result<(Vec<Tensor>, BranchesBackward)> {
        let mut outputs = Vec::with_capacity(self.layers.len());
        let mut backwards = Vec::with_capacity(self.layers.len());
        for branch in &self.layers {
            let recorded = branch.forward_recorded(x, RecordRequest::output())?;
            outputs.push(recorded.output);
            backwards.push(recorded.backward);
        }
        Ok((outputs, self.backward_of(backwards)))
    }

    /// Every branch's recorded training forward for `x`, each writing its output into its
    /// part of `parts` (one per branch, in order); the backward pass.
    pub(crate) fn record_into(
        &self,
        x: &Tensor,
        parts: &[ChannelPart<'_>],
    ) -> Result<BranchesBackward> {
        let backwards = self
            .layers
            .iter()
            .zip(parts)
            .map(|(branch, part)| Ok(branch.forward_recorded_into(x, part)?.backward))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.backward_of(backwards))
    }

    fn backward_of(&self, backwards: Vec<Box<dyn Backward>>) -> BranchesBackward {
        BranchesBackward {
            path: self.path.clone(),
            backwards,
        }
    }
}

/// The branches' recorded backward passes.
pub(crate) struct BranchesBackward {
    path: String,
    backwards: Vec<Box<dyn Backward>>,
}

impl BranchesBackward {
    /// Runs each branch's backward pass on its output gradient, `output_grad(i, view)` for
    /// branch `i` (`view`: the branch reads a range of a larger tensor's channels in place,
    /// [`Backward::takes_channel_views`]), and returns the sum of their input gradients when
    /// `input_grad`.
    pub(crate) fn backward(
        self,
        output_grad: impl Fn(usize, bool) -> Result<Tensor>,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let mut parts: Vec<_> = self.backwards.into_iter().enumerate().collect();
        let adds = parts.iter().rposition(|(_, b)| b.adds_in_place());
        let adder = adds
            .filter(|_| input_grad && parts.len() > 1)
            .map(|i| parts.remove(i));
        let mut dx: Option<Tensor> = None;
        for (i, backward) in parts {
            let dy = output_grad(i, backward.takes_channel_views())?;
            let Some(d) = backward.backward(dy, grads, input_grad)? else {
                continue;
            };
            dx = Some(match dx {
                None => d,
                Some(sum) => sum.add(&d)?,
            });
        }
        if let Some((i, backward)) = adder {
            let dy = output_grad(i, backward.takes_channel_views())?;
            dx = match dx {
                Some(sum) => Some(backward.backward_adding(dy, grads, sum)?),
                None => backward.backward(dy, grads, input_grad)?,
            };
        }
        match dx {
            None if input_grad => Err(missing_input_grad(&self.path)),
            dx => Ok(dx),
        }
    }
}

/// Asserts that the recorded backward pass of the network `build` makes on the CPU kernels'
/// path gives the input's and the kernels' gradients that candle's autograd gives on the
/// device-generic path, within 1e-4 relative to each gradient's scale. The input and the
/// output gradient are drawn from a fixed seed: a ReLU whose input the two paths round to
/// opposite sides of zero would pass one path's gradient and not the other's, and a random
/// draw meets such a kink about once in a thousand runs.
#[cfg(test)]
pub(crate) fn assert_recorded_matches_autograd(
    build: impl Fn(crate::ComputePath) -> Result<(super::SequentialNet, crate::params::ParamStore)>,
    input: &[usize],
) -> Result<()> {
    use candle_core::Var;

    use super::Layer;

    let (recorded, store) = build(crate::ComputePath::Auto)?;
    let (generic, generic_store) = build(crate::ComputePath::DeviceGeneric)?;
    generic_store.assign(&store.weights()?)?;
    let mut dims = vec![3];
    dims.extend(input);
    let x = kandle_testing::random::seeded_uniform(&dims, 1)?;

    let run = recorded.forward_recorded(&x, RecordRequest::output())?;
    let dy = kandle_testing::random::seeded_uniform(run.output.dims(), 2)?;
    let mut grads = ParamGrads::new();
    let dx = run.backward.backward(dy.clone(), &mut grads, true)?;
    let dx = dx.ok_or_else(|| crate::Error::invalid("no input gradient"))?;

    let input = Var::from_tensor(&x)?;
    let y = generic.forward_t(input.as_tensor(), true)?;
    let autograd = (y * &dy)?.sum_all()?.backward()?;
    let want = autograd
        .get(input.as_tensor())
        .ok_or_else(|| crate::Error::invalid("no autograd input gradient"))?;
    let err = relative_difference(&dx, want)?;
    assert!(err < 1e-4, "input gradient: relative error {err}");
    assert_param_grads_match(&store, &generic_store, &mut grads, &autograd)
}

/// The largest difference between `a` and `b` relative to `b`'s largest magnitude.
#[cfg(test)]
pub(crate) fn relative_difference(a: &Tensor, b: &Tensor) -> Result<f32> {
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
}

/// Asserts that the recorded pass's gradients `grads` of `store`'s trainable variables are
/// `autograd`'s of `generic_store`'s (the same variables on the device-generic path), within
/// 1e-4 relative. A convolution's bias before a BatchNorm has a zero gradient that rounding
/// makes noise: the kernels are compared.
#[cfg(test)]
pub(crate) fn assert_param_grads_match(
    store: &crate::params::ParamStore,
    generic_store: &crate::params::ParamStore,
    grads: &mut ParamGrads,
    autograd: &candle_core::backprop::GradStore,
) -> Result<()> {
    let compared = |p: &&crate::params::Param| p.trainable && !p.name.ends_with("bias");
    for (p, q) in store
        .iter()
        .zip(generic_store.iter())
        .filter(|(p, _)| compared(p))
    {
        let got = grads
            .take(p.var.as_tensor())
            .ok_or_else(|| crate::Error::invalid(format!("no gradient for {}", p.name)))?;
        let want = autograd
            .get(q.var.as_tensor())
            .ok_or_else(|| crate::Error::invalid(format!("no autograd gradient for {}", q.name)))?;
        let err = relative_difference(&got, want)?;
        assert!(err < 1e-4, "{}: relative error {err}", p.name);
    }
    Ok(())
}
