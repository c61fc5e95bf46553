//! Runs a kernel's loops compiled for the widest vector instructions the CPU has.
//!
//! The crate is built for the baseline `x86_64` target (SSE2), so that one binary runs
//! everywhere. [`vectorized`] calls a closure through a function compiled with AVX-512 or AVX2
//! enabled, picked at run time, and the closure's loops, inlined there, vectorise for that
//! width. The loops are written with fixed lanes and without fused multiply-adds, so every
//! path gives the same bits.

#![allow(unsafe_code)]

/// Calls `f`, compiled with AVX-512 (the `x86-64-v4` set) when the CPU has it, else with AVX2, else as it is.
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            // SAFETY: the CPU has every feature `avx512` is compiled with.
            return unsafe { avx512(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, the only feature `avx2` is compiled with.
            return unsafe { avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
