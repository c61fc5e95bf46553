//! Fused BatchNorm on the CPU: one pass for the statistics, one for the normalisation.
