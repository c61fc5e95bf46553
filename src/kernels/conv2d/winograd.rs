//! Winograd's minimal filtering F(2x2, 3x3) for 3x3 correlations at unit strides.
//!
//! The output is cut into 2x2 tiles; each reads a 4x4 tile of the input (zero outside the
//! image). With the transforms `V = Bt d B` of an input tile and `U = G g Gt` of a 3x3 kernel,
//! the tile's output is `At (sum over channels of U ⊙ V) A`: sixteen products per tile and
//! channel pair instead of thirty-six. Summed over channels, each of the sixteen elements is
//! one GEMM, `M[e] (o x tiles) = U[e] (o x c) * V[e] (c x tiles)`, so the multiplications run
//! in the same micro-kernels as the other convolutions, 2.25 times fewer of them.
//!
//! The transforms only add and subtract (the kernel's halves are exact in binary), and are
//! computed a row of tiles at a time over contiguous runs, which the compiler vectorises
//! (compiled for AVX2 when the CPU has it). Images whose planes hold few tiles are transformed together, so
//! each GEMM has enough columns to run at speed.

use super::gemm::{matmul, Parallelism, Product, View, ViewMut};
use super::plan::Plan;

/// Elements of a transformed tile (4x4).
const ELEMENTS: usize = 16;

/// Tiles that a group of images should hold at least, so the GEMMs have wide enough operands.
const TARGET_TILES: usize = 128;

/// Fewest input and output channels for which the transforms pay for themselves (the GEMMs'
/// rows and depth).
const MIN_CHANNELS: usize = 64;

/// Fewest tiles per image: planes smaller than 15x15 make groups of many images, whose
/// transformed tiles outgrow the caches.
const MIN_TILES: usize = 64;

/// A 3x3, stride-1 correlation lowered to F(2x2, 3x3): the plan and the transformed kernel.
pub(crate) struct Winograd {
    plan: Plan,
    /// `U[e][o][c]`: element `e` of each transformed 3x3 kernel.
    kernel: Vec<f32>,
}

/// The buffers of one group of images: the transformed input `V[e][c][tile]` and the products
/// `M[e][o][tile]`.
#[derive(Default)]
pub(crate) struct Buffers {
    input: Vec<f32>,
    products: Vec<f32>,
}

impl Winograd {
    /// The correlation of `plan` with the kernel whose tap `(o, c, ky, kx)` is
    /// `tap(o, c, ky, kx)`, or `None` when the plan is not a 3x3, stride-1 correlation with
    /// enough channels for the transforms to pay.
    pub(crate) fn new(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
    ) -> Option<Self> {
        let suits = plan.kh == 3
            && plan.kw == 3
            && plan.sh == 1
            && plan.sw == 1
            && plan.c >= MIN_CHANNELS
            && plan.o >= MIN_CHANNELS
            && plan.ho.div_ceil(2) * plan.wo.div_ceil(2) >= MIN_TILES;
        if !suits {
            return None;
        }
        let (o, c) = (plan.o, plan.c);
        let mut kernel = vec![0f32; ELEMENTS * o * c];
        for oi in 0..o {
            for ci in 0..c {
                let g = |ky, kx| tap(oi, ci, ky, kx);
                // G g: 4 rows of 3, then (G g) Gt: 4x4.
                let mut gg = [[0f32; 3]; 4];
                for (kx, col) in (0..3).map(|kx| (kx, kernel_column(g(0, kx), g(1, kx), g(2, kx))))
                {
                    for (row, v) in gg.iter_mut().zip(col) {
                        row[kx] = v;
                    }
                }
                for (a, row) in gg.iter().enumerate() {
                    for (b, v) in kernel_column(row[0], row[1], row[2])
                        .into_iter()
                        .enumerate()
                    {
                        kernel[((a * 4 + b) * o + oi) * c + ci] = v;
                    }
                }
            }
        }
        Some(Self {
            plan: *plan,
            kernel,
        })
    }

    /// Tiles of one image: `(rows, columns)`.
    fn tiles(&self) -> (usize, usize) {
        (self.plan.ho.div_ceil(2), self.plan.wo.div_ceil(2))
    }

    /// Images to transform together out of `n`, over `threads` threads: enough for
    /// [`TARGET_TILES`] tiles, but no fewer groups than threads while there are images.
    pub(crate) fn group(&self, n: usize, threads: usize) -> usize {
        let (th, tw) = self.tiles();
        let wanted = TARGET_TILES.div_ceil(th * tw).max(1);
        wanted.min(n.div_ceil(threads.max(1))).max(1)
    }

    /// `out = correlate(x) + bias` for a group of whole images: `x` holds them back to back
    /// (`plan.input_len()` each) and `out` their outputs (`plan.output_len()` each).
    pub(crate) fn correlate(
        &self,
        x: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
        buffers: &mut Buffers,
        parallelism: Parallelism,
    ) -> candle_core::Result<()> {
        let plan = &self.plan;
        let (in_len, out_len) = (plan.input_len(), plan.output_len());
        let images = out.len() / out_len.max(1);
        if x.len() != images * in_len || out.len() != images * out_len {
            candle_core::bail!(
                "winograd: {} input and {} output values do not hold whole images of {in_len} \
                 and {out_len}",
                x.len(),
                out.len()
            );
        }
        let (th, tw) = self.tiles();
        let tiles = images * th * tw;
        let (c, o) = (plan.c, plan.o);
        let v = grow(&mut buffers.input, ELEMENTS * c * tiles);
        let mut rows = Rows::default();
        self.transform(Transform::Inputs { x, v }, tiles, &mut rows);
        let m = grow(&mut buffers.products, ELEMENTS * o * tiles);
        for e in 0..ELEMENTS {
            matmul(
                Product {
                    m: o,
                    n: tiles,
                    k: c,
                    accumulate: false,
                    parallelism,
                },
                ViewMut {
                    data: m,
                    offset: e * o * tiles,
                    rs: tiles,
                    cs: 1,
                },
                View {
                    data: &self.kernel,
                    offset: e * o * c,
                    rs: c,
                    cs: 1,
                },
                View {
                    data: v,
                    offset: e * c * tiles,
                    rs: tiles,
                    cs: 1,
                },
            )?;
        }
        self.transform(Transform::Outputs { m, bias, out }, tiles, &mut rows);
        Ok(())
    }

    /// Runs a transform of a group of `tiles` tiles, compiled for AVX2 when the CPU has it.
    #[allow(unsafe_code)]
    fn transform(&self, job: Transform<'_>, tiles: usize, rows: &mut Rows) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            unsafe { self.transform_avx2(job, tiles, rows) };
            return;
        }
        self.transform_any(job, tiles, rows);
    }

    /// [`Self::transform_any`], compiled with AVX2.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(unsafe_code)]
    unsafe fn transform_avx2(&self, job: Transform<'_>, tiles: usize, rows: &mut Rows) {
        self.transform_any(job, tiles, rows);
    }

    /// Transforms each channel of each image of a group into `v`, or each output plane from
    /// `m` (see [`Transform`]).
    #[inline(always)]
    fn transform_any(&self, job: Transform<'_>, tiles: usize, rows: &mut Rows) {
        let plan = &self.plan;
        let (th, tw) = self.tiles();
        match job {
            Transform::Inputs { x, v } => {
                for (i, image) in x.chunks_exact(plan.input_len()).enumerate() {
                    for (ci, channel) in image.chunks_exact(plan.h * plan.w).enumerate() {
                        let at = ci * tiles + i * th * tw;
                        self.transform_input(channel, v, (at, plan.c * tiles), rows);
                    }
                }
            }
            Transform::Outputs { m, bias, out } => {
                for (i, image) in out.chunks_exact_mut(plan.output_len()).enumerate() {
                    let planes = image.chunks_exact_mut(plan.ho * plan.wo).enumerate();
                    for (oi, plane) in planes {
                        let b = bias.map_or(0.0, |b| b[oi]);
                        let at = oi * tiles + i * th * tw;
                        self.transform_output(m, (at, plan.o * tiles), b, plane, rows);
                    }
                }
            }
        }
    }

    /// Writes the transformed tiles of one input channel: element `e` of tile `t` (row-major
    /// over the image's tiles) to `v[at + e * stride + t]`.
    #[inline(always)]
    fn transform_input(
        &self,
        x: &[f32],
        v: &mut [f32],
        (at, stride): (usize, usize),
        rows: &mut Rows,
    ) {
        let plan = &self.plan;
        let (th, tw) = self.tiles();
        let Rows {
            padded,
            even,
            odd,
            z,
            ..
        } = rows;
        for j0 in (0..tw).step_by(MAX_RUN) {
            let run = MAX_RUN.min(tw - j0);
            // Padded columns 2 * j0 - left .. + 2 * run + 2 of the rows this run reads.
            let col0 = (2 * j0) as isize - plan.left;
            let (lo, hi) = (
                (-col0).clamp(0, 2 * run as isize + 2) as usize,
                (plan.w as isize - col0).clamp(0, 2 * run as isize + 2) as usize,
            );
            for ti in 0..th {
                // Even and odd columns of the tile row's four input rows (zero outside the
                // image): tile j reads even[j], odd[j], even[j + 1], odd[j + 1].
                for q in 0..4 {
                    let row = (2 * ti + q) as isize - plan.top;
                    let p = &mut padded[..2 * run + 2];
                    if row < 0 || row >= plan.h as isize || lo >= hi {
                        p.fill(0.0);
                    } else {
                        let src = &x[row as usize * plan.w..][..plan.w];
                        p[..lo].fill(0.0);
                        let from = (col0 + lo as isize) as usize;
                        p[lo..hi].copy_from_slice(&src[from..from + (hi - lo)]);
                        p[hi..].fill(0.0);
                    }
                    for ((pair, e), od) in p.chunks_exact(2).zip(&mut even[q]).zip(&mut odd[q]) {
                        *e = pair[0];
                        *od = pair[1];
                    }
                }
                // Each input row's 1-D transform (d B), per tile, then across the rows (Bt).
                for ((zq, e), od) in z.iter_mut().zip(&*even).zip(&*odd) {
                    let [z0, z1, z2, z3] = zq;
                    let taps = e[..run]
                        .iter()
                        .zip(&od[..run])
                        .zip(e[1..=run].iter().zip(&od[1..=run]));
                    let outs = z0.iter_mut().zip(z1.iter_mut()).zip(z2.iter_mut().zip(z3));
                    for (((d0, d1), (d2, d3)), ((a, b), (c, d))) in taps.zip(outs) {
                        [*a, *b, *c, *d] = input_column(*d0, *d1, *d2, *d3);
                    }
                }
                let t0 = at + ti * tw + j0;
                let [z0, z1, z2, z3] = &*z;
                for (k, (((z0, z1), z2), z3)) in z0.iter().zip(z1).zip(z2).zip(z3).enumerate() {
                    let rows = [&z0[..run], &z1[..run], &z2[..run], &z3[..run]];
                    let at = |a: usize| t0 + (a * 4 + k) * stride;
                    combine_rows(&mut v[at(0)..][..run], rows, |[r0, _, r2, _]| r0 - r2);
                    combine_rows(&mut v[at(1)..][..run], rows, |[_, r1, r2, _]| r1 + r2);
                    combine_rows(&mut v[at(2)..][..run], rows, |[_, r1, r2, _]| r2 - r1);
                    combine_rows(&mut v[at(3)..][..run], rows, |[_, r1, _, r3]| r1 - r3);
                }
            }
        }
    }

    /// Writes one output plane from the products `m`, element `e` of tile `t` of the plane at
    /// `m[at + e * stride + t]`, plus `bias`.
    #[inline(always)]
    fn transform_output(
        &self,
        m: &[f32],
        (at, stride): (usize, usize),
        bias: f32,
        plane: &mut [f32],
        rows: &mut Rows,
    ) {
        let plan = &self.plan;
        let (th, tw) = self.tiles();
        let wo = plan.wo;
        let Rows { s, y, .. } = rows;
        for ti in 0..th {
            for j0 in (0..tw).step_by(MAX_RUN) {
                let run = MAX_RUN.min(tw - j0);
                let el = |e: usize| &m[at + e * stride + ti * tw + j0..][..run];
                // At m: across rows, then across columns.
                for k in 0..4 {
                    let [m0, m1, m2, m3] = [el(k), el(4 + k), el(8 + k), el(12 + k)];
                    let (s0, s1) = s.split_at_mut(1);
                    let outs = s0[0][k][..run].iter_mut().zip(&mut s1[0][k][..run]);
                    let ins = m0.iter().zip(m1).zip(m2.iter().zip(m3));
                    for ((a, b), ((m0, m1), (m2, m3))) in outs.zip(ins) {
                        [*a, *b] = output_column(*m0, *m1, *m2, *m3);
                    }
                }
                for (yr, sr) in y.iter_mut().zip(&*s) {
                    let ins = sr[0][..run].iter().zip(&sr[1][..run]);
                    let ins = ins.zip(sr[2][..run].iter().zip(&sr[3][..run]));
                    for (pair, ((s0, s1), (s2, s3))) in yr.chunks_exact_mut(2).zip(ins) {
                        let [a, b] = output_column(*s0, *s1, *s2, *s3);
                        pair[0] = a + bias;
                        pair[1] = b + bias;
                    }
                }
                for (r, yr) in y.iter().enumerate() {
                    let row = 2 * ti + r;
                    if row >= plan.ho {
                        break;
                    }
                    let col0 = 2 * j0;
                    let width = (2 * run).min(wo - col0);
                    plane[row * wo + col0..][..width].copy_from_slice(&yr[..width]);
                }
            }
        }
    }
}

/// A transform of a group of images: the inputs into `V`, or the products `M` into the outputs.
enum Transform<'a> {
    /// The images `x` into `v`.
    Inputs { x: &'a [f32], v: &'a mut [f32] },
    /// The products `m`, plus the bias, into the output images `out`.
    Outputs {
        m: &'a [f32],
        bias: Option<&'a [f32]>,
        out: &'a mut [f32],
    },
}

/// The rows a transform works on, kept for a whole group.
struct Rows {
    /// One input row around a run of tiles, zero-padded.
    padded: [f32; 2 * MAX_RUN + 2],
    /// The even and odd columns of a tile row's four input rows.
    even: [[f32; MAX_RUN + 1]; 4],
    odd: [[f32; MAX_RUN + 1]; 4],
    /// `d B` of each of the four rows, per column of the 4x4 tile.
    z: [[[f32; MAX_RUN]; 4]; 4],
    /// `At m`: the two rows of each 4-column product.
    s: [[[f32; MAX_RUN]; 4]; 2],
    /// A tile row's two output rows.
    y: [[f32; 2 * MAX_RUN]; 2],
}

impl Default for Rows {
    fn default() -> Self {
        Self {
            padded: [0.0; 2 * MAX_RUN + 2],
            even: [[0.0; MAX_RUN + 1]; 4],
            odd: [[0.0; MAX_RUN + 1]; 4],
            z: [[[0.0; MAX_RUN]; 4]; 4],
            s: [[[0.0; MAX_RUN]; 4]; 2],
            y: [[0.0; 2 * MAX_RUN]; 2],
        }
    }
}

/// Tiles transformed per run along a tile row (longer rows take several runs).
const MAX_RUN: usize = 32;

/// `dst[j] = f(rows[..][j])`.
#[inline(always)]
fn combine_rows(dst: &mut [f32], rows: [&[f32]; 4], f: impl Fn([f32; 4]) -> f32) {
    let src = rows[0].iter().zip(rows[1]).zip(rows[2].iter().zip(rows[3]));
    for (d, ((r0, r1), (r2, r3))) in dst.iter_mut().zip(src) {
        *d = f([*r0, *r1, *r2, *r3]);
    }
}

/// One column of `G g`: the 3 taps `g` to 4 values.
#[inline(always)]
fn kernel_column(g0: f32, g1: f32, g2: f32) -> [f32; 4] {
    [g0, 0.5 * (g0 + g1 + g2), 0.5 * (g0 - g1 + g2), g2]
}

/// One column of `Bt d`: 4 input values to 4.
#[inline(always)]
fn input_column(d0: f32, d1: f32, d2: f32, d3: f32) -> [f32; 4] {
    [d0 - d2, d1 + d2, d2 - d1, d1 - d3]
}

/// One column of `At m`: 4 products to 2 outputs.
#[inline(always)]
fn output_column(m0: f32, m1: f32, m2: f32, m3: f32) -> [f32; 2] {
    [m0 + m1 + m2, m1 - m2 - m3]
}

/// A slice of `buf` exactly `len` long, growing `buf` when needed.
fn grow(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct correlation of one image, for reference.
    fn direct(plan: &Plan, x: &[f32], w: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; plan.output_len()];
        for o in 0..plan.o {
            for i in 0..plan.ho {
                for j in 0..plan.wo {
                    let mut sum = 0f64;
                    for c in 0..plan.c {
                        for ky in 0..3 {
                            for kx in 0..3 {
                                let r = (i + ky) as isize - plan.top;
                                let s = (j + kx) as isize - plan.left;
                                if r < 0 || s < 0 || r >= plan.h as isize || s >= plan.w as isize {
                                    continue;
                                }
                                let xv = x[(c * plan.h + r as usize) * plan.w + s as usize];
                                sum += f64::from(xv * w[((o * plan.c + c) * 3 + ky) * 3 + kx]);
                            }
                        }
                    }
                    out[(o * plan.ho + i) * plan.wo + j] = sum as f32;
                }
            }
        }
        out
    }

    #[test]
    fn matches_direct_correlation() -> candle_core::Result<()> {
        // Odd and even sizes, `same` and `valid` padding, rows longer than one run.
        for (h, w, pad, images) in [
            (15, 15, 1, 3),
            (18, 17, 0, 2),
            (5, 140, 1, 1),
            (16, 16, 1, 2),
        ] {
            let plan = Plan {
                c: 64,
                h,
                w,
                o: 65,
                kh: 3,
                kw: 3,
                sh: 1,
                sw: 1,
                top: pad,
                left: pad,
                ho: h + 2 * pad as usize - 2,
                wo: w + 2 * pad as usize - 2,
            };
            let value = |i: usize| ((i * 7919 % 199) as f32 - 99.0) / 99.0;
            let x: Vec<f32> = (0..images * plan.input_len()).map(value).collect();
            let wt: Vec<f32> = (0..plan.o * plan.c * 9)
                .map(|i| value(i * 31 + 5))
                .collect();
            let bias: Vec<f32> = (0..plan.o).map(|i| i as f32 * 0.25).collect();
            let wino = Winograd::new(&plan, |o, c, ky, kx| {
                wt[((o * plan.c + c) * 3 + ky) * 3 + kx]
            })
            .ok_or_else(|| candle_core::Error::Msg("not lowered".into()))?;
            let mut out = vec![f32::NAN; images * plan.output_len()];
            let mut buffers = Buffers::default();
            wino.correlate(&x, Some(&bias), &mut out, &mut buffers, Parallelism::None)?;
            for (i, got) in out.chunks_exact(plan.output_len()).enumerate() {
                let want = direct(&plan, &x[i * plan.input_len()..][..plan.input_len()], &wt);
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    let w = w + bias[k / (plan.ho * plan.wo)];
                    assert!(
                        (g - w).abs() < 1e-4 * (1.0 + w.abs()),
                        "{plan:?} image {i} at {k}: {g} vs {w}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn declines_other_correlations() {
        let plan = |c, h, kh, sh| Plan {
            c,
            h,
            w: h,
            o: 64,
            kh,
            kw: kh,
            sh,
            sw: sh,
            top: 0,
            left: 0,
            ho: (h - kh) / sh + 1,
            wo: (h - kh) / sh + 1,
        };
        let tap = |_, _, _, _| 1.0;
        assert!(Winograd::new(&plan(64, 17, 3, 1), tap).is_some());
        assert!(
            Winograd::new(&plan(32, 17, 3, 1), tap).is_none(),
            "too few channels"
        );
        assert!(
            Winograd::new(&plan(64, 9, 3, 1), tap).is_none(),
            "too few tiles"
        );
        assert!(Winograd::new(&plan(64, 17, 3, 2), tap).is_none(), "strided");
        assert!(Winograd::new(&plan(64, 17, 1, 1), tap).is_none(), "1x1");
    }
}
