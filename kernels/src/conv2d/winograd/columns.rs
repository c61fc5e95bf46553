//! What the pair kernels compute on whole vectors, written once for both widths ([`Vector`]:
//! AVX2's 256-bit and AVX-512's 512-bit registers): the 4x4 transpose within each 128-bit lane,
//! and the columns of the three transforms, the same operations lane by lane as the portable
//! `input_column`, `output_column` and `gradient_column` (fused multiply-adds in the first two).
//! Everything here is `#[inline(always)]` and only called from functions compiled for the
//! width's instructions (`pairs_avx2`, `pairs_avx512`).

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, __m512, _mm256_add_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_max_ps, _mm256_mul_ps,
    _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_sub_ps, _mm256_unpackhi_ps,
    _mm256_unpacklo_ps, _mm512_add_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_max_ps,
    _mm512_mul_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_ps, _mm512_sub_ps,
    _mm512_unpackhi_ps, _mm512_unpacklo_ps,
};

use super::{SIDE, TILE};

/// A register of `f32` lanes: the operations the transforms take.
pub(super) trait Vector: Copy {
    /// All lanes `v`.
    unsafe fn splat(v: f32) -> Self;
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn sub(self, b: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    /// `self * b + c`, rounded once.
    unsafe fn fmadd(self, b: Self, c: Self) -> Self;
    /// `-(self * b) + c`, rounded once.
    unsafe fn fnmadd(self, b: Self, c: Self) -> Self;
    /// `max(self, 0)`, a NaN staying a NaN.
    unsafe fn relu(self) -> Self;
    /// Within each 128-bit lane: `self`'s and `b`'s low pairs interleaved.
    unsafe fn unpacklo(self, b: Self) -> Self;
    /// Within each 128-bit lane: their high pairs interleaved.
    unsafe fn unpackhi(self, b: Self) -> Self;
    /// Within each 128-bit lane: `self`'s low two values, then `b`'s.
    unsafe fn low_halves(self, b: Self) -> Self;
    /// Within each 128-bit lane: `self`'s high two values, then `b`'s.
    unsafe fn high_halves(self, b: Self) -> Self;
}

macro_rules! vector {
    ($v:ty, $splat:ident, $zero:ident, $add:ident, $sub:ident, $mul:ident, $fmadd:ident,
     $fnmadd:ident, $max:ident, $lo:ident, $hi:ident, $shuffle:ident) => {
        impl Vector for $v {
            #[inline(always)]
            unsafe fn splat(v: f32) -> Self {
                $splat(v)
            }
            #[inline(always)]
            unsafe fn add(self, b: Self) -> Self {
                $add(self, b)
            }
            #[inline(always)]
            unsafe fn sub(self, b: Self) -> Self {
                $sub(self, b)
            }
            #[inline(always)]
            unsafe fn mul(self, b: Self) -> Self {
                $mul(self, b)
            }
            #[inline(always)]
            unsafe fn fmadd(self, b: Self, c: Self) -> Self {
                $fmadd(self, b, c)
            }
            #[inline(always)]
            unsafe fn fnmadd(self, b: Self, c: Self) -> Self {
                $fnmadd(self, b, c)
            }
            #[inline(always)]
            unsafe fn relu(self) -> Self {
                // `max` returns its second operand when either is NaN: a NaN stays.
                $max($zero(), self)
            }
            #[inline(always)]
            unsafe fn unpacklo(self, b: Self) -> Self {
                $lo(self, b)
            }
            #[inline(always)]
            unsafe fn unpackhi(self, b: Self) -> Self {
                $hi(self, b)
            }
            #[inline(always)]
            unsafe fn low_halves(self, b: Self) -> Self {
                $shuffle::<0x44>(self, b)
            }
            #[inline(always)]
            unsafe fn high_halves(self, b: Self) -> Self {
                $shuffle::<0xEE>(self, b)
            }
        }
    };
}

vector!(
    __m256,
    _mm256_set1_ps,
    _mm256_setzero_ps,
    _mm256_add_ps,
    _mm256_sub_ps,
    _mm256_mul_ps,
    _mm256_fmadd_ps,
    _mm256_fnmadd_ps,
    _mm256_max_ps,
    _mm256_unpacklo_ps,
    _mm256_unpackhi_ps,
    _mm256_shuffle_ps
);
vector!(
    __m512,
    _mm512_set1_ps,
    _mm512_setzero_ps,
    _mm512_add_ps,
    _mm512_sub_ps,
    _mm512_mul_ps,
    _mm512_fmadd_ps,
    _mm512_fnmadd_ps,
    _mm512_max_ps,
    _mm512_unpacklo_ps,
    _mm512_unpackhi_ps,
    _mm512_shuffle_ps
);

/// Within each 128-bit lane, the 4x4 transpose of the four vectors' lanes.
#[inline(always)]
pub(super) unsafe fn transpose4<V: Vector>([v0, v1, v2, v3]: [V; 4]) -> [V; 4] {
    let (t0, t1) = (v0.unpacklo(v1), v2.unpacklo(v3));
    let (t2, t3) = (v0.unpackhi(v1), v2.unpackhi(v3));
    [
        t0.low_halves(t1),
        t0.high_halves(t1),
        t2.low_halves(t3),
        t2.high_halves(t3),
    ]
}

/// One column of `Bt d` over the lanes.
#[inline(always)]
pub(super) unsafe fn input_column<V: Vector>([d0, d1, d2, d3, d4, d5]: [V; SIDE]) -> [V; SIDE] {
    let (two, four, five) = (V::splat(2.0), V::splat(4.0), V::splat(5.0));
    let (sum, diff) = (d1.add(d2), d1.sub(d2));
    let (d31, d42) = (d3.sub(d1), d4.sub(d2));
    [
        four.fmadd(d0, five.fnmadd(d2, d4)),
        four.fnmadd(sum, d3.add(d4)),
        four.fmadd(diff, d4.sub(d3)),
        two.fmadd(d31, d42),
        two.fnmadd(d31, d42),
        four.fmadd(d1, five.fnmadd(d3, d5)),
    ]
}

/// One column of `At m` over the lanes.
#[inline(always)]
pub(super) unsafe fn output_column<V: Vector>([m0, m1, m2, m3, m4, m5]: [V; SIDE]) -> [V; TILE] {
    let (a, b) = (m1.add(m2), m1.sub(m2));
    let (c, d) = (m3.add(m4), m3.sub(m4));
    [
        m0.add(a).add(c),
        V::splat(2.0).fmadd(d, b),
        V::splat(4.0).fmadd(c, a),
        V::splat(8.0).fmadd(d, b).add(m5),
    ]
}

/// One column of the output gradient's `A g` over the lanes (no fused multiply-adds: the
/// portable transform's values bit for bit).
#[inline(always)]
pub(super) unsafe fn gradient_column<V: Vector>([g0, g1, g2, g3]: [V; TILE]) -> [V; SIDE] {
    let (even, odd) = (g0.add(g2), g1.add(g3));
    let even4 = g0.add(V::splat(4.0).mul(g2));
    let odd2 = V::splat(2.0).mul(g1).add(V::splat(8.0).mul(g3));
    [
        g0,
        even.add(odd),
        even.sub(odd),
        even4.add(odd2),
        even4.sub(odd2),
        g3,
    ]
}

#[cfg(test)]
mod tests {
    use std::arch::x86_64::{_mm256_loadu_ps, _mm256_storeu_ps, _mm512_loadu_ps, _mm512_storeu_ps};

    use super::Vector;
    use crate::conv2d::epilogue;
    use crate::test_support::{bits, SPECIAL_VALUES};
    use crate::SimdLevel;

    /// Each width's vector ReLU is the portable `epilogue::relu` lane by lane, bit for bit: a
    /// NaN stays (the operand order of `max`), `-inf` becomes zero, `+inf` stays.
    #[test]
    fn the_vector_relu_is_the_portable_relu_at_every_width() {
        let want: Vec<f32> = SPECIAL_VALUES.iter().map(|&v| epilogue::relu(v)).collect();
        assert!(want[0].is_nan() && want[1] == 0.0 && want[2] == f32::INFINITY);
        let level = SimdLevel::detected();
        if level >= SimdLevel::Avx2 {
            let mut got = [0f32; 8];
            // SAFETY: the CPU has AVX2; both arrays hold eight values.
            unsafe {
                _mm256_storeu_ps(
                    got.as_mut_ptr(),
                    _mm256_loadu_ps(SPECIAL_VALUES.as_ptr()).relu(),
                )
            };
            assert_eq!(bits(&got), bits(&want), "AVX2");
        }
        if level >= SimdLevel::Avx512 {
            let (input, want) = (
                [SPECIAL_VALUES, SPECIAL_VALUES].concat(),
                [&want[..], &want[..]].concat(),
            );
            let mut got = [0f32; 16];
            // SAFETY: the CPU has AVX-512; both hold sixteen values.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), _mm512_loadu_ps(input.as_ptr()).relu()) };
            assert_eq!(bits(&got), bits(&want), "AVX-512");
        } else {
            eprintln!("AVX-512 skipped: this CPU has no AVX-512");
        }
    }
}
