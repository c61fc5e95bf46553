//! Which per-device state a call of a library with handles (cuDNN, cuBLASLt) uses: one per
//! device and stream ([`StreamKey`]), kept in a [`PerStream`].
//!
//! candle's `Device::new_cuda` queues each thread's work on CUDA's per-thread default stream, a
//! different stream on every thread, so for such a device a state (a handle bound to a stream,
//! and a workspace, which two streams must not share) is per device and thread; a device made
//! with a stream of its own (`Device::new_cuda_with_stream`) shares one across threads.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use candle_core::cuda_backend::{CudaDevice, DeviceId};

/// Which state a call uses: candle's id of the device (one per `CudaDevice`), and the calling
/// thread when the device's stream is CUDA's per-thread default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct StreamKey {
    device: DeviceId,
    thread: Option<ThreadId>,
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

/// One state `S` per device and stream ([`StreamKey`]), made on first use and shared behind its
/// own mutex: a library's handle, plans and workspace (cuDNN's in `cache`, cuBLASLt's in
/// `matmul_plans`).
pub(crate) struct PerStream<S>(Mutex<Vec<(StreamKey, Arc<Mutex<S>>)>>);

impl<S> PerStream<S> {
    /// No state yet.
    pub(crate) const fn new() -> Self {
        Self(Mutex::new(Vec::new()))
    }

    /// The state of `dev` (on this thread, for a per-thread stream), made by `make` the first
    /// time.
    pub(crate) fn get(
        &self,
        dev: &CudaDevice,
        make: impl FnOnce() -> candle_core::Result<S>,
    ) -> candle_core::Result<Arc<Mutex<S>>> {
        let key = StreamKey::of(dev);
        let mut states = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, state)) = states.iter().find(|(k, _)| *k == key) {
            return Ok(Arc::clone(state));
        }
        let state = Arc::new(Mutex::new(make()?));
        states.push((key, Arc::clone(&state)));
        Ok(state)
    }

    /// The states of `device`, one per stream.
    #[cfg(feature = "cudnn")]
    pub(crate) fn of_device(&self, device: DeviceId) -> Vec<Arc<Mutex<S>>> {
        let states = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        states
            .iter()
            .filter(|(key, _)| key.device == device)
            .map(|(_, state)| Arc::clone(state))
            .collect()
    }

    /// Every state, taken out: the next use makes them again.
    #[cfg(feature = "cudnn")]
    pub(crate) fn take_all(&self) -> Vec<Arc<Mutex<S>>> {
        let mut states = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        states.drain(..).map(|(_, state)| state).collect()
    }
}
