//! The transforms of eight consecutive tiles along a tile row, in AVX2 registers: the common
//! case (planes 16 or more columns wide), where the eight 4x4 input tiles overlap along the same
//! four input rows and the 2x2 outputs fill two runs of sixteen output columns.
//!
//! Each input row is loaded as two pairs of vectors and split into its even and odd columns
//! (tile `l` reads columns `2l .. 2l + 4`), so a transform takes eight tiles in the lanes of a
//! vector with no gather; the outputs are interleaved back into rows before they are stored.
//! Both functions return `false`, touching nothing, where they do not apply (another CPU, or
//! slices too short), and the caller takes its portable path.

#![allow(unsafe_code)]

use super::LANES;

/// Writes the transformed tiles `V = Bt d B` of [`LANES`] consecutive tiles: `src` starts at
/// the first tile's top-left input value, its four input rows `pw` apart; element `e` of tile
/// `l` goes to `v[e * stride + l]`.
pub(super) fn input_tiles(src: &[f32], pw: usize, v: &mut [f32], stride: usize) -> bool {
    let fits = src.len() >= 3 * pw + 2 * LANES + 2 && v.len() >= 15 * stride + LANES;
    #[cfg(target_arch = "x86_64")]
    if fits && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 and both slices hold what the kernel reads and writes
        // (checked above).
        unsafe { avx2::input_tiles(src.as_ptr(), pw, v.as_mut_ptr(), stride) };
        return true;
    }
    let _ = (fits, src, pw, v, stride);
    false
}

/// Writes the outputs `At M A + bias` of [`LANES`] consecutive tiles: element `e` of tile `l`'s
/// products is `m[e * stride + l]`; the tiles' first output row goes to `out[..2 * LANES]` and,
/// when `both_rows`, the second to `out[wo..][..2 * LANES]`.
pub(super) fn output_tiles(
    m: &[f32],
    stride: usize,
    bias: f32,
    out: &mut [f32],
    wo: usize,
    both_rows: bool,
) -> bool {
    let rows_end = if both_rows { wo } else { 0 } + 2 * LANES;
    let fits = m.len() >= 15 * stride + LANES && out.len() >= rows_end;
    #[cfg(target_arch = "x86_64")]
    if fits && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 and both slices hold what the kernel reads and writes
        // (checked above).
        unsafe { avx2::output_tiles(m.as_ptr(), stride, bias, out.as_mut_ptr(), wo, both_rows) };
        return true;
    }
    let _ = (fits, m, stride, bias, out, wo, both_rows);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_castpd_ps, _mm256_castps_pd, _mm256_loadu_ps,
        _mm256_permute2f128_ps, _mm256_permute4x64_pd, _mm256_set1_ps, _mm256_shuffle_ps,
        _mm256_storeu_ps, _mm256_sub_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };

    /// The even and odd values of the sixteen in `a` then `b`, each in order.
    #[inline(always)]
    unsafe fn deinterleave(a: __m256, b: __m256) -> (__m256, __m256) {
        // Within each 128-bit half: [a0 a2 b0 b2 | a4 a6 b4 b6], then the 64-bit pairs put in
        // order.
        let order =
            |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(v)));
        (
            order(_mm256_shuffle_ps::<0x88>(a, b)),
            order(_mm256_shuffle_ps::<0xDD>(a, b)),
        )
    }

    /// `Bt d` (or `d B`) of one column of four: `[d0 - d2, d1 + d2, d2 - d1, d1 - d3]`.
    #[inline(always)]
    unsafe fn input_column(d: [__m256; 4]) -> [__m256; 4] {
        [
            _mm256_sub_ps(d[0], d[2]),
            _mm256_add_ps(d[1], d[2]),
            _mm256_sub_ps(d[2], d[1]),
            _mm256_sub_ps(d[1], d[3]),
        ]
    }

    /// `At m` (or `m A`) of one column of four: `[m0 + m1 + m2, m1 - m2 - m3]`.
    #[inline(always)]
    unsafe fn output_column(m: [__m256; 4]) -> [__m256; 2] {
        [
            _mm256_add_ps(_mm256_add_ps(m[0], m[1]), m[2]),
            _mm256_sub_ps(_mm256_sub_ps(m[1], m[2]), m[3]),
        ]
    }

    /// See [`super::input_tiles`].
    ///
    /// # Safety
    ///
    /// AVX2; `src` holds `3 * pw + 18` values and `v` `15 * stride + 8`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn input_tiles(src: *const f32, pw: usize, v: *mut f32, stride: usize) {
        let mut z = [[_mm256_set1_ps(0.0); 4]; 4];
        for (q, zq) in z.iter_mut().enumerate() {
            let p = src.add(q * pw);
            // Tile l reads d0 = p[2l], d1 = p[2l + 1], d2 = p[2l + 2], d3 = p[2l + 3].
            let (d0, d1) = deinterleave(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
            let (d2, d3) = deinterleave(_mm256_loadu_ps(p.add(2)), _mm256_loadu_ps(p.add(10)));
            *zq = input_column([d0, d1, d2, d3]);
        }
        // Column k of the four rows: a transpose, so k indexes every row.
        #[allow(clippy::needless_range_loop)]
        for k in 0..4 {
            let col = input_column([z[0][k], z[1][k], z[2][k], z[3][k]]);
            for (a, value) in col.into_iter().enumerate() {
                _mm256_storeu_ps(v.add((4 * a + k) * stride), value);
            }
        }
    }

    /// See [`super::output_tiles`].
    ///
    /// # Safety
    ///
    /// AVX2; `m` holds `15 * stride + 8` values, `out` 16 (and `wo + 16` when `both_rows`).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn output_tiles(
        m: *const f32,
        stride: usize,
        bias: f32,
        out: *mut f32,
        wo: usize,
        both_rows: bool,
    ) {
        let el = |e: usize| _mm256_loadu_ps(m.add(e * stride));
        let mut s = [[_mm256_set1_ps(0.0); 4]; 2];
        #[allow(clippy::needless_range_loop)]
        for k in 0..4 {
            let [a, b] = output_column([el(k), el(4 + k), el(8 + k), el(12 + k)]);
            s[0][k] = a;
            s[1][k] = b;
        }
        let bias = _mm256_set1_ps(bias);
        let rows = if both_rows { 2 } else { 1 };
        for (r, sr) in s.iter().enumerate().take(rows) {
            let [y0, y1] = output_column(*sr);
            let (y0, y1) = (_mm256_add_ps(y0, bias), _mm256_add_ps(y1, bias));
            // [y0_0 y1_0 y0_1 y1_1 | y0_4 y1_4 y0_5 y1_5] and the same for tiles 2, 3, 6, 7.
            let (lo, hi) = (_mm256_unpacklo_ps(y0, y1), _mm256_unpackhi_ps(y0, y1));
            let row = out.add(r * wo);
            _mm256_storeu_ps(row, _mm256_permute2f128_ps::<0x20>(lo, hi));
            _mm256_storeu_ps(row.add(8), _mm256_permute2f128_ps::<0x31>(lo, hi));
        }
    }
}
