//! What kandle's tests share across its crates, in one crate that is never published:
//!
//! - [`cifar10_fixture`]: a small, learnable CIFAR-10 set in the official binary format, for
//!   tests and benchmarks where the real set is not available;
//! - [`crash`]: a callback that fails one training step, for the tests of `BackupAndRestore`;
//! - [`launch`]: running programs under `mpirun` with deadlines, and reading what they print.
//!
//! `kandle`, `kandle-strategies` and `kandle-examples` take it as a dev-dependency (the
//! examples' input-pipeline benchmark uses the fixture too).

pub mod cifar10_fixture;
pub mod crash;
pub mod launch;
