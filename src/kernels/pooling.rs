//! Max and average pooling on the CPU with dedicated backward passes.
//!
//! Both take an `(N, C, H, W)` `f32` tensor and any window, stride and zero-or-more padding on
//! each side. Padding is never a candidate: a max pool takes the maximum of a window's real
//! elements, and an average pool divides by their count (TensorFlow's `same` convention; with
//! `valid` every window is full).
//!
//! The max pool records the position of each window's maximum while it runs, and its backward
//! pass adds each output gradient to that one position. On ties the first maximum in row-major
//! window order wins (as in PyTorch); a NaN in a window wins over numbers, so NaNs propagate.
//! The average pool's backward pass spreads each output gradient evenly over its window.

use std::sync::{Arc, OnceLock};

use super::planes::{f32_data, for_each_plane, with_f32};
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

const MAX_OP: &str = "max_pool2d";
const AVG_OP: &str = "avg_pool2d";

/// Marks an output whose window holds no real element (none can, with `same` or `valid`).
const NO_ARGMAX: u32 = u32::MAX;

/// A pooling window's size, strides and padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolWindow {
    /// `(height, width)` of the window.
    pub window: (usize, usize),
    /// `(vertical, horizontal)` strides.
    pub stride: (usize, usize),
    /// Padding: top, bottom, left, right.
    pub pad: (usize, usize, usize, usize),
}

/// Whether the kernels here can run on `x`: an `f32` CPU tensor of shape `(N, C, H, W)`.
pub fn supported(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && x.rank() == 4
}

/// The maximum over each window of the `(N, C, H, W)` `f32` CPU tensor `x`, differentiable.
pub fn max_pool2d(x: &Tensor, window: &PoolWindow) -> Result<Tensor> {
    let plan = Plan::new(MAX_OP, x, window)?;
    let op = MaxPool {
        plan,
        argmax: Arc::new(OnceLock::new()),
    };
    Ok(x.contiguous()?.apply_op1(op)?)
}

/// The mean over each window's real elements of the `(N, C, H, W)` `f32` CPU tensor `x`,
/// differentiable.
pub fn avg_pool2d(x: &Tensor, window: &PoolWindow) -> Result<Tensor> {
    let plan = Plan::new(AVG_OP, x, window)?;
    Ok(x.contiguous()?.apply_op1(AvgPool { plan })?)
}

/// Where every window lands on one `(H, W)` plane.
#[derive(Debug, Clone)]
struct Plan {
    /// Input height and width.
    input: (usize, usize),
    /// The real rows `[start, end)` of each output row's window.
    rows: Vec<(usize, usize)>,
    /// The real columns `[start, end)` of each output column's window.
    cols: Vec<(usize, usize)>,
}

impl Plan {
    fn new(op: &str, x: &Tensor, w: &PoolWindow) -> Result<Self> {
        if !supported(x) {
            return Err(Error::invalid(format!(
                "{op}: expected an f32 CPU tensor of shape (N, C, H, W), got {:?} {:?} on {:?}",
                x.dtype(),
                x.dims(),
                x.device()
            )));
        }
        let (_, _, h, wd) = x.dims4()?;
        let (kh, kw) = w.window;
        let (sh, sw) = w.stride;
        let (pt, pb, pl, pr) = w.pad;
        let rows = spans(h, kh, sh, pt, pb);
        let cols = spans(wd, kw, sw, pl, pr);
        match (rows, cols) {
            (Some(rows), Some(cols)) => Ok(Self {
                input: (h, wd),
                rows,
                cols,
            }),
            _ => Err(Error::invalid(format!(
                "{op}: a {kh}x{kw} window with strides ({sh}, {sw}) and padding {:?} does not fit \
                 the input {:?}",
                w.pad,
                x.dims()
            ))),
        }
    }

    fn in_plane(&self) -> usize {
        self.input.0 * self.input.1
    }

    fn out_plane(&self) -> usize {
        self.rows.len() * self.cols.len()
    }

    fn out_shape(&self, dims: &[usize]) -> Shape {
        Shape::from((dims[0], dims[1], self.rows.len(), self.cols.len()))
    }

    /// Calls `visit(output index, rows, cols)` for every window of a plane.
    #[inline(always)]
    fn for_each_window(&self, mut visit: impl FnMut(usize, (usize, usize), (usize, usize))) {
        let mut o = 0;
        for &r in &self.rows {
            for &c in &self.cols {
                visit(o, r, c);
                o += 1;
            }
        }
    }
}

/// The real `[start, end)` span of each window along an axis of `input` elements, or `None`
/// when not even one window fits.
fn spans(
    input: usize,
    k: usize,
    stride: usize,
    before: usize,
    after: usize,
) -> Option<Vec<(usize, usize)>> {
    let padded = input + before + after;
    if k == 0 || stride == 0 || padded < k || input == 0 {
        return None;
    }
    let out = (padded - k) / stride + 1;
    Some(
        (0..out)
            .map(|o| {
                let start = (o * stride).saturating_sub(before).min(input);
                let end = (o * stride + k).saturating_sub(before).min(input);
                (start, end)
            })
            .collect(),
    )
}

struct MaxPool {
    plan: Plan,
    /// Per output, the index within its input plane of the window's maximum.
    argmax: Arc<OnceLock<Vec<u32>>>,
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        MAX_OP
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_data(MAX_OP, storage, layout)?;
        let plan = &self.plan;
        let width = plan.input.1;
        let (in_len, out_len) = (plan.in_plane(), plan.out_plane());
        let mut best = vec![(f32::NEG_INFINITY, NO_ARGMAX); x.len() / in_len * out_len];
        for_each_plane(&mut best, 1, out_len, |i, _, out| {
            let xp = &x[i * in_len..(i + 1) * in_len];
            plan.for_each_window(|o, (r0, r1), (c0, c1)| {
                let (mut max, mut at) = (f32::NEG_INFINITY, NO_ARGMAX);
                for r in r0..r1 {
                    for (c, &v) in xp[r * width + c0..r * width + c1].iter().enumerate() {
                        if at == NO_ARGMAX || v > max || (v.is_nan() && !max.is_nan()) {
                            max = v;
                            at = (r * width + c0 + c) as u32;
                        }
                    }
                }
                out[o] = (max, at);
            });
        });
        let (y, argmax): (Vec<f32>, Vec<u32>) = best.into_iter().unzip();
        self.argmax
            .set(argmax)
            .map_err(|_| candle_core::Error::Msg(format!("{MAX_OP}: op applied twice")))?;
        Ok((CpuStorage::F32(y), plan.out_shape(layout.dims())))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let argmax = self
            .argmax
            .get()
            .ok_or_else(|| candle_core::Error::Msg(format!("{MAX_OP}: backward before forward")))?;
        let plan = &self.plan;
        let (in_len, out_len) = (plan.in_plane(), plan.out_plane());
        let dx = with_f32(MAX_OP, grad, |dy| {
            let mut dx = vec![0f32; x.elem_count()];
            for_each_plane(&mut dx, 1, in_len, |i, _, dxp| {
                let outputs = i * out_len..(i + 1) * out_len;
                for (&g, &at) in dy[outputs.clone()].iter().zip(&argmax[outputs]) {
                    if at != NO_ARGMAX {
                        dxp[at as usize] += g;
                    }
                }
            });
            Ok(dx)
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

struct AvgPool {
    plan: Plan,
}

impl AvgPool {
    /// One over the number of real elements in each window of a plane.
    fn inverse_counts(&self) -> Vec<f32> {
        let mut inv = vec![0f32; self.plan.out_plane()];
        self.plan.for_each_window(|o, (r0, r1), (c0, c1)| {
            let count = (r1 - r0) * (c1 - c0);
            inv[o] = if count == 0 { 0.0 } else { 1.0 / count as f32 };
        });
        inv
    }
}

impl CustomOp1 for AvgPool {
    fn name(&self) -> &'static str {
        AVG_OP
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_data(AVG_OP, storage, layout)?;
        let plan = &self.plan;
        let width = plan.input.1;
        let inv = self.inverse_counts();
        let (in_len, out_len) = (plan.in_plane(), plan.out_plane());
        let mut y = vec![0f32; x.len() / in_len * out_len];
        for_each_plane(&mut y, 1, out_len, |i, _, yp| {
            let xp = &x[i * in_len..(i + 1) * in_len];
            plan.for_each_window(|o, (r0, r1), (c0, c1)| {
                let sum: f32 = (r0..r1)
                    .map(|r| xp[r * width + c0..r * width + c1].iter().sum::<f32>())
                    .sum();
                yp[o] = sum * inv[o];
            });
        });
        Ok((CpuStorage::F32(y), plan.out_shape(layout.dims())))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let plan = &self.plan;
        let width = plan.input.1;
        let inv = self.inverse_counts();
        let dx = with_f32(AVG_OP, grad, |dy| {
            let mut dx = vec![0f32; x.elem_count()];
            let (in_len, out_len) = (plan.in_plane(), plan.out_plane());
            for_each_plane(&mut dx, 1, in_len, |i, _, dxp| {
                let g = &dy[i * out_len..(i + 1) * out_len];
                plan.for_each_window(|o, (r0, r1), (c0, c1)| {
                    let share = g[o] * inv[o];
                    for r in r0..r1 {
                        dxp[r * width + c0..r * width + c1]
                            .iter_mut()
                            .for_each(|d| *d += share);
                    }
                });
            });
            Ok(dx)
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}
