//! `ChannelPart`: a branch's range of channels in a concatenation's output, allocated once on a
//! CUDA device, which the branch's recorded training forward writes into
//! ([`FastPath::forward_recorded_into`](super::FastPath::forward_recorded_into)): in place when
//! its last kernel can write there (a fused BatchNorm), copied there otherwise.

use candle_core::Tensor;

use crate::Result;

/// Channels `offset .. offset + channels` of `whole`, an `(N, C, ...)` tensor.
pub(crate) struct ChannelPart<'a> {
    whole: &'a Tensor,
    offset: usize,
    channels: usize,
    /// The concatenation's full name, for errors.
    layer: &'a str,
}

impl<'a> ChannelPart<'a> {
    /// Channels `offset .. offset + channels` of `whole`, for the concatenation `layer`.
    pub(crate) fn new(whole: &'a Tensor, offset: usize, channels: usize, layer: &'a str) -> Self {
        Self {
            whole,
            offset,
            channels,
            layer,
        }
    }

    /// The range as a tensor: a view of the concatenation's output, which a kernel that takes
    /// image strides writes in place.
    pub(crate) fn view(&self) -> Result<Tensor> {
        Ok(self.whole.narrow(1, self.offset, self.channels)?)
    }

    /// Copies `y`, a branch's output, into the range and returns the range's view; an error
    /// naming the concatenation when `y` does not fit it (another shape or dtype).
    pub(crate) fn write(&self, y: &Tensor) -> Result<Tensor> {
        let view = self.view()?;
        if y.dims() != view.dims() || y.dtype() != view.dtype() {
            return Err(crate::Error::Shape {
                layer: self.layer.to_string(),
                expected: format!(
                    "a branch output of {:?} {:?} for channels {}..{}",
                    view.dtype(),
                    view.dims(),
                    self.offset,
                    self.offset + self.channels
                ),
                got: format!("{:?} {:?}", y.dtype(), y.dims()),
            });
        }
        self.whole.slice_set(&y.contiguous()?, 1, self.offset)?;
        Ok(view)
    }
}
