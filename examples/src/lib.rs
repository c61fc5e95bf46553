//! Shared helpers for the example binaries.
