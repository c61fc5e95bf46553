//! The transforms of eight tiles in AVX2 registers, as four pairs of horizontally adjacent
//! tiles: a pair's input rows are eight consecutive values for its two tiles' first four
//! columns (and eight more from four columns on for their last two), so six rows of four
//! vector loads, transposed, put the eight tiles' values in the lanes of six vectors, with no
//! gather. The same transpose takes the outputs back out of the lanes: each output row of a
//! pair is eight consecutive values, one store (masked at the plane's right edge).
//!
//! The lanes hold the pairs' first tiles, then their second tiles ([`super::LANE_TILE`]), the
//! order in which the transpose leaves them. Both functions return `false`, touching nothing,
//! where they do not apply (another CPU, or slices too short), and the caller takes its
//! portable path.

#![allow(unsafe_code)]

use super::{ELEMENTS, LANES, SIDE, TILE};

/// Writes the transformed tiles `V = Bt d B` of four pairs of adjacent tiles: pair `j`'s first
/// tile's input tile starts at `padded[starts[j]]`, its rows `pw` apart; element `e` of lane
/// `l` goes to `v[e * stride + l]`.
pub(super) fn input_tiles(
    padded: &[f32],
    starts: [usize; 4],
    pw: usize,
    v: &mut [f32],
    stride: usize,
) -> bool {
    // Each pair reads six rows of twelve values.
    let reach = (SIDE - 1) * pw + 3 * TILE;
    let fits = starts.iter().all(|s| s + reach <= padded.len())
        && v.len() >= (ELEMENTS - 1) * stride + LANES;
    #[cfg(target_arch = "x86_64")]
    if fits && avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA, and both slices hold what the kernel reads and
        // writes (checked above).
        unsafe { avx2::input_tiles(padded.as_ptr(), starts, pw, v.as_mut_ptr(), stride) };
        return true;
    }
    let _ = (fits, padded, starts, pw, v, stride);
    false
}

/// Writes the transformed output gradients `dM = A dY At` of four pairs of adjacent tiles:
/// pair `j`'s first tile starts at `padded[starts[j]]` (a plane of whole tiles, rows `gw`
/// apart); element `e` of lane `l` goes to `dm[e * stride + l]`. The values are the portable
/// transform's bit for bit (no fused multiply-adds; its multiplications are by powers of two).
pub(super) fn gradient_tiles(
    padded: &[f32],
    starts: [usize; 4],
    gw: usize,
    dm: &mut [f32],
    stride: usize,
) -> bool {
    // Each pair reads four rows of eight values.
    let reach = (TILE - 1) * gw + 2 * TILE;
    let fits = starts.iter().all(|s| s + reach <= padded.len())
        && dm.len() >= (ELEMENTS - 1) * stride + LANES;
    #[cfg(target_arch = "x86_64")]
    if fits && avx2_fma() {
        // SAFETY: the CPU has AVX2, and both slices hold what the kernel reads and writes
        // (checked above).
        unsafe { avx2::gradient_tiles(padded.as_ptr(), starts, gw, dm.as_mut_ptr(), stride) };
        return true;
    }
    let _ = (fits, padded, starts, gw, dm, stride);
    false
}

/// The output rows of four pairs of adjacent tiles: row `r` of pair `j` is `[TILE * j + r]`,
/// its first tile's four values, then its second tile's.
pub(super) type PairRows = [[f32; 2 * TILE]; 4 * TILE];

/// Computes the outputs `At M A + bias` of four pairs of adjacent tiles into `rows`, then
/// their ReLU when `relu` (a NaN stays a NaN): element `e` of lane `l`'s products is
/// `m[e * stride + l]`. The caller stores each row where it goes (the pairs may lie in
/// different images).
pub(super) fn output_tiles(
    m: &[f32],
    stride: usize,
    (bias, relu): (f32, bool),
    rows: &mut PairRows,
) -> bool {
    let fits = m.len() >= (ELEMENTS - 1) * stride + LANES;
    #[cfg(target_arch = "x86_64")]
    if fits && avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA, and `m` holds what the kernel reads (checked
        // above); `rows` is whole.
        unsafe { avx2::output_tiles(m.as_ptr(), stride, (bias, relu), rows) };
        return true;
    }
    let _ = (fits, m, stride, bias, relu, rows);
    false
}

/// Which part of a source plane a padded plane holds: its rows `rows` hold the source rows
/// from `src_row` on (`src_stride` apart), `len` values each from source column `src_col`,
/// at the padded plane's column `col`; every other value is zero.
#[derive(Debug, Clone)]
pub(super) struct PaddedRows {
    pub rows: std::ops::Range<usize>,
    pub src_row: usize,
    pub src_stride: usize,
    pub src_col: usize,
    pub len: usize,
    pub col: usize,
}

impl PaddedRows {
    /// The rows of `dst` (rows of `pw`) when the part fits it and `src` holds every value it
    /// reads; `None` otherwise.
    pub(super) fn rows_in(&self, dst: &[f32], pw: usize, src: &[f32]) -> Option<usize> {
        let rows = dst.len() / pw.max(1);
        let fits = pw > 0
            && dst.len() == rows * pw
            && self.col + self.len <= pw
            && self.rows.end <= rows
            && self
                .rows
                .clone()
                .last()
                .is_none_or(|r| self.source(r) + self.len <= src.len());
        fits.then_some(rows)
    }

    /// Where padded row `r`'s values start in `src` (`r` one of `self.rows`).
    fn source(&self, r: usize) -> usize {
        (self.src_row + (r - self.rows.start)) * self.src_stride + self.src_col
    }

    /// Padded row `r`'s copy: the column its values start at, where they start in `src`, and
    /// how many (none outside `self.rows`).
    pub(super) fn row(&self, r: usize) -> (usize, usize, usize) {
        match self.rows.contains(&r) {
            true => (self.col, self.source(r), self.len),
            false => (0, 0, 0),
        }
    }
}

/// Writes the padded plane `dst` (rows of `pw`) from `src` as `part` says, row by row in
/// vector stores (a padded row is a few dozen values: three calls into `memset` and `memcpy`
/// per row cost more than the copy). Returns `false`, touching nothing, where the CPU lacks
/// AVX2 or a row does not fit.
pub(super) fn padded_plane(dst: &mut [f32], pw: usize, src: &[f32], part: &PaddedRows) -> bool {
    let rows = part.rows_in(dst, pw, src);
    #[cfg(target_arch = "x86_64")]
    if let (Some(rows), true) = (rows, avx2_fma()) {
        // SAFETY: the CPU has AVX2; every row of `dst` lies inside it, and every row read of
        // `src` inside it (checked above).
        unsafe { avx2::padded_plane((dst.as_mut_ptr(), rows, pw), src.as_ptr(), part) };
        return true;
    }
    let _ = (rows, dst, src, part);
    false
}

/// Whether the kernels may use AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    crate::simd::avx2_fma()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_maskload_ps, _mm256_maskstore_ps, _mm256_set1_ps,
        _mm256_setzero_ps, _mm256_storeu_ps,
    };

    use super::{SIDE, TILE};
    use crate::conv2d::microkernel::avx2::mask;
    use crate::conv2d::winograd::columns::{
        gradient_column, input_column, output_column, transpose4, Vector,
    };

    /// [`super::padded_plane`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX2; `dst` holds `rows` rows of `pw` values, `part.col + part.len <= pw`,
    /// `part.rows` lies within them, and `src` holds every row `part` reads.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn padded_plane(
        (dst, rows, pw): (*mut f32, usize, usize),
        src: *const f32,
        part: &super::PaddedRows,
    ) {
        for r in 0..rows {
            let (lo, from, n) = part.row(r);
            padded_row((dst.add(r * pw), pw), lo, (src.add(from), n));
        }
    }

    /// One padded row: `n` values of `src` at column `lo` of the `len` values of `dst`, zero
    /// elsewhere.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2; `dst` holds `len` values, `src` holds `n`, and `lo + n <= len`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn padded_row((dst, len): (*mut f32, usize), lo: usize, (src, n): (*const f32, usize)) {
        let zero = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= len {
            _mm256_storeu_ps(dst.add(i), zero);
            i += 8;
        }
        if i < len {
            _mm256_maskstore_ps(dst.add(i), mask(len - i), zero);
        }
        let mut j = 0;
        while j + 8 <= n {
            _mm256_storeu_ps(dst.add(lo + j), _mm256_loadu_ps(src.add(j)));
            j += 8;
        }
        if j < n {
            let m = mask(n - j);
            let tail = _mm256_maskload_ps(src.add(j), m);
            if lo + j + 8 <= len {
                // The lanes past `n` load as zero, which the row holds there: a whole store,
                // where a masked one is slow on AMD's cores.
                _mm256_storeu_ps(dst.add(lo + j), tail);
            } else {
                _mm256_maskstore_ps(dst.add(lo + j), m, tail);
            }
        }
    }

    /// See [`super::input_tiles`].
    ///
    /// # Safety
    ///
    /// AVX2 and FMA; each pair's six rows of twelve values from `p + starts[j]` lie in the
    /// slice, and `v` holds `35 * stride + 8` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn input_tiles(
        p: *const f32,
        starts: [usize; 4],
        pw: usize,
        v: *mut f32,
        stride: usize,
    ) {
        let mut z = [[_mm256_set1_ps(0.0); SIDE]; SIDE];
        for (q, zq) in z.iter_mut().enumerate() {
            let load = |off: usize| starts.map(|s| _mm256_loadu_ps(p.add(s + q * pw + off)));
            // Columns 0..4 of each lane's tile, then 4..6 (the next tile's first two).
            let [d0, d1, d2, d3] = transpose4(load(0));
            let [d4, d5, _, _] = transpose4(load(TILE));
            *zq = input_column([d0, d1, d2, d3, d4, d5]);
        }
        // Column k of the six rows: a transpose, so k indexes every row.
        #[allow(clippy::needless_range_loop)]
        for k in 0..SIDE {
            let col = input_column([z[0][k], z[1][k], z[2][k], z[3][k], z[4][k], z[5][k]]);
            for (a, value) in col.into_iter().enumerate() {
                _mm256_storeu_ps(v.add((SIDE * a + k) * stride), value);
            }
        }
    }

    /// See [`super::gradient_tiles`].
    ///
    /// # Safety
    ///
    /// AVX2; each pair's four rows of eight values from `p + starts[j]` lie in the slice, and
    /// `dm` holds `35 * stride + 8` values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn gradient_tiles(
        p: *const f32,
        starts: [usize; 4],
        gw: usize,
        dm: *mut f32,
        stride: usize,
    ) {
        let row = |q: usize| {
            let loads = starts.map(|s| _mm256_loadu_ps(p.add(s + q * gw)));
            gradient_column(transpose4(loads))
        };
        let z = [row(0), row(1), row(2), row(3)];
        #[allow(clippy::needless_range_loop)]
        for k in 0..SIDE {
            let col = gradient_column([z[0][k], z[1][k], z[2][k], z[3][k]]);
            for (a, value) in col.into_iter().enumerate() {
                _mm256_storeu_ps(dm.add((SIDE * a + k) * stride), value);
            }
        }
    }

    /// See [`super::output_tiles`].
    ///
    /// # Safety
    ///
    /// AVX2 and FMA; `m` holds `35 * stride + 8` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn output_tiles(
        m: *const f32,
        stride: usize,
        (bias, relu): (f32, bool),
        rows: &mut super::PairRows,
    ) {
        let el = |e: usize| _mm256_loadu_ps(m.add(e * stride));
        let mut s = [[_mm256_set1_ps(0.0); SIDE]; TILE];
        for k in 0..SIDE {
            let col = output_column([0, 1, 2, 3, 4, 5].map(|r| el(SIDE * r + k)));
            for (sr, value) in s.iter_mut().zip(col) {
                sr[k] = value;
            }
        }
        let bias = _mm256_set1_ps(bias);
        for (r, sr) in s.iter().enumerate() {
            let y = output_column(*sr).map(|v| _mm256_add_ps(v, bias));
            // Pair j's row r: its first tile's four columns, then its second tile's.
            for (j, row) in transpose4(y).into_iter().enumerate() {
                let row = if relu { row.relu() } else { row };
                _mm256_storeu_ps(rows[TILE * j + r].as_mut_ptr(), row);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{output_tiles, PairRows, ELEMENTS, LANES};
    use crate::conv2d::epilogue;

    /// The output rows with the fused ReLU are those without it, each through the portable
    /// `epilogue::relu`, bit for bit: products holding a NaN, infinities of both signs (one
    /// tile's `+inf` and `-inf` meet, a NaN) and values either side of zero.
    #[test]
    fn the_fused_relu_keeps_nans_as_the_portable_relu() {
        let stride = LANES + 3;
        let mut m: Vec<f32> = (0..(ELEMENTS - 1) * stride + LANES)
            .map(|i| ((i * 7919 % 1999) as f32 - 999.0) / 333.0)
            .collect();
        m[5 * stride + 1] = f32::NAN;
        m[stride + 4] = f32::INFINITY;
        m[9 * stride + 6] = f32::NEG_INFINITY;
        m[20 * stride + 6] = f32::INFINITY;
        for bias in [0.0, -0.75, 1.25] {
            let (mut plain, mut fused): (PairRows, PairRows) = Default::default();
            if !output_tiles(&m, stride, (bias, false), &mut plain) {
                eprintln!("skipped: the SIMD cap is below AVX2");
                return;
            }
            assert!(output_tiles(&m, stride, (bias, true), &mut fused));
            let bits = |rows: &PairRows| -> Vec<u32> {
                rows.iter().flatten().map(|v| v.to_bits()).collect()
            };
            let mut want = plain;
            for v in want.iter_mut().flatten() {
                *v = epilogue::relu(*v);
            }
            assert_eq!(bits(&fused), bits(&want), "bias {bias}");
            let count = |rows: &PairRows, f: fn(f32) -> bool| {
                rows.iter().flatten().filter(|v| f(**v)).count()
            };
            assert!(
                count(&fused, f32::is_nan) > 0,
                "bias {bias}: no NaN to keep"
            );
            assert!(count(&plain, |v| v < 0.0) > 0 && count(&fused, |v| v < 0.0) == 0);
        }
    }
}
