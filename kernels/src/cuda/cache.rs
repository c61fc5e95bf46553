//! What each CUDA device keeps between convolutions: one cuDNN handle on candle's stream of
//! that device, a plan per convolution (descriptors and the algorithm searched for it), and one
//! workspace that only grows.
//!
//! candle's own cuDNN path creates all of these again on every call: the descriptors, a
//! heuristic algorithm pick, and a workspace allocated and zeroed. Here a convolution is
//! searched once per device, [`Key`] (operation, dtype, shapes, window, algorithm settings),
//! and every later call with the same key looks its [`Plan`] up and launches it.
//!
//! The state lives behind its own mutex, held for the whole of a call (a search, or only the
//! launch, which queues work on the stream and returns): cuDNN's handles may be used from any
//! thread but by one at a time. There is one state per device and stream
//! ([`PerStream`](super::stream_key::PerStream)): per device and thread for a device on CUDA's
//! per-thread default streams (candle's `Device::new_cuda`), per device for one made with a
//! stream of its own.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtrMut};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device};

use super::algorithms::{self, Algo, Buffers, Candidate, Kind, Workspace};
use super::descriptors::{ConvDescriptors, Handle};
use super::params::{AlgoSearch, Geometry, Window};
use super::stream_key::PerStream;
use crate::{Error, Result};

/// What one convolution's plan is searched for and looked up by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub kind: Kind,
    pub dtype: DType,
    pub geometry: Geometry,
    pub window: Window,
}

/// A convolution's descriptors and chosen algorithm, with the workspace it needs.
struct Plan {
    descriptors: ConvDescriptors,
    algo: Algo,
    workspace: usize,
}

/// How a device's cache has been used since it was made (or since [`clear_caches`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Algorithm searches run: one per new plan (operation, dtype, shapes, window, settings).
    pub searches: u64,
    /// Calls that found their plan already made.
    pub hits: u64,
    /// Plans kept.
    pub plans: usize,
    /// Bytes of the device's workspaces (one per stream).
    pub workspace_bytes: usize,
}

/// One device's (and stream's) handle, plans and workspace.
struct DeviceState {
    handle: Handle,
    plans: HashMap<Key, Plan>,
    workspace: Option<CudaSlice<u8>>,
    stats: CacheStats,
}

// SAFETY: the raw cuDNN handle and descriptors are not tied to the thread that made them;
// cuDNN allows a handle to be used from any thread as long as no two use it at once, and a
// `DeviceState` is only ever reached through its `Mutex`. The stream and workspace are cudarc
// types that are `Send` already.
unsafe impl Send for DeviceState {}

/// Every device's and stream's state.
static DEVICES: PerStream<DeviceState> = PerStream::new();

/// The state of `dev` (on this thread, for a per-thread stream), made with a new cuDNN handle
/// on its stream the first time.
fn state(dev: &CudaDevice) -> candle_core::Result<Arc<Mutex<DeviceState>>> {
    DEVICES.get(dev, || {
        Ok(DeviceState {
            handle: Handle::new(dev.cuda_stream())?,
            plans: HashMap::new(),
            workspace: None,
            stats: CacheStats::default(),
        })
    })
}

/// Runs the convolution `key` on `dev` over `buffers`: its plan looked up, or searched and
/// kept, then launched on the device's stream, writing the operation's output buffer.
///
/// # Safety
/// `buffers` must hold device memory of `dev` for `key`'s three tensors in `key.dtype`
/// (contiguous `NCHW`), the output not overlapping the inputs, all allocated until the stream
/// has run the operation.
pub(crate) unsafe fn run(dev: &CudaDevice, key: &Key, buffers: Buffers) -> candle_core::Result<()> {
    let state = state(dev)?;
    let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
    state
        .handle
        .stream()
        .context()
        .bind_to_thread()
        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
    if state.plans.contains_key(key) {
        state.stats.hits += 1;
    } else {
        // SAFETY: the caller's contract on `buffers`.
        let plan = unsafe { state.search(key, buffers) }?;
        state.stats.searches += 1;
        state.plans.insert(*key, plan);
    }
    let DeviceState {
        handle,
        plans,
        workspace,
        stats,
    } = &mut *state;
    let Some(plan) = plans.get(key) else {
        candle_core::bail!("cuDNN convolution: the plan of {key:?} was not kept");
    };
    grow(handle, workspace, plan.workspace, false)?;
    stats.workspace_bytes = workspace.as_ref().map_or(0, CudaSlice::len);
    let stream = Arc::clone(handle.stream());
    let (ptr, _written) = match workspace.as_mut() {
        Some(w) if plan.workspace > 0 => {
            let (ptr, guard) = w.device_ptr_mut(&stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let ws = Workspace {
        ptr,
        bytes: plan.workspace,
    };
    // SAFETY: the plan's descriptors were made for `key`, which the caller's buffers fit; the
    // workspace holds at least the plan's bytes and stays allocated (the state owns it, and a
    // larger one replaces it only through a stream-ordered free).
    unsafe { algorithms::launch(handle, &plan.descriptors, plan.algo, key.dtype, buffers, ws) }
}

impl DeviceState {
    /// A new plan for `key`: its descriptors, and the fastest algorithm that fits its settings,
    /// measured on `buffers` for a benchmark search.
    ///
    /// # Safety
    /// As [`run`]'s.
    unsafe fn search(&mut self, key: &Key, buffers: Buffers) -> candle_core::Result<Plan> {
        let mut descriptors = ConvDescriptors::new(&key.geometry, &key.window, key.dtype)?;
        let settings = key.window.algorithms;
        let none = Workspace { ptr: 0, bytes: 0 };
        // SAFETY: heuristics read descriptors only; the caller's contract for the rest.
        let ranked = unsafe {
            algorithms::candidates(
                &self.handle,
                &descriptors,
                key.kind,
                AlgoSearch::Heuristic,
                buffers,
                none,
            )
        }?;
        let (candidates, available) = match settings.search {
            AlgoSearch::Heuristic => (ranked, settings.workspace_limit),
            AlgoSearch::Benchmark => {
                // Room for every algorithm the settings allow, up to the limit; if the device
                // cannot spare that much, the search runs in what there is.
                let wanted = ranked
                    .iter()
                    .filter(|c| {
                        algorithms::choose(&[**c], key.dtype, &settings, usize::MAX).is_some()
                    })
                    .map(|c| c.memory)
                    .filter(|&m| m <= settings.workspace_limit)
                    .max()
                    .unwrap_or(0);
                grow(&self.handle, &mut self.workspace, wanted, true)?;
                let stream = Arc::clone(self.handle.stream());
                let (ptr, bytes, _written) = match self.workspace.as_mut() {
                    Some(w) => {
                        let bytes = w.len();
                        let (ptr, guard) = w.device_ptr_mut(&stream);
                        (ptr, bytes, Some(guard))
                    }
                    None => (0, 0, None),
                };
                let ws = Workspace { ptr, bytes };
                // SAFETY: the caller's contract; the workspace holds `bytes` bytes.
                let measured = unsafe {
                    algorithms::candidates(
                        &self.handle,
                        &descriptors,
                        key.kind,
                        settings.search,
                        buffers,
                        ws,
                    )
                }?;
                (measured, bytes)
            }
        };
        let Some(chosen) = algorithms::choose(&candidates, key.dtype, &settings, available) else {
            return Err(no_algorithm(key, &candidates, available));
        };
        descriptors.set_math(chosen.math)?;
        let workspace = algorithms::workspace_size(&self.handle, &descriptors, chosen.algo)?;
        log::debug!(
            "cuDNN {:?} {:?} {:?}: {:?} in {:?} ({:.3} ms, {} workspace bytes)",
            key.kind,
            key.dtype,
            key.geometry,
            chosen.algo,
            chosen.math,
            chosen.time_ms,
            workspace
        );
        Ok(Plan {
            descriptors,
            algo: chosen.algo,
            workspace,
        })
    }
}

/// Grows `workspace` to at least `bytes` (rounded up to a whole MiB, so that a run of slightly
/// larger needs does not allocate each time). The old one is freed in stream order, after
/// the work queued on it. With `lenient`, a failed allocation keeps the old workspace (the
/// search then runs in less); otherwise it is an error.
fn grow(
    handle: &Handle,
    workspace: &mut Option<CudaSlice<u8>>,
    bytes: usize,
    lenient: bool,
) -> candle_core::Result<()> {
    let have = workspace.as_ref().map_or(0, CudaSlice::len);
    if bytes <= have {
        return Ok(());
    }
    let bytes = bytes.div_ceil(1 << 20).saturating_mul(1 << 20);
    // SAFETY: a workspace is scratch memory that cuDNN writes before it reads; its contents
    // are never read as values.
    match unsafe { handle.stream().alloc::<u8>(bytes) } {
        Ok(new) => {
            *workspace = Some(new);
            Ok(())
        }
        Err(e) if lenient => {
            log::warn!("cuDNN workspace of {bytes} bytes not allocated ({e}); searching in {have}");
            Ok(())
        }
        Err(e) => Err(candle_core::Error::Msg(format!(
            "cuDNN convolution: a workspace of {bytes} bytes could not be allocated: {e}"
        ))),
    }
}

/// The error for a convolution with no algorithm that fits its settings, listing what cuDNN
/// offered.
fn no_algorithm(key: &Key, candidates: &[Candidate], workspace: usize) -> candle_core::Error {
    let offered: Vec<String> = candidates
        .iter()
        .map(|c| {
            format!(
                "{:?} ({} bytes, {}deterministic, {:?})",
                c.algo,
                c.memory,
                if c.deterministic { "" } else { "not " },
                c.math
            )
        })
        .collect();
    candle_core::Error::Msg(format!(
        "cuDNN convolution {:?} of {:?} {:?} with {:?}: no algorithm fits (workspace {} bytes, \
         limit {}); cuDNN offered [{}]",
        key.kind,
        key.dtype,
        key.geometry,
        key.window,
        workspace,
        key.window.algorithms.workspace_limit,
        offered.join(", ")
    ))
}

/// How `device`'s convolution caches have been used, summed over its streams (one per thread
/// that ran a convolution, for a device on CUDA's per-thread streams); an error unless it is a
/// CUDA device. A device that has run no cuDNN convolution has all zeros.
pub fn cache_stats(device: &Device) -> Result<CacheStats> {
    let Device::Cuda(dev) = device else {
        return Err(Error::invalid(format!(
            "cuda::cache_stats: {device:?} is not a CUDA device"
        )));
    };
    let mut sum = CacheStats::default();
    for state in DEVICES.of_device(dev.id()) {
        let state = state.lock().unwrap_or_else(PoisonError::into_inner);
        sum.searches += state.stats.searches;
        sum.hits += state.stats.hits;
        sum.plans += state.plans.len();
        sum.workspace_bytes += state.stats.workspace_bytes;
    }
    Ok(sum)
}

/// Drops every device's cuDNN handles, plans and workspaces; the next convolution on a device
/// makes them again (and searches again). For freeing the workspaces' memory (threads that
/// ran convolutions on a `Device::new_cuda` device each have their own), or a test that counts
/// searches from zero. Waits for each device's queued work first: a workspace may be in use on
/// another thread's stream, which this thread's free would not wait for.
pub fn clear_caches() {
    for state in DEVICES.take_all() {
        let state = state.lock().unwrap_or_else(PoisonError::into_inner);
        let context = state.handle.stream().context();
        if let Err(e) = context.synchronize() {
            log::warn!("cuDNN caches: synchronizing the device before freeing failed: {e}");
        }
    }
}
