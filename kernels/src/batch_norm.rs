//! Fused BatchNorm on the CPU: one pass for the statistics, one for the normalisation.
//!
//! [`batch_norm_train`] normalises an `(N, C, ...)` `f32` tensor with its batch statistics and
//! returns them, so the layer can move its running averages. The statistics are sums of the
//! values shifted by the channel's first value, which keeps the variance accurate even when the
//! mean is large, over short `f32` runs added in `f64`. Its backward pass takes two passes: one for
//! the per-channel sums of `dy` and `dy * xhat` (the gradients of the offset and scale), one
//! for `dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))`.
//!
//! Both are `ChannelKernel`s: small planes are walked channel by channel, so that the second
//! pass reads the channel from the cache, large ones streamed (see `two_pass`), with the
//! loops compiled for the CPU's vector width.
//!
//! [`channel_affine`] is the inference form, `y = x * scale[c] + shift[c]` with the running
//! statistics folded into `scale` and `shift`, differentiable in all three.
//!
//! Both can fold a following ReLU into the same pass (`relu = true`); its gradient passes
//! where the pre-activation is `>= 0`, as candle's ReLU does, or NaN, as PyTorch's does.
//!
//! NaNs propagate as in PyTorch: a NaN in a channel of a training batch makes that channel's
//! mean and variance NaN, and so its whole output; in inference only the NaN's own output is
//! NaN, and the ReLU keeps it.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::output;
use super::planes::{f32_data, nc_plane, with_f32, with_f32_images, PairSums};
use super::replay::Replay3;
use super::simd::vectorized;
use super::two_pass::{self, ChannelKernel, Inputs};
use crate::{Error, Result};

const TRAIN_OP: &str = "batch_norm";
const AFFINE_OP: &str = "channel_affine";

/// Whether the kernels here can run on `x`: an `f32` CPU tensor of shape `(N, C, ...)`.
pub fn supported(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && x.rank() >= 2
}

/// A training batch's per-channel statistics, detached from the graph.
#[derive(Debug, Clone)]
pub struct BatchStats {
    /// The mean, shape `(C,)`.
    pub mean: Tensor,
    /// The biased variance (divided by the element count), shape `(C,)`.
    pub var: Tensor,
}

/// Training-mode batch normalisation of the `(N, C, ...)` `f32` CPU tensor `x` over every axis
/// but the channels: `y = (x - mean) / sqrt(var + epsilon) * weight + bias`, then `max(y, 0)`
/// when `relu`. A missing `weight` is one and a missing `bias` zero. Gradients flow to `x`,
/// `weight` and `bias`; the statistics are returned detached.
pub fn batch_norm_train(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    relu: bool,
) -> Result<(Tensor, BatchStats)> {
    let (replay, stats) = batch_norm_train_replay(x, weight, bias, epsilon, relu)?;
    Ok((replay.output().clone(), stats))
}

/// [`batch_norm_train`], kept for calling its backward pass directly; the backward gives the
/// gradients of `x`, the weight and the bias (of ones and zeros when those are missing).
pub fn batch_norm_train_replay(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    relu: bool,
) -> Result<(Replay3, BatchStats)> {
    let c = check_input(TRAIN_OP, x)?;
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(Error::invalid(format!(
            "{TRAIN_OP}: epsilon must be non-negative, got {epsilon}"
        )));
    }
    let weight = match weight {
        Some(w) => channel_vector(TRAIN_OP, "weight", w, x)?,
        None => Tensor::ones(c, DType::F32, x.device())?,
    };
    let bias = match bias {
        Some(b) => channel_vector(TRAIN_OP, "bias", b, x)?,
        None => Tensor::zeros(c, DType::F32, x.device())?,
    };
    let saved = Arc::new(OnceLock::new());
    let op = TrainOp {
        epsilon,
        relu,
        saved: Arc::clone(&saved),
    };
    let replay = Replay3::apply((&x.contiguous()?, &weight, &bias), op)?;
    let saved: &Saved = saved
        .get()
        .ok_or_else(|| Error::invalid(format!("{TRAIN_OP}: forward pass did not run")))?;
    let stats = BatchStats {
        mean: Tensor::from_slice(&saved.mean, c, x.device())?,
        var: Tensor::from_slice(&saved.var, c, x.device())?,
    };
    Ok((replay, stats))
}

/// `y = x * scale[c] + shift[c]` over the channels of the `(N, C, ...)` `f32` CPU tensor `x`,
/// then `max(y, 0)` when `relu`; differentiable in `x`, `scale` and `shift`. Inference-mode
/// batch normalisation is this with `scale = weight / sqrt(running_var + epsilon)` and
/// `shift = bias - running_mean * scale`.
pub fn channel_affine(x: &Tensor, scale: &Tensor, shift: &Tensor, relu: bool) -> Result<Tensor> {
    check_input(AFFINE_OP, x)?;
    let scale = channel_vector(AFFINE_OP, "scale", scale, x)?;
    let shift = channel_vector(AFFINE_OP, "shift", shift, x)?;
    Ok(x.contiguous()?
        .apply_op3(&scale, &shift, AffineOp { relu })?)
}

/// Checks that `x` suits the kernels and returns its channel count.
fn check_input(op: &str, x: &Tensor) -> Result<usize> {
    if !supported(x) {
        return Err(Error::invalid(format!(
            "{op}: expected an f32 CPU tensor of shape (N, C, ...), got {:?} {:?} on {:?}",
            x.dtype(),
            x.dims(),
            x.device()
        )));
    }
    let (n, c, s) = nc_plane(x.dims());
    if n * c * s == 0 {
        return Err(Error::invalid(format!(
            "{op}: the input {:?} has no elements to normalise",
            x.dims()
        )));
    }
    Ok(c)
}

/// `v` as a contiguous `(C,)` `f32` vector matching the channels of `x`, or an error naming the
/// op and both shapes.
fn channel_vector(op: &str, what: &str, v: &Tensor, x: &Tensor) -> Result<Tensor> {
    let c = x.dim(1)?;
    if v.dims() != [c] || v.dtype() != DType::F32 || !v.device().same_device(x.device()) {
        return Err(Error::invalid(format!(
            "{op}: {what} of shape {:?} ({:?}) does not match the input {:?} ({:?}), which needs ({c},)",
            v.dims(),
            v.dtype(),
            x.dims(),
            x.dtype()
        )));
    }
    Ok(v.contiguous()?)
}

/// What the forward pass keeps for the backward pass and the layer.
struct Saved {
    mean: Vec<f32>,
    var: Vec<f32>,
    invstd: Vec<f32>,
    /// `weight * invstd` and `bias - mean * weight * invstd`: the forward pass as an affine map.
    map: ChannelMap,
}

/// A per-channel affine map `x * scale + shift`.
struct ChannelMap {
    scale: Vec<f32>,
    shift: Vec<f32>,
}

/// One channel's batch statistics and the affine map they make, in `f64`.
struct ChannelNorm {
    mean: f64,
    var: f64,
    invstd: f64,
    scale: f64,
    shift: f64,
    /// `scale` and `shift` in `f32`, as the normalisation applies them.
    map: (f32, f32),
}

struct TrainOp {
    epsilon: f64,
    relu: bool,
    saved: Arc<OnceLock<Saved>>,
}

impl CustomOp3 for TrainOp {
    fn name(&self) -> &'static str {
        TRAIN_OP
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_data(TRAIN_OP, sx, lx)?;
        let (weight, bias) = (f32_data(TRAIN_OP, sw, lw)?, f32_data(TRAIN_OP, sb, lb)?);
        let (n, c, s) = nc_plane(lx.dims());
        let (y, norms) = if self.relu {
            Normalize::<true>::run(x, n, c, s, weight, bias, self.epsilon)
        } else {
            Normalize::<false>::run(x, n, c, s, weight, bias, self.epsilon)
        };
        let narrow = |f: fn(&ChannelNorm) -> f64| norms.iter().map(|v| f(v) as f32).collect();
        let saved = Saved {
            mean: narrow(|v| v.mean),
            var: narrow(|v| v.var),
            invstd: narrow(|v| v.invstd),
            map: ChannelMap {
                scale: narrow(|v| v.scale),
                shift: narrow(|v| v.shift),
            },
        };
        self.saved
            .set(saved)
            .map_err(|_| candle_core::Error::Msg(format!("{TRAIN_OP}: op applied twice")))?;
        Ok((CpuStorage::F32(y), lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let saved = self.saved.get().ok_or_else(|| {
            candle_core::Error::Msg(format!("{TRAIN_OP}: backward before forward"))
        })?;
        let weight = weight.to_vec1::<f32>()?;
        let (n, c, s) = nc_plane(x.dims());
        let count = (n * s) as f64;
        channel_backward(TRAIN_OP, x, grad, |xs, dy, b_image| {
            // dx = k * (dy' - mean(dy') - xhat * mean(dy' * xhat)) with k = weight * invstd,
            // written as a map of dy' and x - mean.
            let (dx, sums) = saved.map.backward(
                Inputs {
                    a: xs,
                    b: dy,
                    b_image,
                    c,
                    s,
                },
                Some(&saved.mean),
                self.relu,
                |ch, [sum_dy, sum_dy_centered]| {
                    let invstd = saved.invstd[ch] as f64;
                    let k = weight[ch] as f64 * invstd;
                    Linear {
                        dy: k as f32,
                        centered: (-k * invstd * invstd * sum_dy_centered / count) as f32,
                        constant: (-k * sum_dy / count) as f32,
                    }
                },
            );
            let dweight = sums
                .iter()
                .zip(&saved.invstd)
                .map(|(&[_, centered], &invstd)| (centered * invstd as f64) as f32)
                .collect();
            let dbias = sums.iter().map(|&[sum_dy, _]| sum_dy as f32).collect();
            (dx, dweight, dbias)
        })
    }
}

struct AffineOp {
    relu: bool,
}

impl CustomOp3 for AffineOp {
    fn name(&self) -> &'static str {
        AFFINE_OP
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_data(AFFINE_OP, sx, lx)?;
        let (scale, shift) = (f32_data(AFFINE_OP, sa, la)?, f32_data(AFFINE_OP, sb, lb)?);
        let (_, c, s) = nc_plane(lx.dims());
        let y = output::by_plane(x.len(), c, s, |i, ch, plane| {
            let (xs, a, b) = (&x[i * s..(i + 1) * s], scale[ch], shift[ch]);
            vectorized(
                #[inline(always)]
                || {
                    if self.relu {
                        plane.zip_with(xs, xs, |v, _| affine::<true>(v, a, b))
                    } else {
                        plane.zip_with(xs, xs, |v, _| affine::<false>(v, a, b))
                    }
                },
            )
        });
        Ok((CpuStorage::F32(y), lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        scale: &Tensor,
        shift: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let map = ChannelMap {
            scale: scale.to_vec1()?,
            shift: shift.to_vec1()?,
        };
        let (_, c, s) = nc_plane(x.dims());
        channel_backward(AFFINE_OP, x, grad, |xs, dy, b_image| {
            let (dx, sums) = map.backward(
                Inputs {
                    a: xs,
                    b: dy,
                    b_image,
                    c,
                    s,
                },
                None,
                self.relu,
                |ch, _| Linear {
                    dy: map.scale[ch],
                    centered: 0.0,
                    constant: 0.0,
                },
            );
            let dscale = sums.iter().map(|v| v[1] as f32).collect();
            let dshift = sums.iter().map(|v| v[0] as f32).collect();
            (dx, dscale, dshift)
        })
    }
}

/// Runs `backward` on the data of the input `x`, the output gradient and the values from one
/// of the gradient's images to the next (more than an image's when the gradient is a range of a
/// larger tensor's channels, read in place), and returns the gradient of `x` and of two
/// per-channel vectors as tensors.
fn channel_backward(
    op: &str,
    x: &Tensor,
    grad: &Tensor,
    backward: impl FnOnce(&[f32], &[f32], usize) -> (Vec<f32>, Vec<f32>, Vec<f32>),
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    if grad.dims() != x.dims() {
        candle_core::bail!(
            "{op}: an output gradient {:?} for an input {:?}",
            grad.dims(),
            x.dims()
        );
    }
    // The gradient is read in place when it is a range of a larger tensor's channels.
    let (dx, da, db) = with_f32(op, x, |xs| {
        with_f32_images(op, grad, |dy, b_image| Ok(backward(xs, dy, b_image)))
    })?;
    let c = da.len();
    Ok((
        Some(Tensor::from_vec(dx, x.shape(), x.device())?),
        Some(Tensor::from_vec(da, c, x.device())?),
        Some(Tensor::from_vec(db, c, x.device())?),
    ))
}

/// One channel's coefficients of the input gradient
/// `dx = dy * dy' + centered * (x - center) + constant`, where `dy'` is the output gradient with
/// the ReLU's mask applied.
#[derive(Clone, Copy)]
struct Linear {
    dy: f32,
    centered: f32,
    constant: f32,
}

impl ChannelMap {
    /// The backward pass through this map (and the ReLU when `relu`) for the input `x` and the
    /// output gradient `dy` (`g.a` and `g.b`): per channel, the sums
    /// `[sum(dy'), sum(dy' * (x - center))]` in `f64`, where `dy'` is `dy` masked by the ReLU
    /// through this map's pre-activation, then the input gradient with the coefficients that
    /// `linear(channel, sums)` makes of them (a [`ChannelKernel`]). Returns the input gradient
    /// and the sums.
    ///
    /// Without a `center` (an affine map of `x` itself, inference's), the sums take `x` as it
    /// is and the input gradient has no centred term (`linear`'s `centered` is not read), so a
    /// NaN in `x` leaves its own gradient `dy' * linear.dy + linear.constant` finite, as
    /// PyTorch's is.
    fn backward(
        &self,
        g: Inputs<'_>,
        center: Option<&[f32]>,
        relu: bool,
        linear: impl Fn(usize, [f64; 2]) -> Linear + Sync,
    ) -> (Vec<f32>, Vec<[f64; 2]>) {
        let zeros;
        let (dx, channels) = match (center, relu) {
            (Some(center), true) => self.backward_with::<true, true>(g, center, linear),
            (Some(center), false) => self.backward_with::<false, true>(g, center, linear),
            (None, relu) => {
                zeros = vec![0f32; g.c];
                match relu {
                    true => self.backward_with::<true, false>(g, &zeros, linear),
                    false => self.backward_with::<false, false>(g, &zeros, linear),
                }
            }
        };
        (
            dx,
            channels.into_iter().map(|channel| channel.sums).collect(),
        )
    }

    /// [`ChannelMap::backward`], with or without the ReLU, and the centred term.
    fn backward_with<const RELU: bool, const CENTERED: bool>(
        &self,
        g: Inputs<'_>,
        center: &[f32],
        linear: impl Fn(usize, [f64; 2]) -> Linear + Sync,
    ) -> (Vec<f32>, Vec<GradChannel>) {
        let kernel = Backward::<RELU, CENTERED, _> {
            map: self,
            center,
            linear,
        };
        two_pass::run(&kernel, g)
    }
}

/// The training forward pass (then the ReLU when `RELU`) as a [`ChannelKernel`] over `x`
/// (both inputs): each channel's mean and variance from sums around its first value, then
/// `y = x * scale + shift`.
struct Normalize<'a, const RELU: bool> {
    x: &'a [f32],
    s: usize,
    /// Values per channel.
    count: f64,
    weight: &'a [f32],
    bias: &'a [f32],
    epsilon: f64,
}

impl<'a, const RELU: bool> Normalize<'a, RELU> {
    /// Normalises the `n` images of `c` planes of `s` values of `x`.
    fn run(
        x: &'a [f32],
        n: usize,
        c: usize,
        s: usize,
        weight: &'a [f32],
        bias: &'a [f32],
        epsilon: f64,
    ) -> (Vec<f32>, Vec<ChannelNorm>) {
        let kernel = Self {
            x,
            s,
            count: (n * s) as f64,
            weight,
            bias,
            epsilon,
        };
        two_pass::run(
            &kernel,
            Inputs {
                a: x,
                b: x,
                b_image: c * s,
                c,
                s,
            },
        )
    }
}

impl<const RELU: bool> ChannelKernel for Normalize<'_, RELU> {
    type Channel = ChannelNorm;

    #[inline(always)]
    fn sums(&self, ch: usize, x: &[f32], _: &[f32], sums: &mut PairSums) {
        let shift = self.x[ch * self.s];
        sums.add(x, x, |v, _| {
            let d = v - shift;
            (d, d * d)
        });
    }

    fn finish(&self, ch: usize, [sum, squares]: [f64; 2]) -> ChannelNorm {
        let shifted_mean = sum / self.count;
        // Rounding may leave a tiny negative difference, clamped to zero; a NaN (a NaN in the
        // channel) stays, as PyTorch's variance does (`f64::max` would make it zero).
        let var = squares / self.count - shifted_mean * shifted_mean;
        let var = if var < 0.0 { 0.0 } else { var };
        let mean = self.x[ch * self.s] as f64 + shifted_mean;
        let invstd = 1.0 / (var + self.epsilon).sqrt();
        let scale = self.weight[ch] as f64 * invstd;
        let shift = self.bias[ch] as f64 - mean * scale;
        ChannelNorm {
            mean,
            var,
            invstd,
            scale,
            shift,
            map: (scale as f32, shift as f32),
        }
    }

    #[inline(always)]
    fn value(&self, norm: &ChannelNorm, x: f32, _: f32) -> f32 {
        affine::<RELU>(x, norm.map.0, norm.map.1)
    }
}

/// The backward pass through a [`ChannelMap`] (and the ReLU when `RELU`, the input
/// gradient's centred term when `CENTERED`) as a [`ChannelKernel`] over `x` and `dy`; see
/// [`ChannelMap::backward`].
struct Backward<'a, const RELU: bool, const CENTERED: bool, L> {
    map: &'a ChannelMap,
    center: &'a [f32],
    linear: L,
}

/// One channel's constants of [`Backward`]'s second pass, and its sums.
struct GradChannel {
    /// The forward map's scale and shift, which give the ReLU's mask.
    a: f32,
    b: f32,
    /// The center of `x`.
    m: f32,
    lin: Linear,
    sums: [f64; 2],
}

impl<const RELU: bool, const CENTERED: bool, L> ChannelKernel for Backward<'_, RELU, CENTERED, L>
where
    L: Fn(usize, [f64; 2]) -> Linear + Sync,
{
    type Channel = GradChannel;

    #[inline(always)]
    fn sums(&self, ch: usize, x: &[f32], dy: &[f32], sums: &mut PairSums) {
        let (a, b, m) = (self.map.scale[ch], self.map.shift[ch], self.center[ch]);
        sums.add(x, dy, |v, g| {
            let mask = relu_mask::<RELU>(v, a, b);
            // The product reads the whole of `dy` (see `select`).
            let product = g * (v - m);
            (select(mask, g, 0.0), select(mask, product, 0.0))
        });
    }

    fn finish(&self, ch: usize, sums: [f64; 2]) -> GradChannel {
        GradChannel {
            a: self.map.scale[ch],
            b: self.map.shift[ch],
            m: self.center[ch],
            lin: (self.linear)(ch, sums),
            sums,
        }
    }

    #[inline(always)]
    fn value(&self, ch: &GradChannel, v: f32, g: f32) -> f32 {
        let Linear {
            dy: k,
            centered: p,
            constant: q,
        } = ch.lin;
        let rest = if CENTERED { p * (v - ch.m) + q } else { q };
        select(relu_mask::<RELU>(v, ch.a, ch.b), rest + k * g, rest)
    }
}

/// `v * a + b`, then the ReLU when `RELU` (NaN stays NaN).
#[inline(always)]
fn affine<const RELU: bool>(v: f32, a: f32, b: f32) -> f32 {
    let z = v * a + b;
    if RELU {
        crate::relu::scalar(z)
    } else {
        z
    }
}

/// Where the ReLU (when `RELU`) passes the gradient: every bit set where the pre-activation
/// `v * a + b` is `>= 0` (or NaN), none elsewhere.
#[inline(always)]
fn relu_mask<const RELU: bool>(v: f32, a: f32, b: f32) -> u32 {
    if RELU {
        ((v * a + b < 0.0) as u32).wrapping_sub(1)
    } else {
        u32::MAX
    }
}

/// `on` where `mask` is set, else `off`: a bitwise select, which vectorises where a branch
/// would not.
///
/// Callers select computed values rather than a value loaded from memory: a selected load
/// becomes a masked load, which here streams from memory at half the speed of a plain one.
#[inline(always)]
fn select(mask: u32, on: f32, off: f32) -> f32 {
    f32::from_bits((on.to_bits() & mask) | (off.to_bits() & !mask))
}

#[cfg(test)]
mod tests;
