//! # kandle-kernels
//!
//! Fast CPU kernels for the hot paths of [kandle](https://github.com/kandle-rs/kandle)'s layers,
//! as candle custom ops with their backward registered, so autograd uses them unchanged:
//! convolution ([`conv2d`]), batch normalisation ([`batch_norm`]), pooling ([`pooling`]),
//! concatenation along channels ([`concat`](mod@concat)) and the ReLU ([`relu`](mod@relu)),
//! and optimizers' updates in place ([`optimizer`]).
//!
//! Candle composes convolution backward, BatchNorm and overlapping pooling from many small
//! generic ops; on the CPU that is an order of magnitude slower than a framework's dedicated
//! kernels. kandle's layers call these kernels whenever their tensors are `f32` on the CPU and
//! fall back to candle's ops everywhere else (CUDA, other dtypes), so results agree across
//! devices.
//!
//! Every kernel is tested against candle's reference ops, forward and gradients. A caller that
//! runs its own backward pass (kandle's recorded training forward) keeps the ops it applies
//! ([`replay`]) and calls their backward passes directly. [`SimdLevel`] names the vector
//! instruction sets the kernels run and caps them. How the kernels work and how fast they are:
//! the crate's `README.md`.
//!
//! With the `cuda` feature, [`cuda`] runs batch normalisation and pooling on CUDA devices on
//! kandle's own kernels (CUDA C compiled at run time with NVRTC), and with `cudnn` also
//! convolutions through cuDNN (forward, input and kernel gradients), all as custom ops on
//! candle's own device and stream, with a per-device cache of cuDNN's handle, searched
//! algorithms and workspace.
//!
//! Unsafe code is confined to the modules that need it (vector intrinsics, writes into memory
//! not zeroed first), each of which allows it and gives every `unsafe` block a `SAFETY` comment;
//! the crate denies it everywhere else.

#![deny(unsafe_code)]

pub mod batch_norm;
pub mod concat;
pub mod conv2d;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dropout;
mod error;
pub mod optimizer;
pub mod pooling;
pub mod relu;
pub mod replay;

mod output;
mod philox;
mod planes;
mod simd;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
mod two_pass;

pub use error::{Error, Result};
pub use simd::SimdLevel;

/// How many times, on this thread, the kernels have read a tensor's data: the count grows with
/// every kernel run, forward or backward, that this thread starts. Tests read it to check that
/// code meant to run no kernel (kandle's device-generic compute path) runs none. Only with the
/// `test-support` feature.
#[cfg(feature = "test-support")]
pub fn data_reads() -> usize {
    planes::data_reads()
}
