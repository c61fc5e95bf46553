//! Runs a kernel's loops compiled for the widest vector instructions the CPU has.
//!
//! The crate is built for the baseline `x86_64` target (SSE2), so that one binary runs
//! everywhere. [`vectorized`] calls a closure through a function compiled with AVX-512 or AVX2
//! enabled, picked at run time, and the closure's loops, inlined there, vectorise for that
//! width. The loops are written with fixed lanes and without fused multiply-adds, so every
//! width gives the same bits.

#![allow(unsafe_code)]

/// Calls `f`, compiled for the widest vector instructions the CPU has.
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    Width::best().run(f)
}

/// A vector width that this CPU can run; made only by detecting the CPU's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Width(Level);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Level {
    /// AVX-512 F, VL, BW and DQ (the `x86-64-v4` set).
    Avx512,
    Avx2,
    /// What the crate is compiled for.
    Baseline,
}

impl Width {
    /// The widest width this CPU can run.
    #[inline(always)]
    pub(crate) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512dq")
            {
                return Self(Level::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Self(Level::Avx2);
            }
        }
        Self(Level::Baseline)
    }

    /// Every width this CPU can run, widest first.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let all = [Level::Avx512, Level::Avx2, Level::Baseline];
        let best = all
            .iter()
            .position(|&l| l == Self::best().0)
            .unwrap_or(all.len() - 1);
        all[best..].iter().map(|&l| Self(l)).collect()
    }

    /// Calls `f`, compiled for this width.
    #[inline(always)]
    pub(crate) fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self.0 {
            // SAFETY: a `Width` is made only for features the CPU has (`best`, `available`).
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => unsafe { avx512(f) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => unsafe { avx2(f) },
            _ => f(),
        }
    }
}

/// Calls `f`, inlined and compiled with AVX-512.
///
/// # Safety
///
/// The CPU must have AVX-512F, VL, BW and DQ. (An `unsafe fn`, rather than a safe one with
/// target features, keeps the crate building on Rust before 1.86.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Calls `f`, inlined and compiled with AVX2.
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
