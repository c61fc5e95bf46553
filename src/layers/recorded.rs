//! kandle's own backward pass: a training forward that records, layer by layer, how to compute
//! its gradients, and the store those gradients land in.
//!
//! Candle's autograd accumulates every gradient into a freshly zeroed tensor (`zeros_like`, then
//! `add`), even when a value has a single consumer, as every activation of a sequential network
//! does. On the CPU those two extra passes over each activation, and the page faults of their
//! fresh buffers, cost a training step more than a fifth of its time. A recorded forward instead
//! hands each layer's output gradient straight to that layer's backward, adds only where a value
//! really fans out (the branches of a [`Concat`](super::Concat)), and never computes the
//! gradient of the images.
//!
//! Layers with a kernel for the tensor (kandle's CPU kernels; on CUDA devices its CUDA kernels
//! and, with `cudnn`, cuDNN's convolution gradients) record their kernels' backward passes
//! directly; others write their backward out in candle's ops, which run on any device, or get
//! [`record_with_candle`], which runs that one layer under candle's autograd, so every network
//! can be trained this way, on any device, and gives the same gradients.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use candle_core::{Tensor, TensorId, Var};

use super::Layer;
use crate::replica::buckets::BucketWatch;
use crate::Result;

/// A layer's training forward pass: its output and how to run it backward.
pub struct Recorded {
    /// The output, detached from candle's graph.
    pub output: Tensor,
    /// When the output is a softmax, the logits it was computed from (detached). The backward
    /// pass then takes the gradient of the logits rather than of the output, so a
    /// cross-entropy can be differentiated stably from the logits.
    pub logits: Option<Tensor>,
    /// The backward pass.
    pub backward: Box<dyn Backward>,
}

impl Recorded {
    /// An output without logits.
    pub fn new(output: Tensor, backward: impl Backward + 'static) -> Self {
        Self {
            output,
            logits: None,
            backward: Box::new(backward),
        }
    }
}

/// The backward pass of one recorded forward, run once.
pub trait Backward {
    /// From `dy`, the gradient of the loss with respect to the output (or to the logits, see
    /// [`Recorded::logits`]), adds the gradients of the layer's variables to `grads` and, when
    /// `input_grad`, returns the gradient with respect to the input (`None` otherwise).
    fn backward(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>>;

    /// The input's gradient plus `add`, another branch's gradient of the same input (a
    /// concatenation's branches share their input). The default adds it to
    /// [`Backward::backward`]'s result; a layer whose kernel adds it while writing the
    /// gradient overrides this and [`Backward::adds_in_place`].
    fn backward_adding(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        add: Tensor,
    ) -> Result<Tensor> {
        let dx = self
            .backward(dy, grads, true)?
            .ok_or_else(|| missing_input_grad("a concatenation's branch"))?;
        Ok(dx.add(&add)?)
    }

    /// Whether [`Backward::backward_adding`] adds as it writes the gradient, saving a pass.
    fn adds_in_place(&self) -> bool {
        false
    }

    /// Whether [`Backward::backward`] reads a `dy` that is a range of a larger tensor's
    /// channels (`narrow` on axis 1: a concatenation's gradient, cut into its branches') in
    /// place, so that the caller need not copy the range out first. Any layer takes such a
    /// view (candle's ops do); the ones that say so read it without a copy of their own.
    fn takes_channel_views(&self) -> bool {
        false
    }

    /// Whether [`Backward::backward`] hands `dy` on as the input's gradient unchanged (an
    /// identity, or a ReLU that the layer before absorbed), so that what the layer before
    /// takes is what this one takes.
    fn passes_gradient_on(&self) -> bool {
        false
    }
}

impl<F> Backward for F
where
    F: FnOnce(Tensor, &mut ParamGrads, bool) -> Result<Option<Tensor>>,
{
    fn backward(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        (*self)(dy, grads, input_grad)
    }
}

/// The gradients of the variables, by tensor id, summed over every use of each variable.
#[derive(Debug, Default)]
pub struct ParamGrads {
    grads: HashMap<TensorId, Tensor>,
    /// Told of every gradient added, to hand in gradient buckets during the backward pass.
    watch: Option<BucketWatch>,
}

impl ParamGrads {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `grad` to the gradient of the variable whose tensor is `param`.
    pub fn add(&mut self, param: &Tensor, grad: Tensor) -> Result<()> {
        self.add_id(param.id(), grad)
    }

    fn add_id(&mut self, id: TensorId, grad: Tensor) -> Result<()> {
        match self.grads.entry(id) {
            Entry::Vacant(slot) => {
                slot.insert(grad);
            }
            Entry::Occupied(mut slot) => {
                let sum = slot.get().add(&grad)?;
                slot.insert(sum);
            }
        }
        match &mut self.watch {
            Some(watch) => watch.added(id, &self.grads),
            None => Ok(()),
        }
    }

    /// An empty store whose gradients `watch` follows as they arrive.
    pub(crate) fn watched(watch: BucketWatch) -> Self {
        Self {
            grads: HashMap::new(),
            watch: Some(watch),
        }
    }

    /// The watch given to [`Self::watched`], if any.
    pub(crate) fn take_watch(&mut self) -> Option<BucketWatch> {
        self.watch.take()
    }

    /// Removes and returns the gradient of the variable whose tensor is `param`, if it got one.
    pub fn take(&mut self, param: &Tensor) -> Option<Tensor> {
        self.grads.remove(&param.id())
    }
}

/// Records `layer` by running it alone under candle's autograd: the input becomes a variable,
/// and the backward pass differentiates `sum(output * dy)` (or `sum(logits * dy)`), which
/// gives the input's gradient and every variable's. With `with_logits`, the layer's
/// [`Layer::forward_with_logits`] runs and its logits are kept; otherwise its
/// [`Layer::forward_t`]. This is the default of [`FastPath::forward_recorded`]; it costs a copy of
/// the input, so layers with a kernel record their own backward instead.
pub fn record_with_candle<L: Layer + ?Sized>(
    layer: &L,
    x: &Tensor,
    with_logits: bool,
) -> Result<Recorded> {
    let input = Var::from_tensor(x)?;
    let (output, logits) = if with_logits {
        layer.forward_with_logits(input.as_tensor(), true)?
    } else {
        (layer.forward_t(input.as_tensor(), true)?, None)
    };
    let differentiated = logits.clone().unwrap_or_else(|| output.clone());
    let backward = move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
        // Candle's gradients stay attached to the graph that computed them: `dy` may come from
        // the next layer's autograd and depend on that layer's variables, which this layer's
        // autograd must not differentiate again (their gradients would be counted twice).
        let mut store = differentiated.mul(&dy.detach())?.sum_all()?.backward()?;
        let dx = store.remove(input.as_tensor());
        let ids: Vec<TensorId> = store.get_ids().copied().collect();
        for id in ids {
            if let Some(g) = store.get_id(id) {
                grads.add_id(id, g.detach())?;
            }
        }
        if !input_grad {
            return Ok(None);
        }
        Ok(Some(match dx {
            Some(dx) => dx.detach(),
            // The output does not depend on the input (a constant layer).
            None => input.as_tensor().zeros_like()?,
        }))
    };
    Ok(Recorded {
        output: output.detach(),
        logits: logits.map(|l| l.detach()),
        backward: Box::new(backward),
    })
}

/// A layer that passes its input through: the gradient passes through too.
pub(crate) fn identity(x: &Tensor) -> Recorded {
    Recorded::new(x.clone(), PassThrough)
}

/// An identity's backward pass, which says it hands the gradient on unchanged.
struct PassThrough;

impl Backward for PassThrough {
    fn backward(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        pass_through(dy, grads, input_grad)
    }

    fn passes_gradient_on(&self) -> bool {
        true
    }
}

/// The backward pass of an identity.
pub(crate) fn pass_through(
    dy: Tensor,
    _grads: &mut ParamGrads,
    input_grad: bool,
) -> Result<Option<Tensor>> {
    Ok(input_grad.then_some(dy))
}

/// The error for a backward pass inside `layer` that gave no input gradient when asked for one.
pub(crate) fn missing_input_grad(layer: &str) -> crate::Error {
    crate::Error::invalid(format!(
        "layer `{layer}`: its backward pass returned no input gradient"
    ))
}

#[cfg(test)]
mod tests {
    use crate::layers::{FastPath, RecordRequest};
    use candle_core::Device;

    use super::ParamGrads;
    use crate::layers::{CandleLayer, Layer, LayerSpecExt, Sequential};
    use crate::Result;

    /// Layers recorded under candle's autograd, one after the other, give each variable its
    /// gradient once: the gradient a layer receives is detached from the next layer's graph.
    #[test]
    fn stacked_candle_records_count_each_gradient_once() -> Result<()> {
        let linear = |i, o| CandleLayer::new(move |vb| candle_nn::linear(i, o, vb));
        let net = Sequential::new()
            .add(linear(4, 3).named("first"))
            .add(linear(3, 2).named("second"));
        let (net, store, _) = net.build_network(&Device::Cpu, &[4], 0)?;
        let x = kandle_testing::random::seeded_normal(&[5, 4], 1.0, 1)?;
        let dy = kandle_testing::random::seeded_normal(&[5, 2], 1.0, 2)?;
        let recorded = net.forward_recorded(&x, RecordRequest::output())?;
        let mut ours = ParamGrads::new();
        recorded.backward.backward(dy.clone(), &mut ours, false)?;
        let mut theirs = net.forward_t(&x, true)?.mul(&dy)?.sum_all()?.backward()?;
        for p in store.iter() {
            let (a, b) = (
                ours.take(p.var.as_tensor()),
                theirs.remove(p.var.as_tensor()),
            );
            let (Some(a), Some(b)) = (a, b) else {
                panic!("{}: a gradient is missing", p.name);
            };
            let diff = (a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff <= 1e-5 * scale, "{}: {diff} against {scale}", p.name);
        }
        Ok(())
    }
}
