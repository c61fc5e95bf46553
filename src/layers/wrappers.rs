//! Wrappers that change how a recipe is named, trained or computed: `.named("stem")`,
//! `.trainable(false)` (freezing, for transfer learning), `.inference_mode()` (Keras's
//! `training=False` at the call: the layer runs as in inference while the model trains, frozen
//! or not) and `.dtype_policy(...)` (a layer's own mixed-precision policy).

use super::{BuildContext, Built, LayerSpec};
use crate::{DTypePolicy, Result};

/// A recipe with a user-chosen name, which becomes its variables' prefix.
#[derive(Debug, Clone)]
pub struct Named<L> {
    inner: L,
    name: String,
}

impl<L: LayerSpec + Clone> LayerSpec for Named<L> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn class_name(&self) -> &'static str {
        self.inner.class_name()
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        self.inner.build(ctx, input_shape)
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }

    fn name(&self) -> Option<&str> {
        Some(&self.name)
    }
}

/// A recipe whose variables are trainable or frozen. Frozen variables are left out of the
/// optimizer, get no gradient and count as non-trainable in the summary; a frozen
/// `BatchNormalization` always uses its moving statistics and leaves them as they are, as in
/// Keras. [`Model::set_trainable`](crate::Model::set_trainable) overrides it by layer name on a
/// compiled model.
#[derive(Debug, Clone)]
pub struct Trainable<L> {
    inner: L,
    trainable: bool,
}

impl<L: LayerSpec + Clone> LayerSpec for Trainable<L> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn class_name(&self) -> &'static str {
        self.inner.class_name()
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        ctx.with_trainable(self.trainable, |ctx| self.inner.build(ctx, input_shape))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }

    fn name(&self) -> Option<&str> {
        self.inner.name()
    }
}

/// A recipe with its own [`DTypePolicy`], as Keras's `dtype=` layer argument: e.g. a last
/// dense layer kept in `float32` inside a `mixed_float16` model. It decides the dtype the
/// layer computes in on the device-generic path; kandle's CPU kernels stay `float32`.
#[derive(Debug, Clone)]
pub struct WithDTypePolicy<L> {
    inner: L,
    policy: DTypePolicy,
}

impl<L: LayerSpec + Clone> LayerSpec for WithDTypePolicy<L> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn class_name(&self) -> &'static str {
        self.inner.class_name()
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let dtype = self
            .policy
            .compute_dtype_on(ctx.compute_path(), &ctx.device().clone());
        ctx.with_dtype(dtype, |ctx| self.inner.build(ctx, input_shape))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }

    fn name(&self) -> Option<&str> {
        self.inner.name()
    }
}

/// A recipe whose layers run as in inference even while the model trains, as Keras's
/// `base_model(x, training=False)`: its `BatchNormalization` layers normalise with their moving
/// statistics and never update them, and its `Dropout` layers drop nothing. Unlike
/// [`Trainable`], its variables still train; in the transfer-learning recipe a pretrained base
/// keeps its statistics through fine-tuning, after it is unfrozen.
#[derive(Debug, Clone)]
pub struct InferenceMode<L> {
    inner: L,
}

impl<L: LayerSpec + Clone> LayerSpec for InferenceMode<L> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn class_name(&self) -> &'static str {
        self.inner.class_name()
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        ctx.with_inference(true, |ctx| self.inner.build(ctx, input_shape))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }

    fn name(&self) -> Option<&str> {
        self.inner.name()
    }
}

/// Builder methods available on every recipe.
pub trait LayerSpecExt: LayerSpec + Clone + Sized {
    /// Names the layer; its variables become `<name>.weight` and so on.
    fn named(self, name: impl Into<String>) -> Named<Self> {
        Named {
            inner: self,
            name: name.into(),
        }
    }

    /// Sets whether the layer's variables are trained (`false` freezes them).
    fn trainable(self, trainable: bool) -> Trainable<Self> {
        Trainable {
            inner: self,
            trainable,
        }
    }

    /// Gives the layer its own mixed-precision policy (see [`WithDTypePolicy`]).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use kandle::layers::{BuildContext, Dense, LayerSpec, LayerSpecExt};
    /// use kandle::{ComputePath, DTypePolicy};
    ///
    /// // A mixed_float16 network's context on the device-generic path (a GPU's)...
    /// let mut ctx = BuildContext::new(&Device::Cpu, 0)
    ///     .with_compute_path(ComputePath::DeviceGeneric)
    ///     .with_compute_dtype(DType::F16);
    /// // ...and a last layer kept in float32.
    /// let head = Dense::new(3).dtype_policy(DTypePolicy::float32()).build(&mut ctx, &[4])?;
    /// let x = Tensor::ones((2, 4), DType::F16, &Device::Cpu)?;
    /// assert_eq!(head.layer().forward_t(&x, false)?.dtype(), DType::F32);
    /// # Ok::<(), kandle::Error>(())
    /// ```
    fn dtype_policy(self, policy: DTypePolicy) -> WithDTypePolicy<Self> {
        WithDTypePolicy {
            inner: self,
            policy,
        }
    }

    /// Runs the layer as in inference even while the model trains (Keras's `training=False`):
    /// see [`InferenceMode`].
    ///
    /// ```
    /// use kandle::layers::{BatchNormalization, Conv2D, LayerSpecExt, Sequential};
    ///
    /// let base = Sequential::new()
    ///     .add(Conv2D::new(4, 3))
    ///     .add(BatchNormalization::new())
    ///     .inference_mode();
    /// let summary = Sequential::new().add(base).summary(&[1, 8, 8])?;
    /// // The convolution and BatchNorm's scale and offset still train.
    /// assert_eq!(summary.trainable, 4 * 9 + 4 + 2 * 4);
    /// # Ok::<(), kandle::Error>(())
    /// ```
    fn inference_mode(self) -> InferenceMode<Self> {
        InferenceMode { inner: self }
    }

    /// The recipe as a trait object.
    fn boxed(self) -> Box<dyn LayerSpec> {
        Box::new(self)
    }
}

impl<L: LayerSpec + Clone> LayerSpecExt for L {}

impl LayerSpec for Box<dyn LayerSpec> {
    fn kind(&self) -> &'static str {
        (**self).kind()
    }

    fn class_name(&self) -> &'static str {
        (**self).class_name()
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        (**self).build(ctx, input_shape)
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        (**self).clone_spec()
    }

    fn name(&self) -> Option<&str> {
        (**self).name()
    }
}
