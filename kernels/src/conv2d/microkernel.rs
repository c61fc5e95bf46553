//! A register-blocked matrix product for CPUs with AVX2 and FMA, or AVX-512: `dst (+)= lhs *
//! rhs` with the left operand packed once ([`PackedStack`]) and the right one copied a chunk
//! at a time into strips.
//!
//! Each call of the inner kernel keeps an `MR x NR` block of `dst` in registers: six rows of
//! two vectors, twelve registers, sixteen columns with AVX2 (`avx2`) and thirty-two with
//! AVX-512 (`avx512`). For each step along the inner dimension it loads two vectors of `rhs`
//! and broadcasts six values of the packed panel: twelve FMAs for eight loads, so the FMA
//! pipes stay busy; a last block narrower than a full one goes through masked loads and
//! stores (AVX-512's mask registers, and only the registers that cover it). The left operand
//! (a kernel) is packed once per layer instead of once per call, in the same panels for every
//! width. Columns of `rhs` are taken a chunk at a time; when more than one panel reads them
//! and its rows lie far apart, the chunk is first copied into strips of `NR` columns laid end
//! to end, so the kernel reads them as one stream. Read in place, the rows of an image's
//! channels lie a power of two apart (4 KiB for 32x32 planes) and every row of a strip falls in
//! the same L1 set: copied, a 1x1 convolution over 32x32 planes runs 1.9x faster. A single
//! panel, and rows at most [`IN_PLACE_STRIDE`] apart (Winograd's blocks), read `rhs` in
//! place.
//!
//! The loops are written once (`driver`), over a small trait for a width's vectors, and
//! compiled for each width; [`product`] picks the one [`SimdLevel::in_use`] names.
//!
//! A kernel gradient's products (`dW^T (taps x o) += X (taps x positions) * dY^T`) have no
//! operand to pack once: the left one (an expansion, or Winograd's transformed tiles) is read
//! where it lies ([`Panels::in_place`], each value broadcast from its row), and the right one
//! is written by its maker straight into strips ([`Strips`]): the
//! output gradient transposed, or Winograd's output-gradient transform with channels in the
//! lanes. The `gemm` crate runs the products on other CPUs, and those split over the pool.
//!
//! The left operand's panels, packed or read in place, are made in `panels`, which needs no
//! `unsafe`; this module and the kernels below it allow it.

#![allow(unsafe_code)]

use super::gemm::{View, ViewMut};
use crate::SimdLevel;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod driver;
mod panels;

#[cfg(test)]
pub(crate) use panels::PackedLhs;
pub(crate) use panels::{PackedStack, Panels};

/// Rows of `dst` per kernel call (the last panel of a product may hold fewer), at every width.
pub(crate) const MR: usize = 6;

/// Columns of `dst` per AVX2 kernel call (two vectors); AVX-512's calls take
/// [`block_columns`], a multiple of it.
pub(crate) const NR: usize = 16;

/// Columns of `dst` per kernel call at `level` (at least [`NR`]).
pub(crate) fn block_columns(level: SimdLevel) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => avx512::VECTORS * 16,
        _ => NR,
    }
}

/// Whether this CPU runs [`product`]: x86-64 with AVX2 and FMA, which the SIMD cap allows
/// ([`SimdLevel`]).
pub(crate) fn supported() -> bool {
    crate::simd::avx2_fma()
}

/// Whether the convolutions run their products here rather than in the `gemm` crate: where
/// the kernels run AVX2 or AVX-512 ([`SimdLevel::in_use`]).
pub(crate) fn preferred() -> bool {
    supported()
}

/// Whether `n` columns fill the kernel's blocks of [`block_columns`] well: the last, partial
/// block wastes at most an eighth of the work.
pub(crate) fn fills_blocks(n: usize) -> bool {
    n.next_multiple_of(block_columns(SimdLevel::in_use())) * 7 <= n * 8
}

/// A right operand already laid out as the micro-kernel reads a chunk it copies: strips of
/// `nr` ([`block_columns`]) columns, each `k` rows of `nr` values, strip `s` at `offset + s *
/// stride`, the last strip's columns past the matrix zero. Made by whoever writes the operand,
/// when it is read by several panels and its rows would be far apart.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Strips<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub stride: usize,
    pub nr: usize,
}

impl Strips<'_> {
    /// Whether the strips of a `k x n` matrix lie inside `data`.
    fn fits(&self, k: usize, n: usize) -> bool {
        let strips = n.div_ceil(self.nr.max(1));
        if strips == 0 || k == 0 {
            return true;
        }
        (strips - 1)
            .checked_mul(self.stride)
            .and_then(|last| last.checked_add(k * self.nr))
            .and_then(|end| end.checked_add(self.offset))
            .is_some_and(|end| end <= self.data.len())
    }
}

/// What a product's outputs start from, before the product is added.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Start<'a> {
    /// Zero: `dst = lhs * rhs`.
    Zero,
    /// What `dst` holds: `dst += lhs * rhs`.
    Dst,
    /// One value per row of `dst` (a bias), set in the registers: `dst = row + lhs * rhs`.
    Rows(&'a [f32]),
}

/// How a product writes `dst`: what it starts from, and whether `max(dst, 0)` follows (a NaN
/// staying a NaN).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Write<'a> {
    pub start: Start<'a>,
    pub relu: bool,
}

/// `dst = start + lhs * rhs` (see [`Start`]), then its ReLU when `write.relu`, for the
/// `lhs.m x n` matrix `dst` and the `lhs.k x n` matrix `rhs` (a [`View`] or [`Strips`]), with
/// unit column strides (`cs == 1`) and any row stride, at the width [`SimdLevel::in_use`]
/// names. Returns an error (and touches nothing) when a matrix does not fit its slice (or a
/// start row is missing, or strips are not of the width in use), or the CPU lacks AVX2 and FMA.
pub(crate) fn product<'a>(
    lhs: Panels<'_>,
    rhs: impl Into<Right<'a>>,
    n: usize,
    dst: ViewMut<'_>,
    write: Write<'_>,
) -> candle_core::Result<()> {
    product_at(SimdLevel::in_use(), lhs, rhs.into(), n, dst, write)
}

/// The right operand of a product: a matrix of unit column stride, or strips.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Right<'a> {
    Matrix(View<'a>),
    Strips(Strips<'a>),
}

impl<'a> From<View<'a>> for Right<'a> {
    fn from(rhs: View<'a>) -> Self {
        Right::Matrix(rhs)
    }
}

impl<'a> From<Strips<'a>> for Right<'a> {
    fn from(rhs: Strips<'a>) -> Self {
        Right::Strips(rhs)
    }
}

impl Right<'_> {
    /// Whether a `k x n` operand fits at `level`'s width.
    fn fits(&self, level: SimdLevel, k: usize, n: usize) -> bool {
        match self {
            Right::Matrix(rhs) => rhs.cs == 1 && rhs.fits(k, n),
            Right::Strips(strips) => strips.nr == block_columns(level) && strips.fits(k, n),
        }
    }

    /// The operand, for an error message.
    fn describe(&self) -> String {
        match self {
            Right::Matrix(rhs) => rhs.describe(),
            Right::Strips(s) => format!(
                "strips of {} in {} at {} strides {}",
                s.nr,
                s.data.len(),
                s.offset,
                s.stride
            ),
        }
    }
}

/// [`product`] compiled for `level` (AVX-512's kernel, or AVX2's below it), whatever the cap;
/// an error when the CPU cannot run it.
fn product_at(
    level: SimdLevel,
    lhs: Panels<'_>,
    rhs: Right<'_>,
    n: usize,
    dst: ViewMut<'_>,
    write: Write<'_>,
) -> candle_core::Result<()> {
    let (m, k) = (lhs.m, lhs.k);
    let rows_fit = match write.start {
        Start::Rows(rows) => rows.len() >= m,
        Start::Zero | Start::Dst => true,
    };
    let fits = rows_fit
        && lhs.fits()
        && dst.cs == 1
        && (m <= 1 || n <= dst.rs)
        && rhs.fits(level, k, n)
        && dst.fits(m, n);
    if !fits {
        candle_core::bail!(
            "microkernel: a {m}x{k} by {k}x{n} product does not fit its buffers (rhs {}, dst {})",
            rhs.describe(),
            dst.describe()
        );
    }
    if level < SimdLevel::Avx2 || level > SimdLevel::detected() {
        candle_core::bail!(
            "microkernel: no kernel for {level} on this CPU (it has {})",
            SimdLevel::detected()
        );
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has `level`'s instructions, AVX2 and FMA at least (checked above); every
    // row the kernels read of `rhs` (`k` rows of `n` values, `rhs.rs` apart, or its strips of
    // `level`'s width) and write of `dst` (`m` rows of `n`, `dst.rs` apart) lies inside its
    // slice (checked above), and so does every panel of `lhs`; the copy's strips hold
    // `k * COLUMN_CHUNK` values.
    unsafe {
        let c = (dst.data.as_mut_ptr().add(dst.offset), dst.rs);
        let kernel = match level {
            SimdLevel::Avx512 => avx512::product,
            _ => avx2::product,
        };
        match rhs {
            Right::Matrix(rhs) => {
                let (ptr, ld) = (rhs.data.as_ptr().add(rhs.offset), rhs.rs);
                if m > MR && ld > IN_PLACE_STRIDE {
                    with_strips(k, |strips| {
                        let copy = Some(strips.as_mut_ptr());
                        kernel(&lhs, driver::Rhs::Rows { ptr, ld, copy }, n, c, write);
                    });
                } else {
                    kernel(
                        &lhs,
                        driver::Rhs::Rows {
                            ptr,
                            ld,
                            copy: None,
                        },
                        n,
                        c,
                        write,
                    );
                }
            }
            Right::Strips(strips) => {
                let ptr = strips.data.as_ptr().add(strips.offset);
                let stride = strips.stride;
                kernel(&lhs, driver::Rhs::Strips { ptr, stride }, n, c, write);
            }
        }
    }
    Ok(())
}

thread_local! {
    static STRIPS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Runs `f` with this thread's buffer for a chunk of `rhs` copied into strips: room for
/// [`COLUMN_CHUNK`] columns of `k` rows.
fn with_strips<R>(k: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut strips = STRIPS.with(std::cell::Cell::take);
    if strips.len() < k * COLUMN_CHUNK {
        strips.resize(k * COLUMN_CHUNK, 0.0);
    }
    let result = f(&mut strips);
    STRIPS.with(|s| s.set(strips));
    result
}

/// The widest row stride of `rhs` read in place by several panels: rows this close (a
/// Winograd block's transformed tiles, 256 bytes apart) spread over the L1 sets, and copying
/// them into strips would cost more than it saves.
const IN_PLACE_STRIDE: usize = 4 * NR;

/// Columns of `rhs` per pass over the panels of `lhs`, so the part of `rhs` the panels read
/// stays in cache from one panel to the next.
const COLUMN_CHUNK: usize = 8 * NR;

#[cfg(test)]
mod tests {
    use super::*;

    /// The widths this CPU runs the kernel at, widest first.
    fn levels() -> Vec<SimdLevel> {
        [SimdLevel::Avx512, SimdLevel::Avx2]
            .into_iter()
            .filter(|&level| level <= SimdLevel::detected())
            .collect()
    }

    #[test]
    fn matches_a_float64_product_at_every_width() -> candle_core::Result<()> {
        // (m, k, n, ld_rhs, ld_dst): full and partial panels (m not a multiple of six), full
        // and partial column blocks (masked tails of 1 to 31 columns, and tails of exactly one
        // AVX-512 register), more columns than a chunk, strided rows, a zero-depth and a
        // one-deep product, one panel (read in place) and several (rows close together read in
        // place, rows far apart from strips), products deeper than a slice of the depth (at
        // every width, a slice's last row and one past it); each start, with and without the
        // ReLU.
        let cases = [
            (13, 600, 150, 160, 151),
            (7, 257, 40, 1024, 40),
            (6, 256, 33, 33, 33),
            (1, 129, 20, 20, 20),
            (6, 5, 16, 16, 16),
            (13, 37, 48, 50, 64),
            (1, 160, 32, 32, 32),
            (4, 0, 16, 16, 16),
            (7, 9, 5, 5, 6),
            (12, 30, 41, 41, 45),
            (5, 3, 225, 230, 225),
            (8, 20, 130, 1024, 131),
            (11, 1, 33, 33, 40),
            (17, 1, 47, 1024, 47),
            (9, 14, 63, 64, 63),
            (14, 6, 200, 300, 201),
            (3, 25, 31, 31, 31),
        ];
        // How each product starts: 0 zero, 1 from `dst`, 2 from a value per row.
        let writes = [
            (0, false),
            (1, false),
            (2, false),
            (0, true),
            (1, true),
            (2, true),
        ];
        for ((m, k, n, ld_rhs, ld_dst), (from, relu)) in cases
            .into_iter()
            .flat_map(|case| writes.map(|write| (case, write)))
        {
            let row_start: Vec<f32> = (0..m).map(|i| i as f32 * 0.5 - 1.0).collect();
            let start = [Start::Zero, Start::Dst, Start::Rows(&row_start)][from];
            let value = |i: usize| ((i * 7919 % 211) as f32 - 105.0) / 105.0;
            let lhs: Vec<f32> = (0..m * k).map(value).collect();
            let rhs: Vec<f32> = (0..k * ld_rhs).map(|i| value(i * 13 + 1)).collect();
            let before: Vec<f32> = (0..m * ld_dst)
                .map(|i| {
                    if i % ld_dst < n {
                        value(i * 3 + 2)
                    } else {
                        f32::NAN
                    }
                })
                .collect();
            let packed = PackedLhs::new(&lhs, m, k)?;
            // Packing from the transpose, read across its rows, packs the same panels.
            let lhs_t: Vec<f32> = (0..k * m).map(|i| lhs[(i % m) * k + i / m]).collect();
            let mut from_t = PackedLhs::default();
            let view_t = View {
                data: &lhs_t,
                offset: 0,
                rs: 1,
                cs: m,
            };
            from_t.pack(view_t, m, k)?;
            assert_eq!(
                from_t.data, packed.data,
                "{m}x{k} packed from its transpose"
            );
            let mut first: Option<Vec<f32>> = None;
            for level in levels() {
                let mut dst = before.clone();
                let rhs_view = View {
                    data: &rhs,
                    offset: 0,
                    rs: ld_rhs,
                    cs: 1,
                };
                let dst_view = ViewMut {
                    data: &mut dst,
                    offset: 0,
                    rs: ld_dst,
                    cs: 1,
                };
                let write = Write { start, relu };
                product_at(
                    level,
                    packed.panels(),
                    Right::Matrix(rhs_view),
                    n,
                    dst_view,
                    write,
                )?;
                let case = format!("{m}x{k}x{n} at {level} (start {from}, relu {relu})");
                for i in 0..m {
                    for j in 0..n {
                        let start = match start {
                            Start::Zero => 0.0,
                            Start::Dst => f64::from(before[i * ld_dst + j]),
                            Start::Rows(rows) => f64::from(rows[i]),
                        };
                        let terms = (0..k)
                            .map(|p| f64::from(lhs[i * k + p]) * f64::from(rhs[p * ld_rhs + j]));
                        let (sum, magnitude) =
                            terms.fold((start, start.abs()), |(s, a), t| (s + t, a + t.abs()));
                        let want = if relu { sum.max(0.0) } else { sum };
                        let got = dst[i * ld_dst + j];
                        // Each of the `k` fused multiply-adds rounds once, by at most half an
                        // epsilon of what it has summed: `k` epsilons of the sum of `|a * b|`
                        // and the start bound the error (the ReLU does not widen it).
                        let bound = (k as f64 + 1.0) * f64::from(f32::EPSILON) * magnitude;
                        assert!(
                            (f64::from(got) - want).abs() <= bound,
                            "{case} at ({i}, {j}): {got} vs {want} (bound {bound:e})"
                        );
                    }
                    assert!(
                        dst[i * ld_dst + n..(i + 1) * ld_dst]
                            .iter()
                            .all(|v| v.is_nan()),
                        "{case}: a value past the columns was written"
                    );
                }
                // Every width sums each output in the same order, one fused multiply-add per
                // step from the start value: the same bits.
                match &first {
                    None => first = Some(dst),
                    Some(first) => assert!(
                        first
                            .iter()
                            .zip(&dst)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{case}: other bits than the widest width's"
                    ),
                }
            }
        }
        Ok(())
    }

    /// The fused ReLU keeps a NaN, makes `-inf` zero and keeps `+inf`, as `x < 0 ? 0 : x` does,
    /// at every width: a NaN from the right operand (a whole column), from `dst` (one output)
    /// or from a row's start (a whole row), in full blocks and masked last columns.
    #[test]
    fn the_relu_keeps_nans_and_infinities_at_every_width() -> candle_core::Result<()> {
        let (m, k, n) = (7, 3, 37);
        let value = |i: usize| ((i * 7919 % 211) as f32 - 105.0) / 105.0;
        let lhs: Vec<f32> = (0..m * k).map(value).collect();
        let mut rhs: Vec<f32> = (0..k * n).map(|i| value(i * 13 + 1)).collect();
        // Column 3 (a full block) and column 35 (a masked tail) read a NaN.
        rhs[n + 3] = f32::NAN;
        rhs[2 * n + 35] = f32::NAN;
        let mut before: Vec<f32> = (0..m * n).map(|i| value(i * 3 + 2)).collect();
        before[2 * n + 20] = f32::NAN;
        before[3 * n + 36] = f32::INFINITY;
        before[4 * n + 9] = f32::NEG_INFINITY;
        let mut rows: Vec<f32> = (0..m).map(|i| i as f32 * 0.5 - 1.0).collect();
        rows[1] = f32::NAN;
        rows[5] = f32::NEG_INFINITY;
        rows[6] = f32::INFINITY;
        let packed = PackedLhs::new(&lhs, m, k)?;
        for (from, start) in [Start::Zero, Start::Dst, Start::Rows(&rows)]
            .into_iter()
            .enumerate()
        {
            for level in levels() {
                let mut dst = before.clone();
                let rhs_view = View {
                    data: &rhs,
                    offset: 0,
                    rs: n,
                    cs: 1,
                };
                let dst_view = ViewMut {
                    data: &mut dst,
                    offset: 0,
                    rs: n,
                    cs: 1,
                };
                let write = Write { start, relu: true };
                product_at(
                    level,
                    packed.panels(),
                    Right::Matrix(rhs_view),
                    n,
                    dst_view,
                    write,
                )?;
                for (at, &got) in dst.iter().enumerate() {
                    let (i, j) = (at / n, at % n);
                    let start = match start {
                        Start::Zero => 0.0,
                        Start::Dst => before[at],
                        Start::Rows(rows) => rows[i],
                    };
                    let sum = (0..k).fold(start, |s, p| s + lhs[i * k + p] * rhs[p * n + j]);
                    let case = format!("start {from} at {level}, ({i}, {j})");
                    if sum.is_nan() {
                        assert!(got.is_nan(), "{case}: {got}, not NaN");
                    } else if sum.is_infinite() {
                        assert_eq!(got, sum.max(0.0), "{case}");
                    } else {
                        assert!(got >= 0.0 && (got - sum.max(0.0)).abs() < 1e-4, "{case}");
                    }
                }
                let nans = dst.iter().filter(|v| v.is_nan()).count();
                let want = [2 * m, 2 * m + 1, 2 * m + n - 2][from];
                assert_eq!(nans, want, "start {from} at {level}: NaN outputs");
            }
        }
        Ok(())
    }

    #[test]
    fn rows_in_place_and_strips_give_the_packed_products_bits() -> candle_core::Result<()> {
        // (m, k, n, ld_lhs): one panel and several with a short last one, masked last
        // columns, more columns than a chunk, strided lhs rows.
        for (m, k, n, ld_lhs) in [
            (6, 7, 32, 7),
            (13, 37, 48, 40),
            (20, 64, 160, 64),
            (7, 5, 17, 9),
            (8, 300, 70, 300),
        ] {
            let value = |i: usize| ((i * 7919 % 211) as f32 - 105.0) / 105.0;
            let lhs: Vec<f32> = (0..m * ld_lhs).map(value).collect();
            let rhs: Vec<f32> = (0..k * n).map(|i| value(i * 13 + 1)).collect();
            let dense: Vec<f32> = (0..m * k).map(|i| lhs[i / k * ld_lhs + i % k]).collect();
            let packed = PackedLhs::new(&dense, m, k)?;
            let in_place = View {
                data: &lhs,
                offset: 0,
                rs: ld_lhs,
                cs: 1,
            };
            for level in levels() {
                let nr = block_columns(level);
                let mut strips = vec![f32::NAN; n.div_ceil(nr) * k * nr];
                for (at, v) in strips.iter_mut().enumerate() {
                    let (s, p, i) = (at / (k * nr), at / nr % k, at % nr);
                    *v = rhs
                        .get(p * n + s * nr + i)
                        .filter(|_| s * nr + i < n)
                        .map_or(0.0, |v| *v);
                }
                let strips = Strips {
                    data: &strips,
                    offset: 0,
                    stride: k * nr,
                    nr,
                };
                let matrix = View {
                    data: &rhs,
                    offset: 0,
                    rs: n,
                    cs: 1,
                };
                let start = [0.5f32; 32];
                let write = Write {
                    start: Start::Rows(&start[..m]),
                    relu: true,
                };
                let run = |lhs: Panels<'_>, rhs: Right<'_>| -> candle_core::Result<Vec<f32>> {
                    let mut dst = vec![f32::NAN; m * n];
                    let view = ViewMut {
                        data: &mut dst,
                        offset: 0,
                        rs: n,
                        cs: 1,
                    };
                    product_at(level, lhs, rhs, n, view, write)?;
                    Ok(dst)
                };
                let want = run(packed.panels(), matrix.into())?;
                let case = format!("{m}x{k}x{n} at {level}");
                for (what, got) in [
                    (
                        "rows in place",
                        run(Panels::in_place(in_place, m, k), matrix.into())?,
                    ),
                    ("strips", run(packed.panels(), strips.into())?),
                    (
                        "both",
                        run(Panels::in_place(in_place, m, k), strips.into())?,
                    ),
                ] {
                    assert!(
                        want.iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{case}: {what} gave other bits"
                    );
                }
                // Strips of another width are refused.
                let other = Strips {
                    nr: nr * 2,
                    ..strips
                };
                assert!(run(packed.panels(), other.into()).is_err(), "{case}");
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_operands_that_do_not_fit_and_widths_without_a_kernel() -> candle_core::Result<()> {
        const ZERO: Write<'static> = Write {
            start: Start::Zero,
            relu: false,
        };
        let lhs = PackedLhs::new(&[1.0; 12], 3, 4)?;
        assert!(PackedLhs::new(&[1.0; 11], 3, 4).is_err());
        let mut dst = vec![0f32; 3 * 16];
        let view = |data| View {
            data,
            offset: 0,
            rs: 16,
            cs: 1,
        };
        // A right operand one row short, then one read by columns.
        let short = [0.0; 3 * 16];
        let short_rhs_refused = |data: &mut [f32]| -> bool {
            let dst = ViewMut {
                data,
                offset: 0,
                rs: 16,
                cs: 1,
            };
            product(lhs.panels(), view(&short), 16, dst, ZERO).is_err()
        };
        assert!(short_rhs_refused(&mut dst));
        let whole = [0.0; 4 * 16];
        let by_columns = View {
            cs: 4,
            ..view(&whole)
        };
        let dst_ok = ViewMut {
            data: &mut dst,
            offset: 0,
            rs: 16,
            cs: 1,
        };
        assert!(product(lhs.panels(), by_columns, 4, dst_ok, ZERO).is_err());
        // Start values for two of the three rows.
        let two_rows = Write {
            start: Start::Rows(&[1.0, 2.0]),
            relu: false,
        };
        let dst_ok = ViewMut {
            data: &mut dst,
            offset: 0,
            rs: 16,
            cs: 1,
        };
        assert!(product(lhs.panels(), view(&whole), 16, dst_ok, two_rows).is_err());
        // A width without a kernel.
        let dst_ok = ViewMut {
            data: &mut dst,
            offset: 0,
            rs: 16,
            cs: 1,
        };
        let err = product_at(
            SimdLevel::Baseline,
            lhs.panels(),
            Right::Matrix(view(&whole)),
            16,
            dst_ok,
            ZERO,
        )
        .expect_err("no kernel at the baseline");
        assert!(err.to_string().contains("no kernel for baseline"), "{err}");
        assert!(dst.iter().all(|v| *v == 0.0));
        Ok(())
    }

    /// The product alone on one thread, on the shapes of ResNet-50's 1x1 layers at batch 16 (a
    /// group of six 7x7 images side by side, a tile of 512 positions of a 56x56 plane), for
    /// the rate the micro-kernel reaches against the machine's peak. Run with `cargo test
    /// --release -p kandle-kernels --lib timing_products -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing, run by hand in a release build"]
    fn timing_products() -> candle_core::Result<()> {
        for (m, k, n) in [
            (2048, 512, 294),
            (512, 2048, 294),
            (256, 64, 512),
            (64, 256, 512),
            (1024, 256, 392),
        ] {
            let value = |i: usize| ((i * 7919 % 211) as f32 - 105.0) / 105.0;
            let lhs: Vec<f32> = (0..m * k).map(value).collect();
            let rhs: Vec<f32> = (0..k * n).map(|i| value(i * 13 + 1)).collect();
            let mut dst = vec![0f32; m * n];
            let packed = PackedLhs::new(&lhs, m, k)?;
            let mut best = f64::INFINITY;
            for _ in 0..20 {
                let t = std::time::Instant::now();
                let view = View {
                    data: &rhs,
                    offset: 0,
                    rs: n,
                    cs: 1,
                };
                let out = ViewMut {
                    data: &mut dst,
                    offset: 0,
                    rs: n,
                    cs: 1,
                };
                let write = Write {
                    start: Start::Zero,
                    relu: false,
                };
                product(packed.panels(), view, n, out, write)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            let gflop = 2.0 * (m * k * n) as f64 / 1e9;
            println!(
                "{m}x{k}x{n}: {:.3} ms, {:.1} GFLOP/s on one thread",
                best * 1e3,
                gflop / best
            );
        }
        Ok(())
    }
}
