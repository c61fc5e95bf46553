//! A replica's steps as CUDA graphs ([`crate::devices::set_cuda_graphs`], or
//! `KANDLE_CUDA_GRAPHS=1`): the training step (the forward pass, the loss, the recorded
//! backward pass and the step buffer), an evaluation (the forward pass in inference mode, the
//! loss and metric sums) and a prediction, each captured once its batch's shapes have repeated
//! and replayed as one launch per step, as PyTorch's `torch.cuda.graphs` and
//! `torch.compile(mode="reduce-overhead")` do ([`Graphs`]). A step of hundreds of small kernels
//! costs the host one launch instead of hundreds; a captured step keeps the memory of its
//! intermediate tensors for its replays.
//!
//! When a step is warmed up, captured, replayed or run eagerly is `graph_schedule.rs`'s
//! [`GraphSchedule`]; this is how, on CUDA ([`CudaCapture`]):
//!
//! - **Warm-up**: the first [`WARMUP_STEPS`] steps of a shape run eagerly with candle's upload
//!   cache on (`CudaDevice::enable_cuda_graph_htod_cache`), so every small host-to-device copy
//!   the step makes (strided layouts, constants) is on the device before the capture, where
//!   such a copy is not allowed; they also load every kernel module, search cuDNN's algorithms
//!   and grow its workspace.
//! - **Capture**: the next step of the same shapes copies its batch into tensors kept for the
//!   graph, runs eagerly on them under stream capture (thread-local mode, cudarc's per-buffer
//!   event tracking paused: [`TrackingPaused`]), instantiates the
//!   graph (its memory freed and mapped again at each launch, at the same addresses) and
//!   launches it. The step's outputs (a training step's fused buffer and moving statistics
//!   before the pass, an evaluation's sums, a prediction's outputs) stay the graph's, written
//!   again by each replay; the caller gets copies of them ([`GraphOutput`]), which it may keep
//!   across steps.
//! - **Replay**: a step of the captured shapes copies its batch into the kept tensors and
//!   launches the graph; one of other shapes (the short last batch of an epoch) runs eagerly.
//!   Everything a step changes lives on the device and is changed in place (the moving
//!   statistics, dropout's generator position), so each replay is the next step; the loss
//!   scale is read from its variable on the device. A training step's final phase (the
//!   optimizer's update) runs outside the graph, after the strategy summed the replicas'
//!   buffers, except in a whole step ([`super::whole_step`], a replica alone on its device),
//!   whose graph holds the gated update, reading the learning rate from device memory.
//! - **Fallback**: a step that cannot be captured (one that reads a value back to the host, as
//!   an `Embedding`'s index check or an augmentation layer's draw does; an upload the warm-up
//!   did not cache) fails the capture, which is dropped: the replica says why once
//!   (`log::warn!`) and trains eagerly from then on, with the same results. Steps with gradient
//!   buckets or accumulated micro-batches run eagerly, and a replica of a `SyncBatchNorm` group
//!   never captures (its exchanges wait for the other replicas).

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaGraph};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{Device, Tensor, Var};

#[cfg(doc)]
use super::graph_schedule::WARMUP_STEPS;
use super::graph_schedule::{batch_like, tensors, GraphSchedule, StepCapture};
use super::StepBuffer;
use crate::data::Batch;
use crate::{Error, Result};

/// What a captured step makes: tensors the graph writes again at each replay, handed out as
/// copies.
pub(crate) trait GraphOutput: Sized {
    /// A copy of every tensor, in new memory.
    fn copied(&self) -> candle_core::Result<Self>;
}

impl GraphOutput for Tensor {
    fn copied(&self) -> candle_core::Result<Self> {
        self.copy()
    }
}

impl GraphOutput for Vec<Tensor> {
    fn copied(&self) -> candle_core::Result<Self> {
        self.iter().map(Tensor::copy).collect()
    }
}

impl GraphOutput for StepBuffer {
    fn copied(&self) -> candle_core::Result<Self> {
        Ok(StepBuffer {
            fused: self.fused.copy()?,
            grads_reduced: self.grads_reduced,
            statistics_before: self.statistics_before.copied()?,
        })
    }
}

/// A replica's steps on a CUDA device, each kind captured as its own graph.
pub(crate) struct Graphs {
    device: CudaDevice,
    /// Training steps: the step buffer.
    pub(crate) train: GraphSchedule<StepBuffer, CudaCapture>,
    /// Whole training steps, the update included ([`super::whole_step`]): the step's summary.
    pub(crate) whole: GraphSchedule<Tensor, CudaCapture>,
    /// Evaluations: the loss and metric sums.
    pub(crate) evaluate: GraphSchedule<Tensor, CudaCapture>,
    /// Predictions: the outputs.
    pub(crate) predict: GraphSchedule<Vec<Tensor>, CudaCapture>,
}

impl Graphs {
    /// The graphs of a replica on `device`, none captured yet.
    pub(crate) fn new(device: &CudaDevice) -> Self {
        let on = |what| CudaCapture {
            device: device.clone(),
            what,
        };
        Self {
            device: device.clone(),
            train: GraphSchedule::new(on("training step")),
            whole: GraphSchedule::new(on(WHOLE_STEP)),
            evaluate: GraphSchedule::new(on("evaluation")),
            predict: GraphSchedule::new(on("prediction")),
        }
    }

    /// Drops the graphs of whole steps, which the next steps warm up and capture again: for
    /// when the optimizer's state moved to new tensors.
    pub(crate) fn restart_whole_steps(&mut self) {
        self.whole = GraphSchedule::new(CudaCapture {
            device: self.device.clone(),
            what: WHOLE_STEP,
        });
    }
}

/// What whole steps are, for the log.
const WHOLE_STEP: &str = "training step with its update";

/// Captures one kind of a replica's steps on a CUDA device as CUDA graphs.
pub(crate) struct CudaCapture {
    device: CudaDevice,
    /// What the steps are, for the log.
    what: &'static str,
}

/// cudarc's event tracking paused on a device's context while a step is captured, and resumed
/// after, however the capture ends.
///
/// With tracking on (candle's default, as each device has a stream of its own), every use of a
/// buffer first makes the stream wait on the event of the buffer's last write, and records an
/// event after it. Inside a capture, the wait is on an event recorded before the capture began:
/// a dependency across the capture's boundary, which the driver refuses
/// (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`), failing every capture; and an event recorded inside
/// the capture belongs to the graph, so an eager step after it could not wait on it. A capture
/// records the work of one thread on one stream, which orders it: the events are not needed.
/// Buffers allocated under capture (the graph's) carry no events; they are used on this
/// stream only, and the graph's outputs reach other devices through copies made after it.
struct TrackingPaused {
    context: std::sync::Arc<CudaContext>,
    /// Whether tracking was on, so that it is turned back on.
    was_on: bool,
}

impl TrackingPaused {
    fn on(context: &std::sync::Arc<CudaContext>) -> Self {
        let was_on = context.is_event_tracking();
        if was_on {
            // SAFETY: while paused, only this thread queues work on the context's stream (the
            // capture lock keeps the loader's copies off it), so stream order alone orders every
            // use of a buffer; the flag is read at each use, so buffers made before the pause
            // resume their tracking after it.
            unsafe { context.disable_event_tracking() };
        }
        Self {
            context: std::sync::Arc::clone(context),
            was_on,
        }
    }
}

impl Drop for TrackingPaused {
    fn drop(&mut self) {
        if self.was_on {
            // SAFETY: turns back on what `on` turned off; buffers allocated meanwhile stay
            // untracked, which their single-stream use allows (see the type's documentation).
            unsafe { self.context.enable_event_tracking() };
        }
    }
}

/// A captured step: the graph, the batch it reads and the output it writes.
pub(crate) struct CapturedStep<O> {
    /// The batch the graph reads, each step's copied in.
    batch: Vec<Var>,
    /// What the graph writes: the step's output of the capture, at the graph's addresses.
    output: O,
    graph: Graph,
}

/// A CUDA graph, owned by one replica and launched under its schedule's lock.
struct Graph(CudaGraph);

// SAFETY: a `CudaGraph` is a graph and its executable instance, which the driver lets any
// thread use as long as no two use it at once; a `GraphSchedule` keeps it behind its mutex, so
// one thread at a time launches it, and it is dropped by whichever thread drops the replica.
unsafe impl Send for Graph {}

impl<O: GraphOutput> StepCapture<O> for CudaCapture {
    type Captured = CapturedStep<O>;

    fn warm_up(&self, batch: &Batch, eager: &dyn Fn(&Batch) -> Result<O>) -> Result<O> {
        let _cache = self.device.enable_cuda_graph_htod_cache();
        eager(batch)
    }

    fn capture(
        &self,
        batch: &Batch,
        eager: &dyn Fn(&Batch) -> Result<O>,
    ) -> std::result::Result<(CapturedStep<O>, O), String> {
        let kept: Vec<Var> = tensors(batch)
            .map(|t| {
                let kept = Var::zeros(t.shape(), t.dtype(), t.device())?;
                kept.set(t)?;
                Ok(kept)
            })
            .collect::<candle_core::Result<_>>()
            .map_err(|e| format!("copying the batch: {e}"))?;
        let on_kept = batch_like(batch, kept.iter().map(|v| v.as_tensor().clone()).collect());
        let stream = self.device.cuda_stream();
        let context = stream.context().clone();
        let _cache = self.device.enable_cuda_graph_htod_cache();
        // No other thread queues work on the stream while it is captured (the loader's copies).
        let _alone = crate::devices::stream_capture::capturing();
        let untracked = TrackingPaused::on(&context);
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("beginning the capture: {e}"))?;
        // A panic in the step still ends the capture, so that this thread's stream stays usable.
        let traced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| eager(&on_kept)));
        let ended = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        // Tracked again before anything is made outside the graph (the output's copies, which
        // may go to other devices).
        drop(untracked);
        let traced = match traced {
            Ok(traced) => traced,
            Err(panic) => {
                drop(ended);
                let _ = context.check_err();
                std::panic::resume_unwind(panic)
            }
        };
        // Errors cudarc keeps for calls that could not return one (frees, event records).
        let kept_error = context.check_err();
        let failure = match (traced, ended, kept_error) {
            (Ok(output), Ok(Some(graph)), Ok(())) => {
                let captured = CapturedStep {
                    batch: kept,
                    output,
                    graph: Graph(graph),
                };
                let launched = captured.graph.0.launch();
                return match launched.map_err(|e| e.to_string()) {
                    Ok(()) => match captured.output.copied() {
                        Ok(output) => Ok((captured, output)),
                        Err(e) => Err(format!("copying the first launch's output: {e}")),
                    },
                    Err(e) => Err(format!("the first launch failed: {e}")),
                };
            }
            (Err(e), _, _) => format!("the step failed under capture: {e}"),
            (_, Err(e), _) => format!("ending the capture: {e}"),
            (_, Ok(None), _) => "the capture recorded no graph".to_string(),
            (_, _, Err(e)) => format!("a driver call during the capture failed: {e}"),
        };
        // What the failed capture made is dropped by now; forget what its drops reported.
        let _ = context.check_err();
        Err(failure)
    }

    fn replay(&self, captured: &CapturedStep<O>, batch: &Batch) -> Result<O> {
        for (kept, t) in captured.batch.iter().zip(tensors(batch)) {
            kept.set(t)?;
        }
        captured.graph.0.launch().map_err(|e| {
            Error::Device(format!(
                "the launch of a {}'s CUDA graph failed: {e}",
                self.what
            ))
        })?;
        Ok(captured.output.copied()?)
    }

    fn fell_back(&self, reason: &str) {
        log::warn!(
            "the {} on {} could not be captured as a CUDA graph, so it runs without one: \
             {reason}",
            self.what,
            crate::devices::label(&Device::Cuda(self.device.clone()))
        );
    }
}
