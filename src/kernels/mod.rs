//! Fast CPU kernels for the layers' hot paths, as candle custom ops with their backward
//! registered, so autograd uses them unchanged.
//!
//! Candle composes convolution backward, BatchNorm and overlapping pooling from many small
//! generic ops; on the CPU that is an order of magnitude slower than a framework's dedicated
//! kernels. The layers call these kernels whenever their tensors are `f32` on the CPU and fall
//! back to candle's ops everywhere else (CUDA, other dtypes), so results agree across devices.
//!
//! Every kernel is tested against candle's reference ops, forward and gradients. The layers'
//! recorded training forward ([`crate::layers::Recorded`]) keeps the ops it applies
//! (`replay`) and calls their backward passes directly.

pub mod batch_norm;
pub mod concat;
pub mod conv2d;
pub mod pooling;

mod output;
mod planes;
pub(crate) mod replay;
pub(crate) mod simd;
#[cfg(test)]
mod tests;
mod two_pass;

/// How many times, on this thread, kandle's kernels have read a tensor's data: the count grows
/// with every kernel run, forward or backward, that this thread starts. Tests read it to check that
/// a network built for [`ComputePath::DeviceGeneric`](crate::ComputePath::DeviceGeneric) runs
/// no kernel.
#[cfg(test)]
pub(crate) fn data_reads() -> usize {
    planes::data_reads()
}
