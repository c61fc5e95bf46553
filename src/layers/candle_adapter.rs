//! `CandleLayer`: makes any candle `Module` or `ModuleT` a kandle layer, so existing candle code
//! keeps working inside a `Sequential`.
//!
//! The recipe is a closure that builds the module from a candle `VarBuilder`. Every variable
//! it creates joins the model under the layer's name (`candle_1.weight`), is trained by the
//! model's optimizer and is saved in checkpoints. Its initial values come from candle's
//! initialisers; strategies copy the first replica's values to the others.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_nn::{ModuleT, VarBuilder, VarMap};

use super::{BuildContext, Built, Layer, LayerSpec};
use crate::Result;

type ModuleFactory =
    dyn Fn(VarBuilder) -> candle_core::Result<Box<dyn ModuleT + Send + Sync>> + Send + Sync;

/// A candle module as a layer.
///
/// ```
/// use kandle::layers::{CandleLayer, Sequential};
///
/// let net = Sequential::new().add(CandleLayer::new(|vb| candle_nn::linear(4, 2, vb)));
/// let summary = net.summary(&[4])?;
/// assert_eq!(summary.trainable, 4 * 2 + 2);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Clone)]
pub struct CandleLayer {
    factory: Arc<ModuleFactory>,
}

impl std::fmt::Debug for CandleLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CandleLayer")
    }
}

impl CandleLayer {
    /// Wraps a module built by `factory` (any `Module` is also a `ModuleT`).
    pub fn new<M, F>(factory: F) -> Self
    where
        M: ModuleT + Send + Sync + 'static,
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        Self {
            factory: Arc::new(move |vb| {
                factory(vb).map(|m| Box::new(m) as Box<dyn ModuleT + Send + Sync>)
            }),
        }
    }
}

impl LayerSpec for CandleLayer {
    fn kind(&self) -> &'static str {
        "candle"
    }

    fn class_name(&self) -> &'static str {
        "CandleLayer"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, ctx.device());
        let module = (self.factory)(vb).map_err(|e| {
            crate::Error::invalid(format!(
                "layer `{}`: building the candle module failed: {e}",
                ctx.path()
            ))
        })?;
        let mut vars: Vec<_> = varmap
            .data()
            .lock()
            .map_err(|_| crate::Error::invalid("candle VarMap lock poisoned"))?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, var) in vars {
            ctx.adopt(&name, var)?;
        }
        // The output shape of an opaque module is found by running it once on zeros.
        let mut probe_dims = vec![1];
        probe_dims.extend_from_slice(input_shape);
        let probe = Tensor::zeros(probe_dims, DType::F32, ctx.device())?;
        let out = module
            .forward_t(&probe, false)
            .map_err(|e| crate::Error::Shape {
                layer: ctx.path(),
                expected: format!("what the wrapped candle module accepts ({e})"),
                got: crate::error::shape_with_batch(input_shape),
            })?;
        let output_shape = out.dims()[1..].to_vec();
        Ok(Built::leaf(CandleModule { module }, output_shape))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct CandleModule {
    module: Box<dyn ModuleT + Send + Sync>,
}

impl Layer for CandleModule {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        Ok(self.module.forward_t(x, train)?)
    }
}
