//! Winograd's minimal filtering F(2x2, 3x3) for 3x3 correlations at unit strides.
//!
//! The output is cut into 2x2 tiles; each reads a 4x4 tile of the input (zero outside the
//! image). With the transforms `V = Bt d B` of an input tile and `U = G g Gt` of a 3x3 kernel,
//! the tile's output is `At (sum over channels of U ⊙ V) A`: sixteen products per tile and
//! channel pair instead of thirty-six. Summed over channels, each of the sixteen elements is
//! one matrix product, `M[e] (o x tiles) = U[e] (o x c) * V[e] (c x tiles)`, 2.25 times fewer
//! multiplications than the direct correlation.
//!
//! The tiles of a group of images are taken a *block* at a time, a few dozen tiles sized so the
//! block's transformed tiles stay in the core's L2 cache: transformed, multiplied (sixteen
//! products) and transformed back before the next block, so nothing larger than a block goes
//! through memory. On CPUs with AVX2 and FMA (and without AVX-512), the products run in
//! [`super::microkernel`], reading the block's transformed tiles as they lie and the kernel's
//! panels packed once per layer; elsewhere in the `gemm` crate (AVX-512 kernels where present).
//!
//! The transforms only add and subtract (the kernel's halves are exact in binary), and are
//! computed a run of tiles along a tile row at a time over contiguous values, which the
//! compiler vectorises (compiled for AVX2 when the CPU has it).

use super::gemm::{matmul, Parallelism, Product, View, ViewMut};
use super::microkernel::{self, PackedLhs, NR};
use super::plan::Plan;

mod row_avx2;

/// Elements of a transformed tile (4x4).
const ELEMENTS: usize = 16;

/// The most `f32`s a block's transformed input tiles may take (256 KiB), so they stay in L2
/// with the products and the kernel panel the products read.
const BLOCK_BUDGET: usize = 64 * 1024;

/// The most tiles in a block.
const MAX_BLOCK: usize = 4 * NR;

/// Fewest input and output channels for which the transforms pay for themselves.
const MIN_CHANNELS: usize = 16;

/// Fewest tiles per image (planes of 7x7 and more): below, the direct correlation is as fast.
const MIN_TILES: usize = 16;

/// A 3x3, stride-1 correlation lowered to F(2x2, 3x3): the plan and the transformed kernel.
pub(crate) struct Winograd {
    plan: Plan,
    /// `U[e][o][c]`: element `e` of each transformed 3x3 kernel.
    kernel: Vec<f32>,
    /// `U[e]` packed for [`microkernel::product`], one per element; empty where the `gemm`
    /// crate runs the products.
    packed: Vec<PackedLhs>,
    /// Tiles per block (a multiple of [`NR`]).
    block: usize,
}

/// The buffers of one task: its group's padded images, a block's transformed input
/// `V[e][c][column]` and products `M[e][o][column]` (each element's matrix
/// [`element_stride`] apart), and the tile in each column.
#[derive(Default)]
pub(crate) struct Buffers {
    padded: Vec<f32>,
    input: Vec<f32>,
    products: Vec<f32>,
    tiles: Vec<Tile>,
}

impl Winograd {
    /// The correlation of `plan` with the kernel whose tap `(o, c, ky, kx)` is
    /// `tap(o, c, ky, kx)`, or `None` when the plan is not a 3x3, stride-1 correlation with
    /// enough channels for the transforms to pay.
    pub(crate) fn new(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
    ) -> Option<Self> {
        Self::with_products(plan, tap, microkernel::preferred())
    }

    /// [`Self::new`], with the products in [`microkernel`] when `packed` (and the CPU runs it).
    fn with_products(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
        packed: bool,
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
        let packed = if packed && microkernel::supported() {
            kernel
                .chunks_exact(o * c)
                .map(|u| PackedLhs::new(u, o, c))
                .collect::<candle_core::Result<_>>()
                .ok()?
        } else {
            Vec::new()
        };
        let block = (BLOCK_BUDGET / (ELEMENTS * c) / NR * NR).clamp(NR, MAX_BLOCK);
        Some(Self {
            plan: *plan,
            kernel,
            packed,
            block,
        })
    }

    /// Tiles of one image: `(rows, columns)`.
    fn tiles(&self) -> (usize, usize) {
        (self.plan.ho.div_ceil(2), self.plan.wo.div_ceil(2))
    }

    /// Images to correlate together out of `n`, over `threads` threads: enough to fill a block,
    /// but no fewer groups than threads while there are images.
    pub(crate) fn group(&self, n: usize, threads: usize) -> usize {
        let (th, tw) = self.tiles();
        let wanted = self.block.div_ceil(th * tw).max(1);
        wanted.min(n.div_ceil(threads.max(1))).max(1)
    }

    /// Rows and columns of an image plane padded to cover every tile's 4x4 input tile.
    fn padded_plane(&self) -> (usize, usize) {
        let (th, tw) = self.tiles();
        (2 * th + 2, 2 * tw + 2)
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
        if tiles == 0 {
            return Ok(());
        }
        self.pad(x, images, &mut buffers.padded);
        let blocks = tiles.div_ceil(self.block);
        let per_block = tiles.div_ceil(blocks);
        for t0 in (0..tiles).step_by(per_block) {
            let t1 = (t0 + per_block).min(tiles);
            self.correlate_block(t0..t1, bias, out, buffers, parallelism)?;
        }
        Ok(())
    }

    /// Copies each channel of the group's `images` images `x` into `padded`, a plane of
    /// [`Self::padded_plane`] each, zero outside the image, so every tile reads its 4x4 input
    /// tile without bounds to check.
    fn pad(&self, x: &[f32], images: usize, padded: &mut Vec<f32>) {
        let plan = &self.plan;
        let (ph, pw) = self.padded_plane();
        let planes = images * plan.c;
        let padded = grow(padded, planes * ph * pw);
        let (lo, hi) = column_window(plan.left, plan.w, pw);
        for (dst, src) in padded
            .chunks_exact_mut(ph * pw)
            .zip(x.chunks_exact(plan.h * plan.w))
        {
            for (r, row) in dst.chunks_exact_mut(pw).enumerate() {
                let from = r as isize - plan.top;
                if from < 0 || from >= plan.h as isize || lo >= hi {
                    row.fill(0.0);
                    continue;
                }
                let src = &src[from as usize * plan.w..][..plan.w];
                row[..lo].fill(0.0);
                let s0 = (lo as isize - plan.left) as usize;
                row[lo..hi].copy_from_slice(&src[s0..s0 + (hi - lo)]);
                row[hi..].fill(0.0);
            }
        }
    }

    /// Tiles `range` of a group (numbered row-major through its images): transformed from the
    /// padded images, multiplied, and transformed back into `out`.
    fn correlate_block(
        &self,
        range: std::ops::Range<usize>,
        bias: Option<&[f32]>,
        out: &mut [f32],
        buffers: &mut Buffers,
        parallelism: Parallelism,
    ) -> candle_core::Result<()> {
        let (c, o) = (self.plan.c, self.plan.o);
        let width = range.len().next_multiple_of(NR);
        let Buffers {
            padded,
            input,
            products,
            tiles,
        } = buffers;
        tiles.clear();
        let (th, tw) = self.tiles();
        // The columns past the block's tiles repeat its last tile: their products are computed
        // (the micro-kernel's width) but never read back.
        tiles.extend((0..width).map(|col| {
            let t = range.start + col.min(range.len() - 1);
            let (image, at) = (t / (th * tw), t % (th * tw));
            Tile {
                image,
                ti: at / tw,
                tj: at % tw,
            }
        }));
        let (v_stride, m_stride) = (element_stride(c * width), element_stride(o * width));
        let v = grow(input, ELEMENTS * v_stride);
        let job = Transform::Inputs { padded, v };
        self.transform(job, tiles, width);
        let m = grow(products, ELEMENTS * m_stride);
        for e in 0..ELEMENTS {
            let (ve, me) = (&v[e * v_stride..][..c * width], &mut m[e * m_stride..]);
            // The micro-kernel runs on this thread: a product split over the pool goes to gemm.
            match (self.packed.get(e), parallelism) {
                (Some(u), Parallelism::None) => microkernel::product(
                    u,
                    View {
                        data: ve,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                    width,
                    ViewMut {
                        data: me,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                    false,
                )?,
                _ => matmul(
                    Product {
                        m: o,
                        n: width,
                        k: c,
                        accumulate: false,
                        parallelism,
                    },
                    ViewMut {
                        data: me,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                    View {
                        data: &self.kernel,
                        offset: e * o * c,
                        rs: c,
                        cs: 1,
                    },
                    View {
                        data: ve,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                )?,
            }
        }
        let job = Transform::Outputs { m, bias, out };
        self.transform(job, &tiles[..range.len()], width);
        Ok(())
    }

    /// Runs a transform of a block, compiled for AVX2 when the CPU has it.
    #[allow(unsafe_code)]
    fn transform(&self, job: Transform<'_>, tiles: &[Tile], width: usize) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            unsafe { self.transform_avx2(job, tiles, width) };
            return;
        }
        self.transform_any(job, tiles, width);
    }

    /// [`Self::transform_any`], compiled with AVX2.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(unsafe_code)]
    unsafe fn transform_avx2(&self, job: Transform<'_>, tiles: &[Tile], width: usize) {
        self.transform_any(job, tiles, width);
    }

    /// Transforms the block's `tiles` of each padded input channel into `v` (`[e][c][width]`),
    /// or writes them to each output channel from `m` (`[e][o][width]`), [`LANES`] tiles at a
    /// time (see [`Transform`]).
    #[inline(always)]
    fn transform_any(&self, job: Transform<'_>, tiles: &[Tile], width: usize) {
        let plan = &self.plan;
        let (ph, pw) = self.padded_plane();
        match job {
            Transform::Inputs { padded, v } => {
                let stride = element_stride(plan.c * width);
                for (g, lanes) in tiles.chunks(LANES).enumerate() {
                    // Each lane's 4x4 input tile starts at `start[l] + plane offset`.
                    let mut start = [0usize; LANES];
                    for (s, t) in start.iter_mut().zip(lanes) {
                        *s = t.image * plan.c * ph * pw + 2 * t.ti * pw + 2 * t.tj;
                    }
                    // Consecutive tiles of one tile row: their input tiles overlap along the
                    // same four rows.
                    let along_row = along_row(lanes);
                    for ci in 0..plan.c {
                        let plane = ci * ph * pw;
                        let mut d = [[0f32; LANES]; ELEMENTS];
                        let at = ci * width + g * LANES;
                        if along_row {
                            let src = &padded[plane + start[0]..];
                            if row_avx2::input_tiles(src, pw, &mut v[at..], stride) {
                                continue;
                            }
                            for (q, row) in d.chunks_exact_mut(4).enumerate() {
                                gather_row(row, &src[q * pw..]);
                            }
                        } else {
                            for (l, s) in start.iter().enumerate().take(lanes.len()) {
                                let at = plane + s;
                                for (q, row) in d.chunks_exact_mut(4).enumerate() {
                                    let src = &padded[at + q * pw..][..4];
                                    for (dv, sv) in row.iter_mut().zip(src) {
                                        dv[l] = *sv;
                                    }
                                }
                            }
                        }
                        let transformed = transform_input(&d);
                        for (e, vals) in transformed.iter().enumerate() {
                            copy_lanes(&mut v[at + e * stride..], vals, lanes.len());
                        }
                    }
                }
            }
            Transform::Outputs { m, bias, out } => {
                let stride = element_stride(plan.o * width);
                let plane = plan.ho * plan.wo;
                for (g, lanes) in tiles.chunks(LANES).enumerate() {
                    // Consecutive tiles of one tile row whose outputs all lie in the plane's
                    // columns: two runs of output columns.
                    let t = lanes[0];
                    let whole_runs = along_row(lanes) && 2 * (t.tj + LANES) <= plan.wo;
                    let both_rows = 2 * t.ti + 1 < plan.ho;
                    let first = t.image * plan.output_len() + 2 * t.ti * plan.wo + 2 * t.tj;
                    for oi in 0..plan.o {
                        let at = oi * width + g * LANES;
                        let b = bias.map_or(0.0, |b| b[oi]);
                        if whole_runs {
                            let (m, out) = (&m[at..], &mut out[first + oi * plane..]);
                            if row_avx2::output_tiles(m, stride, b, out, plan.wo, both_rows) {
                                continue;
                            }
                        }
                        let mut products = [[0f32; LANES]; ELEMENTS];
                        for (e, p) in products.iter_mut().enumerate() {
                            copy_lanes(p, &m[at + e * stride..], lanes.len());
                        }
                        let y = transform_output(&products, b);
                        for (l, t) in lanes.iter().enumerate() {
                            let base = t.image * plan.output_len() + oi * plane;
                            let (r0, c0) = (2 * t.ti, 2 * t.tj);
                            for (dr, rows) in y.chunks_exact(2).enumerate() {
                                if r0 + dr >= plan.ho {
                                    break;
                                }
                                let row = base + (r0 + dr) * plan.wo + c0;
                                out[row] = rows[0][l];
                                if c0 + 1 < plan.wo {
                                    out[row + 1] = rows[1][l];
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Whether `lanes` are [`LANES`] consecutive tiles of one tile row.
fn along_row(lanes: &[Tile]) -> bool {
    lanes.len() == LANES
        && lanes
            .windows(2)
            .all(|p| (p[1].image, p[1].ti, p[1].tj) == (p[0].image, p[0].ti, p[0].tj + 1))
}

/// The distance between consecutive elements' matrices of `len` values in a block's buffers:
/// `len` and one cache line more, so the sixteen rows a transform writes (or reads) at once
/// fall in distinct cache sets even when `len` is a multiple of the L1 cache's way size.
fn element_stride(len: usize) -> usize {
    len + 16
}

/// Tiles a transform takes at once, one per vector lane.
const LANES: usize = 8;

/// One input row of [`LANES`] consecutive tiles along a tile row: `d[k][l] = src[2 * l + k]`
/// (each tile starts two columns after the previous one), a fixed-size de-interleave the
/// compiler turns into vector shuffles.
#[inline(always)]
fn gather_row(d: &mut [[f32; LANES]], src: &[f32]) {
    let Ok(src) = <&[f32; 2 * LANES + 2]>::try_from(&src[..2 * LANES + 2]) else {
        return;
    };
    for (k, dk) in d.iter_mut().enumerate().take(4) {
        for (l, v) in dk.iter_mut().enumerate() {
            *v = src[2 * l + k];
        }
    }
}

/// Copies the first `n` of [`LANES`] values from `src` to `dst`: a fixed-size copy the
/// compiler keeps in registers when `n` is all of them, rather than a call to `memcpy`.
#[inline(always)]
fn copy_lanes(dst: &mut [f32], src: &[f32], n: usize) {
    let (dst, src) = (&mut dst[..n], &src[..n]);
    if let (Ok(whole), Ok(from)) = (
        <&mut [f32; LANES]>::try_from(&mut *dst),
        <&[f32; LANES]>::try_from(src),
    ) {
        *whole = *from;
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = *s;
    }
}

/// One tile of a block: image `image` of the group, tile row `ti`, tile column `tj`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tile {
    image: usize,
    ti: usize,
    tj: usize,
}

/// The columns `lo .. hi` of a padded row of `pw` that hold columns `lo - left ..` of an image
/// row `w` wide (the others are zero).
fn column_window(left: isize, w: usize, pw: usize) -> (usize, usize) {
    let lo = left.clamp(0, pw as isize) as usize;
    let hi = (left + w as isize).clamp(0, pw as isize) as usize;
    (lo, hi.max(lo))
}

/// `Bt d B` of [`LANES`] 4x4 input tiles, `d[4 * row + column][lane]`, laid out alike.
#[inline(always)]
fn transform_input(d: &[[f32; LANES]; ELEMENTS]) -> [[f32; LANES]; ELEMENTS] {
    // d B: each row's four values to four.
    let mut z = [[0f32; LANES]; ELEMENTS];
    for (zr, dr) in z.chunks_exact_mut(4).zip(d.chunks_exact(4)) {
        for l in 0..LANES {
            let [a, b, c, e] = input_column(dr[0][l], dr[1][l], dr[2][l], dr[3][l]);
            [zr[0][l], zr[1][l], zr[2][l], zr[3][l]] = [a, b, c, e];
        }
    }
    // Bt (d B): across the rows, column by column.
    let mut v = [[0f32; LANES]; ELEMENTS];
    for k in 0..4 {
        for l in 0..LANES {
            let col = input_column(z[k][l], z[4 + k][l], z[8 + k][l], z[12 + k][l]);
            for (a, value) in col.into_iter().enumerate() {
                v[4 * a + k][l] = value;
            }
        }
    }
    v
}

/// `At m A + bias` of [`LANES`] tiles' products, `m[e][lane]`: the 2x2 outputs as
/// `[row 0 col 0, row 0 col 1, row 1 col 0, row 1 col 1][lane]`.
#[inline(always)]
fn transform_output(m: &[[f32; LANES]; ELEMENTS], bias: f32) -> [[f32; LANES]; 4] {
    // At m: across the rows, column by column, to two rows of four.
    let mut s = [[0f32; LANES]; 8];
    for k in 0..4 {
        for l in 0..LANES {
            let [a, b] = output_column(m[k][l], m[4 + k][l], m[8 + k][l], m[12 + k][l]);
            s[k][l] = a;
            s[4 + k][l] = b;
        }
    }
    // (At m) A: each row's four values to two.
    let mut y = [[0f32; LANES]; 4];
    for (yr, sr) in y.chunks_exact_mut(2).zip(s.chunks_exact(4)) {
        for l in 0..LANES {
            let [a, b] = output_column(sr[0][l], sr[1][l], sr[2][l], sr[3][l]);
            yr[0][l] = a + bias;
            yr[1][l] = b + bias;
        }
    }
    y
}

/// A transform of a block: the group's padded inputs into `V`, or the products `M` into the
/// group's outputs.
enum Transform<'a> {
    /// The padded images `padded` into `v`.
    Inputs { padded: &'a [f32], v: &'a mut [f32] },
    /// The products `m`, plus the bias, into the output images `out`.
    Outputs {
        m: &'a [f32],
        bias: Option<&'a [f32]>,
        out: &'a mut [f32],
    },
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
        // Odd and even sizes, `same` and `valid` padding, long rows, blocks across images
        // (7x7), several blocks per image (32x32), products in the micro-kernel and in `gemm`.
        let cases = [
            (15, 15, 1, 3, 64),
            (18, 17, 0, 2, 64),
            (5, 140, 1, 1, 64),
            (16, 16, 1, 2, 64),
            (7, 7, 1, 5, 40),
            (32, 32, 1, 1, 16),
        ];
        for ((h, w, pad, images, c), packed) in cases
            .into_iter()
            .flat_map(|case| [(case, true), (case, false)])
        {
            let plan = Plan {
                c,
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
            let tap = |o, c, ky, kx| wt[((o * plan.c + c) * 3 + ky) * 3 + kx];
            let wino = Winograd::with_products(&plan, tap, packed)
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
                        "{plan:?} (packed: {packed}) image {i} at {k}: {g} vs {w}"
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
            Winograd::new(&plan(64, 9, 3, 1), tap).is_some(),
            "7x7 outputs"
        );
        assert!(
            Winograd::new(&plan(8, 17, 3, 1), tap).is_none(),
            "too few channels"
        );
        assert!(
            Winograd::new(&plan(64, 6, 3, 1), tap).is_none(),
            "too few tiles"
        );
        assert!(Winograd::new(&plan(64, 17, 3, 2), tap).is_none(), "strided");
        assert!(Winograd::new(&plan(64, 17, 1, 1), tap).is_none(), "1x1");
    }
}
