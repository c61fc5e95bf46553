//! The micro-kernel compiled for AVX-512 (F, VL, BW, DQ): blocks of six rows by
//! [`VECTORS`] 16-lane registers, the last columns through mask registers, which cost nothing
//! on the lanes they leave out, so a narrow last block takes only the registers it needs.

use std::arch::x86_64::{
    __m512, __mmask16, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_storeu_ps,
    _mm512_maskz_loadu_ps, _mm512_max_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
};

use super::driver::{self, Lanes};

/// Registers per row of a block: 6x32 blocks take twelve of the thirty-two.
pub(super) const VECTORS: usize = 2;

/// AVX-512's 16-lane registers.
pub(super) struct Avx512;

impl Lanes for Avx512 {
    type V = __m512;
    type Mask = __mmask16;
    const LANES: usize = 16;
    const NARROW_TAILS: bool = true;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> __m512 {
        _mm512_set1_ps(*p)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v);
    }
    #[inline(always)]
    unsafe fn mask(active: usize) -> __mmask16 {
        // At most 16 ones: the truncation keeps them all.
        ((1u32 << active.min(16)) - 1) as __mmask16
    }
    #[inline(always)]
    unsafe fn load_masked(p: *const f32, mask: __mmask16) -> __m512 {
        _mm512_maskz_loadu_ps(mask, p)
    }
    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, mask: __mmask16, v: __m512) {
        _mm512_mask_storeu_ps(p, mask, v);
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn relu(v: __m512) -> __m512 {
        // `max` returns its second operand when either is NaN: a NaN stays.
        _mm512_max_ps(_mm512_setzero_ps(), v)
    }

    driver::compiled_block!("avx512f,avx512vl,avx512bw,avx512dq");
}

driver::compiled_product!(
    Avx512,
    "avx512f,avx512vl,avx512bw,avx512dq",
    "AVX-512F, VL, BW and DQ"
);
