//! The layers that run kandle-kernels' CPU kernels (`f32` on the CPU) against the same layers
//! on their composed path (candle's ops): BatchNorm and the pooling layers, forward, gradients
//! and moving statistics.

mod batch_norm;
mod pooling;

use kandle_kernels::test_support as support;
