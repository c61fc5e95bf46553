//! What a forward correlation does to each output channel besides the correlation itself (a
//! scale, a bias, a ReLU), applied as the outputs are written; shared by the direct passes and
//! Winograd's.

/// What the forward pass does to each output channel `o` besides the correlation:
/// `y[o] = scale[o] * (x ⋆ w)[o] + bias[o]`, then `max(y, 0)` when `relu`. A missing `scale`
/// is one and a missing `bias` zero. The scale is applied to the kernel's taps, and the ReLU
/// as the outputs are written (by the micro-kernel, Winograd's output transform, or the copy
/// out of a group's products), so neither costs a pass over memory.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Epilogue<'a> {
    pub scale: Option<&'a [f32]>,
    pub bias: Option<&'a [f32]>,
    pub relu: bool,
}

impl Epilogue<'_> {
    /// Applies the ReLU, if any, to finished outputs (a NaN stays a NaN): for outputs no
    /// fused write took it.
    pub(super) fn finish(&self, y: &mut [f32]) {
        if self.relu {
            for v in y {
                *v = relu(*v);
            }
        }
    }
}

/// `max(v, 0)`, a NaN staying a NaN: the ReLU kernel's rule.
pub(crate) use crate::relu::scalar as relu;
