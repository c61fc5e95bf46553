//! [`Batch`]: one batch as a list of parts, one tensor per model input and one per output's
//! targets, each with its own shape and dtype, plus each sample's loss weight.

use candle_core::{Device, Tensor};

use crate::{Error, Result};

/// One batch, assembled on the CPU: one tensor per model input and one per output's targets,
/// in the model's orders, all with the same first (sample) dimension.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use kandle::data::Batch;
///
/// let image = Tensor::zeros((4, 1, 8, 8), DType::F32, &Device::Cpu)?;
/// let ids = Tensor::zeros((4, 6), DType::U32, &Device::Cpu)?;
/// let label = Tensor::new(&[0u32, 1, 1, 0], &Device::Cpu)?;
/// let batch = Batch::from_parts(vec![image, ids], vec![label])?;
/// assert_eq!(batch.len(), 4);
/// assert_eq!(batch.narrow(1, 2)?.inputs[1].dims(), [2, 6]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Batch {
    /// One tensor `(batch, input shape...)` per model input, each in its own dtype.
    pub inputs: Vec<Tensor>,
    /// One tensor per model output: `u32` `(batch,)` for class indices, `f32`
    /// `(batch, shape...)` for values.
    pub targets: Vec<Tensor>,
    /// Each sample's weight in the loss, `f32` `(batch,)` (sample weights times class weights),
    /// or `None` when every sample weighs 1.
    pub weights: Option<Tensor>,
}

impl Batch {
    /// A batch of unweighted samples of a model of one input and one output.
    pub fn new(x: Tensor, y: Tensor) -> Self {
        Self {
            inputs: vec![x],
            targets: vec![y],
            weights: None,
        }
    }

    /// A batch of unweighted samples with one tensor per input and one per output's targets.
    /// Errors when there is no input, or when the parts' sample counts differ.
    pub fn from_parts(inputs: Vec<Tensor>, targets: Vec<Tensor>) -> Result<Self> {
        let Some(first) = inputs.first() else {
            return Err(Error::invalid("a batch needs at least one input"));
        };
        let n = first.dims().first().copied();
        let parts = inputs.iter().map(|t| ("input", t));
        let parts = parts.chain(targets.iter().map(|t| ("target", t)));
        for (i, (what, t)) in parts.enumerate() {
            if t.dims().first().copied() != n {
                return Err(Error::invalid(format!(
                    "batch part {} (an {what}) has shape {:?}, but the first input has {:?}",
                    i + 1,
                    t.dims(),
                    first.dims()
                )));
            }
        }
        Ok(Self {
            inputs,
            targets,
            weights: None,
        })
    }

    /// The batch with each sample's loss weighted by `weights` (`(batch,)`).
    pub fn with_weights(mut self, weights: Tensor) -> Self {
        self.weights = Some(weights);
        self
    }

    /// The first (for most models the only) input.
    pub fn input(&self) -> Option<&Tensor> {
        self.inputs.first()
    }

    /// Number of samples in the batch.
    pub fn len(&self) -> usize {
        self.inputs
            .first()
            .or(self.targets.first())
            .and_then(|t| t.dims().first().copied())
            .unwrap_or(0)
    }

    /// Whether the batch holds no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples `start..start + len` of every part.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        let narrow = |parts: &[Tensor]| -> Result<Vec<Tensor>> {
            parts.iter().map(|t| Ok(t.narrow(0, start, len)?)).collect()
        };
        Ok(Self {
            inputs: narrow(&self.inputs)?,
            targets: narrow(&self.targets)?,
            weights: match &self.weights {
                Some(w) => Some(w.narrow(0, start, len)?),
                None => None,
            },
        })
    }

    /// Every part moved to `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        self.map_parts(|t| Ok(t.to_device(device)?))
    }

    /// The batch with `f` applied to each of its tensors (inputs, targets, weights).
    pub(crate) fn map_parts(&self, mut f: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let mut moved =
            |parts: &[Tensor]| -> Result<Vec<Tensor>> { parts.iter().map(&mut f).collect() };
        let inputs = moved(&self.inputs)?;
        let targets = moved(&self.targets)?;
        let weights = match &self.weights {
            Some(w) => Some(f(w)?),
            None => None,
        };
        Ok(Self {
            inputs,
            targets,
            weights,
        })
    }
}
