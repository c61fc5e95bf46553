//! Max and average pooling on the CPU with dedicated backward passes.
