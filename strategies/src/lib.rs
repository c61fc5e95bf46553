//! # kandle-strategies
//!
//! Distribution strategies for kandle, implementing [`kandle::Strategy`]: the model is
//! replicated across devices (and hosts), every replica takes a slice of each global batch,
//! and gradients are reduced so that training matches one device at the same global batch.
