//! A register-blocked matrix product for CPUs with AVX2 and FMA, for operands that fit the
//! caches: `dst = lhs * rhs` with the left operand packed once ([`PackedLhs`]) and the right one
//! read in place, row by row.
//!
//! Each call of the inner kernel keeps an `MR x NR` block of `dst` in twelve vector registers
//! (six rows, two 8-lane vectors), and for each step along the inner dimension loads two
//! vectors of `rhs` and broadcasts six values of the packed panel: twelve FMAs for eight loads,
//! so the two FMA pipes stay busy. The right operand is read as it lies, so a caller that
//! writes it in row-major runs `NR` wide (Winograd's transformed tiles) pays no packing at all,
//! and the left one (a transformed kernel) is packed once per layer instead of once per call.
//!
//! The `gemm` crate covers every other product; this one serves Winograd's sixteen products
//! per block of tiles, whose operands are too small for a general GEMM's packing to pay off.

#![allow(unsafe_code)]

/// Rows of `dst` per kernel call (the last panel of a product may hold fewer).
pub(crate) const MR: usize = 6;

/// Columns of `dst` per kernel call: two AVX2 vectors.
pub(crate) const NR: usize = 16;

/// Whether this CPU runs [`product`]: x86-64 with AVX2 and FMA.
pub(crate) fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// An `m x k` row-major matrix packed into panels of [`MR`] rows (the last one may be
/// shorter), each laid out `[k][rows]`, so the kernel reads a panel's column as consecutive
/// values.
#[derive(Debug, Clone)]
pub(crate) struct PackedLhs {
    data: Vec<f32>,
    m: usize,
    k: usize,
}

impl PackedLhs {
    /// Packs the row-major `m x k` matrix `lhs` (`lhs.len() == m * k`).
    pub(crate) fn new(lhs: &[f32], m: usize, k: usize) -> Self {
        debug_assert_eq!(lhs.len(), m * k);
        let mut data = Vec::with_capacity(m * k);
        for r0 in (0..m).step_by(MR) {
            let rows = MR.min(m - r0);
            for kk in 0..k {
                data.extend((r0..r0 + rows).map(|r| lhs[r * k + kk]));
            }
        }
        Self { data, m, k }
    }
}

/// `dst[i * ld_dst + j] = sum over p of lhs[i][p] * rhs[p * ld_rhs + j]` for every row `i` of
/// `lhs` and every column `j < n`; `n` must be a multiple of [`NR`]. Returns an error (and
/// touches nothing) when an operand does not fit its slice or the CPU lacks AVX2 and FMA.
pub(crate) fn product(
    lhs: &PackedLhs,
    rhs: &[f32],
    ld_rhs: usize,
    n: usize,
    dst: &mut [f32],
    ld_dst: usize,
) -> candle_core::Result<()> {
    let (m, k) = (lhs.m, lhs.k);
    let spans = |rows: usize, ld: usize| (rows > 0).then(|| (rows - 1) * ld + n);
    let fits = n % NR == 0
        && n <= ld_rhs
        && n <= ld_dst
        && spans(k, ld_rhs).is_none_or(|end| end <= rhs.len())
        && spans(m, ld_dst).is_none_or(|end| end <= dst.len());
    if !fits {
        candle_core::bail!(
            "microkernel: a {m}x{k} by {k}x{n} product does not fit its buffers (rhs {} with row \
             stride {ld_rhs}, dst {} with row stride {ld_dst}; columns must be a multiple of {NR})",
            rhs.len(),
            dst.len()
        );
    }
    if !supported() {
        candle_core::bail!("microkernel: this CPU lacks AVX2 or FMA");
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX2 and FMA (checked above); every row the kernels read of `rhs`
    // (`k` rows of `n` values, `ld_rhs` apart) and write of `dst` (`m` rows of `n`, `ld_dst`
    // apart) lies inside its slice (checked above), and the packed panels hold `m * k` values.
    unsafe {
        avx2::product(lhs, rhs.as_ptr(), ld_rhs, n, dst.as_mut_ptr(), ld_dst);
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };

    use super::{PackedLhs, MR, NR};

    /// Every panel of `lhs` against every `NR` columns of `rhs`.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `rhs` holds `lhs.k` rows of `n` values `ld_rhs` apart and
    /// `dst` `lhs.m` rows of `n` values `ld_dst` apart; `n` is a multiple of `NR`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(
        lhs: &PackedLhs,
        rhs: *const f32,
        ld_rhs: usize,
        n: usize,
        dst: *mut f32,
        ld_dst: usize,
    ) {
        let k = lhs.k;
        for r0 in (0..lhs.m).step_by(MR) {
            // Panels before this one are full, so this one starts at `r0 * k`.
            let panel = lhs.data.as_ptr().add(r0 * k);
            let out = dst.add(r0 * ld_dst);
            for j in (0..n).step_by(NR) {
                let (b, c) = (rhs.add(j), out.add(j));
                match MR.min(lhs.m - r0) {
                    6 => block::<6>(k, panel, b, ld_rhs, c, ld_dst),
                    5 => block::<5>(k, panel, b, ld_rhs, c, ld_dst),
                    4 => block::<4>(k, panel, b, ld_rhs, c, ld_dst),
                    3 => block::<3>(k, panel, b, ld_rhs, c, ld_dst),
                    2 => block::<2>(k, panel, b, ld_rhs, c, ld_dst),
                    _ => block::<1>(k, panel, b, ld_rhs, c, ld_dst),
                }
            }
        }
    }

    /// One `R x NR` block: `c[r][..NR] = sum over p of a[p * R + r] * b[p * ldb..][..NR]`.
    ///
    /// # Safety
    ///
    /// As for [`product`]: `a` holds `k * R` values, `b` `k` rows of `NR` values `ldb` apart,
    /// `c` `R` rows of `NR` values `ldc` apart.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<const R: usize>(
        k: usize,
        a: *const f32,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
    ) {
        let mut acc: [[__m256; 2]; R] = [[_mm256_setzero_ps(); 2]; R];
        for p in 0..k {
            let row = b.add(p * ldb);
            let (b0, b1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)));
            let col = a.add(p * R);
            for (r, acc) in acc.iter_mut().enumerate() {
                let v = _mm256_broadcast_ss(&*col.add(r));
                acc[0] = _mm256_fmadd_ps(v, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(v, b1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let row = c.add(r * ldc);
            _mm256_storeu_ps(row, acc[0]);
            _mm256_storeu_ps(row.add(8), acc[1]);
        }
        debug_assert_eq!(NR, 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_naive_product() -> candle_core::Result<()> {
        if !supported() {
            return Ok(());
        }
        // Full and partial panels, strided rows, a zero-depth product.
        for (m, k, n, ld_rhs, ld_dst) in [
            (6, 5, 16, 16, 16),
            (13, 37, 48, 50, 64),
            (1, 160, 32, 32, 32),
            (4, 0, 16, 16, 16),
        ] {
            let value = |i: usize| ((i * 7919 % 211) as f32 - 105.0) / 105.0;
            let lhs: Vec<f32> = (0..m * k).map(value).collect();
            let rhs: Vec<f32> = (0..k * ld_rhs).map(|i| value(i * 13 + 1)).collect();
            let mut dst = vec![f32::NAN; m * ld_dst];
            product(
                &PackedLhs::new(&lhs, m, k),
                &rhs,
                ld_rhs,
                n,
                &mut dst,
                ld_dst,
            )?;
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|p| f64::from(lhs[i * k + p]) * f64::from(rhs[p * ld_rhs + j]))
                        .sum();
                    let got = dst[i * ld_dst + j];
                    assert!(
                        (f64::from(got) - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{m}x{k}x{n} at ({i}, {j}): {got} vs {want}"
                    );
                }
                assert!(dst[i * ld_dst + n..(i + 1) * ld_dst]
                    .iter()
                    .all(|v| v.is_nan()));
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_operands_that_do_not_fit() {
        let lhs = PackedLhs::new(&[1.0; 12], 3, 4);
        let mut dst = vec![0f32; 3 * 16];
        // Columns not a multiple of NR, then a right operand one row short.
        assert!(product(&lhs, &[0.0; 4 * 16], 16, 8, &mut dst, 16).is_err());
        assert!(product(&lhs, &[0.0; 3 * 16], 16, 16, &mut dst, 16).is_err());
        assert!(dst.iter().all(|v| *v == 0.0));
    }
}
