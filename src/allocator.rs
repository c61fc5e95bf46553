//! The C allocator's settings for training on the CPU: freed activation buffers are kept and
//! reused instead of being handed back to the kernel.
//!
//! A training step allocates and frees the same few dozen large buffers (activations and their
//! gradients, megabytes each) every step. With glibc's defaults, buffers above its `mmap`
//! threshold are mapped on allocation and unmapped on free, and the heap's top is trimmed
//! whenever it grows past the trim threshold, so every step pays page faults and TLB shootdowns
//! to touch fresh memory again: about a fifth of a MiniGoogLeNet step on a 2-core VM.
//! [`keep_freed_memory`] raises both thresholds (`mallopt`), so freed buffers stay in the heap
//! and the next step reuses them. The process keeps its peak heap instead of returning it to the
//! system, the usual trade for a training job.
//!
//! Replicas on the CPU call it once when they are built. `KANDLE_MALLOC=system` in the
//! environment keeps the allocator's own settings. On targets other than Linux with glibc it
//! does nothing.

/// The environment variable that, set to `system`, leaves the allocator's settings alone.
pub const MALLOC_ENV: &str = "KANDLE_MALLOC";

/// Allocations up to this size come from the heap, whose freed memory is reused; a
/// MiniGoogLeNet activation at batch 64 is 25 MiB, a larger model's or batch's more.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: i32 = 512 << 20;

/// The largest threshold older glibc releases accept on 64-bit targets, tried when
/// [`MMAP_THRESHOLD`] is refused.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD_FALLBACK: i32 = 32 << 20;

/// Free memory at the heap's top kept before it is returned to the system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: i32 = 1 << 30;

/// Raises glibc's `mmap` and trim thresholds once per process, unless `KANDLE_MALLOC=system`;
/// returns whether the settings are in effect (always `false` on other targets).
pub fn keep_freed_memory() -> bool {
    static APPLIED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *APPLIED.get_or_init(|| {
        let system = std::env::var(MALLOC_ENV).is_ok_and(|v| v.eq_ignore_ascii_case("system"));
        !system && apply()
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn apply() -> bool {
    let mmap = [MMAP_THRESHOLD, MMAP_THRESHOLD_FALLBACK]
        .into_iter()
        // SAFETY: `mallopt` only changes glibc's allocator parameters, under the allocator's
        // own lock; it takes two integers and touches no memory of ours. A refused value
        // changes nothing.
        .map(|bytes| unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) })
        .find(|&accepted| accepted == 1)
        .unwrap_or(0);
    // SAFETY: as for the `mmap` threshold.
    let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) };
    mmap == 1 && trim == 1
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_accepts_the_settings_once() {
        // No test sets KANDLE_MALLOC, so the settings apply, and a second call changes nothing.
        assert!(keep_freed_memory());
        assert!(keep_freed_memory());
    }
}
