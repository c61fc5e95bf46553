//! Max and average pooling on the CPU with dedicated backward passes.
//!
//! Both take an `(N, C, H, W)` `f32` tensor and any window, stride and zero-or-more padding on
//! each side. Padding is never a candidate: a max pool takes the maximum of a window's real
//! elements, and an average pool divides by their count (TensorFlow's `same` convention; with
//! `valid` every window is full).
//!
//! The max pool records the position of each window's maximum while it runs when a backward
//! pass is to follow (in inference it finds the maxima alone), and its backward pass adds each
//! output gradient to that one position. On ties the first maximum in row-major
//! window order wins (as in PyTorch); a NaN in a window wins over numbers, so NaNs propagate.
//! The average pool's backward pass spreads each output gradient evenly over its window.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::concat::ChannelSlot;
use super::output;
use super::planes::{f32_data, for_each_plane, for_each_plane_pair, for_each_plane_with, with_f32};
use super::replay::Replay1;
use super::simd::{vectorized, SimdLevel};
use crate::{Error, Result};

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
/// The forward pass finds the maxima alone, for inference; a backward pass, if one follows,
/// finds their positions again first.
pub fn max_pool2d(x: &Tensor, window: &PoolWindow) -> Result<Tensor> {
    let op = MaxPool::new(Plan::new(MAX_OP, x, window)?, false);
    Ok(x.contiguous()?.apply_op1(op)?)
}

/// [`max_pool2d`]'s maxima written into a concatenation's channels (`slot`) instead of a
/// tensor of their own, for inference (not differentiable). Errors as [`max_pool2d`]'s, and
/// when the result's shape is not the slot's.
pub fn max_pool2d_into(x: &Tensor, window: &PoolWindow, slot: &mut ChannelSlot<'_>) -> Result<()> {
    let plan = Plan::new(MAX_OP, x, window)?;
    let (n, c, _, _) = x.dims4()?;
    let (out, offset) = slot.target(MAX_OP, plan.out_shape(x.dims()).dims())?;
    let (in_len, out_len) = (plan.in_plane(), plan.out_plane());
    with_f32(MAX_OP, x, |x| {
        out.try_fill((1, n > 1), (offset, c * out_len), None, |i, mut image| {
            let mut columns = vec![0f32; plan.input.1];
            for y in image.each() {
                vectorized(
                    #[inline(always)]
                    || {
                        for (ch, yp) in y.chunks_exact_mut(out_len).enumerate() {
                            let xp = &x[(i * c + ch) * in_len..][..in_len];
                            plan.max_values(xp, yp, &mut columns);
                        }
                    },
                );
            }
            Ok(())
        })
    })?;
    Ok(())
}

/// [`max_pool2d`] recording where each maximum is as it runs, for a backward pass that follows,
/// kept for calling that backward pass directly.
pub fn max_pool2d_replay(x: &Tensor, window: &PoolWindow) -> Result<Replay1> {
    let op = MaxPool::new(Plan::new(MAX_OP, x, window)?, true);
    Ok(Replay1::apply(&x.contiguous()?, op)?)
}

/// The mean over each window's real elements of the `(N, C, H, W)` `f32` CPU tensor `x`,
/// differentiable.
pub fn avg_pool2d(x: &Tensor, window: &PoolWindow) -> Result<Tensor> {
    Ok(avg_pool2d_replay(x, window)?.output().clone())
}

/// [`avg_pool2d`], kept for calling its backward pass directly.
pub fn avg_pool2d_replay(x: &Tensor, window: &PoolWindow) -> Result<Replay1> {
    let plan = Plan::new(AVG_OP, x, window)?;
    Ok(Replay1::apply(&x.contiguous()?, AvgPool { plan })?)
}

/// Where every window lands on one `(H, W)` plane.
#[derive(Debug, Clone)]
struct Plan {
    /// The window, strides and padding.
    window: PoolWindow,
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
        if h * wd >= NO_ARGMAX as usize {
            return Err(Error::invalid(format!(
                "{op}: planes of {h}x{wd} are too large to index with 32 bits, in {:?}",
                x.dims()
            )));
        }
        let (kh, kw) = w.window;
        let (sh, sw) = w.stride;
        let (pt, pb, pl, pr) = w.pad;
        let rows = spans(h, kh, sh, pt, pb);
        let cols = spans(wd, kw, sw, pl, pr);
        match (rows, cols) {
            (Some(rows), Some(cols)) => Ok(Self {
                window: *w,
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

    /// Whether one window covers the whole plane (global pooling).
    fn is_global(&self) -> bool {
        let (h, w) = self.input;
        self.rows == [(0, h)] && self.cols == [(0, w)]
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

    /// The maximum of each window of the plane `xp` into `y`, without the positions: for each
    /// output row, the maximum of every column over the window's rows (`column_max`, the
    /// plane's width), then of those over each window's columns. Inference's path; as
    /// [`Self::max_plane`] but for the positions, NaNs winning alike.
    #[inline(always)]
    fn max_values(&self, xp: &[f32], y: &mut [f32], column_max: &mut [f32]) {
        let width = self.input.1;
        let ow = self.cols.len();
        let column_max = &mut column_max[..width];
        for (&(r0, r1), y_row) in self.rows.iter().zip(y.chunks_mut(ow)) {
            if r0 == r1 {
                y_row.fill(f32::NEG_INFINITY);
                continue;
            }
            column_max.copy_from_slice(&xp[r0 * width..][..width]);
            for r in (r0 + 1)..r1 {
                fold_values(column_max, &xp[r * width..][..width]);
            }
            for (yv, &(c0, c1)) in y_row.iter_mut().zip(&self.cols) {
                *yv = column_max[c0..c1]
                    .iter()
                    .fold(f32::NEG_INFINITY, |max, &v| nan_max(max, v));
            }
        }
    }

    /// The maximum of each window of the plane `xp` into `y` and its index in the plane into
    /// `argmax`, for the backward pass.
    ///
    /// For each output row it first takes the maximum of every column over the window's rows,
    /// then of those over each window's columns. Both run on whole sets of [`LANES`] values
    /// (the padded row is as long as a whole number of them, its padding `-inf`), so that
    /// rows of 7 or 15 values take vector operations too rather than a vectorised loop's
    /// scalar tail.
    #[inline(always)]
    fn max_plane(&self, xp: &[f32], y: &mut [f32], argmax: &mut [u32], scratch: &mut MaxScratch) {
        let width = self.input.1;
        let left = self.window.pad.2;
        let (kw, sw) = (self.window.window.1, self.window.stride.1);
        let ow = self.cols.len();
        let MaxScratch {
            row,
            column_index,
            cols,
            phases,
        } = scratch;
        let padded = row.len();
        for (i, (&(r0, r1), y_row)) in self.rows.iter().zip(y.chunks_mut(ow)).enumerate() {
            let at_row = &mut argmax[i * ow..(i + 1) * ow];
            cols.fill(f32::NEG_INFINITY, NO_ARGMAX);
            for r in r0..r1 {
                row[left..left + width].copy_from_slice(&xp[r * width..(r + 1) * width]);
                let base = (r * width) as u32;
                let sets = row.as_chunks::<LANES>().0.iter();
                let indices = column_index.as_chunks::<LANES>().0;
                for ((values, offsets), (max, at)) in sets.zip(indices).zip(cols.sets()) {
                    let index = offsets.map(|offset| offset.saturating_add(base));
                    fold_lanes((max, at), (values, &index));
                }
            }
            // The column maxima split by column modulo the stride: window `j` covers padded
            // columns `j * sw + k`, entry `j + k / sw` of phase `k % sw`.
            if sw == 2 {
                let [even, odd] = &mut phases[..] else {
                    unreachable!("two phases at stride 2")
                };
                let pairs = cols.max.as_chunks::<2>().0;
                let (e, o) = (&mut even.max[..pairs.len()], &mut odd.max[..pairs.len()]);
                for ((e, o), pair) in e.iter_mut().zip(o.iter_mut()).zip(pairs) {
                    (*e, *o) = (pair[0], pair[1]);
                }
                let pairs = cols.at.as_chunks::<2>().0;
                let (e, o) = (&mut even.at[..pairs.len()], &mut odd.at[..pairs.len()]);
                for ((e, o), pair) in e.iter_mut().zip(o.iter_mut()).zip(pairs) {
                    (*e, *o) = (pair[0], pair[1]);
                }
            } else {
                for (p, phase) in phases.iter_mut().enumerate() {
                    let (max, at) = (&cols.max[p.min(padded)..], &cols.at[p.min(padded)..]);
                    for (dst, src) in phase.max.iter_mut().zip(max.iter().step_by(sw)) {
                        *dst = *src;
                    }
                    for (dst, src) in phase.at.iter_mut().zip(at.iter().step_by(sw)) {
                        *dst = *src;
                    }
                }
            }
            for j0 in (0..ow).step_by(LANES) {
                let mut best = [f32::NEG_INFINITY; LANES];
                let mut best_at = [NO_ARGMAX; LANES];
                for k in 0..kw {
                    let phase = &phases[k % sw];
                    let at = j0 + k / sw;
                    let values = phase.max[at..at + LANES].try_into().unwrap_or(&best);
                    let index = phase.at[at..at + LANES].try_into().unwrap_or(&best_at);
                    let (values, index) = (*values, *index);
                    fold_lanes((&mut best, &mut best_at), (&values, &index));
                }
                let n = LANES.min(ow - j0);
                y_row[j0..j0 + n].copy_from_slice(&best[..n]);
                at_row[j0..j0 + n].copy_from_slice(&best_at[..n]);
            }
        }
    }

    /// The input gradient, `len` values: `add(i, plane)` adds the gradient of the outputs of
    /// plane `i` to the zeroed input plane, in parallel over the planes.
    ///
    /// The buffer is zeroed whole by the allocator first. Zeroing each plane as it is written
    /// measured slower here for page-sized planes: the allocator's zeroing writes whole cache
    /// lines without reading them, and streams across pages, where a plane of one page makes a
    /// cold start for every plane.
    fn input_gradient(
        &self,
        len: usize,
        add: impl Fn(usize, &mut [f32]) + Sync + Send,
    ) -> Vec<f32> {
        let mut dx = vec![0f32; len];
        for_each_plane(&mut dx, 1, self.in_plane(), |i, _, dxp| add(i, dxp));
        dx
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
    /// Whether the forward pass records where each maximum is.
    record: bool,
    /// Per output, the index within its input plane of the window's maximum: recorded by the
    /// forward pass, or found by the backward pass when the forward did not record it.
    argmax: Arc<OnceLock<Vec<u32>>>,
}

impl MaxPool {
    fn new(plan: Plan, record: bool) -> Self {
        Self {
            plan,
            record,
            argmax: Arc::new(OnceLock::new()),
        }
    }

    /// The maxima of the planes of `x` (`outputs` values), and their positions when `ARGMAX`.
    fn pool<const ARGMAX: bool>(&self, x: &[f32], outputs: usize) -> (Vec<f32>, Vec<u32>) {
        let plan = &self.plan;
        let (in_len, out_len) = (plan.in_plane(), plan.out_plane());
        let mut y = vec![0f32; outputs];
        let mut argmax = vec![0u32; if ARGMAX { outputs } else { 0 }];
        let plane = |i: usize| &x[i * in_len..(i + 1) * in_len];
        if ARGMAX {
            let scratch = || MaxScratch::new(plan);
            // Compiled for AVX-512 where it is in use, at the baseline width otherwise: with
            // AVX2 the compiler stores the positions' selects with masked stores, which AMD's
            // cores run slowly (a Zen 4: 15-32% slower than the baseline width).
            let wide = SimdLevel::in_use() == SimdLevel::Avx512;
            let fill = |scratch: &mut MaxScratch, i: usize, yp: &mut [f32], ap: &mut [u32]| {
                if wide {
                    vectorized(
                        #[inline(always)]
                        || plan.max_plane(plane(i), yp, ap, scratch),
                    );
                } else {
                    plan.max_plane(plane(i), yp, ap, scratch);
                }
            };
            for_each_plane_pair(&mut y, &mut argmax, out_len, scratch, fill);
        } else {
            let columns = || vec![0f32; plan.input.1];
            for_each_plane_with(&mut y, out_len, columns, |columns, i, yp| {
                vectorized(
                    #[inline(always)]
                    || plan.max_values(plane(i), yp, columns),
                );
            });
        }
        (y, argmax)
    }
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
        let outputs = x.len() / plan.in_plane() * plan.out_plane();
        let y = if self.record {
            let (y, argmax) = self.pool::<true>(x, outputs);
            self.argmax
                .set(argmax)
                .map_err(|_| candle_core::Error::Msg(format!("{MAX_OP}: op applied twice")))?;
            y
        } else {
            self.pool::<false>(x, outputs).0
        };
        Ok((CpuStorage::F32(y), plan.out_shape(layout.dims())))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let argmax = match self.argmax.get() {
            Some(argmax) => argmax,
            None => {
                let plan = &self.plan;
                let outputs = x.elem_count() / plan.in_plane().max(1) * plan.out_plane();
                let found = with_f32(MAX_OP, x, |x| Ok(self.pool::<true>(x, outputs).1))?;
                self.argmax.get_or_init(|| found)
            }
        };
        let plan = &self.plan;
        let out_len = plan.out_plane();
        let dx = with_f32(MAX_OP, grad, |dy| {
            Ok(plan.input_gradient(x.elem_count(), |i, dxp| {
                let outputs = i * out_len..(i + 1) * out_len;
                for (&g, &at) in dy[outputs.clone()].iter().zip(&argmax[outputs]) {
                    if at != NO_ARGMAX {
                        dxp[at as usize] += g;
                    }
                }
            }))
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// Whether `v` should replace the running maximum `max`: it is larger, or a NaN where the
/// maximum is not.
#[inline(always)]
fn beats(v: f32, max: f32) -> bool {
    (v > max) | (v.is_nan() & !max.is_nan())
}

/// Values [`Plan::max_plane`] takes at once.
const LANES: usize = 16;

/// The buffers of [`Plan::max_plane`], made once per rayon task, over the padded width
/// rounded up to whole sets of [`LANES`]: one input row (padding `-inf`), each padded column's
/// index in its row (`NO_ARGMAX` for padding, which a row's offset leaves so), the column
/// maxima over a window's rows, and those split by column modulo the stride, long enough for
/// a set of lanes from every window's entry.
struct MaxScratch {
    row: Vec<f32>,
    column_index: Vec<u32>,
    cols: Maxima,
    phases: Vec<Maxima>,
}

impl MaxScratch {
    fn new(plan: &Plan) -> Self {
        let (_, _, left, right) = plan.window.pad;
        let width = plan.input.1;
        let padded = (left + width + right).next_multiple_of(LANES);
        let column_index = (0..padded)
            .map(|c| {
                if (left..left + width).contains(&c) {
                    (c - left) as u32
                } else {
                    NO_ARGMAX
                }
            })
            .collect();
        let (kw, sw) = (plan.window.window.1, plan.window.stride.1);
        let phase_len = padded.div_ceil(sw).max(plan.cols.len() + kw / sw) + LANES;
        Self {
            row: vec![f32::NEG_INFINITY; padded],
            column_index,
            cols: Maxima::new(padded),
            phases: (0..sw).map(|_| Maxima::new(phase_len)).collect(),
        }
    }
}

/// Running maxima and where they are in the plane (`NO_ARGMAX` for padding, which holds
/// `-inf` and never wins), a whole number of sets of [`LANES`].
struct Maxima {
    max: Vec<f32>,
    at: Vec<u32>,
}

impl Maxima {
    fn new(len: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; len],
            at: vec![NO_ARGMAX; len],
        }
    }

    fn fill(&mut self, max: f32, at: u32) {
        self.max.fill(max);
        self.at.fill(at);
    }

    /// The maxima and their positions a set of lanes at a time.
    fn sets(&mut self) -> impl Iterator<Item = (&mut [f32; LANES], &mut [u32; LANES])> {
        self.max
            .as_chunks_mut::<LANES>()
            .0
            .iter_mut()
            .zip(self.at.as_chunks_mut::<LANES>().0)
    }
}

/// Folds a set of values and their positions into a set of running maxima, lane by lane. The
/// selects are bitwise, so the compiler keeps them branch-free (random data would defeat a
/// branch predictor) and makes them vector operations.
#[inline(always)]
fn fold_lanes(
    (max, at): (&mut [f32; LANES], &mut [u32; LANES]),
    (values, index): (&[f32; LANES], &[u32; LANES]),
) {
    for l in 0..LANES {
        let (v, a, m, ma) = (values[l], index[l], max[l], at[l]);
        let take = 0u32.wrapping_sub(wins((v, a), (m, ma)) as u32);
        max[l] = f32::from_bits((v.to_bits() & take) | (m.to_bits() & !take));
        at[l] = (a & take) | (ma & !take);
    }
}

/// Whether `(v, at)` should replace the running maximum `(max, max_at)`: it beats it, or ties
/// with it at a smaller index (the first in row-major order).
#[inline(always)]
fn wins((v, at): (f32, u32), (max, max_at): (f32, u32)) -> bool {
    beats(v, max) | ((v == max) & (at < max_at))
}

/// Folds `values[i]` into each running maximum `max[i]` (the values [`fold_lanes`] keeps, without
/// their positions).
///
/// Both sides of the select are new values, so every maximum is stored whole: a select
/// between a value and the old maximum is compiled to a masked store, which AMD's cores run
/// slowly.
#[inline(always)]
fn fold_values(max: &mut [f32], values: &[f32]) {
    for (m, &v) in max.iter_mut().zip(values) {
        *m = nan_max(*m, v);
    }
}

/// The larger of `a` and `b`, NaN when either is (the maximum [`beats`] keeps, up to which
/// NaN): `f32::max` drops a NaN, the sum keeps it.
#[inline(always)]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() | b.is_nan() {
        a + b
    } else {
        a.max(b)
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
            let (len, in_len, out_len) = (x.elem_count(), plan.in_plane(), plan.out_plane());
            if plan.is_global() {
                // One window over the whole plane: every value takes the same share.
                return Ok(output::by_plane(len, 1, in_len, |i, _, plane| {
                    plane.filled(dy[i] * inv[0])
                }));
            }
            Ok(plan.input_gradient(len, |i, dxp| {
                let g = &dy[i * out_len..(i + 1) * out_len];
                plan.for_each_window(|o, (r0, r1), (c0, c1)| {
                    let share = g[o] * inv[o];
                    for r in r0..r1 {
                        dxp[r * width + c0..r * width + c1]
                            .iter_mut()
                            .for_each(|d| *d += share);
                    }
                });
            }))
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests;
