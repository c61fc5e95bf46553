//! Fused BatchNorm on the CPU: one pass for the statistics, one for the normalisation.
//!
//! [`batch_norm_train`] normalises an `(N, C, ...)` `f32` tensor with its batch statistics and
//! returns them, so the layer can move its running averages. The statistics are sums of the
//! values shifted by the channel's first value, which keeps the variance accurate even when the
//! mean is large, over short `f32` runs added in `f64`. Its backward pass takes two passes: one for
//! the per-channel sums of `dy` and `dy * xhat` (the gradients of the offset and scale), one
//! for `dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))`.
//!
//! [`channel_affine`] is the inference form, `y = x * scale[c] + shift[c]` with the running
//! statistics folded into `scale` and `shift`, differentiable in all three.
//!
//! Both can fold a following ReLU into the same pass (`relu = true`); its gradient passes
//! where the pre-activation is `>= 0`, as candle's ReLU does.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::planes::{channel_sums, f32_data, for_each_plane, lane_sums, nc_plane, with_f32};
use super::replay::Replay3;
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
pub(crate) fn batch_norm_train_replay(
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
        let (mean, var) = statistics(x, n, c, s);
        let mut saved = Saved {
            mean: Vec::with_capacity(c),
            var: Vec::with_capacity(c),
            invstd: Vec::with_capacity(c),
            map: ChannelMap {
                scale: Vec::with_capacity(c),
                shift: Vec::with_capacity(c),
            },
        };
        for ch in 0..c {
            let invstd = 1.0 / (var[ch] + self.epsilon).sqrt();
            let scale = weight[ch] as f64 * invstd;
            saved.mean.push(mean[ch] as f32);
            saved.var.push(var[ch] as f32);
            saved.invstd.push(invstd as f32);
            saved.map.scale.push(scale as f32);
            saved
                .map
                .shift
                .push((bias[ch] as f64 - mean[ch] * scale) as f32);
        }
        let y = saved.map.apply(x, c, s, self.relu);
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
        channel_backward(TRAIN_OP, x, grad, |xs, dy| {
            let sums = saved.map.grad_sums(xs, dy, c, s, &saved.mean, self.relu);
            let mut lin = Linear::with_capacity(c);
            let (mut dweight, mut dbias) = (Vec::with_capacity(c), Vec::with_capacity(c));
            for (ch, &[sum_dy, sum_dy_centered]) in sums.iter().enumerate() {
                let invstd = saved.invstd[ch] as f64;
                let dy_xhat = sum_dy_centered * invstd;
                let k = weight[ch] as f64 * invstd;
                lin.dy.push(k as f32);
                lin.centered.push((-k * invstd * dy_xhat / count) as f32);
                lin.constant.push((-k * sum_dy / count) as f32);
                dweight.push(dy_xhat as f32);
                dbias.push(sum_dy as f32);
            }
            let dx = saved
                .map
                .grad_input(xs, dy, c, s, &saved.mean, &lin, self.relu);
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
        let map = ChannelMap {
            scale: f32_data(AFFINE_OP, sa, la)?.to_vec(),
            shift: f32_data(AFFINE_OP, sb, lb)?.to_vec(),
        };
        let (_, c, s) = nc_plane(lx.dims());
        Ok((
            CpuStorage::F32(map.apply(x, c, s, self.relu)),
            lx.shape().clone(),
        ))
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
        let zeros = vec![0f32; c];
        channel_backward(AFFINE_OP, x, grad, |xs, dy| {
            let sums = map.grad_sums(xs, dy, c, s, &zeros, self.relu);
            let lin = Linear {
                dy: map.scale.clone(),
                centered: zeros.clone(),
                constant: zeros.clone(),
            };
            let dx = map.grad_input(xs, dy, c, s, &zeros, &lin, self.relu);
            let dscale = sums.iter().map(|v| v[1] as f32).collect();
            let dshift = sums.iter().map(|v| v[0] as f32).collect();
            (dx, dscale, dshift)
        })
    }
}

/// Runs `backward` on the data of the input `x` and the output gradient, and returns the
/// gradient of `x` and of two per-channel vectors as tensors.
fn channel_backward(
    op: &str,
    x: &Tensor,
    grad: &Tensor,
    backward: impl FnOnce(&[f32], &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>),
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (dx, da, db) = with_f32(op, x, |xs| with_f32(op, grad, |dy| Ok(backward(xs, dy))))?;
    let c = da.len();
    Ok((
        Some(Tensor::from_vec(dx, x.shape(), x.device())?),
        Some(Tensor::from_vec(da, c, x.device())?),
        Some(Tensor::from_vec(db, c, x.device())?),
    ))
}

/// Per-channel coefficients of the input gradient
/// `dx = dy_coef * dy' + centered_coef * (x - center) + constant`, where `dy'` is the output
/// gradient with the ReLU's mask applied.
struct Linear {
    dy: Vec<f32>,
    centered: Vec<f32>,
    constant: Vec<f32>,
}

impl Linear {
    fn with_capacity(c: usize) -> Self {
        Self {
            dy: Vec::with_capacity(c),
            centered: Vec::with_capacity(c),
            constant: Vec::with_capacity(c),
        }
    }
}

impl ChannelMap {
    /// `x * scale + shift` per channel (then the ReLU), as a new buffer.
    fn apply(&self, x: &[f32], c: usize, s: usize, relu: bool) -> Vec<f32> {
        let mut y = vec![0f32; x.len()];
        for_each_plane(&mut y, c, s, |i, ch, out| {
            let (a, b) = (self.scale[ch], self.shift[ch]);
            let xs = &x[i * s..(i + 1) * s];
            if relu {
                out.iter_mut().zip(xs).for_each(|(o, &v)| {
                    let z = v * a + b;
                    *o = if z < 0.0 { 0.0 } else { z };
                });
            } else {
                out.iter_mut().zip(xs).for_each(|(o, &v)| *o = v * a + b);
            }
        });
        y
    }

    /// Per channel, `[sum(dy'), sum(dy' * (x - center))]` in `f64`, where `dy'` is `dy` masked
    /// by the ReLU (when `relu`) through this map's pre-activation.
    fn grad_sums(
        &self,
        x: &[f32],
        dy: &[f32],
        c: usize,
        s: usize,
        center: &[f32],
        relu: bool,
    ) -> Vec<[f64; 2]> {
        let n = x.len() / (c * s);
        channel_sums(n, c, |i, ch| {
            let (a, b, m) = (self.scale[ch], self.shift[ch], center[ch]);
            let range = i * s..(i + 1) * s;
            if relu {
                lane_sums(&x[range.clone()], &dy[range], |v, g| {
                    let g = masked::<true>(v, g, a, b);
                    (g, g * (v - m))
                })
            } else {
                lane_sums(&x[range.clone()], &dy[range], |v, g| (g, g * (v - m)))
            }
        })
    }

    /// The input gradient `lin.dy * dy' + lin.centered * (x - center) + lin.constant`.
    #[allow(clippy::too_many_arguments)]
    fn grad_input(
        &self,
        x: &[f32],
        dy: &[f32],
        c: usize,
        s: usize,
        center: &[f32],
        lin: &Linear,
        relu: bool,
    ) -> Vec<f32> {
        let mut dx = vec![0f32; x.len()];
        for_each_plane(&mut dx, c, s, |i, ch, out| {
            let (a, b, m) = (self.scale[ch], self.shift[ch], center[ch]);
            let (k, p, q) = (lin.dy[ch], lin.centered[ch], lin.constant[ch]);
            let range = i * s..(i + 1) * s;
            let (xs, gs) = (&x[range.clone()], &dy[range]);
            if relu {
                for ((o, &v), &g) in out.iter_mut().zip(xs).zip(gs) {
                    *o = k * masked::<true>(v, g, a, b) + p * (v - m) + q;
                }
            } else {
                for ((o, &v), &g) in out.iter_mut().zip(xs).zip(gs) {
                    *o = k * g + p * (v - m) + q;
                }
            }
        });
        dx
    }
}

/// `g` where the pre-activation `v * a + b` is `>= 0` (or NaN), else zero, when `RELU`.
#[inline(always)]
fn masked<const RELU: bool>(v: f32, g: f32, a: f32, b: f32) -> f32 {
    if RELU && v * a + b < 0.0 {
        0.0
    } else {
        g
    }
}

/// Per-channel mean and biased variance of `n` images of `c` planes of `s` values, from sums
/// around each channel's first value.
fn statistics(x: &[f32], n: usize, c: usize, s: usize) -> (Vec<f64>, Vec<f64>) {
    let sums = channel_sums(n, c, |i, ch| {
        let shift = x[ch * s];
        let plane = &x[i * s..(i + 1) * s];
        lane_sums(plane, plane, |v, _| {
            let d = v - shift;
            (d, d * d)
        })
    });
    let count = (n * s) as f64;
    sums.iter()
        .enumerate()
        .map(|(ch, &[sum, squares])| {
            let shifted_mean = sum / count;
            let var = (squares / count - shifted_mean * shifted_mean).max(0.0);
            (x[ch * s] as f64 + shifted_mean, var)
        })
        .unzip()
}
