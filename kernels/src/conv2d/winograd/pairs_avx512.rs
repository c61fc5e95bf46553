//! The transforms of sixteen tiles in AVX-512 registers: two groups of [`super::LANES`] tiles
//! side by side, each as [`super::pairs_avx2`] lays out its eight. A 512-bit vector holds the
//! first group's four pairs' first tiles, their second tiles, then the second group's the same
//! way; so each row of a pair is one 256-bit load per group, and the 128-bit-lane transpose
//! and the arithmetic are AVX2's, over twice the lanes. A group's lanes lie right after the
//! previous group's in a block's buffers, so a transformed element of both groups is one
//! 512-bit store or load.
//!
//! The values are the AVX2 kernels' bit for bit (the same operations lane by lane, fused
//! multiply-adds included). The functions return `false`, touching nothing, where they do not
//! apply (a CPU without AVX-512, the cap below it, or slices too short), and the caller takes
//! the AVX2 or portable path.

#![allow(unsafe_code)]

use super::pairs_avx2::{PaddedRows, PairRows};
use super::{ELEMENTS, LANES, SIDE, TILE};

/// Writes the transformed tiles `V = Bt d B` of two groups of four pairs of adjacent tiles:
/// pair `j` of group `g`'s first tile's input tile starts at `padded[starts[g][j]]`, its rows
/// `pw` apart; element `e` of lane `l` of group `g` goes to `v[e * stride + LANES * g + l]`.
pub(super) fn input_tiles(
    padded: &[f32],
    starts: [[usize; 4]; 2],
    pw: usize,
    v: &mut [f32],
    stride: usize,
) -> bool {
    // Each pair reads six rows of twelve values.
    let reach = (SIDE - 1) * pw + 3 * TILE;
    let fits = starts.iter().flatten().all(|s| s + reach <= padded.len())
        && v.len() >= (ELEMENTS - 1) * stride + 2 * LANES;
    #[cfg(target_arch = "x86_64")]
    if fits && usable() {
        // SAFETY: the CPU has AVX-512 (F, VL, BW, DQ) and FMA, and both slices hold what the
        // kernel reads and writes (checked above).
        unsafe { avx512::input_tiles(padded.as_ptr(), starts, pw, v.as_mut_ptr(), stride) };
        return true;
    }
    let _ = (fits, padded, starts, pw, v, stride);
    false
}

/// Writes the transformed output gradients `dM = A dY At` of two groups of four pairs of
/// adjacent tiles (see [`super::pairs_avx2::gradient_tiles`]): pair `j` of group `g` starts at
/// `padded[starts[g][j]]`; element `e` of lane `l` of group `g` goes to
/// `dm[e * stride + LANES * g + l]`.
pub(super) fn gradient_tiles(
    padded: &[f32],
    starts: [[usize; 4]; 2],
    gw: usize,
    dm: &mut [f32],
    stride: usize,
) -> bool {
    let reach = (TILE - 1) * gw + 2 * TILE;
    let fits = starts.iter().flatten().all(|s| s + reach <= padded.len())
        && dm.len() >= (ELEMENTS - 1) * stride + 2 * LANES;
    #[cfg(target_arch = "x86_64")]
    if fits && usable() {
        // SAFETY: the CPU has AVX-512 (F, DQ), and both slices hold what the kernel reads
        // and writes (checked above).
        unsafe { avx512::gradient_tiles(padded.as_ptr(), starts, gw, dm.as_mut_ptr(), stride) };
        return true;
    }
    let _ = (fits, padded, starts, gw, dm, stride);
    false
}

/// Computes the outputs `At M A + bias` of two groups of four pairs of adjacent tiles into
/// `rows` (one [`PairRows`] per group, as [`super::pairs_avx2::output_tiles`] writes one),
/// then their ReLU when `relu`: element `e` of lane `l` of group `g`'s products is
/// `m[e * stride + LANES * g + l]`.
pub(super) fn output_tiles(
    m: &[f32],
    stride: usize,
    (bias, relu): (f32, bool),
    rows: &mut [PairRows; 2],
) -> bool {
    let fits = m.len() >= (ELEMENTS - 1) * stride + 2 * LANES;
    #[cfg(target_arch = "x86_64")]
    if fits && usable() {
        // SAFETY: the CPU has AVX-512 and FMA, and `m` holds what the kernel reads (checked
        // above); `rows` is whole.
        unsafe { avx512::output_tiles(m.as_ptr(), stride, (bias, relu), rows) };
        return true;
    }
    let _ = (fits, m, stride, bias, relu, rows);
    false
}

/// [`super::pairs_avx2::padded_plane`] in 512-bit stores, the row ends through mask
/// registers. Returns `false`, touching nothing, where AVX-512 is not in use or a row does
/// not fit.
pub(super) fn padded_plane(dst: &mut [f32], pw: usize, src: &[f32], part: &PaddedRows) -> bool {
    let rows = part.rows_in(dst, pw, src);
    #[cfg(target_arch = "x86_64")]
    if let (Some(rows), true) = (rows, usable()) {
        // SAFETY: the CPU has AVX-512; every row of `dst` lies inside it, and every row read
        // of `src` inside it (checked above).
        unsafe { avx512::padded_plane((dst.as_mut_ptr(), rows, pw), src.as_ptr(), part) };
        return true;
    }
    let _ = (rows, dst, src, part);
    false
}

/// Whether the kernels may use AVX-512 (the CPU has it and the cap allows it): the callers
/// take two groups at a time only then.
pub(super) fn usable() -> bool {
    cfg!(target_arch = "x86_64") && crate::SimdLevel::in_use() >= crate::SimdLevel::Avx512
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _mm256_loadu_ps, _mm256_storeu_ps, _mm512_add_ps, _mm512_castps256_ps512,
        _mm512_castps512_ps256, _mm512_extractf32x8_ps, _mm512_insertf32x8, _mm512_loadu_ps,
        _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_storeu_ps,
    };

    use super::{PaddedRows, PairRows, SIDE, TILE};
    use crate::conv2d::winograd::columns::{
        gradient_column, input_column, output_column, transpose4, Vector,
    };

    /// The mask of a vector's first `n` lanes (`n < 16`).
    #[inline(always)]
    fn first(n: usize) -> u16 {
        (1u16 << n) - 1
    }

    /// [`super::padded_plane`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F; `dst` holds `rows` rows of `pw` values, `part.col + part.len <=
    /// pw`, `part.rows` lies within them, and `src` holds every row `part` reads.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn padded_plane(
        (dst, rows, pw): (*mut f32, usize, usize),
        src: *const f32,
        part: &PaddedRows,
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
    /// The CPU has AVX-512F; `dst` holds `len` values, `src` holds `n`, and `lo + n <= len`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn padded_row((dst, len): (*mut f32, usize), lo: usize, (src, n): (*const f32, usize)) {
        let zero = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= len {
            _mm512_storeu_ps(dst.add(i), zero);
            i += 16;
        }
        if i < len {
            _mm512_mask_storeu_ps(dst.add(i), first(len - i), zero);
        }
        let mut j = 0;
        while j + 16 <= n {
            _mm512_storeu_ps(dst.add(lo + j), _mm512_loadu_ps(src.add(j)));
            j += 16;
        }
        if j < n {
            let m = first(n - j);
            _mm512_mask_storeu_ps(dst.add(lo + j), m, _mm512_maskz_loadu_ps(m, src.add(j)));
        }
    }

    /// See [`super::input_tiles`].
    ///
    /// # Safety
    ///
    /// AVX-512 (F, DQ) and FMA; each pair's six rows of twelve values from
    /// `p + starts[g][j]` lie in the slice, and `v` holds `35 * stride + 16` values.
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub(super) unsafe fn input_tiles(
        p: *const f32,
        starts: [[usize; 4]; 2],
        pw: usize,
        v: *mut f32,
        stride: usize,
    ) {
        let row = |q: usize| -> [__m512; SIDE] {
            // Pair `j`'s eight values of row `q` from column `off`: the first group's in the
            // low half, the second's in the high half.
            let load = |off: usize| {
                [0, 1, 2, 3].map(|j| {
                    let at = |g: usize| p.add(starts[g][j] + q * pw + off);
                    let low = _mm512_castps256_ps512(_mm256_loadu_ps(at(0)));
                    _mm512_insertf32x8::<1>(low, _mm256_loadu_ps(at(1)))
                })
            };
            // Columns 0..4 of each lane's tile, then 4..6 (the next tile's first two).
            let [d0, d1, d2, d3] = transpose4(load(0));
            let [d4, d5, _, _] = transpose4(load(TILE));
            input_column([d0, d1, d2, d3, d4, d5])
        };
        let z = [row(0), row(1), row(2), row(3), row(4), row(5)];
        // Column k of the six rows: a transpose, so k indexes every row.
        #[allow(clippy::needless_range_loop)]
        for k in 0..SIDE {
            let col = input_column([z[0][k], z[1][k], z[2][k], z[3][k], z[4][k], z[5][k]]);
            for (a, value) in col.into_iter().enumerate() {
                _mm512_storeu_ps(v.add((SIDE * a + k) * stride), value);
            }
        }
    }

    /// See [`super::gradient_tiles`].
    ///
    /// # Safety
    ///
    /// AVX-512 (F, DQ); each pair's four rows of eight values from `p + starts[g][j]` lie in
    /// the slice, and `dm` holds `35 * stride + 16` values.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn gradient_tiles(
        p: *const f32,
        starts: [[usize; 4]; 2],
        gw: usize,
        dm: *mut f32,
        stride: usize,
    ) {
        let row = |q: usize| {
            let loads = [0, 1, 2, 3].map(|j| {
                let at = |g: usize| p.add(starts[g][j] + q * gw);
                let low = _mm512_castps256_ps512(_mm256_loadu_ps(at(0)));
                _mm512_insertf32x8::<1>(low, _mm256_loadu_ps(at(1)))
            });
            gradient_column(transpose4(loads))
        };
        let z = [row(0), row(1), row(2), row(3)];
        #[allow(clippy::needless_range_loop)]
        for k in 0..SIDE {
            let col = gradient_column([z[0][k], z[1][k], z[2][k], z[3][k]]);
            for (a, value) in col.into_iter().enumerate() {
                _mm512_storeu_ps(dm.add((SIDE * a + k) * stride), value);
            }
        }
    }

    /// See [`super::output_tiles`].
    ///
    /// # Safety
    ///
    /// AVX-512 (F, DQ) and FMA; `m` holds `35 * stride + 16` values.
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub(super) unsafe fn output_tiles(
        m: *const f32,
        stride: usize,
        (bias, relu): (f32, bool),
        rows: &mut [PairRows; 2],
    ) {
        let el = |e: usize| _mm512_loadu_ps(m.add(e * stride));
        let column = |k: usize| output_column([0, 1, 2, 3, 4, 5].map(|r| el(SIDE * r + k)));
        let columns = [
            column(0),
            column(1),
            column(2),
            column(3),
            column(4),
            column(5),
        ];
        let bias = _mm512_set1_ps(bias);
        for r in 0..TILE {
            let sr = columns.map(|c| c[r]);
            let y = output_column(sr).map(|v| _mm512_add_ps(v, bias));
            // Pair j's row r: its first tile's four columns, then its second tile's, the first
            // group's in the low half.
            for (j, row) in transpose4(y).into_iter().enumerate() {
                let row = if relu { row.relu() } else { row };
                let [low, high] = &mut *rows;
                _mm256_storeu_ps(low[TILE * j + r].as_mut_ptr(), _mm512_castps512_ps256(row));
                _mm256_storeu_ps(
                    high[TILE * j + r].as_mut_ptr(),
                    _mm512_extractf32x8_ps::<1>(row),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::pairs_avx2;
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1999) as f32 - 999.0) / 333.0)
            .collect()
    }

    /// Whether this CPU runs the AVX-512 kernels (whatever the cap: the tests call them).
    fn has_avx512() -> bool {
        let has = crate::SimdLevel::detected() >= crate::SimdLevel::Avx512;
        if !has {
            eprintln!("skipped: this CPU has no AVX-512");
        }
        has
    }

    /// Both groups' transformed tiles are the AVX2 kernel's, group by group, bit for bit.
    #[test]
    fn input_tiles_are_avx2s_two_groups_at_once() {
        if !has_avx512() {
            return;
        }
        let pw = 40;
        let padded = values(30 * pw, 1);
        let starts = [[0, 8, 16, 24], [4 * pw, 4 * pw + 8, 12 * pw + 4, 16 * pw]];
        let stride = 2 * LANES + 5;
        let mut wide = vec![f32::NAN; (ELEMENTS - 1) * stride + 2 * LANES];
        let reach = (SIDE - 1) * pw + 3 * TILE;
        assert!(starts.iter().flatten().all(|s| s + reach <= padded.len()));
        // SAFETY: the CPU has AVX-512 and FMA (checked above), `padded` holds every pair's
        // rows (asserted) and `wide` every element of both groups.
        unsafe { avx512::input_tiles(padded.as_ptr(), starts, pw, wide.as_mut_ptr(), stride) };
        for (g, group_starts) in starts.iter().enumerate() {
            let mut narrow = vec![f32::NAN; (ELEMENTS - 1) * stride + LANES];
            if !pairs_avx2::input_tiles(&padded, *group_starts, pw, &mut narrow, stride) {
                eprintln!("skipped: the SIMD cap is below AVX2, the reference kernel's");
                return;
            }
            for e in 0..ELEMENTS {
                let want = &narrow[e * stride..][..LANES];
                let got = &wide[e * stride + LANES * g..][..LANES];
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "group {g}, element {e}"
                );
            }
        }
        let short = &mut wide[..(ELEMENTS - 1) * stride + LANES];
        assert!(!input_tiles(&padded, starts, pw, short, stride));
    }

    /// Both groups' output rows are the AVX2 kernel's, with the bias and the ReLU, a NaN kept.
    #[test]
    fn output_tiles_are_avx2s_two_groups_at_once() {
        if !has_avx512() {
            return;
        }
        let stride = 2 * LANES + 3;
        let mut m = values((ELEMENTS - 1) * stride + 2 * LANES, 2);
        m[7 * stride + LANES + 2] = f32::NAN;
        for write in [(0.5, false), (-0.25, true)] {
            let mut wide = [[[f32::NAN; 2 * TILE]; 4 * TILE]; 2];
            // SAFETY: the CPU has AVX-512 and FMA (checked above) and `m` holds both groups'
            // elements.
            unsafe { avx512::output_tiles(m.as_ptr(), stride, write, &mut wide) };
            for (g, got) in wide.iter().enumerate() {
                let mut want = [[f32::NAN; 2 * TILE]; 4 * TILE];
                if !pairs_avx2::output_tiles(&m[LANES * g..], stride, write, &mut want) {
                    eprintln!("skipped: the SIMD cap is below AVX2, the reference kernel's");
                    return;
                }
                let bits = |rows: &PairRows| -> Vec<u32> {
                    rows.iter().flatten().map(|v| v.to_bits()).collect()
                };
                assert_eq!(bits(got), bits(&want), "group {g}, {write:?}");
            }
        }
    }

    /// Both groups' transformed gradients are the portable transform's, bit for bit, through
    /// the AVX2 kernel group by group and the AVX-512 kernel for both.
    #[test]
    fn gradient_tiles_are_the_portable_transforms() {
        let gw = 24;
        let padded = values(20 * gw, 4);
        let starts = [
            [0, 8, 16, 4 * gw],
            [4 * gw + 8, 8 * gw, 8 * gw + 16, 12 * gw + 8],
        ];
        let stride = 2 * LANES + 7;
        let want: Vec<[[f32; LANES]; ELEMENTS]> = starts
            .iter()
            .map(|group| {
                let mut d = [[0f32; LANES]; TILE * TILE];
                for l in 0..LANES {
                    // Lane `l`: pair `l`'s first tile, or (from 4) pair `l - 4`'s second.
                    let start = group[l % 4] + if l < 4 { 0 } else { TILE };
                    for q in 0..TILE {
                        for k in 0..TILE {
                            d[q * TILE + k][l] = padded[start + q * gw + k];
                        }
                    }
                }
                super::super::transforms::transform_gradient(&d)
            })
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (g, group) in starts.iter().enumerate() {
            let mut narrow = vec![f32::NAN; (ELEMENTS - 1) * stride + LANES];
            if !pairs_avx2::gradient_tiles(&padded, *group, gw, &mut narrow, stride) {
                eprintln!("skipped: the SIMD cap is below AVX2");
                return;
            }
            for e in 0..ELEMENTS {
                assert_eq!(
                    bits(&narrow[e * stride..][..LANES]),
                    bits(&want[g][e]),
                    "{g}, {e}"
                );
            }
        }
        if !has_avx512() {
            return;
        }
        let mut wide = vec![f32::NAN; (ELEMENTS - 1) * stride + 2 * LANES];
        let reach = (TILE - 1) * gw + 2 * TILE;
        assert!(starts.iter().flatten().all(|s| s + reach <= padded.len()));
        // SAFETY: the CPU has AVX-512 (checked above), `padded` holds every pair's rows
        // (asserted) and `wide` every element of both groups.
        unsafe { avx512::gradient_tiles(padded.as_ptr(), starts, gw, wide.as_mut_ptr(), stride) };
        for (g, want) in want.iter().enumerate() {
            for e in 0..ELEMENTS {
                let got = &wide[e * stride + LANES * g..][..LANES];
                assert_eq!(bits(got), bits(&want[e]), "group {g}, element {e}");
            }
        }
    }

    /// The padded plane is the AVX2 kernel's, across the ends of rows of every length.
    #[test]
    fn padded_planes_are_avx2s() {
        if !has_avx512() {
            return;
        }
        let src = values(40 * 37, 3);
        for (pw, len, col) in [
            (21, 15, 2),
            (40, 37, 1),
            (16, 16, 0),
            (7, 5, 1),
            (52, 33, 18),
        ] {
            let part = PaddedRows {
                rows: 1..6,
                src_row: 2,
                src_stride: 37,
                src_col: 1,
                len: len.min(36),
                col,
            };
            let (mut wide, mut narrow) = (vec![f32::NAN; 8 * pw], vec![f32::NAN; 8 * pw]);
            let last = (part.src_row + part.rows.len() - 1) * part.src_stride + 1 + part.len;
            assert!(col + part.len <= pw && last <= src.len());
            // SAFETY: the CPU has AVX-512 (checked above); `wide` holds 8 rows of `pw`, the
            // part fits them and `src` holds every row it reads (asserted).
            unsafe { avx512::padded_plane((wide.as_mut_ptr(), 8, pw), src.as_ptr(), &part) };
            if !pairs_avx2::padded_plane(&mut narrow, pw, &src, &part) {
                eprintln!("skipped: the SIMD cap is below AVX2, the reference kernel's");
                return;
            }
            assert_eq!(wide, narrow, "pw {pw}, len {len}, col {col}");
        }
    }
}
