//! `Flatten`: reshapes `(batch, d1, d2, ...)` to `(batch, d1 * d2 * ...)`.

use candle_core::Tensor;

use super::{BuildContext, Built, FastPath, Layer, LayerSpec, ParamGrads, RecordRequest, Recorded};
use crate::Result;

/// Flattens everything but the batch axis.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flatten;

impl LayerSpec for Flatten {
    fn kind(&self) -> &'static str {
        "flatten"
    }

    fn class_name(&self) -> &'static str {
        "Flatten"
    }

    fn build(&self, _ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        Ok(Built::fast(
            Flatten,
            vec![input_shape.iter().product()],
            Vec::new(),
        ))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(Flatten)
    }
}

impl Layer for Flatten {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        Ok(x.flatten_from(1)?)
    }
}

impl FastPath for Flatten {
    fn forward_recorded(&self, x: &Tensor, _: RecordRequest) -> Result<Recorded> {
        let shape = x.shape().clone();
        Ok(Recorded::new(
            x.flatten_from(1)?,
            move |dy: Tensor, _: &mut ParamGrads, input_grad: bool| {
                Ok(if input_grad {
                    Some(dy.reshape(&shape)?)
                } else {
                    None
                })
            },
        ))
    }
}
