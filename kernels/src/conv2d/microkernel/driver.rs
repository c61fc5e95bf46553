//! The micro-kernel's loops, written once over a vector width ([`Lanes`]): the walk over a
//! product's column chunks, panels and column blocks, the copy of a chunk into strips, and the
//! register block. The left operand's panels are packed (`[k][rows]`) or rows read in place
//! (each value broadcast from where it lies); the right operand's rows are read in place,
//! copied a chunk at a time into strips, or come already laid out in strips. Everything here
//! is inlined into a function compiled for one instruction set (`avx2::product`,
//! `avx512::product`), so the intrinsics behind [`Lanes`] compile to that set's instructions.

use super::{Panels, Start, Write, COLUMN_CHUNK, MR};

/// Bytes of one strip of the right operand a block reads at once (its `kc x NR` values): half
/// an L1 data cache, so the strip and the panel's values meeting it stay there.
const STRIP_BYTES: usize = 16 * 1024;

/// How [`product`] reads the right operand: rows `ld` apart (copied a chunk at a time into the
/// strips at `copy` when given), or strips of `NR` columns already laid out, `k` rows of `NR`
/// values each, strip `s` at `ptr + s * stride`, the last one padded with zeros.
#[derive(Clone, Copy)]
pub(super) enum Rhs {
    Rows {
        ptr: *const f32,
        ld: usize,
        copy: Option<*mut f32>,
    },
    Strips {
        ptr: *const f32,
        stride: usize,
    },
}

/// One instruction set's vectors of `f32`: the few operations the micro-kernel needs. Every
/// method is `#[inline(always)]` and is only called from a function compiled with the set's
/// target features.
pub(super) trait Lanes {
    /// A register of [`Self::LANES`] values.
    type V: Copy;
    /// Which lanes a masked load or store touches.
    type Mask: Copy;
    /// Values per register.
    const LANES: usize;
    /// Whether a last block narrower than a full block runs with as few registers per row as
    /// cover it (masks that cost nothing, AVX-512's), rather than with all of them, masked.
    const NARROW_TAILS: bool;

    /// All lanes zero.
    unsafe fn zero() -> Self::V;
    /// All lanes `*p`.
    unsafe fn splat(p: *const f32) -> Self::V;
    /// The `LANES` values at `p`.
    unsafe fn load(p: *const f32) -> Self::V;
    /// Stores `v` at `p`.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// The first `active` lanes (all of them when `active >= LANES`).
    unsafe fn mask(active: usize) -> Self::Mask;
    /// The lanes of `mask` read from `p`, zero in the others, which are not read.
    unsafe fn load_masked(p: *const f32, mask: Self::Mask) -> Self::V;
    /// Stores the lanes of `mask` at `p`, leaving the others untouched.
    unsafe fn store_masked(p: *mut f32, mask: Self::Mask, v: Self::V);
    /// `a * b + c`, rounded once.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `max(v, 0)`, a NaN staying a NaN.
    unsafe fn relu(v: Self::V) -> Self::V;

    /// [`block`] at this width, compiled for its instruction set as a function of its own, so
    /// the compiler keeps the block's sums in registers before inlining it into the product.
    ///
    /// # Safety
    ///
    /// As for [`block`].
    unsafe fn block<const R: usize, const V: usize, const MASKED: bool, const MASKED_B: bool>(
        args: BlockArgs,
    );
}

/// Compiles, inside a width's `impl Lanes`, its [`Lanes::block`]: [`block`] compiled with the
/// target features `$features`.
macro_rules! compiled_block {
    ($features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn block<
            const R: usize,
            const V: usize,
            const MASKED: bool,
            const MASKED_B: bool,
        >(
            args: driver::BlockArgs,
        ) {
            driver::block::<Self, R, V, MASKED, MASKED_B>(args);
        }
    };
}
pub(super) use compiled_block;

/// Compiles a width's entry point, `product`: [`product`] for `$lanes` with its `VECTORS`
/// registers per row, compiled with the target features `$features` (which `$cpu` names).
macro_rules! compiled_product {
    ($lanes:ty, $features:literal, $cpu:literal) => {
        #[doc = concat!("[`driver::product`] compiled for ", $cpu, ".")]
        ///
        /// # Safety
        ///
        #[doc = concat!("The CPU has ", $cpu, "; otherwise as for [`driver::product`].")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn product(
            lhs: &super::Panels<'_>,
            rhs: driver::Rhs,
            n: usize,
            dst: (*mut f32, usize),
            write: super::Write<'_>,
        ) {
            driver::product::<$lanes, VECTORS>(lhs, rhs, n, dst, write);
        }
    };
}
pub(super) use compiled_product;

/// Every panel of `lhs` against every block of `NV` registers of columns (`NR = NV * LANES`)
/// of `rhs`, a chunk of [`COLUMN_CHUNK`] columns at a time (see [`Rhs`]), and within a chunk
/// a slice of the depth at a time (as many rows as fill [`STRIP_BYTES`] of a strip; later
/// slices add to the sums the earlier ones stored, so the sums and their rounding are those of
/// one pass); a last block narrower than `NR` is read (from rows) and written through masks.
/// `write` as for [`super::product`], its ReLU applied after the last slice.
///
/// # Safety
///
/// The CPU runs `L`'s instructions and this is inlined into a function compiled for them;
/// `rhs` holds `lhs.k` rows of `n` values as [`Rhs`] describes (its strips `NR` wide, its
/// copy room for `lhs.k * COLUMN_CHUNK` values), `dst` `lhs.m` rows of `n` values `ld_dst`
/// apart, and every panel of `lhs` lies inside its slice.
#[inline(always)]
pub(super) unsafe fn product<L: Lanes, const NV: usize>(
    lhs: &Panels<'_>,
    rhs: Rhs,
    n: usize,
    (dst, ld_dst): (*mut f32, usize),
    write: Write<'_>,
) {
    let nr = NV * L::LANES;
    debug_assert_eq!(COLUMN_CHUNK % nr, 0);
    let k = lhs.k;
    // The depth a block runs at once: a strip of `kc x NR` values stays in L1 while every
    // panel reads it, and each panel's `MR x kc` values while it meets the chunk's strips.
    let kc = (STRIP_BYTES / std::mem::size_of::<f32>() / nr).max(1);
    for j0 in (0..n).step_by(COLUMN_CHUNK) {
        let j1 = (j0 + COLUMN_CHUNK).min(n);
        // One pass over the whole depth when it is shallow (or zero: the start values alone).
        let mut k0 = 0;
        loop {
            let kb = kc.min(k - k0);
            let (first, last) = (k0 == 0, k0 + kb == k);
            if let Rhs::Rows {
                ptr,
                ld,
                copy: Some(strips),
            } = rhs
            {
                copy_strips::<L, NV>((ptr.add(k0 * ld + j0), ld), kb, j1 - j0, strips);
            }
            for r0 in (0..lhs.m).step_by(MR) {
                let rows = MR.min(lhs.m - r0);
                let (start, a_row, a_step) = lhs.panel(r0 / MR, rows);
                let a = (lhs.data.as_ptr().add(start + k0 * a_step), a_row, a_step);
                let out = dst.add(r0 * ld_dst);
                // The panel's rows of the start values, if any; later depths add to the sums.
                let start = match write.start {
                    _ if !first => BlockStart::Dst,
                    Start::Zero => BlockStart::Zero,
                    Start::Dst => BlockStart::Dst,
                    Start::Rows(values) => BlockStart::Rows(values.as_ptr().add(r0)),
                };
                let write = (start, write.relu && last);
                for j in (j0..j1).step_by(nr) {
                    let width = nr.min(j1 - j);
                    // Whether the block's columns of `rhs` are read as rows, through masks.
                    let (b, from_rows) = match rhs {
                        Rhs::Rows {
                            copy: Some(strips), ..
                        } => ((strips.add((j - j0) * kb).cast_const(), nr), false),
                        Rhs::Rows {
                            ptr,
                            ld,
                            copy: None,
                        } => ((ptr.add(k0 * ld + j), ld), true),
                        Rhs::Strips { ptr, stride } => {
                            ((ptr.add(j / nr * stride + k0 * nr), nr), false)
                        }
                    };
                    let args = BlockArgs {
                        k: kb,
                        a,
                        b,
                        c: (out.add(j), ld_dst),
                        write,
                        width,
                    };
                    run_block::<L, NV>(args, rows, from_rows);
                }
            }
            if last {
                break;
            }
            k0 += kb;
        }
    }
}

/// Runs `args`' block of `rows` rows at the width its columns need: as few registers per row
/// as cover them where the width's masks cost nothing, all `NV` otherwise (through masks for a
/// last, narrower block; reading `rhs` through them too when `from_rows`).
///
/// # Safety
///
/// As for [`block`].
#[inline(always)]
unsafe fn run_block<L: Lanes, const NV: usize>(args: BlockArgs, rows: usize, from_rows: bool) {
    let width = args.width;
    let vectors = if L::NARROW_TAILS {
        width.div_ceil(L::LANES)
    } else {
        NV
    };
    macro_rules! run {
        ($rows:literal, $v:literal) => {
            match (width == $v * L::LANES, from_rows) {
                (true, _) => L::block::<$rows, $v, false, false>(args),
                (false, false) => L::block::<$rows, $v, true, false>(args),
                (false, true) => L::block::<$rows, $v, true, true>(args),
            }
        };
    }
    macro_rules! rows {
        ($v:literal) => {
            match rows {
                6 => run!(6, $v),
                5 => run!(5, $v),
                4 => run!(4, $v),
                3 => run!(3, $v),
                2 => run!(2, $v),
                _ => run!(1, $v),
            }
        };
    }
    // Only the counts up to `NV` are compiled in.
    match vectors {
        1 if NV == 1 || L::NARROW_TAILS => rows!(1),
        2 if NV == 2 || (NV > 2 && L::NARROW_TAILS) => rows!(2),
        3 if NV == 3 || (NV > 3 && L::NARROW_TAILS) => rows!(3),
        _ if NV == 4 => rows!(4),
        _ => unreachable!("{NV} registers per row"),
    }
}

/// Copies `width` (at most [`COLUMN_CHUNK`]) columns of the `k` rows of `rhs` into
/// `strips`, `NR = NV * LANES` columns a strip, each strip `k` rows of `NR` values laid end to
/// end; a last strip narrower than `NR` is padded with zeros.
///
/// # Safety
///
/// As for [`product`]; `rhs` holds `k` rows of `width` values `ld_rhs` apart and `strips`
/// room for `k * width.next_multiple_of(NR)` values.
#[inline(always)]
unsafe fn copy_strips<L: Lanes, const NV: usize>(
    (rhs, ld_rhs): (*const f32, usize),
    k: usize,
    width: usize,
    strips: *mut f32,
) {
    let nr = NV * L::LANES;
    let full = width / nr;
    let tail = width % nr;
    let mut masks = [L::mask(0); NV];
    for (i, mask) in masks.iter_mut().enumerate() {
        *mask = L::mask(tail.saturating_sub(i * L::LANES));
    }
    for p in 0..k {
        let row = rhs.add(p * ld_rhs);
        for s in 0..full {
            let (from, to) = (row.add(s * nr), strips.add((s * k + p) * nr));
            for i in 0..NV {
                L::store(to.add(i * L::LANES), L::load(from.add(i * L::LANES)));
            }
        }
        if tail > 0 {
            let (from, to) = (row.add(full * nr), strips.add((full * k + p) * nr));
            for (i, &mask) in masks.iter().enumerate() {
                let v = L::load_masked(from.add(i * L::LANES), mask);
                L::store(to.add(i * L::LANES), v);
            }
        }
    }
}

/// What one call of [`block`] computes: `c (+)= a * b` for `k` steps, `write` being where the
/// sums start and whether the ReLU follows.
#[derive(Clone, Copy)]
pub(super) struct BlockArgs {
    /// Depth of the product.
    k: usize,
    /// The panel, its row `r` at step `p` at `a + r * row + p * step` (`(a, row, step)`):
    /// `[k][R]` packed, or rows read in place.
    a: (*const f32, usize, usize),
    /// `b` and its row stride.
    b: (*const f32, usize),
    /// `c` and its row stride.
    c: (*mut f32, usize),
    /// Where the sums start, and whether the ReLU follows.
    write: (BlockStart, bool),
    /// Columns of `c` written (of `b` read when masked).
    width: usize,
}

/// Where a block's sums start: zero, `c`, or a value per row.
#[derive(Clone, Copy)]
pub(super) enum BlockStart {
    Zero,
    Dst,
    Rows(*const f32),
}

/// One `R x (V * LANES)` block (the first `width` columns of `c` when `MASKED`, of `b` too
/// when `MASKED_B`), in `R * V` registers:
/// `c[r][..] = start + sum over p of a[r * row + p * step] * b[p * ldb..][..]`, then
/// `max(c, 0)` when `relu` (`write` is `(start, relu)`).
///
/// # Safety
///
/// As for [`product`]: `a` holds the panel's `R x k` values, `b` `k` rows of `width` values `ldb` apart
/// (of `V * LANES` unless `MASKED_B`), `c` `R` rows of `width` values `ldc` apart; `width` is
/// `V * LANES` unless `MASKED`.
#[inline(always)]
pub(super) unsafe fn block<
    L: Lanes,
    const R: usize,
    const V: usize,
    const MASKED: bool,
    const MASKED_B: bool,
>(
    args: BlockArgs,
) {
    let BlockArgs {
        k,
        a: (a, a_row, a_step),
        b: (b, ldb),
        c: (c, ldc),
        write: (start, relu),
        width,
    } = args;
    let mut masks = [L::mask(0); V];
    if MASKED || MASKED_B {
        for (i, mask) in masks.iter_mut().enumerate() {
            *mask = L::mask(width.saturating_sub(i * L::LANES));
        }
    }
    let load = |p: *const f32, masked: bool| {
        let mut v = [L::zero(); V];
        for (i, v) in v.iter_mut().enumerate() {
            *v = if masked {
                L::load_masked(p.add(i * L::LANES), masks[i])
            } else {
                L::load(p.add(i * L::LANES))
            };
        }
        v
    };
    let mut acc = [[L::zero(); V]; R];
    match start {
        BlockStart::Zero => {}
        BlockStart::Dst => {
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = load(c.add(r * ldc), MASKED);
            }
        }
        BlockStart::Rows(values) => {
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = [L::splat(values.add(r)); V];
            }
        }
    }
    for p in 0..k {
        let bv = load(b.add(p * ldb), MASKED_B);
        let col = a.add(p * a_step);
        for (r, row) in acc.iter_mut().enumerate() {
            let v = L::splat(col.add(r * a_row));
            for (acc, &b) in row.iter_mut().zip(&bv) {
                *acc = L::fma(v, b, *acc);
            }
        }
    }
    if relu {
        for row in &mut acc {
            for v in row {
                *v = L::relu(*v);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let row = c.add(r * ldc);
        for (i, &v) in acc.iter().enumerate() {
            if MASKED {
                L::store_masked(row.add(i * L::LANES), masks[i], v);
            } else {
                L::store(row.add(i * L::LANES), v);
            }
        }
    }
}
