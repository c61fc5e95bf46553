//! Convolution as GEMM on the CPU: forward, backward-input and backward-weight.
