//! A replica's training step as a CUDA graph ([`crate::devices::set_cuda_graphs`], or
//! `KANDLE_CUDA_GRAPHS=1`): the forward pass, the loss, the recorded backward pass and the step
//! buffer, captured once the batch's shapes have repeated and replayed as one launch per step,
//! as PyTorch's `torch.cuda.graphs` and `torch.compile(mode="reduce-overhead")` do. A step of
//! hundreds of small kernels costs the host one launch instead of hundreds.
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
//!   graph, runs eagerly on them under stream capture (thread-local mode), instantiates the
//!   graph (its memory freed and mapped again at each launch, at the same addresses) and
//!   launches it. The step's outputs (the fused buffer, the moving statistics before the pass)
//!   stay the graph's: each replay writes them again.
//! - **Replay**: a step of the captured shapes copies its batch into the kept tensors and
//!   launches the graph; one of other shapes (the short last batch of an epoch) runs eagerly.
//!   Everything a step changes lives on the device and is changed in place (the moving
//!   statistics, dropout's generator position), so each replay is the next step; the loss
//!   scale is read from its variable on the device, and the learning rate only by the final
//!   phase (the optimizer's update), which runs outside the graph.
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
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{Device, Tensor, Var};

use super::graph_schedule::{batch_like, tensors, StepCapture};
#[cfg(doc)]
use super::graph_schedule::{GraphSchedule, WARMUP_STEPS};
use super::StepBuffer;
use crate::data::Batch;
use crate::{Error, Result};

/// Captures a replica's steps on a CUDA device as CUDA graphs.
pub(crate) struct CudaCapture {
    device: CudaDevice,
}

impl CudaCapture {
    /// Captures on `device`, candle's stream of the calling thread.
    pub(crate) fn new(device: &CudaDevice) -> Self {
        Self {
            device: device.clone(),
        }
    }
}

/// A captured step: the graph, the batch it reads and the outputs it writes.
pub(crate) struct CapturedStep {
    /// The batch the graph reads, each step's copied in.
    batch: Vec<Var>,
    /// What the graph writes: the step's outputs of the capture, at the graph's addresses.
    fused: Tensor,
    statistics_before: Vec<Tensor>,
    graph: Graph,
}

/// A CUDA graph, owned by one replica and launched under its schedule's lock.
struct Graph(CudaGraph);

// SAFETY: a `CudaGraph` is a graph and its executable instance, which the driver lets any
// thread use as long as no two use it at once; a `GraphSchedule` keeps it behind its mutex, so
// one thread at a time launches it, and it is dropped by whichever thread drops the replica.
unsafe impl Send for Graph {}

impl CapturedStep {
    /// The step buffer the last launch wrote.
    fn buffer(&self) -> StepBuffer {
        StepBuffer {
            fused: self.fused.clone(),
            grads_reduced: false,
            statistics_before: self.statistics_before.clone(),
        }
    }
}

impl StepCapture for CudaCapture {
    type Captured = CapturedStep;

    fn warm_up(
        &self,
        batch: &Batch,
        eager: &dyn Fn(&Batch) -> Result<StepBuffer>,
    ) -> Result<StepBuffer> {
        let _cache = self.device.enable_cuda_graph_htod_cache();
        eager(batch)
    }

    fn capture(
        &self,
        batch: &Batch,
        eager: &dyn Fn(&Batch) -> Result<StepBuffer>,
    ) -> std::result::Result<(CapturedStep, StepBuffer), String> {
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
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("beginning the capture: {e}"))?;
        let traced = eager(&on_kept);
        let ended = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        // Errors cudarc keeps for calls that could not return one (frees, event records).
        let kept_error = context.check_err();
        let failure = match (traced, ended, kept_error) {
            (Ok(buffer), Ok(Some(graph)), Ok(())) => {
                let captured = CapturedStep {
                    batch: kept,
                    fused: buffer.fused,
                    statistics_before: buffer.statistics_before,
                    graph: Graph(graph),
                };
                return match captured.graph.0.launch() {
                    Ok(()) => {
                        let buffer = captured.buffer();
                        Ok((captured, buffer))
                    }
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

    fn replay(&self, captured: &CapturedStep, batch: &Batch) -> Result<StepBuffer> {
        for (kept, t) in captured.batch.iter().zip(tensors(batch)) {
            kept.set(t)?;
        }
        captured.graph.0.launch().map_err(|e| {
            Error::Device(format!(
                "the launch of a training step's CUDA graph failed: {e}"
            ))
        })?;
        Ok(captured.buffer())
    }

    fn fell_back(&self, reason: &str) {
        log::warn!(
            "the training step on {} could not be captured as a CUDA graph, so it runs without \
             one: {reason}",
            crate::devices::label(&Device::Cuda(self.device.clone()))
        );
    }
}
