//! Multi-worker training over MPI (the `mpi` feature): [`MultiWorkerMirroredStrategy`].
//!
//! Worker processes are launched by `mpirun -n W <binary>`; each runs the same program, reads
//! its shard of every global batch, and trains a Mirrored set of local replicas. Per step, the
//! local replicas' fused buffers `[gradients, loss and metric sums, sample count, moving
//! statistics]` are summed in-process, then across workers with one `MPI_Allreduce` on the host.
//!
//! - [`world`]: MPI initialisation (once per process), rank and size, and the guarded
//!   collectives (all-reduce and broadcast of `f32` buffers);
//! - [`watchdog`]: the heartbeat protocol that makes a dead or stalled worker fail the others
//!   within the timeout, with an error naming it;
//! - [`strategy`]: the strategy and the model it distributes.
//!
//! CPU tensors cross processes through MPI. GPU tensors would go through NCCL with the unique
//! id broadcast over MPI, as Horovod does; that path is not built yet, so CUDA replicas are
//! copied to the host for the MPI all-reduce.

mod strategy;
mod watchdog;
mod world;

pub use strategy::MultiWorkerMirroredStrategy;
