//! Joining `(N, C_i, ...)` `f32` CPU tensors along channels, and cutting a gradient back into
//! the parts' channels, plane by plane in parallel into memory that is not zeroed first.
//!
//! Candle's `cat` and `narrow(..).contiguous()` copy on one thread into a zeroed buffer; here
//! each plane of the result is copied once, by the pool's threads, from the plane of the part
//! that holds it (`output::by_plane`). [`concat_channels`] is a custom op whose backward
//! hands autograd each part's channels of the output gradient (views, as candle's `cat` does);
//! a recorded backward pass cuts them with [`channel_slice`].
//!
//! In inference nothing needs the parts on their own: a [`ConcatOutput`] is the joined
//! output, allocated first, and each part writes its channels of every image straight into
//! it through a [`ChannelSlot`] (the convolution and pooling kernels take one), so the parts
//! are never copied.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::output::{by_plane, PartedOutput};
use super::planes::{f32_data, nc_plane, with_f32};
use crate::{Error, Result};

const CONCAT: &str = "concat_channels";
const SLICE: &str = "channel_slice";

/// Whether [`concat_channels`] joins `a` and `b`: both `f32` on the CPU, of rank 3 or more, with
/// the same images and the same dimensions after the channel axis.
pub fn supported(a: &Tensor, b: &Tensor) -> bool {
    let (da, db) = (a.dims(), b.dims());
    a.device().is_cpu()
        && b.device().is_cpu()
        && a.dtype() == candle_core::DType::F32
        && b.dtype() == candle_core::DType::F32
        && da.len() >= 3
        && da.len() == db.len()
        && da[0] == db[0]
        && da[2..] == db[2..]
}

/// `a` then `b` along the channel axis (axis 1), as `Tensor::cat(&[a, b], 1)` computes it;
/// differentiable in both.
pub fn concat_channels(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !supported(a, b) {
        return Err(Error::invalid(format!(
            "{CONCAT}: expected two f32 CPU tensors that agree on all but channels, got {:?} {:?} \
             and {:?} {:?}",
            a.dtype(),
            a.dims(),
            b.dtype(),
            b.dims()
        )));
    }
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    Ok(a.apply_op2(&b, Concat)?)
}

/// Channels `offset .. offset + channels` of the `(N, C, ...)` `f32` CPU tensor `x`, as a new
/// contiguous tensor (`x.narrow(1, offset, channels)?.contiguous()`).
pub fn channel_slice(x: &Tensor, offset: usize, channels: usize) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (n, c, s) = nc_plane(&dims);
    if dims.len() < 2 || offset + channels > c {
        return Err(Error::invalid(format!(
            "{SLICE}: channels {offset}..{} of {dims:?}",
            offset + channels
        )));
    }
    let data = with_f32(SLICE, x, |data| {
        Ok(by_plane(n * channels * s, channels, s, |i, ch, plane| {
            let image = i / channels.max(1);
            plane.copied(&data[(image * c + offset + ch) * s..][..s])
        }))
    })?;
    let mut out_dims = dims;
    out_dims[1] = channels;
    Ok(Tensor::from_vec(data, out_dims, x.device())?)
}

/// The forward op: both parts' planes into one output.
struct Concat;

impl CustomOp2 for Concat {
    fn name(&self) -> &'static str {
        CONCAT
    }

    fn cpu_fwd(
        &self,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (a, b) = (f32_data(CONCAT, sa, la)?, f32_data(CONCAT, sb, lb)?);
        let (n, ca, s) = nc_plane(la.dims());
        let cb = nc_plane(lb.dims()).1;
        let c = ca + cb;
        let out = by_plane(n * c * s, c, s, |i, ch, plane| {
            let image = i / c.max(1);
            if ch < ca {
                plane.copied(&a[(image * ca + ch) * s..][..s])
            } else {
                plane.copied(&b[(image * cb + ch - ca) * s..][..s])
            }
        });
        let mut dims = la.dims().to_vec();
        dims[1] = c;
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Views, as candle's own `cat` gives back: autograd adds them where they go.
        let (ca, cb) = (a.dim(1)?, b.dim(1)?);
        Ok((Some(grad.narrow(1, 0, ca)?), Some(grad.narrow(1, ca, cb)?)))
    }
}

/// The output of a concatenation along channels, `(N, C, ...)` `f32` on the CPU, written in
/// place by its parts: each takes a [`ChannelSlot`] of its channels ([`Self::part`]) and writes
/// them in every image. Where a part writes first, its tasks zero their images whole just
/// before, so the output is never zeroed in a pass of its own.
#[doc(hidden)]
pub struct ConcatOutput {
    out: PartedOutput,
    dims: Vec<usize>,
}

impl ConcatOutput {
    /// An output of shape `dims`, `(N, C, ...)`, nothing written yet.
    pub fn new(dims: &[usize]) -> Result<Self> {
        if dims.len() < 2 {
            return Err(Error::invalid(format!(
                "{CONCAT}: an output of shape {dims:?} has no channel axis"
            )));
        }
        let (n, c, s) = nc_plane(dims);
        Ok(Self {
            out: PartedOutput::new(n, c * s),
            dims: dims.to_vec(),
        })
    }

    /// Channels `offset .. offset + channels` of every image, for one part to write.
    pub fn part(&mut self, offset: usize, channels: usize) -> Result<ChannelSlot<'_>> {
        if offset + channels > self.dims[1] {
            return Err(Error::invalid(format!(
                "{CONCAT}: channels {offset}..{} of an output of shape {:?}",
                offset + channels,
                self.dims
            )));
        }
        let mut dims = self.dims.clone();
        dims[1] = channels;
        Ok(ChannelSlot {
            out: &mut self.out,
            dims,
            offset: offset * nc_plane(&self.dims).2,
        })
    }

    /// The joined tensor: what the parts wrote, zero in channels no part did.
    pub fn into_tensor(self) -> Result<Tensor> {
        let values = self.out.into_vec();
        Ok(Tensor::from_vec(
            values,
            self.dims,
            &candle_core::Device::Cpu,
        )?)
    }
}

/// One part's channels of a [`ConcatOutput`]: what a kernel writes into instead of a tensor of
/// its own.
#[doc(hidden)]
pub struct ChannelSlot<'a> {
    out: &'a mut PartedOutput,
    /// The part's own shape: the output's, with its channels.
    dims: Vec<usize>,
    /// Where the part starts in each image, in values.
    offset: usize,
}

impl ChannelSlot<'_> {
    /// The output to write and where in each image the part starts (in values), once `op`'s
    /// result of shape `dims` is checked to be the part's.
    pub(crate) fn target(
        &mut self,
        op: &str,
        dims: &[usize],
    ) -> candle_core::Result<(&mut PartedOutput, usize)> {
        if dims != self.dims.as_slice() {
            candle_core::bail!(
                "{op}: its output {dims:?} does not fit the concatenation's part {:?}",
                self.dims
            );
        }
        Ok((&mut *self.out, self.offset))
    }

    /// Copies `t`, a part computed on its own, into the slot.
    pub fn copy_from(&mut self, t: &Tensor) -> Result<()> {
        let dims = t.dims().to_vec();
        let (n, c, s) = nc_plane(&dims);
        let (out, offset) = self.target(CONCAT, &dims)?;
        let parallel = n > 1;
        with_f32(CONCAT, t, |data| {
            out.try_fill((1, parallel), (offset, c * s), None, |i, mut image| {
                for dst in image.each() {
                    dst.copy_from_slice(&data[i * c * s..][..c * s]);
                }
                Ok(())
            })
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
