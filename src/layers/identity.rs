//! `Identity`: hands its input on unchanged, in training and inference alike; the shortcut
//! branch of a residual block.

use candle_core::Tensor;

use super::{identity, BuildContext, Built, FastPath, Layer, LayerSpec, RecordRequest, Recorded};
use crate::Result;

/// Returns its input unchanged, and passes the gradient through without a copy.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::layers::{BuildContext, Identity, LayerSpec};
///
/// let built = Identity.build(&mut BuildContext::new(&Device::Cpu, 0), &[3])?;
/// let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
/// assert_eq!(built.layer().forward_t(&x, true)?.to_vec2::<f32>()?, [[1., 2., 3.]]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Identity;

impl LayerSpec for Identity {
    fn kind(&self) -> &'static str {
        "identity"
    }

    fn class_name(&self) -> &'static str {
        "Identity"
    }

    fn build(&self, _ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        Ok(Built::fast(Identity, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

impl Layer for Identity {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        Ok(x.clone())
    }
}

impl FastPath for Identity {
    fn forward_recorded(&self, x: &Tensor, _: RecordRequest) -> Result<Recorded> {
        Ok(identity(x))
    }

    fn passes_through(&self) -> bool {
        true
    }
}
