//! Layers: recipes that are declared without input sizes and built lazily for an input shape.
//!
//! Two traits split what Keras keeps in one class:
//! - a [`LayerSpec`] is the recipe (`Conv2D::new(32, 3)`): `Clone`, device-free, cheap;
//! - building it with a [`BuildContext`] for an input shape creates its variables on a device
//!   and returns a [`Layer`], the thing that runs `forward_t(x, train)`.
//!
//! Shapes exclude the batch dimension, as in Keras, and images are `(channels, height, width)`
//! (Candle's NCHW layout). A strategy builds the same recipe once per replica, which is how
//! replicas get identical, identically named variables.
//!
//! Layers with a CPU kernel (convolution, batch normalisation, pooling) call it for `f32` CPU
//! tensors and compose candle's device-generic ops otherwise; a layer built in a context for
//! [`ComputePath::DeviceGeneric`](crate::ComputePath::DeviceGeneric) never calls a kernel, so
//! the CPU runs the ops a GPU runs.
//!
//! ```
//! use kandle::layers::{Activation, Conv2D, Dense, Flatten, MaxPooling2D, Padding, Sequential};
//!
//! let net = Sequential::new()
//!     .add(Conv2D::new(16, 3).padding(Padding::Same))
//!     .add(Activation::Relu)
//!     .add(MaxPooling2D::new(2))
//!     .add(Flatten)
//!     .add(Dense::new(10))
//!     .add(Activation::Softmax);
//! let summary = net.summary(&[1, 8, 8])?;
//! assert_eq!(summary.trainable, 16 * 9 + 16 + 16 * 4 * 4 * 10 + 10);
//! # Ok::<(), kandle::Error>(())
//! ```

mod activation;
mod batch_norm;
mod candle_adapter;
mod concat;
mod conv2d;
mod dense;
#[cfg(test)]
mod device_generic_tests;
mod dropout;
mod flatten;
mod fold;
#[cfg(test)]
mod kernel_path_tests;
mod pooling;
mod recorded;
mod sequential;
mod summary;
mod window;
mod wrappers;

#[doc(hidden)]
pub use crate::kernels::concat::ChannelSlot;
pub(crate) use activation::log_softmax as activation_log_softmax;
pub use activation::Activation;
pub use batch_norm::BatchNormalization;
pub use candle_adapter::CandleLayer;
pub use concat::Concat;
pub use conv2d::Conv2D;
pub use dense::Dense;
pub use dropout::Dropout;
pub use flatten::Flatten;
#[doc(hidden)]
pub use fold::ChannelAffine;
pub(crate) use fold::{run_layers, run_layers_into};
pub use pooling::{AveragePooling2D, GlobalAveragePooling2D, MaxPooling2D};
pub(crate) use recorded::{identity, missing_input_grad, pass_through};
// The recorded backward pass is kandle's own machinery: public only because `Layer`'s defaulted
// methods name it, and hidden from the documentation.
#[doc(hidden)]
pub use recorded::{record_with_candle, Backward, ParamGrads, Recorded};
pub use sequential::{Sequential, SequentialNet};
pub use summary::{Summary, SummaryRow};
pub use window::Padding;
pub use wrappers::{LayerSpecExt, Named, Trainable};

use candle_core::Tensor;

pub use crate::params::BuildContext;
use crate::Result;

/// A built layer: variables on a device and the computation that uses them.
pub trait Layer: Send + Sync {
    /// Runs the layer. `train` selects training behaviour (batch statistics, dropout).
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor>;

    /// Runs the layer and, when its output is a softmax of some logits, also returns those
    /// logits, so that cross-entropy can be computed stably from them. The default returns
    /// `None` for the logits.
    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        Ok((self.forward_t(x, train)?, None))
    }

    #[doc(hidden)]
    /// The training forward pass, recorded for kandle's own backward pass (see [`Recorded`]).
    /// The output is `forward_t(x, true)`'s, without logits. The default runs this layer alone
    /// under candle's autograd ([`record_with_candle`]); layers with CPU kernels record their
    /// kernels' backward passes instead.
    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
        record_with_candle(self, x, false)
    }

    #[doc(hidden)]
    /// [`Self::forward_recorded`] for the last layer of a network, which may also return the
    /// logits of a softmax output (as [`Self::forward_with_logits`] does); the backward pass
    /// then takes the gradient of the logits. The default keeps the logits the layer gives
    /// through candle's autograd.
    fn forward_recorded_with_logits(&self, x: &Tensor) -> Result<Recorded> {
        record_with_candle(self, x, true)
    }

    #[doc(hidden)]
    /// Whether the layer is exactly `max(x, 0)`, which the layer before it may absorb.
    fn is_relu(&self) -> bool {
        false
    }

    #[doc(hidden)]
    /// Asks the layer to apply `max(y, 0)` to its own output from now on, because a ReLU
    /// follows it; returns whether it will (the ReLU is then skipped). The default declines.
    fn fuse_relu(&mut self) -> bool {
        false
    }

    #[doc(hidden)]
    /// In inference, the per-channel affine map (and ReLU) this layer applies, when it is one
    /// that the layer before it may fold into its own output (a BatchNorm with its running
    /// statistics is); `like` is the input of the layer before, for its device and type.
    /// `None` by default.
    fn inference_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        let _ = like;
        Ok(None)
    }

    #[doc(hidden)]
    /// This layer's inference output with `affine` applied to it, computed at once, or `None`
    /// when the layer cannot fold it in (the default).
    fn forward_then_affine(&self, x: &Tensor, affine: &ChannelAffine) -> Result<Option<Tensor>> {
        let _ = (x, affine);
        Ok(None)
    }

    #[doc(hidden)]
    /// Writes this layer's inference output, with `affine` (if any) applied to it, straight
    /// into `slot`, its channels of a concatenation's output, and returns `true`; or returns
    /// `false` having written nothing, when it cannot (the default), and the caller copies
    /// the output [`Self::forward_t`] gives.
    fn forward_into(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
        slot: &mut ChannelSlot<'_>,
    ) -> Result<bool> {
        let _ = (x, affine, slot);
        Ok(false)
    }

    #[doc(hidden)]
    /// Whether, in inference, the layer hands its input on unchanged (a dropout, a ReLU that
    /// the layer before absorbed), so that the layer before it gives the stack's output.
    /// `false` by default.
    fn passes_through(&self) -> bool {
        false
    }
}

impl<L: Layer + ?Sized> Layer for Box<L> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        (**self).forward_t(x, train)
    }
    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        (**self).forward_with_logits(x, train)
    }
    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
        (**self).forward_recorded(x)
    }
    fn forward_recorded_with_logits(&self, x: &Tensor) -> Result<Recorded> {
        (**self).forward_recorded_with_logits(x)
    }
    fn is_relu(&self) -> bool {
        (**self).is_relu()
    }
    fn fuse_relu(&mut self) -> bool {
        (**self).fuse_relu()
    }
    fn inference_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        (**self).inference_affine(like)
    }
    fn forward_then_affine(&self, x: &Tensor, affine: &ChannelAffine) -> Result<Option<Tensor>> {
        (**self).forward_then_affine(x, affine)
    }
    fn forward_into(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
        slot: &mut ChannelSlot<'_>,
    ) -> Result<bool> {
        (**self).forward_into(x, affine, slot)
    }
    fn passes_through(&self) -> bool {
        (**self).passes_through()
    }
}

/// What building a recipe produces.
pub struct Built {
    /// The runnable layer.
    pub layer: Box<dyn Layer>,
    /// The output shape, without the batch dimension.
    pub output_shape: Vec<usize>,
    /// For composites: one row per direct child, for [`Summary`].
    pub children: Vec<SummaryRow>,
}

impl Built {
    /// A leaf layer with no children.
    pub fn leaf(layer: impl Layer + 'static, output_shape: Vec<usize>) -> Self {
        Self {
            layer: Box::new(layer),
            output_shape,
            children: Vec::new(),
        }
    }
}

/// A layer recipe: declared without input sizes, built for an input shape.
pub trait LayerSpec: Send + Sync + 'static {
    /// The kind, used for automatic names (`conv2d` gives `conv2d_1`, `conv2d_2`, ...). Names
    /// are part of checkpoints, so a layer's kind never changes.
    fn kind(&self) -> &'static str;

    /// The class name the summary prints beside the layer's name, as Keras does
    /// (`conv2d_1 (Conv2D)`). The default is the name of the implementing Rust type, without
    /// its module path or generic parameters (`MyBlock` for `my_crate::MyBlock<T>`).
    fn class_name(&self) -> &'static str {
        short_type_name(std::any::type_name::<Self>())
    }

    /// Creates the variables in `ctx` and returns the layer for inputs of `input_shape`
    /// (without the batch dimension). A shape the layer cannot take is an [`crate::Error::Shape`]
    /// naming `ctx.path()`.
    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built>;

    /// A boxed copy of the recipe.
    fn clone_spec(&self) -> Box<dyn LayerSpec>;

    /// The name given by the user, if any.
    fn name(&self) -> Option<&str> {
        None
    }
}

impl Clone for Box<dyn LayerSpec> {
    fn clone(&self) -> Self {
        self.clone_spec()
    }
}

impl std::fmt::Debug for dyn LayerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name().unwrap_or(self.kind()))
    }
}

/// `MyBlock` for `my_crate::blocks::MyBlock<f32>`: a type name without its path or generic
/// parameters.
fn short_type_name(full: &'static str) -> &'static str {
    let bare = full.split('<').next().unwrap_or(full);
    bare.rsplit("::").next().unwrap_or(bare)
}

/// Builds a list of child recipes in scopes named after them (the user's name, or `kind_N`
/// numbered per kind from 1), feeding each child's output shape to the next when `chain`.
pub(crate) fn child_names(children: &[Box<dyn LayerSpec>]) -> Vec<String> {
    let mut counts = std::collections::HashMap::<&str, usize>::new();
    children
        .iter()
        .map(|c| match c.name() {
            Some(n) => n.to_string(),
            None => {
                let n = counts.entry(c.kind()).or_insert(0);
                *n += 1;
                format!("{}_{}", c.kind(), n)
            }
        })
        .collect()
}

/// The shape error for the layer being built in `ctx`.
pub(crate) fn shape_error(ctx: &BuildContext, expected: &str, got: &[usize]) -> crate::Error {
    crate::Error::Shape {
        layer: ctx.path(),
        expected: expected.to_string(),
        got: crate::error::shape_with_batch(got),
    }
}

/// Checks at run time that `x` is `(batch, expected...)`, naming `layer` otherwise.
pub(crate) fn check_input(layer: &str, x: &Tensor, expected: &[usize]) -> Result<()> {
    let dims = x.dims();
    if dims.len() != expected.len() + 1 || &dims[1..] != expected {
        return Err(crate::Error::Shape {
            layer: layer.to_string(),
            expected: crate::error::shape_with_batch(expected),
            got: format!("{dims:?}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct MyBlock<T>(std::marker::PhantomData<T>);

    impl<T: Send + Sync + Clone + 'static> LayerSpec for MyBlock<T> {
        fn kind(&self) -> &'static str {
            "my_block"
        }
        fn build(&self, _: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
            Ok(Built::leaf(Flatten, input_shape.to_vec()))
        }
        fn clone_spec(&self) -> Box<dyn LayerSpec> {
            Box::new(self.clone())
        }
    }

    #[test]
    fn class_names() {
        assert_eq!(short_type_name("a::b::C<d::E<f::G>>"), "C");
        assert_eq!(short_type_name("Plain"), "Plain");
        let user = MyBlock::<Vec<f32>>(std::marker::PhantomData);
        assert_eq!(user.class_name(), "MyBlock");
        assert_eq!(user.clone().boxed().class_name(), "MyBlock");
        assert_eq!(user.named("block").class_name(), "MyBlock");
        let specs: Vec<(Box<dyn LayerSpec>, &str)> = vec![
            (Conv2D::new(1, 1).boxed(), "Conv2D"),
            (BatchNormalization::new().boxed(), "BatchNormalization"),
            (MaxPooling2D::new(2).boxed(), "MaxPooling2D"),
            (AveragePooling2D::new(2).boxed(), "AveragePooling2D"),
            (GlobalAveragePooling2D.boxed(), "GlobalAveragePooling2D"),
            (Dense::new(1).boxed(), "Dense"),
            (Activation::Relu.boxed(), "Activation"),
            (Activation::Softmax.trainable(false).boxed(), "Activation"),
            (Concat::new([Flatten]).boxed(), "Concatenate"),
            (Flatten.boxed(), "Flatten"),
            (Dropout::new(0.5).boxed(), "Dropout"),
            (Sequential::new().boxed(), "Sequential"),
            (
                CandleLayer::new(|vb| candle_nn::linear(1, 1, vb)).boxed(),
                "CandleLayer",
            ),
        ];
        for (spec, class) in specs {
            assert_eq!(spec.class_name(), class, "{}", spec.kind());
        }
    }
}
