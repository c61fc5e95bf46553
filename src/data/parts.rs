//! A sample's inputs as parts, each with its own name, shape and dtype: what a dataset
//! describes with [`InputSpec`]s (one per model input) and writes through [`PartMut`]s, and the
//! typed buffers the loader assembles a batch's parts in.
//!
//! A part is carried in its own dtype from the dataset to the replica (float32, float16,
//! bfloat16, float64, or integer ids as `u8`, `u32` or `i64`); the model casts it to its
//! input's dtype there, so nothing is converted on the way.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

use crate::error::shape_with_batch;
use crate::{Error, Result};

/// One input of a dataset's samples: the model input it feeds, its shape and its dtype.
///
/// A dataset whose inputs all have names feeds a model's inputs by name (as a Keras dict);
/// one whose inputs have none feeds them in the model's order.
///
/// ```
/// use candle_core::DType;
/// use kandle::data::InputSpec;
///
/// let ids = InputSpec::new(&[12]).named("tokens").with_dtype(DType::U32);
/// assert_eq!(ids.sample_len(), 12);
/// assert_eq!(ids.to_string(), "`tokens` (batch, 12) u32");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputSpec {
    /// The model input this part feeds, or `None` to feed the inputs in order.
    pub name: Option<String>,
    /// One sample's shape, without the batch dimension.
    pub shape: Vec<usize>,
    /// The dtype the dataset gives it in.
    pub dtype: DType,
}

impl InputSpec {
    /// An unnamed `f32` input of `shape`.
    pub fn new(shape: &[usize]) -> Self {
        Self {
            name: None,
            shape: shape.to_vec(),
            dtype: DType::F32,
        }
    }

    /// The input named `name`.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The input in `dtype`.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Elements per sample.
    pub fn sample_len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// `` `name` (batch, shape...) dtype ``, or without the name for an unnamed input.
impl std::fmt::Display for InputSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(name) = &self.name {
            write!(f, "`{name}` ")?;
        }
        write!(
            f,
            "{} {}",
            shape_with_batch(&self.shape),
            self.dtype.as_str()
        )
    }
}

/// Where a dataset writes one input of one sample: a slice of that input's dtype and
/// [`InputSpec::sample_len`] elements.
#[derive(Debug)]
#[non_exhaustive]
pub enum PartMut<'a> {
    /// `f32` values.
    F32(&'a mut [f32]),
    /// `f64` values.
    F64(&'a mut [f64]),
    /// `f16` values.
    F16(&'a mut [f16]),
    /// `bf16` values.
    BF16(&'a mut [bf16]),
    /// Bytes (e.g. pixels or ids below 256).
    U8(&'a mut [u8]),
    /// Unsigned ids.
    U32(&'a mut [u32]),
    /// Signed ids.
    I64(&'a mut [i64]),
}

impl PartMut<'_> {
    /// The dtype of the slice.
    pub fn dtype(&self) -> DType {
        match self {
            PartMut::F32(_) => DType::F32,
            PartMut::F64(_) => DType::F64,
            PartMut::F16(_) => DType::F16,
            PartMut::BF16(_) => DType::BF16,
            PartMut::U8(_) => DType::U8,
            PartMut::U32(_) => DType::U32,
            PartMut::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            PartMut::F32(s) => s.len(),
            PartMut::F64(s) => s.len(),
            PartMut::F16(s) => s.len(),
            PartMut::BF16(s) => s.len(),
            PartMut::U8(s) => s.len(),
            PartMut::U32(s) => s.len(),
            PartMut::I64(s) => s.len(),
        }
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `f32` slice, or an error naming `what` and the dtype it has.
    pub fn as_f32(&mut self, what: &str) -> Result<&mut [f32]> {
        match self {
            PartMut::F32(s) => Ok(s),
            other => Err(Error::invalid(format!(
                "{what} is read as f32, but its buffer is {}",
                other.dtype().as_str()
            ))),
        }
    }
}

/// One input's values for a whole batch (or a whole dataset), in its dtype.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PartBuffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    U8(Vec<u8>),
    U32(Vec<u32>),
    I64(Vec<i64>),
}

impl PartBuffer {
    /// `len` zeros of `dtype`; an error for a dtype a part cannot have.
    pub(crate) fn zeros(dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => PartBuffer::F32(vec![0.0; len]),
            DType::F64 => PartBuffer::F64(vec![0.0; len]),
            DType::F16 => PartBuffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => PartBuffer::BF16(vec![bf16::ZERO; len]),
            DType::U8 => PartBuffer::U8(vec![0; len]),
            DType::U32 => PartBuffer::U32(vec![0; len]),
            DType::I64 => PartBuffer::I64(vec![0; len]),
            other => return Err(unsupported(other)),
        })
    }

    /// A tensor's values, flattened, in its dtype (copied to the CPU).
    pub(crate) fn from_tensor(t: &Tensor) -> Result<Self> {
        let flat = t.to_device(&Device::Cpu)?.flatten_all()?;
        Ok(match flat.dtype() {
            DType::F32 => PartBuffer::F32(flat.to_vec1()?),
            DType::F64 => PartBuffer::F64(flat.to_vec1()?),
            DType::F16 => PartBuffer::F16(flat.to_vec1()?),
            DType::BF16 => PartBuffer::BF16(flat.to_vec1()?),
            DType::U8 => PartBuffer::U8(flat.to_vec1()?),
            DType::U32 => PartBuffer::U32(flat.to_vec1()?),
            DType::I64 => PartBuffer::I64(flat.to_vec1()?),
            other => return Err(unsupported(other)),
        })
    }

    /// The buffer as a CPU tensor of `shape`.
    pub(crate) fn into_tensor(self, shape: Vec<usize>) -> Result<Tensor> {
        let cpu = &Device::Cpu;
        Ok(match self {
            PartBuffer::F32(v) => Tensor::from_vec(v, shape, cpu)?,
            PartBuffer::F64(v) => Tensor::from_vec(v, shape, cpu)?,
            PartBuffer::F16(v) => Tensor::from_vec(v, shape, cpu)?,
            PartBuffer::BF16(v) => Tensor::from_vec(v, shape, cpu)?,
            PartBuffer::U8(v) => Tensor::from_vec(v, shape, cpu)?,
            PartBuffer::U32(v) => Tensor::from_vec(v, shape, cpu)?,
            PartBuffer::I64(v) => Tensor::from_vec(v, shape, cpu)?,
        })
    }

    /// The buffer cut into slices of `size` elements (one per sample).
    pub(crate) fn chunks_mut(&mut self, size: usize) -> Vec<PartMut<'_>> {
        match self {
            PartBuffer::F32(v) => v.chunks_mut(size).map(PartMut::F32).collect(),
            PartBuffer::F64(v) => v.chunks_mut(size).map(PartMut::F64).collect(),
            PartBuffer::F16(v) => v.chunks_mut(size).map(PartMut::F16).collect(),
            PartBuffer::BF16(v) => v.chunks_mut(size).map(PartMut::BF16).collect(),
            PartBuffer::U8(v) => v.chunks_mut(size).map(PartMut::U8).collect(),
            PartBuffer::U32(v) => v.chunks_mut(size).map(PartMut::U32).collect(),
            PartBuffer::I64(v) => v.chunks_mut(size).map(PartMut::I64).collect(),
        }
    }

    /// Copies elements `start..start + out.len()` into `out`, which must have this buffer's
    /// dtype.
    pub(crate) fn copy_to(&self, start: usize, out: &mut PartMut<'_>) -> Result<()> {
        let end = start + out.len();
        match (self, out) {
            (PartBuffer::F32(v), PartMut::F32(o)) => o.copy_from_slice(&v[start..end]),
            (PartBuffer::F64(v), PartMut::F64(o)) => o.copy_from_slice(&v[start..end]),
            (PartBuffer::F16(v), PartMut::F16(o)) => o.copy_from_slice(&v[start..end]),
            (PartBuffer::BF16(v), PartMut::BF16(o)) => o.copy_from_slice(&v[start..end]),
            (PartBuffer::U8(v), PartMut::U8(o)) => o.copy_from_slice(&v[start..end]),
            (PartBuffer::U32(v), PartMut::U32(o)) => o.copy_from_slice(&v[start..end]),
            (PartBuffer::I64(v), PartMut::I64(o)) => o.copy_from_slice(&v[start..end]),
            (_, out) => {
                return Err(Error::invalid(format!(
                    "an input part is held as {} but was asked for as {}",
                    self.dtype().as_str(),
                    out.dtype().as_str()
                )))
            }
        }
        Ok(())
    }

    /// The elements at `runs` (start and length of each), one after the other.
    pub(crate) fn gather(&self, runs: impl Iterator<Item = (usize, usize)> + Clone) -> Self {
        fn pick<T: Copy>(v: &[T], runs: impl Iterator<Item = (usize, usize)>) -> Vec<T> {
            runs.flat_map(|(start, len)| v[start..start + len].iter().copied())
                .collect()
        }
        match self {
            PartBuffer::F32(v) => PartBuffer::F32(pick(v, runs)),
            PartBuffer::F64(v) => PartBuffer::F64(pick(v, runs)),
            PartBuffer::F16(v) => PartBuffer::F16(pick(v, runs)),
            PartBuffer::BF16(v) => PartBuffer::BF16(pick(v, runs)),
            PartBuffer::U8(v) => PartBuffer::U8(pick(v, runs)),
            PartBuffer::U32(v) => PartBuffer::U32(pick(v, runs)),
            PartBuffer::I64(v) => PartBuffer::I64(pick(v, runs)),
        }
    }

    /// The dtype of the buffer.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            PartBuffer::F32(_) => DType::F32,
            PartBuffer::F64(_) => DType::F64,
            PartBuffer::F16(_) => DType::F16,
            PartBuffer::BF16(_) => DType::BF16,
            PartBuffer::U8(_) => DType::U8,
            PartBuffer::U32(_) => DType::U32,
            PartBuffer::I64(_) => DType::I64,
        }
    }
}

fn unsupported(dtype: DType) -> Error {
    Error::invalid(format!(
        "an input part cannot be {}: use f32, f64, f16, bf16, u8, u32 or i64",
        dtype.as_str()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_keep_their_dtype_from_tensor_to_tensor() -> Result<()> {
        let ids = Tensor::new(&[[3u32, 1], [4, 1]], &Device::Cpu)?;
        let buffer = PartBuffer::from_tensor(&ids)?;
        assert_eq!(buffer.dtype(), DType::U32);
        let picked = buffer.gather([(2, 2)].into_iter());
        let t = picked.into_tensor(vec![1, 2])?;
        assert_eq!(t.to_vec2::<u32>()?, [[4, 1]]);
        let half = Tensor::new(&[1f32, 2.5], &Device::Cpu)?.to_dtype(DType::F16)?;
        let mut out = PartBuffer::zeros(DType::F16, 1)?;
        PartBuffer::from_tensor(&half)?.copy_to(1, &mut out.chunks_mut(1)[0])?;
        assert_eq!(
            out.into_tensor(vec![1])?.to_vec1::<f16>()?,
            [f16::from_f32(2.5)]
        );
        Ok(())
    }

    #[test]
    fn a_copy_into_another_dtype_is_an_error() -> Result<()> {
        let buffer = PartBuffer::from_tensor(&Tensor::new(&[1f32], &Device::Cpu)?)?;
        let mut out = PartBuffer::zeros(DType::I64, 1)?;
        let err = buffer
            .copy_to(0, &mut out.chunks_mut(1)[0])
            .expect_err("f32 into i64");
        assert!(err.to_string().contains("held as f32"), "{err}");
        assert!(PartBuffer::zeros(DType::I16, 1).is_err());
        Ok(())
    }
}
