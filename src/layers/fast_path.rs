//! The fast path of kandle's own layers: their recorded backward passes and how they fuse with
//! their neighbours, behind one crate-private trait.
//!
//! The public [`Layer`] is what a layer author writes. Composites ([`SequentialNet`], the
//! layers with branches) hold their children as [`FastPath`] objects: kandle's layers implement
//! it themselves, and any other layer enters through [`Built::leaf`](super::Built::leaf) wrapped
//! in [`Foreign`], which takes every default (recorded under candle's autograd, no fusion).
//!
//! [`SequentialNet`]: super::SequentialNet

use candle_core::Tensor;

use super::{record_with_candle, ChannelAffine, ChannelPart, ChannelSlot, Layer, Recorded};
use crate::Result;

/// What kandle's own layers add to [`Layer`]: a recorded training forward for kandle's backward
/// pass, and the hooks that let neighbouring layers run as one in inference.
pub(crate) trait FastPath: Layer + AsLayer {
    /// The training forward pass, recorded for kandle's own backward pass (see [`Recorded`]),
    /// as `request` asks. The output is `forward_t(x, true)`'s. With [`RecordRequest::logits`]
    /// (the last layer of a network), the layer also returns the logits of a softmax output,
    /// as [`Layer::forward_with_logits`] does, and the backward pass then takes the gradient
    /// of the logits. Without [`RecordRequest::input_grad`] (a caller that never asks the
    /// backward pass for the input's gradient, as for a network's input), a composite runs the
    /// layers below its lowest trainable one (frozen layers, and those without variables)
    /// without recording them, so none of them computes a gradient; the backward pass must then
    /// be run with `input_grad` false.
    ///
    /// The default runs this layer alone under candle's autograd ([`record_with_candle`]),
    /// keeping the logits the layer gives when asked for them; layers with kernels record
    /// their kernels' backward passes instead (where a kernel takes the tensor: its device and
    /// dtype), others their backward in candle's ops, and those that give no logits leave a
    /// request for logits to the default. Whatever the device, the gradients are those of
    /// candle's autograd over [`Layer::forward_t`].
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        record_with_candle(self, x, request.logits)
    }

    /// The recorded training forward pass ([`Self::forward_recorded`] with
    /// [`RecordRequest::output`]) with the output written into `part`, the layer's range of a
    /// concatenation's output allocated once; the recorded output is the range's view. By
    /// default the layer records as usual and its output is copied there
    /// ([`record_into_by_copy`]); a layer whose last kernel can write such a range (a fused
    /// BatchNorm on CUDA) writes it in place.
    fn forward_recorded_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Recorded> {
        record_into_by_copy(self, x, part)
    }

    /// Writes this layer's inference output straight into `part`, its range of a
    /// concatenation's output on a CUDA device, and returns the range's view; or returns `None`
    /// having written nothing, when it cannot (the default), and the caller copies the output
    /// [`Layer::forward_t`] gives. ([`Self::forward_into`] is the CPU's.)
    fn forward_inference_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Option<Tensor>> {
        let _ = (x, part);
        Ok(None)
    }

    /// Whether the layer is exactly `max(x, 0)`, which the layer before it may absorb.
    fn is_relu(&self) -> bool {
        false
    }

    /// Asks the layer to apply `max(y, 0)` to its own output from now on, because a ReLU
    /// follows it; returns whether it will (the ReLU is then skipped). The default declines.
    fn fuse_relu(&mut self) -> bool {
        false
    }

    /// In inference, the per-channel affine map (and ReLU) this layer applies, when it is one
    /// that the layer before it may fold into its own output (a BatchNorm with its running
    /// statistics is); `like` is the input of the layer before, for its device and type.
    /// `None` by default.
    fn inference_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        let _ = like;
        Ok(None)
    }

    /// The training forward pass where no gradient is asked of this layer or any below it (a
    /// frozen stretch under every layer that trains): [`Layer::forward_t`] in training by
    /// default; a stack of layers folds its frozen BatchNorms as in inference
    /// ([`Self::frozen_affine`]).
    fn forward_frozen(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_t(x, true)
    }

    /// In training too, the per-channel affine map (and ReLU) [`Self::inference_affine`] gives,
    /// when the layer's training forward is that same map (a frozen BatchNorm normalises with
    /// its running statistics in training): where no gradient is asked of a stretch of layers
    /// (a frozen base under a head that trains), the layer before folds it in as in inference.
    /// `None` by default.
    fn frozen_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        let _ = like;
        Ok(None)
    }

    /// This layer's inference output with `affine` applied to it, computed at once, or `None`
    /// when the layer cannot fold it in (the default). A layer that folds must give the same
    /// output in training (it is also called where a frozen stretch trains, see
    /// [`Self::frozen_affine`]), as a convolution does.
    fn forward_then_affine(&self, x: &Tensor, affine: &ChannelAffine) -> Result<Option<Tensor>> {
        let _ = (x, affine);
        Ok(None)
    }

    /// Writes this layer's inference output, with `affine` (if any) applied to it, straight
    /// into `slot`, its channels of a concatenation's output, and returns `true`; or returns
    /// `false` having written nothing, when it cannot (the default), and the caller copies
    /// the output [`Layer::forward_t`] gives.
    fn forward_into(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
        slot: &mut ChannelSlot<'_>,
    ) -> Result<bool> {
        let _ = (x, affine, slot);
        Ok(false)
    }

    /// Whether, in inference, the layer hands its input on unchanged (a dropout, a ReLU that
    /// the layer before absorbed), so that the layer before it gives the stack's output.
    /// `false` by default.
    fn passes_through(&self) -> bool {
        false
    }

    /// Whether the layer came from outside kandle ([`Foreign`]).
    #[cfg(test)]
    fn foreign(&self) -> bool {
        false
    }
}

/// [`FastPath::forward_recorded_into`] by a copy: `layer` records as usual, and its output is
/// copied into `part`.
pub(crate) fn record_into_by_copy(
    layer: &(impl FastPath + ?Sized),
    x: &Tensor,
    part: &ChannelPart<'_>,
) -> Result<Recorded> {
    let recorded = layer.forward_recorded(x, RecordRequest::output())?;
    Ok(Recorded {
        output: part.write(&recorded.output)?,
        ..recorded
    })
}

/// What a recorded forward pass is asked for ([`FastPath::forward_recorded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecordRequest {
    /// Whether the logits of a softmax output are wanted too, and the backward pass takes
    /// their gradient.
    pub(crate) logits: bool,
    /// Whether the backward pass may be asked for the input's gradient.
    pub(crate) input_grad: bool,
}

impl RecordRequest {
    /// The output, with the input's gradient: what a layer inside a network is asked.
    pub(crate) fn output() -> Self {
        Self {
            logits: false,
            input_grad: true,
        }
    }

    /// The output and its logits, with the input's gradient: what the last layer is asked.
    pub(crate) fn with_logits() -> Self {
        Self {
            logits: true,
            input_grad: true,
        }
    }

    /// This request, without the input's gradient.
    pub(crate) fn without_input_grad(self) -> Self {
        Self {
            input_grad: false,
            ..self
        }
    }
}

/// A [`FastPath`] object seen as the public [`Layer`] it is.
pub(crate) trait AsLayer {
    /// This layer as a [`Layer`].
    fn as_layer(&self) -> &dyn Layer;

    /// This layer, boxed, as a [`Layer`].
    fn into_layer(self: Box<Self>) -> Box<dyn Layer>;
}

impl<L: Layer + 'static> AsLayer for L {
    fn as_layer(&self) -> &dyn Layer {
        self
    }

    fn into_layer(self: Box<Self>) -> Box<dyn Layer> {
        self
    }
}

/// A layer from outside kandle: recorded under candle's autograd, fused with nothing.
pub(crate) struct Foreign<L>(pub(crate) L);

impl<L: Layer> Layer for Foreign<L> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.0.forward_t(x, train)
    }

    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        self.0.forward_with_logits(x, train)
    }
}

impl<L: Layer + 'static> FastPath for Foreign<L> {
    #[cfg(test)]
    fn foreign(&self) -> bool {
        true
    }
}
