//! One CUDA device, two threads: while a replica captures a step as a CUDA graph on its
//! device's stream, nothing else may queue work on that stream (the work would join the graph,
//! or fail the capture and itself), and the device's per-buffer event tracking is paused (see
//! `replica/graph.rs`), so a buffer another thread made meanwhile would not be ordered with the
//! steps that read it. A capture holds this lock exclusively ([`capturing`]); a thread that
//! queues work beside the training thread, as the loader's prefetch thread does when it copies
//! batches to the device ahead of their steps (on a stream of their own, [`super::batch_upload`]),
//! holds it shared for each piece of work ([`beside_the_steps`]). Captures are rare (one per
//! batch shape), so the copies seldom wait.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static STREAMS: RwLock<()> = RwLock::new(());

/// Held while a step is captured: no other thread queues work meanwhile.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn capturing() -> RwLockWriteGuard<'static, ()> {
    // The lock guards no data: a panic while it was held leaves nothing inconsistent.
    STREAMS
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Held while a thread other than the training thread queues work on a device.
pub(crate) fn beside_the_steps() -> RwLockReadGuard<'static, ()> {
    STREAMS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
