//! Which per-device state a call of a library with handles (cuDNN, cuBLASLt) uses: one per
//! device and stream.
//!
//! candle's `Device::new_cuda` queues each thread's work on CUDA's per-thread default stream, a
//! different stream on every thread, so for such a device a state (a handle bound to a stream,
//! and a workspace, which two streams must not share) is per device and thread; a device made
//! with a stream of its own (`Device::new_cuda_with_stream`) shares one across threads.

use std::thread::ThreadId;

use candle_core::cuda_backend::{CudaDevice, DeviceId};

/// Which state a call uses: candle's id of the device (one per `CudaDevice`), and the calling
/// thread when the device's stream is CUDA's per-thread default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct StreamKey {
    /// The device.
    pub device: DeviceId,
    /// The calling thread, for a device on the per-thread default stream.
    pub thread: Option<ThreadId>,
}

/// `CU_STREAM_PER_THREAD`: the handle of the calling thread's own default stream, which
/// candle's `Device::new_cuda` uses.
const PER_THREAD_STREAM: usize = 0x2;

impl StreamKey {
    /// The key of `dev`'s stream, on the calling thread.
    pub(crate) fn of(dev: &CudaDevice) -> Self {
        let per_thread = dev.cuda_stream().cu_stream() as usize == PER_THREAD_STREAM;
        Self {
            device: dev.id(),
            thread: per_thread.then(|| std::thread::current().id()),
        }
    }
}
