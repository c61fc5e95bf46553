//! Joining `(N, C_i, ...)` `f32` CPU tensors along channels, and cutting a gradient back into
//! the parts' channels, plane by plane in parallel into memory that is not zeroed first.
//!
//! Candle's `cat` and `narrow(..).contiguous()` copy on one thread into a zeroed buffer; here
//! each plane of the result is copied once, by the pool's threads, from the plane of the part
//! that holds it ([`super::output::by_plane`]). [`concat_channels`] is a custom op whose backward
//! hands autograd each part's channels of the output gradient (views, as candle's `cat` does);
//! a recorded backward pass cuts them with [`channel_slice`].

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::output::by_plane;
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
