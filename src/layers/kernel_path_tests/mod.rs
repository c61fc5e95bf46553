//! The layers that run kandle-kernels' CPU kernels (`f32` on the CPU) against the same layers
//! on their composed path (candle's ops): BatchNorm and the pooling layers, forward, gradients
//! and moving statistics.

mod batch_norm;
mod pooling;

/// The helpers kandle-kernels' own tests use (seeded random tensors, gradients of a weighted
/// sum, closeness checks), shared with them.
#[path = "../../../kernels/src/tests/support.rs"]
mod support;
