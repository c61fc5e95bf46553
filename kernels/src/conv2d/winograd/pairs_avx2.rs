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

/// Writes the padded plane `dst` (rows of `pw`) from `src` as `part` says, row by row in
/// vector stores (a padded row is a few dozen values: three calls into `memset` and `memcpy`
/// per row cost more than the copy). Returns `false`, touching nothing, where the CPU lacks
/// AVX2 or a row does not fit.
pub(super) fn padded_plane(dst: &mut [f32], pw: usize, src: &[f32], part: &PaddedRows) -> bool {
    let rows = dst.len() / pw.max(1);
    let last_src = |r: usize| {
        (part.src_row + (r - part.rows.start)) * part.src_stride + part.src_col + part.len
    };
    let fits = pw > 0
        && dst.len() == rows * pw
        && part.col + part.len <= pw
        && part.rows.end <= rows
        && (part.rows.is_empty() || last_src(part.rows.end - 1) <= src.len());
    #[cfg(target_arch = "x86_64")]
    if fits && avx2_fma() {
        // SAFETY: the CPU has AVX2; every row of `dst` lies inside it, and every row read of
        // `src` inside it (checked above).
        unsafe { avx2::padded_plane((dst.as_mut_ptr(), rows, pw), src.as_ptr(), part) };
        return true;
    }
    let _ = (fits, dst, src, part);
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
        __m256, _mm256_add_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_loadu_ps,
        _mm256_maskload_ps, _mm256_maskstore_ps, _mm256_max_ps, _mm256_mul_ps, _mm256_set1_ps,
        _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_storeu_ps, _mm256_sub_ps, _mm256_unpackhi_ps,
        _mm256_unpacklo_ps,
    };

    use super::{SIDE, TILE};
    use crate::conv2d::microkernel::avx2::mask;

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
            let row = (dst.add(r * pw), pw);
            if part.rows.contains(&r) {
                let from = (part.src_row + (r - part.rows.start)) * part.src_stride + part.src_col;
                padded_row(row, part.col, (src.add(from), part.len));
            } else {
                padded_row(row, 0, (src, 0));
            }
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

    /// Within each 128-bit half, the 4x4 transpose of the four vectors' halves.
    #[inline(always)]
    unsafe fn transpose4([v0, v1, v2, v3]: [__m256; 4]) -> [__m256; 4] {
        let (t0, t1) = (_mm256_unpacklo_ps(v0, v1), _mm256_unpacklo_ps(v2, v3));
        let (t2, t3) = (_mm256_unpackhi_ps(v0, v1), _mm256_unpackhi_ps(v2, v3));
        [
            _mm256_shuffle_ps::<0x44>(t0, t1),
            _mm256_shuffle_ps::<0xEE>(t0, t1),
            _mm256_shuffle_ps::<0x44>(t2, t3),
            _mm256_shuffle_ps::<0xEE>(t2, t3),
        ]
    }

    /// [`super::super::input_column`] over the lanes.
    #[inline(always)]
    unsafe fn input_column([d0, d1, d2, d3, d4, d5]: [__m256; SIDE]) -> [__m256; SIDE] {
        let (two, four, five) = (
            _mm256_set1_ps(2.0),
            _mm256_set1_ps(4.0),
            _mm256_set1_ps(5.0),
        );
        let (sum, diff) = (_mm256_add_ps(d1, d2), _mm256_sub_ps(d1, d2));
        let (d31, d42) = (_mm256_sub_ps(d3, d1), _mm256_sub_ps(d4, d2));
        [
            _mm256_fmadd_ps(four, d0, _mm256_fnmadd_ps(five, d2, d4)),
            _mm256_fnmadd_ps(four, sum, _mm256_add_ps(d3, d4)),
            _mm256_fmadd_ps(four, diff, _mm256_sub_ps(d4, d3)),
            _mm256_fmadd_ps(two, d31, d42),
            _mm256_fnmadd_ps(two, d31, d42),
            _mm256_fmadd_ps(four, d1, _mm256_fnmadd_ps(five, d3, d5)),
        ]
    }

    /// [`super::super::output_column`] over the lanes.
    #[inline(always)]
    unsafe fn output_column([m0, m1, m2, m3, m4, m5]: [__m256; SIDE]) -> [__m256; TILE] {
        let (a, b) = (_mm256_add_ps(m1, m2), _mm256_sub_ps(m1, m2));
        let (c, d) = (_mm256_add_ps(m3, m4), _mm256_sub_ps(m3, m4));
        [
            _mm256_add_ps(_mm256_add_ps(m0, a), c),
            _mm256_fmadd_ps(_mm256_set1_ps(2.0), d, b),
            _mm256_fmadd_ps(_mm256_set1_ps(4.0), c, a),
            _mm256_add_ps(_mm256_fmadd_ps(_mm256_set1_ps(8.0), d, b), m5),
        ]
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

    /// The gradient transform's column over the lanes (the portable `gradient_column`, the
    /// same operations).
    #[inline(always)]
    unsafe fn gradient_column([g0, g1, g2, g3]: [__m256; TILE]) -> [__m256; SIDE] {
        let (even, odd) = (_mm256_add_ps(g0, g2), _mm256_add_ps(g1, g3));
        let even4 = _mm256_add_ps(g0, _mm256_mul_ps(_mm256_set1_ps(4.0), g2));
        let odd2 = _mm256_add_ps(
            _mm256_mul_ps(_mm256_set1_ps(2.0), g1),
            _mm256_mul_ps(_mm256_set1_ps(8.0), g3),
        );
        [
            g0,
            _mm256_add_ps(even, odd),
            _mm256_sub_ps(even, odd),
            _mm256_add_ps(even4, odd2),
            _mm256_sub_ps(even4, odd2),
            g3,
        ]
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
        let (bias, zero) = (_mm256_set1_ps(bias), _mm256_setzero_ps());
        for (r, sr) in s.iter().enumerate() {
            let y = output_column(*sr).map(|v| _mm256_add_ps(v, bias));
            // Pair j's row r: its first tile's four columns, then its second tile's.
            for (j, row) in transpose4(y).into_iter().enumerate() {
                // `max` returns its second operand when either is NaN: a NaN stays.
                let row = if relu { _mm256_max_ps(zero, row) } else { row };
                _mm256_storeu_ps(rows[TILE * j + r].as_mut_ptr(), row);
            }
        }
    }
}
