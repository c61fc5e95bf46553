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
//! It also keeps every thread in the main heap (one arena). glibc gives other threads arenas of
//! their own, made of heaps of at most 64 MiB that are unmapped as soon as they fall empty,
//! whatever the thresholds: a replica's thread (`MirroredStrategy` on the CPU, a pipeline's
//! stage) or a program training off its main thread mapped and faulted in its activations
//! afresh every step. On 2 cores, `bench_strategies` (MiniGoogLeNet, 1 to 4 replicas) spent 7.1
//! s of system time with glibc's arenas and 1.4 s with one, 11% less CPU time in all.
//!
//! The library never calls it by itself: the allocator belongs to the program. A program that
//! trains on the CPU calls it once at start, as the example binaries do. On targets other than
//! Linux with glibc it does nothing.

/// Allocations up to this size come from the heap, whose freed memory is reused; a
/// MiniGoogLeNet activation at batch 64 is 25 MiB, a larger model's or batch's more.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: i32 = 512 << 20;

/// The largest threshold older glibc releases accept on 64-bit targets, tried when
/// [`MMAP_THRESHOLD`] is refused.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD_FALLBACK: i32 = 32 << 20;

/// Free memory at the heap's top is never returned to the system (-1 turns glibc's trimming
/// off): a step of ResNet-50 on 224x224 images frees gigabytes at its end and takes them again
/// at the next step's start, which a finite threshold made fault in afresh every step.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: i32 = -1;

/// Tunes the C allocator of the whole process for training on the CPU: freed activation
/// buffers stay in the heap and the next step reuses them instead of faulting in fresh pages
/// (about a fifth of a MiniGoogLeNet step on a 2-core machine). It raises glibc's `mmap` and
/// trim thresholds and keeps the threads started afterwards in the main heap (`mallopt`), once
/// per process, so call it before starting threads; the process then keeps its peak heap
/// instead of returning it to the system. Returns whether the settings are in effect (always
/// `false` on targets other than Linux with glibc).
///
/// It changes the process, not just kandle, so kandle never calls it: the program decides.
///
/// ```
/// // At the start of a program that trains on the CPU:
/// let tuned = kandle::keep_freed_memory();
/// # let _ = tuned;
/// ```
pub fn keep_freed_memory() -> bool {
    static APPLIED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *APPLIED.get_or_init(apply)
}

/// One arena: every thread allocates from the main heap, which the thresholds above keep.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const ARENAS: i32 = 1;

/// Raises glibc's `mmap` and trim thresholds and keeps one arena; whether all three took. The one item of kandle that
/// uses `unsafe` (`mallopt` is a C function): it allows `unsafe_code`, which the crate root
/// denies everywhere else, and each call says why it is sound.
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
    // SAFETY: as for the `mmap` threshold. Threads already attached to an arena keep it; those
    // started afterwards (a program calls this first) share the main one.
    let arenas = unsafe { libc::mallopt(libc::M_ARENA_MAX, ARENAS) };
    mmap == 1 && trim == 1 && arenas == 1
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
        // The settings apply once; a second call changes nothing.
        assert!(keep_freed_memory());
        assert!(keep_freed_memory());
    }
}
