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
mod add;
mod batch_norm;
mod branches;
mod candle_adapter;
mod channel_part;
mod concat;
mod conv2d;
mod dense;
mod dropout;
mod embedding;
mod fast_path;
mod flatten;
mod fold;
mod identity;
mod pooling;
mod preprocessing;
mod random_stream;
mod recorded;
mod relu;
mod sequential;
mod stages;
mod summary;
mod window;
mod wrappers;
mod zero_padding;

pub(crate) use crate::kernels::concat::ChannelSlot;
pub(crate) use activation::log_softmax as activation_log_softmax;
pub use activation::Activation;
pub(crate) use activation::BuiltActivation;
pub use add::Add;
pub use batch_norm::BatchNormalization;
#[cfg(test)]
pub(crate) use branches::{
    assert_param_grads_match, assert_recorded_matches_autograd, relative_difference,
};
pub use candle_adapter::CandleLayer;
pub(crate) use channel_part::ChannelPart;
pub use concat::Concat;
pub(crate) use concat::{channel_part, join_channels};
pub use conv2d::Conv2D;
pub use dense::Dense;
pub use dropout::Dropout;
pub use embedding::Embedding;
use fast_path::Foreign;
pub(crate) use fast_path::{record_into_by_copy, FastPath, RecordRequest};
pub use flatten::Flatten;
pub(crate) use fold::ChannelAffine;
pub(crate) use fold::{run_layers, run_layers_into, run_layers_into_part, Pass};
pub use identity::Identity;
pub use pooling::{
    Average, AveragePooling2D, GlobalAveragePooling2D, Max, MaxPooling2D, Pooling2D, Reduction,
};
pub use preprocessing::{
    FillMode, Normalization, RandomCrop, RandomFlip, RandomResizedCrop, RandomRotation, RandomZoom,
    Rescaling,
};
pub(crate) use recorded::{identity, missing_input_grad, pass_through};
pub(crate) use recorded::{record_with_candle, Backward, ParamGrads, Recorded};
pub(crate) use relu::{relu, ReluRecord};
pub use sequential::{Sequential, SequentialNet};
pub(crate) use stages::check_starts as check_stage_starts;
pub use stages::StagePlacement;
pub use summary::{StageSummary, Summary, SummaryRow};
pub use window::Padding;
pub use wrappers::{InferenceMode, LayerSpecExt, Named, Trainable, WithDTypePolicy};
pub use zero_padding::ZeroPadding2D;

use candle_core::Tensor;

pub use crate::params::BuildContext;
use crate::Result;

/// A built layer: variables on a device and the computation that uses them.
///
/// A layer author writes [`Layer::forward_t`] (and, for a softmax output,
/// [`Layer::forward_with_logits`]); the layer then trains under every strategy. On the CPU a
/// replica trains through kandle's recorded backward pass, which runs such a layer alone under
/// candle's autograd. kandle's own layers also fuse with their neighbours and record their
/// kernels' backward passes; that machinery is the crate's own and not part of this trait.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::layers::{BuildContext, Built, Layer, LayerSpec};
///
/// /// `y = 2x`.
/// struct Double;
///
/// impl Layer for Double {
///     fn forward_t(&self, x: &Tensor, _train: bool) -> kandle::Result<Tensor> {
///         Ok((x * 2.0)?)
///     }
/// }
///
/// #[derive(Clone)]
/// struct DoubleSpec;
///
/// impl LayerSpec for DoubleSpec {
///     fn kind(&self) -> &'static str {
///         "double"
///     }
///     fn build(&self, _: &mut BuildContext, input_shape: &[usize]) -> kandle::Result<Built> {
///         Ok(Built::leaf(Double, input_shape.to_vec()))
///     }
///     fn clone_spec(&self) -> Box<dyn LayerSpec> {
///         Box::new(self.clone())
///     }
/// }
///
/// let built = DoubleSpec.build(&mut BuildContext::new(&Device::Cpu, 0), &[3])?;
/// let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
/// assert_eq!(built.layer().forward_t(&x, false)?.to_vec2::<f32>()?, [[2., 4., 6.]]);
/// # Ok::<(), kandle::Error>(())
/// ```
pub trait Layer: Send + Sync {
    /// Runs the layer. `train` selects training behaviour (batch statistics, dropout).
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor>;

    /// Runs the layer and, when its output is a softmax of some logits, also returns those
    /// logits, so that cross-entropy can be computed stably from them. The default returns
    /// `None` for the logits.
    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        Ok((self.forward_t(x, train)?, None))
    }
}

impl<L: Layer + ?Sized> Layer for Box<L> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        (**self).forward_t(x, train)
    }
    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        (**self).forward_with_logits(x, train)
    }
}

/// What building a recipe produces: the runnable layer, its output shape and, for composites,
/// the summary rows of its children.
pub struct Built {
    /// The runnable layer, with kandle's fast path where it is one of kandle's own.
    layer: Box<dyn FastPath>,
    /// The output shape, without the batch dimension.
    pub output_shape: Vec<usize>,
    /// For composites: one row per direct child, for [`Summary`].
    pub children: Vec<SummaryRow>,
}

impl Built {
    /// A layer with no children.
    pub fn leaf(layer: impl Layer + 'static, output_shape: Vec<usize>) -> Self {
        Self::composite(layer, output_shape, Vec::new())
    }

    /// A layer made of others, whose summary rows are `children`.
    pub fn composite(
        layer: impl Layer + 'static,
        output_shape: Vec<usize>,
        children: Vec<SummaryRow>,
    ) -> Self {
        Self::fast(Foreign(layer), output_shape, children)
    }

    /// One of kandle's own layers, with its fast path.
    pub(crate) fn fast(
        layer: impl FastPath + 'static,
        output_shape: Vec<usize>,
        children: Vec<SummaryRow>,
    ) -> Self {
        Self {
            layer: Box::new(layer),
            output_shape,
            children,
        }
    }

    /// The layer.
    pub fn layer(&self) -> &dyn Layer {
        self.layer.as_layer()
    }

    /// The layer, owned.
    pub fn into_layer(self) -> Box<dyn Layer> {
        self.layer.into_layer()
    }

    /// The layer with its fast path, owned.
    pub(crate) fn into_fast_path(self) -> Box<dyn FastPath> {
        self.layer
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

/// A child of a composite layer, built in a scope named after it.
pub(crate) struct BuiltChild {
    /// The child, with its fast path.
    pub(crate) layer: Box<dyn FastPath>,
    /// Its output shape, without the batch axis.
    pub(crate) output_shape: Vec<usize>,
    /// Its summary row, with its own children's.
    pub(crate) row: SummaryRow,
    /// Whether any of its variables trains: a child that does not, with none below it that
    /// does, needs no backward pass.
    pub(crate) trains: bool,
}

/// Builds `spec` for `input_shape` in the scope `name` of `ctx`, with its summary row.
pub(crate) fn build_child(
    ctx: &mut BuildContext,
    spec: &dyn LayerSpec,
    name: &str,
    input_shape: &[usize],
) -> Result<BuiltChild> {
    let built = ctx.scoped(name, |ctx| spec.build(ctx, input_shape))?;
    let (trainable, non_trainable) = ctx.count_in(name);
    let row = SummaryRow {
        name: name.to_string(),
        kind: spec.kind().to_string(),
        class_name: spec.class_name().to_string(),
        output_shape: built.output_shape.clone(),
        trainable,
        non_trainable,
        children: built.children,
        connected_to: Vec::new(),
        more_output_shapes: Vec::new(),
    };
    Ok(BuiltChild {
        layer: built.layer,
        output_shape: built.output_shape,
        trains: row.trainable > 0,
        row,
    })
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
pub(crate) mod nan_tests;
#[cfg(test)]
mod tests;
