//! # kandle-strategies
//!
//! Distribution strategies for kandle. Each implements [`kandle::Strategy`], so switching is one
//! line and `fit` never changes:
//!
//! - [`MirroredStrategy`]: a replica per device of this process, one thread each; the global
//!   batch is split across replicas, gradients are summed as one fused buffer with the chosen
//!   [`CrossDeviceOps`], and every replica applies the same update;
//! - [`CentralStorageStrategy`]: variables and optimizer state live once on a central device;
//!   replicas compute gradients that are summed and applied there;
//! - `MultiWorkerMirroredStrategy` (the `mpi` feature): Mirrored inside each worker process
//!   launched by `mpirun`, and one all-reduce of the fused buffer across workers per step: MPI
//!   on the host, or NCCL on the GPUs with the `nccl` feature;
//! - `ParameterServerStrategy` (the `mpi` feature): variables sharded over parameter-server
//!   processes launched with the workers by `mpirun`; workers push gradients and pull weights,
//!   synchronously (one update per global batch) or asynchronously (with an optional staleness
//!   bound);
//! - [`PipelineStrategy`]: model parallelism: the model cut into stages, one per device (each
//!   stage's variables only there), every batch pipelined through them in micro-batches on a
//!   GPipe or 1F1B [`pipeline::Schedule`].
//!
//! Every strategy trains as one device would at the same global batch (for models without
//! per-replica batch statistics, or with `sync_batch_norm`), reports metrics summed over all
//! replicas, and writes checkpoints with the same names as one device. Mirrored, CentralStorage
//! and MultiWorkerMirrored run their replicas with the same [`ReplicaOptions`] (SyncBatchNorm,
//! the timeout, threads per replica), built with its own builder methods and given to each
//! strategy with `with_options`.
//!
//! ```
//! use kandle::prelude::*;
//! use kandle_strategies::MirroredStrategy;
//!
//! let strategy = MirroredStrategy::cpu(2)?; // the one line that changes
//! let net = Sequential::new().add(Flatten).add(Dense::new(10)).add(Activation::Softmax);
//! let mut model = net.compile(Sgd::new(0.1), SparseCategoricalCrossentropy::new(), [Accuracy], &strategy)?;
//! let (train, _) = kandle::data::digits::load()?.train_test_split(0.9, 0)?;
//! let history = model.fit(&train, FitOptions { batch_size_per_replica: 16, verbosity: Verbosity::Silent, ..Default::default() })?;
//! assert_eq!(history.epochs, vec![0]);
//! # Ok::<(), kandle::Error>(())
//! ```

mod bucket_exchange;
mod central_storage;
mod cross_device_ops;
mod mirrored;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
mod multi_worker;
mod nccl;
#[cfg(feature = "mpi")]
pub mod parameter_server;
pub mod partition;
pub mod pipeline;
mod rendezvous;
mod replica_pool;
mod replica_set;

pub use central_storage::CentralStorageStrategy;
pub use cross_device_ops::CrossDeviceOps;
pub use mirrored::MirroredStrategy;
#[cfg(feature = "mpi")]
pub use multi_worker::{CommunicationImplementation, MultiWorkerMirroredStrategy};
#[cfg(feature = "mpi")]
pub use parameter_server::ParameterServerStrategy;
pub use pipeline::PipelineStrategy;
pub use replica_pool::ReplicaThreads;
pub use replica_set::{ReplicaOptions, DEFAULT_BUCKET_BYTES};
