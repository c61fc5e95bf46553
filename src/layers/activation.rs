//! `Activation`: an element-wise (or, for softmax, per-row) non-linearity with no variables,
//! as a layer of its own or as the `activation` option of `Dense` and `Conv2D`.

use candle_core::{Tensor, D};

use super::{
    identity, missing_input_grad, pass_through, record_with_candle, relu, BuildContext, Built,
    FastPath, Layer, LayerSpec, ParamGrads, RecordRequest, Recorded, ReluRecord,
};
use crate::Result;

/// A non-linearity applied to the whole input.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Activation {
    /// `max(x, 0)`, a NaN staying NaN (as PyTorch's `relu`).
    Relu,
    /// `max(x, slope * x)`, a NaN staying NaN.
    LeakyRelu(f64),
    /// Softmax over the last axis. Cross-entropy losses read the logits before it, so a model
    /// ending in softmax trains as stably as one that outputs logits.
    Softmax,
    /// `1 / (1 + exp(-x))`.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// Gaussian error linear unit (erf form).
    Gelu,
    /// `x * sigmoid(x)`.
    Swish,
    /// The identity.
    Linear,
}

impl Activation {
    /// Applies the function to a tensor (a ReLU of an `f32` CPU tensor on kandle's CPU kernel,
    /// as a layer on the default compute path).
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        self.with_kernels(true).apply(x)
    }

    /// [`Activation::apply`], differentiable by candle's autograd in training (see
    /// [`BuiltActivation::apply_t`]).
    pub(crate) fn apply_t(self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.with_kernels(true).apply_t(x, train)
    }

    /// The activation built for a compute path: on kandle's CPU kernels where `kernels` (and
    /// the tensor suits them), on candle's device-generic ops otherwise.
    pub(crate) fn with_kernels(self, kernels: bool) -> BuiltActivation {
        BuiltActivation {
            activation: self,
            kernels,
        }
    }
}

/// An [`Activation`] built for a compute path: the layer it builds, and the option a `Dense` or
/// a `Conv2D` applies to its own output.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BuiltActivation {
    activation: Activation,
    /// Whether a ReLU may run on kandle's kernel (see [`crate::ComputePath::uses_kernels`]).
    kernels: bool,
}

impl BuiltActivation {
    /// The function of `x`.
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self.activation {
            Activation::Relu => relu(x, self.kernels)?,
            Activation::LeakyRelu(slope) => x.maximum(&(x * slope)?)?,
            Activation::Softmax => candle_nn::ops::softmax_last_dim(x)?,
            Activation::Sigmoid => candle_nn::ops::sigmoid(x)?,
            Activation::Tanh => x.tanh()?,
            Activation::Gelu => x.gelu_erf()?,
            Activation::Swish => x.silu()?,
            Activation::Linear => x.clone(),
        })
    }

    /// [`Self::apply`], differentiable by candle's autograd in training: candle's fused
    /// softmax has no backward pass, so a softmax in training is composed of ops that have one
    /// (a softmax whose logits the loss takes is never differentiated, and keeps the fused
    /// op).
    fn apply_t(self, x: &Tensor, train: bool) -> Result<Tensor> {
        match (self.activation, train) {
            (Activation::Softmax, true) => Ok(candle_nn::ops::softmax(x, candle_core::D::Minus1)?),
            _ => self.apply(x),
        }
    }
}

/// The activation a layer carries as an option (`Dense::new(10).activation(..)`), applied to
/// that layer's own output `y`: the same values, logits and gradients as the separate layer.
impl BuiltActivation {
    /// `y` through the activation (see [`Self::apply_t`]).
    pub(crate) fn after(self, y: Tensor, train: bool) -> Result<Tensor> {
        match self.activation {
            Activation::Linear => Ok(y),
            _ => self.apply_t(&y, train),
        }
    }

    /// `y` through the activation, with `y` as the logits when the activation is a softmax.
    pub(crate) fn after_with_logits(self, y: Tensor) -> Result<(Tensor, Option<Tensor>)> {
        match self.activation {
            Activation::Linear => Ok((y, None)),
            Activation::Softmax => Ok((self.apply(&y)?, Some(y))),
            _ => Ok((self.apply(&y)?, None)),
        }
    }

    /// The recorded activation of the recorded `inner` output: the activation's backward pass
    /// runs first, then `inner`'s. With `with_logits`, a softmax gives `inner`'s output as the
    /// logits (as [`FastPath::forward_recorded`] does for the separate layer, asked for them).
    pub(crate) fn after_recorded(self, inner: Recorded, with_logits: bool) -> Result<Recorded> {
        if self.activation == Activation::Linear {
            return Ok(inner);
        }
        let request = RecordRequest {
            logits: with_logits,
            input_grad: true,
        };
        let outer = self.forward_recorded(&inner.output, request)?;
        let (first, then) = (outer.backward, inner.backward);
        let kind = self.activation.kind();
        Ok(Recorded {
            output: outer.output,
            logits: outer.logits,
            backward: Box::new(
                move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                    let dz = first
                        .backward(dy, grads, true)?
                        .ok_or_else(|| missing_input_grad(kind))?;
                    then.backward(dz, grads, input_grad)
                },
            ),
        })
    }
}

impl LayerSpec for Activation {
    fn kind(&self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::LeakyRelu(_) => "leaky_relu",
            Activation::Softmax => "softmax",
            Activation::Sigmoid => "sigmoid",
            Activation::Tanh => "tanh",
            Activation::Gelu => "gelu",
            Activation::Swish => "swish",
            Activation::Linear => "linear",
        }
    }

    fn class_name(&self) -> &'static str {
        "Activation"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let layer = self.with_kernels(ctx.compute_path().uses_kernels());
        Ok(Built::fast(layer, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

/// The recipe used directly as a layer, without building it, takes the default path.
impl Layer for Activation {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.with_kernels(true).forward_t(x, train)
    }

    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        self.with_kernels(true).forward_with_logits(x, train)
    }
}

impl Layer for BuiltActivation {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.apply_t(x, train)
    }

    fn forward_with_logits(&self, x: &Tensor, _train: bool) -> Result<(Tensor, Option<Tensor>)> {
        let logits = (self.activation == Activation::Softmax).then(|| x.clone());
        Ok((self.apply(x)?, logits))
    }
}

impl FastPath for BuiltActivation {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        match self.activation {
            // The backward pass takes the gradient of the logits, which pass through unchanged.
            Activation::Softmax if request.logits => Ok(Recorded {
                output: self.apply(x)?,
                logits: Some(x.clone()),
                backward: Box::new(pass_through),
            }),
            Activation::Linear => Ok(identity(x)),
            Activation::Relu => {
                let (y, relu) = ReluRecord::relu(x, self.kernels)?;
                Ok(Recorded::new(
                    y,
                    move |dy: Tensor, _: &mut ParamGrads, input_grad: bool| {
                        Ok(if input_grad {
                            Some(relu.backward(&dy)?)
                        } else {
                            None
                        })
                    },
                ))
            }
            _ => record_with_candle(self, x, false),
        }
    }

    fn is_relu(&self) -> bool {
        self.activation == Activation::Relu
    }
}

/// Numerically stable `log(softmax(x))` over the last axis.
pub(crate) fn log_softmax(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(x, D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{BatchNormalization, Conv2D, Dense, Padding, Sequential, SequentialNet};
    use crate::params::ParamStore;
    use crate::ComputePath;
    use candle_core::{Device, Var};

    #[test]
    fn values() -> Result<()> {
        let x = Tensor::new(&[-2f32, 0., 3.], &Device::Cpu)?;
        assert_eq!(
            Activation::Relu.apply(&x)?.to_vec1::<f32>()?,
            vec![0., 0., 3.]
        );
        assert_eq!(
            Activation::LeakyRelu(0.5).apply(&x)?.to_vec1::<f32>()?,
            vec![-1., 0., 3.]
        );
        let s = Activation::Softmax.apply(&x)?.to_vec1::<f32>()?;
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[2] > s[1] && s[1] > s[0]);
        let big = Tensor::new(&[[1000f32, 0.]], &Device::Cpu)?;
        let ls = log_softmax(&big)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(ls.iter().all(|v| v.is_finite()) && (ls[1] + 1000.).abs() < 1e-3);
        Ok(())
    }

    /// A forward and backward pass: the output, the logits, and the gradients of the
    /// trainable variables (by name) and of the input.
    struct Pass {
        output: Tensor,
        logits: Option<Tensor>,
        grads: Vec<(String, Tensor)>,
        input: Tensor,
    }

    fn build(
        net: &Sequential,
        shape: &[usize],
        path: ComputePath,
    ) -> Result<(SequentialNet, ParamStore)> {
        let ctx = BuildContext::new(&Device::Cpu, 3).with_compute_path(path);
        let (net, store, _) = net.build_in(ctx, shape)?;
        Ok((net, store))
    }

    fn missing(what: &str) -> crate::Error {
        crate::Error::invalid(format!("no gradient for {what}"))
    }

    /// Through the recorded backward pass, with `dy` the gradient of the logits when the
    /// network gives some (and `with_logits`), of the output otherwise.
    fn recorded(
        (net, store): &(SequentialNet, ParamStore),
        x: &Tensor,
        dy: &Tensor,
        with_logits: bool,
    ) -> Result<Pass> {
        let request = RecordRequest {
            logits: with_logits,
            input_grad: true,
        };
        let r = net.forward_recorded(x, request)?;
        let mut grads = ParamGrads::new();
        let input = r.backward.backward(dy.clone(), &mut grads, true)?;
        let grads = store
            .iter()
            .filter(|p| p.trainable)
            .map(|p| {
                let g = grads
                    .take(p.var.as_tensor())
                    .ok_or_else(|| missing(&p.name))?;
                Ok((p.name.clone(), g))
            })
            .collect::<Result<_>>()?;
        Ok(Pass {
            output: r.output,
            logits: r.logits,
            grads,
            input: input.ok_or_else(|| missing("the input"))?,
        })
    }

    /// [`recorded`] through candle's autograd over the whole network.
    fn autograd(
        (net, store): &(SequentialNet, ParamStore),
        x: &Tensor,
        dy: &Tensor,
        with_logits: bool,
    ) -> Result<Pass> {
        let x = Var::from_tensor(x)?;
        let (output, logits) = if with_logits {
            net.forward_with_logits(x.as_tensor(), true)?
        } else {
            (net.forward_t(x.as_tensor(), true)?, None)
        };
        let head = logits.as_ref().unwrap_or(&output);
        let mut all = head.mul(dy)?.sum_all()?.backward()?;
        let grads = store
            .iter()
            .filter(|p| p.trainable)
            .map(|p| {
                let g = all
                    .remove(p.var.as_tensor())
                    .ok_or_else(|| missing(&p.name))?;
                Ok((p.name.clone(), g))
            })
            .collect::<Result<_>>()?;
        Ok(Pass {
            output: output.detach(),
            logits: logits.map(|l| l.detach()),
            input: all
                .remove(x.as_tensor())
                .ok_or_else(|| missing("the input"))?,
            grads,
        })
    }

    fn assert_close(what: &str, a: &Tensor, b: &Tensor) -> Result<()> {
        assert_eq!(a.dims(), b.dims(), "{what}");
        let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
        assert!(
            diff / scale < 1e-5,
            "{what}: relative difference {}",
            diff / scale
        );
        Ok(())
    }

    fn assert_same_pass(what: &str, a: &Pass, b: &Pass) -> Result<()> {
        assert_close(&format!("{what}: output"), &a.output, &b.output)?;
        match (&a.logits, &b.logits) {
            (Some(la), Some(lb)) => assert_close(&format!("{what}: logits"), la, lb)?,
            (None, None) => {}
            _ => panic!("{what}: logits in one pass only"),
        }
        assert_eq!(a.grads.len(), b.grads.len(), "{what}");
        for ((name, ga), (other, gb)) in a.grads.iter().zip(&b.grads) {
            assert_eq!(name, other, "{what}");
            assert_close(&format!("{what}: {name}"), ga, gb)?;
        }
        assert_close(&format!("{what}: input gradient"), &a.input, &b.input)
    }

    /// `with` (a layer carrying the activation) computes what `without` (the layer, then the
    /// activation layer) computes, with the same variables: forward, logits, recorded backward
    /// and candle's autograd, with and without the kernels.
    fn check_option(
        with: Sequential,
        without: Sequential,
        x: &Tensor,
        softmax: bool,
    ) -> Result<()> {
        let shape = &x.dims()[1..];
        for path in [ComputePath::Auto, ComputePath::DeviceGeneric] {
            let fused = build(&with, shape, path)?;
            let separate = build(&without, shape, path)?;
            let names =
                |store: &ParamStore| store.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
            assert_eq!(names(&fused.1), names(&separate.1));
            for train in [true, false] {
                let (a, la) = fused.0.forward_with_logits(x, train)?;
                let (b, lb) = separate.0.forward_with_logits(x, train)?;
                assert_close("forward", &a, &b)?;
                let (a, b) = (
                    fused.0.forward_t(x, train)?,
                    separate.0.forward_t(x, train)?,
                );
                assert_close("forward_t", &a, &b)?;
                assert_eq!(la.is_some(), softmax);
                if let (Some(la), Some(lb)) = (la, lb) {
                    assert_close("logits", &la, &lb)?;
                }
            }
            let out = fused.0.forward_t(x, true)?;
            let dy = kandle_testing::random::seeded_normal(out.dims(), 1.0, 1)?
                .to_device(out.device())?;
            // Candle's softmax has no backward pass of its own: a softmax is differentiated
            // at its logits only.
            let logits_choices: &[bool] = if softmax { &[true] } else { &[false, true] };
            for &with_logits in logits_choices {
                let what = format!("{path}, logits {with_logits}");
                let ours = recorded(&fused, x, &dy, with_logits)?;
                assert_eq!(ours.logits.is_some(), softmax && with_logits, "{what}");
                assert_same_pass(
                    &format!("{what}, recorded vs autograd"),
                    &ours,
                    &autograd(&fused, x, &dy, with_logits)?,
                )?;
                assert_same_pass(
                    &format!("{what}, recorded vs separate layers"),
                    &ours,
                    &recorded(&separate, x, &dy, with_logits)?,
                )?;
            }
        }
        Ok(())
    }

    #[test]
    fn dense_activation_option_is_dense_then_activation() -> Result<()> {
        let x = kandle_testing::random::seeded_normal(&[5, 6], 1.0, 2)?;
        for activation in [Activation::Relu, Activation::Softmax, Activation::Sigmoid] {
            let with = Sequential::new()
                .add(Dense::new(3))
                .add(Dense::new(4).activation(activation));
            let without = Sequential::new()
                .add(Dense::new(3))
                .add(Dense::new(4))
                .add(activation);
            check_option(with, without, &x, activation == Activation::Softmax)?;
        }
        Ok(())
    }

    #[test]
    fn conv_relu_option_is_conv_then_relu() -> Result<()> {
        let x = kandle_testing::random::seeded_normal(&[3, 2, 6, 6], 1.0, 3)?;
        let conv = || Conv2D::new(4, 3).padding(Padding::Same);
        let with = Sequential::new()
            .add(conv().activation(Activation::Relu))
            .add(BatchNormalization::new())
            .add(Conv2D::new(3, 3).stride(2).activation(Activation::Relu));
        let without = Sequential::new()
            .add(conv())
            .add(Activation::Relu)
            .add(BatchNormalization::new())
            .add(Conv2D::new(3, 3).stride(2))
            .add(Activation::Relu);
        check_option(with, without, &x, false)?;
        // A convolution with a softmax over its last axis gives its logits too.
        let with = Sequential::new().add(conv().activation(Activation::Softmax));
        let without = Sequential::new().add(conv()).add(Activation::Softmax);
        check_option(with, without, &x, true)
    }
}
