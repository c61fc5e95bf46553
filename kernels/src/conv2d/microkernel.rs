//! A register-blocked matrix product for CPUs with AVX2 and FMA: `dst (+)= lhs * rhs` with the
//! left operand packed once ([`PackedLhs`]) and the right one copied a chunk at a time into
//! strips.
//!
//! Each call of the inner kernel keeps an `MR x NR` block of `dst` in twelve vector registers
//! (six rows, two 8-lane vectors), and for each step along the inner dimension loads two
//! vectors of `rhs` and broadcasts six values of the packed panel: twelve FMAs for eight loads,
//! so the two FMA pipes stay busy; a last block narrower than sixteen columns goes through
//! masked loads and stores. The left operand (a kernel) is packed once per layer instead of
//! once per call. Columns of `rhs` are taken a chunk at a time; when more than one panel reads
//! them and its rows lie far apart, the chunk is first copied into strips of `NR` columns laid
//! end to end, so the kernel reads them as one stream. Read in place, the rows of an image's
//! channels lie a power of two apart (4 KiB for 32x32 planes) and every row of a strip falls in
//! the same L1 set: copied, a 1x1 convolution over 32x32 planes runs 1.9x faster. A single
//! panel, and rows at most [`IN_PLACE_STRIDE`] apart (Winograd's blocks), read `rhs` in
//! place.
//!
//! The `gemm` crate runs the products on other CPUs (AVX-512 kernels where present), and the
//! kernel gradient's products, whose operands are read across their rows.

#![allow(unsafe_code)]

use super::super::output;
use super::gemm::{View, ViewMut};

/// Rows of `dst` per kernel call (the last panel of a product may hold fewer).
pub(crate) const MR: usize = 6;

/// Columns of `dst` per kernel call: two AVX2 vectors.
pub(crate) const NR: usize = 16;

/// Whether this CPU runs [`product`]: x86-64 with AVX2 and FMA, which the SIMD cap allows
/// ([`SimdLevel`](crate::SimdLevel)).
pub(crate) fn supported() -> bool {
    crate::simd::avx2_fma()
}

/// Whether the convolutions run their products here: the kernels run AVX2
/// ([`SimdLevel::in_use`](crate::SimdLevel::in_use)); with AVX-512, the `gemm` crate's wider
/// kernels run them.
pub(crate) fn preferred() -> bool {
    crate::SimdLevel::in_use() == crate::SimdLevel::Avx2
}

/// Whether `n` columns fill the kernel's blocks of [`NR`] columns well: the last, partial
/// block wastes at most an eighth of the work.
pub(crate) fn fills_blocks(n: usize) -> bool {
    n.next_multiple_of(NR) * 7 <= n * 8
}

/// An `m x k` row-major matrix packed into panels of [`MR`] rows (the last one may be
/// shorter), each laid out `[k][rows]`, so the kernel reads a panel's column as consecutive
/// values.
#[derive(Debug, Clone, Default)]
pub(crate) struct PackedLhs {
    data: Vec<f32>,
    m: usize,
    k: usize,
}

impl PackedLhs {
    /// Packs the row-major `m x k` matrix `lhs`.
    pub(crate) fn new(lhs: &[f32], m: usize, k: usize) -> candle_core::Result<Self> {
        let mut packed = Self::default();
        let view = View {
            data: lhs,
            offset: 0,
            rs: k,
            cs: 1,
        };
        packed.pack(view, m, k)?;
        Ok(packed)
    }

    /// Packs the `m x k` matrix `lhs` (any strides) in place of this one, reusing its memory.
    /// Returns an error (and packs nothing) when `lhs` does not fit its slice.
    pub(crate) fn pack(&mut self, lhs: View<'_>, m: usize, k: usize) -> candle_core::Result<()> {
        if !lhs.fits(m, k) {
            candle_core::bail!(
                "microkernel: a {m}x{k} matrix does not fit {}",
                lhs.describe()
            );
        }
        self.data.clear();
        self.data.resize(m * k, 0.0);
        for (r0, panel) in (0..m)
            .step_by(MR)
            .zip(self.data.chunks_mut((MR * k).max(1)))
        {
            let rows = MR.min(m - r0);
            for (kk, column) in panel.chunks_exact_mut(rows).enumerate() {
                let at = lhs.offset + r0 * lhs.rs + kk * lhs.cs;
                for (r, slot) in column.iter_mut().enumerate() {
                    *slot = lhs.data[at + r * lhs.rs];
                }
            }
        }
        (self.m, self.k) = (m, k);
        Ok(())
    }

    /// The panels, for [`product`].
    pub(crate) fn panels(&self) -> Panels<'_> {
        Panels {
            data: &self.data,
            m: self.m,
            k: self.k,
            panel_stride: MR * self.k,
            matrix: 0,
        }
    }
}

/// `count` matrices of `m x k`, each packed as [`PackedLhs`] packs one, stored panel by panel:
/// panel `p` of every matrix together, `[p][matrix][k][rows]`, so one task writes one panel of
/// all of them (Winograd's 36 transformed kernels, each output channel's at once).
#[derive(Debug, Clone, Default)]
pub(crate) struct PackedStack {
    data: Vec<f32>,
    count: usize,
    m: usize,
    k: usize,
}

impl PackedStack {
    /// The stack written by `fill(p, rows, out)` for each panel `p` (rows `MR * p ..
    /// MR * p + rows` of every matrix), in parallel: `out` is the panel of each matrix in
    /// turn, `[matrix][k][rows]`.
    pub(crate) fn build(
        count: usize,
        (m, k): (usize, usize),
        fill: impl Fn(usize, usize, &mut [f32]) + Sync + Send,
    ) -> Self {
        let chunk = count * MR * k;
        let data = output::try_by_chunk(count * m * k, chunk, true, None, |p, out| {
            fill(p, MR.min(m - MR * p), out);
            Ok::<(), std::convert::Infallible>(())
        });
        let Ok(data) = data;
        Self { data, count, m, k }
    }

    /// The panels of matrix `i`.
    pub(crate) fn panels(&self, i: usize) -> Panels<'_> {
        Panels {
            data: &self.data,
            m: self.m,
            k: self.k,
            panel_stride: self.count * MR * self.k,
            matrix: i.min(self.count.saturating_sub(1)),
        }
    }

    /// The matrices unpacked, row-major, one after the other: `[matrix][m][k]`.
    pub(crate) fn unpacked(&self) -> Vec<f32> {
        let (m, k) = (self.m, self.k);
        let mut out = vec![0f32; self.count * m * k];
        for (i, matrix) in out.chunks_exact_mut((m * k).max(1)).enumerate() {
            let panels = self.panels(i);
            for r0 in (0..m).step_by(MR) {
                let rows = MR.min(m - r0);
                let panel = &self.data[panels.panel_start(r0 / MR, rows)..][..rows * k];
                for (kk, column) in panel.chunks_exact(rows).enumerate() {
                    for (r, v) in column.iter().enumerate() {
                        matrix[(r0 + r) * k + kk] = *v;
                    }
                }
            }
        }
        out
    }
}

/// The panels of one packed `m x k` matrix: panel `p` (rows `MR * p ..`, `rows` of them) holds
/// `[k][rows]` at [`Self::panel_start`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Panels<'a> {
    data: &'a [f32],
    m: usize,
    k: usize,
    /// From one panel of the matrix to the next.
    panel_stride: usize,
    /// Which matrix of a [`PackedStack`] (0 for a [`PackedLhs`]).
    matrix: usize,
}

impl Panels<'_> {
    /// Where panel `p`, of `rows` rows, starts.
    fn panel_start(&self, p: usize, rows: usize) -> usize {
        p * self.panel_stride + self.matrix * rows * self.k
    }

    /// Whether every panel lies inside `data`.
    fn fits(&self) -> bool {
        if self.m == 0 {
            return true;
        }
        let last = (self.m - 1) / MR;
        let rows = self.m - MR * last;
        let end = self.panel_start(last, rows) + rows * self.k;
        (last == 0 || self.panel_stride >= MR * self.k) && end <= self.data.len()
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
/// `lhs.m x n` matrix `dst` and the `lhs.k x n` matrix `rhs`, both with unit column strides
/// (`cs == 1`) and any row stride. Returns an error (and touches nothing) when a matrix does
/// not fit its slice (or a start row is missing), or the CPU lacks AVX2 and FMA.
pub(crate) fn product(
    lhs: Panels<'_>,
    rhs: View<'_>,
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
        && rhs.cs == 1
        && dst.cs == 1
        && (m <= 1 || n <= dst.rs)
        && rhs.fits(k, n)
        && dst.fits(m, n);
    if !fits {
        candle_core::bail!(
            "microkernel: a {m}x{k} by {k}x{n} product does not fit its buffers (rhs {}, dst {})",
            rhs.describe(),
            dst.describe()
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
    // (`k` rows of `n` values, `rhs.rs` apart) and write of `dst` (`m` rows of `n`, `dst.rs`
    // apart) lies inside its slice (checked above), and so does every packed panel.
    unsafe {
        let b = rhs.data.as_ptr().add(rhs.offset);
        let c = dst.data.as_mut_ptr().add(dst.offset);
        if m > MR && rhs.rs > IN_PLACE_STRIDE {
            with_strips(k, |strips| {
                avx2::product(&lhs, (b, rhs.rs), n, (c, dst.rs), write, Some(strips))
            });
        } else {
            avx2::product(&lhs, (b, rhs.rs), n, (c, dst.rs), write, None);
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

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::{
        __m256, __m256i, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256,
        _mm256_maskload_ps, _mm256_maskstore_ps, _mm256_max_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };

    use super::{Panels, Start, Write, COLUMN_CHUNK, MR, NR};

    /// Eight lanes on, then eight off: [`mask`] reads eight of them.
    static MASKS: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

    /// A mask with the first `active` (at most 8) of eight lanes on, for masked loads and
    /// stores.
    #[inline(always)]
    pub(crate) unsafe fn mask(active: usize) -> __m256i {
        _mm256_loadu_si256(MASKS.as_ptr().add(8 - active.min(8)).cast())
    }

    /// Every panel of `lhs` against every `NR` columns of `rhs`, a chunk of columns at a time;
    /// a last block narrower than `NR` is read and written through masks. `write` as for
    /// [`super::product`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `rhs` holds `lhs.k` rows of `n` values `ld_rhs` apart and
    /// `dst` `lhs.m` rows of `n` values `ld_dst` apart.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(
        lhs: &Panels<'_>,
        (rhs, ld_rhs): (*const f32, usize),
        n: usize,
        (dst, ld_dst): (*mut f32, usize),
        write: Write<'_>,
        strips: Option<&mut [f32]>,
    ) {
        let k = lhs.k;
        let strips = strips.map(|s| s.as_mut_ptr());
        for j0 in (0..n).step_by(COLUMN_CHUNK) {
            let j1 = (j0 + COLUMN_CHUNK).min(n);
            if let Some(strips) = strips {
                copy_strips((rhs.add(j0), ld_rhs), k, j1 - j0, strips);
            }
            for r0 in (0..lhs.m).step_by(MR) {
                let rows = MR.min(lhs.m - r0);
                let a = lhs.data.as_ptr().add(lhs.panel_start(r0 / MR, rows));
                let out = dst.add(r0 * ld_dst);
                // The panel's rows of the start values, if any.
                let start = match write.start {
                    Start::Zero => BlockStart::Zero,
                    Start::Dst => BlockStart::Dst,
                    Start::Rows(values) => BlockStart::Rows(values.as_ptr().add(r0)),
                };
                let write = (start, write.relu);
                for j in (j0..j1).step_by(NR) {
                    let width = NR.min(j1 - j);
                    let b = match strips {
                        Some(strips) => (strips.add((j - j0) * k).cast_const(), NR),
                        None => (rhs.add(j), ld_rhs),
                    };
                    let c = (out.add(j), ld_dst);
                    macro_rules! run {
                        ($rows:literal) => {
                            match (width == NR, strips.is_some()) {
                                (true, _) => block::<$rows, false, false>(k, a, b, c, write, width),
                                (false, true) => {
                                    block::<$rows, true, false>(k, a, b, c, write, width)
                                }
                                (false, false) => {
                                    block::<$rows, true, true>(k, a, b, c, write, width)
                                }
                            }
                        };
                    }
                    match rows {
                        6 => run!(6),
                        5 => run!(5),
                        4 => run!(4),
                        3 => run!(3),
                        2 => run!(2),
                        _ => run!(1),
                    }
                }
            }
        }
    }

    /// Copies `width` (at most [`COLUMN_CHUNK`]) columns of the `k` rows of `rhs` into
    /// `strips`, [`NR`] columns a strip, each strip `k` rows of `NR` values laid end to end; a
    /// last strip narrower than `NR` is padded with zeros.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2; `rhs` holds `k` rows of `width` values `ld_rhs` apart and `strips`
    /// room for `k * width.next_multiple_of(NR)` values.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn copy_strips(
        (rhs, ld_rhs): (*const f32, usize),
        k: usize,
        width: usize,
        strips: *mut f32,
    ) {
        let full = width / NR;
        let tail = width % NR;
        let masks = (mask(tail), mask(tail.saturating_sub(8)));
        for p in 0..k {
            let row = rhs.add(p * ld_rhs);
            for s in 0..full {
                let (from, to) = (row.add(s * NR), strips.add((s * k + p) * NR));
                _mm256_storeu_ps(to, _mm256_loadu_ps(from));
                _mm256_storeu_ps(to.add(8), _mm256_loadu_ps(from.add(8)));
            }
            if tail > 0 {
                let (from, to) = (row.add(full * NR), strips.add((full * k + p) * NR));
                _mm256_storeu_ps(to, _mm256_maskload_ps(from, masks.0));
                _mm256_storeu_ps(to.add(8), _mm256_maskload_ps(from.add(8), masks.1));
            }
        }
    }

    /// Where a block's sums start: zero, `c`, or a value per row.
    #[derive(Clone, Copy)]
    enum BlockStart {
        Zero,
        Dst,
        Rows(*const f32),
    }

    /// One `R x NR` block (the first `width` columns of `c` when `MASKED`, of `b` too when
    /// `MASKED_B`):
    /// `c[r][..] = start + sum over p of a[p * R + r] * b[p * ldb..][..]`, then `max(c, 0)`
    /// when `relu` (`write` is `(start, relu)`).
    ///
    /// # Safety
    ///
    /// As for [`product`]: `a` holds `k * R` values, `b` `k` rows of `width` values `ldb`
    /// apart, `c` `R` rows of `width` values `ldc` apart; `width` is `NR` unless `MASKED`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<const R: usize, const MASKED: bool, const MASKED_B: bool>(
        k: usize,
        a: *const f32,
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        (start, relu): (BlockStart, bool),
        width: usize,
    ) {
        let masks = (mask(width), mask(width.saturating_sub(8)));
        let load = |p: *const f32, masked: bool| {
            if masked {
                (
                    _mm256_maskload_ps(p, masks.0),
                    _mm256_maskload_ps(p.add(8), masks.1),
                )
            } else {
                (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
            }
        };
        let mut acc: [[__m256; 2]; R] = [[_mm256_setzero_ps(); 2]; R];
        match start {
            BlockStart::Zero => {}
            BlockStart::Dst => {
                for (r, acc) in acc.iter_mut().enumerate() {
                    let (v0, v1) = load(c.add(r * ldc), MASKED);
                    *acc = [v0, v1];
                }
            }
            BlockStart::Rows(values) => {
                for (r, acc) in acc.iter_mut().enumerate() {
                    let v = _mm256_broadcast_ss(&*values.add(r));
                    *acc = [v, v];
                }
            }
        }
        for p in 0..k {
            let (b0, b1) = load(b.add(p * ldb), MASKED_B);
            let col = a.add(p * R);
            for (r, acc) in acc.iter_mut().enumerate() {
                let v = _mm256_broadcast_ss(&*col.add(r));
                acc[0] = _mm256_fmadd_ps(v, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(v, b1, acc[1]);
            }
        }
        if relu {
            // `max` returns its second operand when either is NaN: a NaN stays.
            let zero = _mm256_setzero_ps();
            for acc in &mut acc {
                *acc = [_mm256_max_ps(zero, acc[0]), _mm256_max_ps(zero, acc[1])];
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let row = c.add(r * ldc);
            if MASKED {
                _mm256_maskstore_ps(row, masks.0, acc[0]);
                _mm256_maskstore_ps(row.add(8), masks.1, acc[1]);
            } else {
                _mm256_storeu_ps(row, acc[0]);
                _mm256_storeu_ps(row.add(8), acc[1]);
            }
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
        // Full and partial panels and column blocks (masked tails of 1 to 15 columns), more
        // columns than a chunk, strided rows, a zero-depth product, one panel (read in place)
        // and several (rows close together read in place, rows far apart from strips); each
        // start, with and without the ReLU.
        let cases = [
            (6, 5, 16, 16, 16),
            (13, 37, 48, 50, 64),
            (1, 160, 32, 32, 32),
            (4, 0, 16, 16, 16),
            (7, 9, 5, 5, 6),
            (12, 30, 41, 41, 45),
            (5, 3, 225, 230, 225),
            (8, 20, 130, 1024, 131),
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
            product(
                packed.panels(),
                rhs_view,
                n,
                dst_view,
                Write { start, relu },
            )?;
            for i in 0..m {
                for j in 0..n {
                    let start = match start {
                        Start::Zero => 0.0,
                        Start::Dst => f64::from(before[i * ld_dst + j]),
                        Start::Rows(rows) => f64::from(rows[i]),
                    };
                    let sum: f64 = start
                        + (0..k)
                            .map(|p| f64::from(lhs[i * k + p]) * f64::from(rhs[p * ld_rhs + j]))
                            .sum::<f64>();
                    let want = if relu { sum.max(0.0) } else { sum };
                    let got = dst[i * ld_dst + j];
                    assert!(
                        (f64::from(got) - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{m}x{k}x{n} (start {from}, relu {relu}) at ({i}, {j}): {got} vs {want}"
                    );
                }
                assert!(
                    dst[i * ld_dst + n..(i + 1) * ld_dst]
                        .iter()
                        .all(|v| v.is_nan()),
                    "{m}x{k}x{n}: a value past the columns was written"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_operands_that_do_not_fit() -> candle_core::Result<()> {
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
        assert!(dst.iter().all(|v| *v == 0.0));
        Ok(())
    }
}
