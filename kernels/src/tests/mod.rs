//! The CPU kernels against candle's own ops and autograd: forward values and gradients over
//! seeded random shapes, for every kernel and both vector widths this CPU has.

mod batch_norm;
mod concat;
mod conv2d;
mod pooling;

use crate::test_support as support;
