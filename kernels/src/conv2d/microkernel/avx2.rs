//! The micro-kernel compiled for AVX2 and FMA: 6x16 blocks of twelve 8-lane registers (two
//! per row), masked through `vmaskmovps`.

use std::arch::x86_64::{
    __m256, __m256i, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256,
    _mm256_maskload_ps, _mm256_maskstore_ps, _mm256_max_ps, _mm256_setzero_ps, _mm256_storeu_ps,
};

use super::driver::{self, Lanes};

/// Registers per row of a block: 6x16 blocks take twelve of the sixteen.
pub(super) const VECTORS: usize = 2;

/// Eight lanes on, then eight off: [`mask`] reads eight of them.
static MASKS: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

/// A mask with the first `active` (at most 8) of eight lanes on, for masked loads and
/// stores.
///
/// # Safety
///
/// The CPU has AVX.
#[inline(always)]
pub(crate) unsafe fn mask(active: usize) -> __m256i {
    _mm256_loadu_si256(MASKS.as_ptr().add(8 - active.min(8)).cast())
}

/// AVX2's 8-lane registers.
pub(super) struct Avx2;

impl Lanes for Avx2 {
    type V = __m256;
    type Mask = __m256i;
    const LANES: usize = 8;
    // AMD's cores run `vmaskmovps` stores slowly, and the kernel has always masked both.
    const NARROW_TAILS: bool = false;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> __m256 {
        _mm256_broadcast_ss(&*p)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v);
    }
    #[inline(always)]
    unsafe fn mask(active: usize) -> __m256i {
        mask(active)
    }
    #[inline(always)]
    unsafe fn load_masked(p: *const f32, mask: __m256i) -> __m256 {
        _mm256_maskload_ps(p, mask)
    }
    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, mask: __m256i, v: __m256) {
        _mm256_maskstore_ps(p, mask, v);
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn relu(v: __m256) -> __m256 {
        // `max` returns its second operand when either is NaN: a NaN stays.
        _mm256_max_ps(_mm256_setzero_ps(), v)
    }

    driver::compiled_block!("avx2,fma");
}

driver::compiled_product!(Avx2, "avx2,fma", "AVX2 and FMA");
