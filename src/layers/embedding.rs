//! `Embedding`: integer ids to learned vectors, as Keras's `Embedding(input_dim, output_dim)`:
//! `(batch, ids...)` of `u8`, `u32` or `i64` ids in `0..input_dim` to
//! `(batch, ids..., output_dim)`. A model's input of ids reaches it in its integer dtype (see
//! [`InputSpec`](crate::data::InputSpec)); an id out of range is an error naming the layer,
//! never a read outside the table.

use candle_core::{DType, Tensor};

use super::{BuildContext, Built, FastPath, Layer, LayerSpec};
use crate::params::Init;
use crate::{Error, Result};

/// Learned vectors for integer ids: the table `embeddings` of shape
/// `(input_dim, output_dim)`, initialised uniform on `[-0.05, 0.05)` as in Keras.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use kandle::layers::{Embedding, LayerSpec};
/// use kandle::params::BuildContext;
///
/// let mut ctx = BuildContext::new(&Device::Cpu, 0);
/// let built = Embedding::new(10, 4).build(&mut ctx, &[3])?;
/// assert_eq!(built.output_shape, [3, 4]);
/// let ids = Tensor::new(&[[1u32, 9, 0]], &Device::Cpu)?;
/// assert_eq!(built.layer().forward_t(&ids, false)?.dims(), [1, 3, 4]);
/// let bad = Tensor::new(&[[1u32, 10, 0]], &Device::Cpu)?;
/// assert!(built.layer().forward_t(&bad, false).is_err());
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Embedding {
    input_dim: usize,
    output_dim: usize,
}

impl Embedding {
    /// A table of `input_dim` ids (`0..input_dim`), each a vector of `output_dim` values.
    pub fn new(input_dim: usize, output_dim: usize) -> Self {
        Self {
            input_dim,
            output_dim,
        }
    }
}

impl LayerSpec for Embedding {
    fn kind(&self) -> &'static str {
        "embedding"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        if self.input_dim == 0 || self.output_dim == 0 {
            return Err(Error::invalid(format!(
                "layer `{}`: input_dim and output_dim must be positive, got {} and {}",
                ctx.path(),
                self.input_dim,
                self.output_dim
            )));
        }
        let table = ctx.variable(
            "embeddings",
            &[self.input_dim, self.output_dim],
            Init::Uniform {
                low: -0.05,
                high: 0.05,
            },
        )?;
        let layer = EmbeddingLayer {
            name: ctx.path(),
            table: ctx.tensor_of(&table),
            input_dim: self.input_dim,
        };
        let mut output_shape = input_shape.to_vec();
        output_shape.push(self.output_dim);
        Ok(Built::fast(layer, output_shape, Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct EmbeddingLayer {
    name: String,
    table: Tensor,
    input_dim: usize,
}

impl Layer for EmbeddingLayer {
    fn forward_t(&self, ids: &Tensor, _train: bool) -> Result<Tensor> {
        if ids.dtype().is_float() {
            return Err(Error::invalid(format!(
                "layer `{}` takes integer ids (u8, u32 or i64), but its input is {}: give the \
                 ids as an integer part",
                self.name,
                ids.dtype().as_str()
            )));
        }
        let flat = ids.flatten_all()?.to_dtype(DType::I64)?;
        let (low, high) = (
            flat.min(0)?.to_scalar::<i64>()?,
            flat.max(0)?.to_scalar::<i64>()?,
        );
        if flat.elem_count() > 0 && (low < 0 || high >= self.input_dim as i64) {
            let bad = if low < 0 { low } else { high };
            return Err(Error::invalid(format!(
                "layer `{}`: id {bad} is outside 0..{}",
                self.name, self.input_dim
            )));
        }
        let rows = self.table.index_select(&flat.to_dtype(DType::U32)?, 0)?;
        let mut dims = ids.dims().to_vec();
        dims.push(self.table.dim(1)?);
        Ok(rows.reshape(dims)?)
    }
}

impl FastPath for EmbeddingLayer {}
