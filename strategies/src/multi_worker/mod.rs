//! Multi-worker training over MPI (the `mpi` feature): [`MultiWorkerMirroredStrategy`].
//!
//! Worker processes are launched by `mpirun -n W <binary>`; each runs the same program, reads
//! its shard of every global batch, and trains a Mirrored set of local replicas. Per step, the
//! local replicas' fused buffers `[gradients, loss and metric sums, sample count, moving
//! statistics]` are summed across every replica of every worker with one all-reduce: in process
//! and then with `MPI_Allreduce` on the host, or all at once with NCCL on the GPUs.
//!
//! Every collective is guarded by the shared [`mpi`](crate::mpi) module: its world (one per
//! process, shared with the parameter servers) and its watchdog, which makes a dead or stalled
//! worker fail the others within the timeout, with an error naming it.
//!
//! - [`strategy`]: the strategy and the model it distributes;
//! - [`communication`]: which library carries the fused buffer between workers;
//! - `nccl` (feature `nccl`): the NCCL communicators that join every GPU of every worker, with
//!   the unique id broadcast over MPI as Horovod does, and the guarded all-reduce over them;
//! - [`sync_batch_norm`]: SyncBatchNorm's statistics summed across workers over MPI;
//! - [`gradient_buckets`]: over MPI, the gradients summed across workers in buckets while the
//!   backward passes go on.
//!
//! CPU tensors cross processes through MPI on the host; GPU replicas in a build with `nccl` sum
//! their buffers with one NCCL all-reduce on the GPUs, with no host staging.

mod communication;
mod gradient_buckets;
#[cfg(feature = "nccl")]
mod nccl;
mod strategy;
mod sync_batch_norm;

pub use communication::CommunicationImplementation;
pub use strategy::MultiWorkerMirroredStrategy;
