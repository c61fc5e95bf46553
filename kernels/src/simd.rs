//! Runs a kernel's loops compiled for the widest vector instructions the CPU has, up to a cap
//! the user may set.
//!
//! The crate is built for the baseline `x86_64` target (SSE2), so that one binary runs
//! everywhere. [`vectorized`] calls a closure through a function compiled with AVX-512 or AVX2
//! enabled, picked at run time, and the closure's loops, inlined there, vectorise for that
//! width. The loops are written with fixed lanes and without fused multiply-adds, so every
//! width gives the same bits.
//!
//! [`SimdLevel`] names the instruction sets; [`SimdLevel::set_cap`] (or `KANDLE_MAX_SIMD`)
//! caps the level every kernel picks, so that a CPU with AVX-512 runs, and tests, the AVX2
//! code too.

#![allow(unsafe_code)]

use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

/// The environment variable that caps [`SimdLevel::in_use`]: `avx512`, `avx2` or `baseline`.
const CAP_ENV: &str = "KANDLE_MAX_SIMD";

/// The vector instruction sets kandle's CPU kernels are compiled for, narrowest first.
///
/// Each kernel runs the widest level the CPU has ([`SimdLevel::detected`]), unless a cap is set
/// with [`SimdLevel::set_cap`] or the environment variable `KANDLE_MAX_SIMD` (`avx512`, `avx2`
/// or `baseline`, read once, when a kernel first asks). A cap makes a CPU with AVX-512 run the
/// AVX2 kernels, to test them or to compare the two. It holds for the whole process, and
/// covers kandle's kernels only: the `gemm` crate behind some matrix products picks its own.
///
/// ```
/// use kandle_kernels::SimdLevel;
///
/// assert!(SimdLevel::in_use() <= SimdLevel::detected());
/// assert_eq!("avx2".parse::<SimdLevel>()?, SimdLevel::Avx2);
/// assert!("avx1024".parse::<SimdLevel>().is_err());
///
/// SimdLevel::Avx2.set_cap();
/// assert!(SimdLevel::in_use() <= SimdLevel::Avx2);
/// # Ok::<(), kandle_kernels::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// What the crate is compiled for (SSE2 on `x86_64`): no run-time vector extension.
    Baseline,
    /// AVX2 with fused multiply-add (the `x86-64-v3` set): 8 lanes of `f32`, 16 registers.
    Avx2,
    /// AVX-512 F, VL, BW and DQ (the `x86-64-v4` set): 16 lanes, 32 registers.
    Avx512,
}

/// No cap read yet.
const UNREAD: u8 = u8::MAX;

/// The cap, as a [`SimdLevel`]'s index, or [`UNREAD`].
static CAP: AtomicU8 = AtomicU8::new(UNREAD);

impl SimdLevel {
    const ALL: [Self; 3] = [Self::Baseline, Self::Avx2, Self::Avx512];

    /// The widest level this CPU can run.
    #[inline]
    pub fn detected() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") {
                if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") {
                    return Self::Avx512;
                }
                return Self::Avx2;
            }
        }
        Self::Baseline
    }

    /// The level kandle's kernels run: the widest this CPU has, at most the cap.
    #[inline]
    pub fn in_use() -> Self {
        Self::detected().min(Self::cap())
    }

    /// The cap: [`SimdLevel::Avx512`] unless [`SimdLevel::set_cap`] or `KANDLE_MAX_SIMD` set
    /// a lower one.
    pub fn cap() -> Self {
        match CAP.load(Ordering::Relaxed) {
            UNREAD => {
                let cap = Self::cap_from_env();
                // Another thread may have set a cap meanwhile: that one stands.
                let _ =
                    CAP.compare_exchange(UNREAD, cap as u8, Ordering::Relaxed, Ordering::Relaxed);
                Self::ALL[usize::from(CAP.load(Ordering::Relaxed))]
            }
            index => Self::ALL[usize::from(index)],
        }
    }

    /// Caps the level every kernel of this process runs from now on at `self` (a cap above
    /// what the CPU has changes nothing). Overrides `KANDLE_MAX_SIMD`.
    pub fn set_cap(self) {
        CAP.store(self as u8, Ordering::Relaxed);
    }

    /// The cap `KANDLE_MAX_SIMD` names; no cap (with a warning) when it names no level.
    fn cap_from_env() -> Self {
        let Ok(value) = std::env::var(CAP_ENV) else {
            return Self::Avx512;
        };
        value.parse().unwrap_or_else(|e| {
            log::warn!("{CAP_ENV}: {e}; the kernels run the widest level the CPU has");
            Self::Avx512
        })
    }

    /// The name `KANDLE_MAX_SIMD` and [`FromStr`] take.
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SimdLevel {
    type Err = crate::Error;

    /// `avx512`, `avx2` or `baseline`, in any case.
    fn from_str(s: &str) -> crate::Result<Self> {
        Self::ALL
            .into_iter()
            .find(|level| level.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                crate::Error::invalid(format!(
                    "`{s}` is no SIMD level: expected avx512, avx2 or baseline"
                ))
            })
    }
}

/// Whether the kernels may use AVX2 and FMA: the CPU has them and the cap allows them.
#[inline]
pub(crate) fn avx2_fma() -> bool {
    SimdLevel::in_use() >= SimdLevel::Avx2
}

/// Calls `f`, compiled for the widest vector instructions the kernels may use.
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    Width::best().run(f)
}

/// A vector width that this CPU can run; made only from the CPU's detected features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Width(SimdLevel);

impl Width {
    /// The widest width the kernels may use ([`SimdLevel::in_use`]).
    #[inline(always)]
    pub(crate) fn best() -> Self {
        Self(SimdLevel::in_use())
    }

    /// Every width this CPU can run, widest first, whatever the cap.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let detected = SimdLevel::detected();
        SimdLevel::ALL
            .into_iter()
            .rev()
            .filter(|&l| l <= detected)
            .map(Self)
            .collect()
    }

    /// Calls `f`, compiled for this width.
    #[inline(always)]
    pub(crate) fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self.0 {
            // SAFETY: a `Width` is made only for a level the CPU has (`best`, `available`).
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => unsafe { avx512(f) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => unsafe { avx2(f) },
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

#[cfg(test)]
mod tests {
    use super::SimdLevel;

    #[test]
    fn levels_parse_by_name_and_refuse_others() {
        for level in SimdLevel::ALL {
            assert_eq!(level.name().parse::<SimdLevel>().ok(), Some(level));
            assert_eq!(
                level.to_string().to_uppercase().parse::<SimdLevel>().ok(),
                Some(level)
            );
        }
        let err = "sse9".parse::<SimdLevel>().expect_err("no such level");
        assert!(err.to_string().contains("`sse9` is no SIMD level"), "{err}");
    }

    #[test]
    fn the_level_in_use_never_exceeds_the_cpu_or_the_cap() {
        assert!(SimdLevel::in_use() <= SimdLevel::detected());
        assert!(SimdLevel::in_use() <= SimdLevel::cap());
    }
}
