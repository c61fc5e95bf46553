//! Fused buffers: many tensors flattened into one contiguous `f32` vector, so that a step
//! crosses devices (or processes) with one transfer or one collective call instead of one per
//! tensor (Horovod's "tensor fusion").

use crate::Result;
use candle_core::{DType, Shape, Tensor};

/// Where each tensor sits in a fused buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedLayout {
    shapes: Vec<Shape>,
    offsets: Vec<usize>,
    len: usize,
}

impl FusedLayout {
    /// The layout of `tensors`, in order.
    pub fn of(tensors: &[Tensor]) -> Self {
        Self::from_shapes(tensors.iter().map(|t| t.shape().clone()))
    }

    /// The layout of tensors with these shapes, in order.
    pub fn from_shapes(shapes: impl IntoIterator<Item = Shape>) -> Self {
        let shapes: Vec<Shape> = shapes.into_iter().collect();
        let mut offsets = Vec::with_capacity(shapes.len());
        let mut len = 0;
        for s in &shapes {
            offsets.push(len);
            len += s.elem_count();
        }
        Self {
            shapes,
            offsets,
            len,
        }
    }

    /// Total number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of tensors.
    pub fn count(&self) -> usize {
        self.shapes.len()
    }

    /// Cuts `buffer[start..start + self.len()]` back into tensors of the recorded shapes.
    pub fn split(&self, buffer: &Tensor, start: usize) -> Result<Vec<Tensor>> {
        self.shapes
            .iter()
            .zip(&self.offsets)
            .map(|(shape, &off)| {
                Ok(buffer
                    .narrow(0, start + off, shape.elem_count())?
                    .reshape(shape)?)
            })
            .collect()
    }
}

/// Concatenates `tensors`, flattened and converted to `f32`, into one vector on their device.
pub fn fuse(tensors: &[&Tensor]) -> Result<Tensor> {
    let flat = tensors
        .iter()
        .map(|t| Ok(t.flatten_all()?.to_dtype(DType::F32)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&flat, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn round_trip() -> Result<()> {
        let a = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?;
        let b = Tensor::new(&[7f32], &Device::Cpu)?;
        let layout = FusedLayout::of(&[a.clone(), b.clone()]);
        assert_eq!(layout.len(), 7);
        let buffer = fuse(&[&a, &b])?;
        let back = layout.split(&buffer, 0)?;
        assert_eq!(back[0].to_vec2::<f32>()?, a.to_vec2::<f32>()?);
        assert_eq!(back[1].to_vec1::<f32>()?, vec![7.]);
        Ok(())
    }
}
