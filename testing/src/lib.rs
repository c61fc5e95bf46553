//! What kandle's tests share across its crates, in one crate that is never published:
//!
//! - [`cifar10_fixture`]: a small, learnable CIFAR-10 set in the official binary format, for
//!   tests and benchmarks where the real set is not available;
//! - [`crash`]: callbacks that fail one training step or raise a stop signal at one, for the
//!   tests of `BackupAndRestore` and preemption;
//! - [`launch`]: running programs under `mpirun` with deadlines, and reading what they print;
//! - [`random`]: seeded random tensors, the same on every run and machine;
//! - [`strategies`]: the strategy tests' equivalence run, the steps of a resumed run, and
//!   comparing weights with one device's within the float32 spread of an equivalent ordering;
//! - [`tensorboard`]: reading TensorBoard event files back, independently of kandle's writer;
//! - [`webp`]: a one-colour lossless WebP file, which the `image` crate cannot write.
//!
//! With the `mpi` feature it also builds the programs the MPI tests (`tests/`) launch under
//! `mpirun`: `kandle-mpi-check` (multi-worker) and `kandle-ps-check` (parameter servers), test
//! programs rather than binaries of `kandle-strategies`.
//!
//! `kandle` and `kandle-strategies` take it as a dev-dependency, `kandle-examples` as a
//! dependency (its input-pipeline benchmark writes the fixture).

pub mod cifar10_fixture;
pub mod crash;
pub mod launch;
pub mod random;
pub mod strategies;
pub mod tensorboard;
pub mod webp;
