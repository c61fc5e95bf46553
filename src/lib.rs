//! # kandle
//!
//! Keras-style training for [Candle](https://github.com/huggingface/candle): declare a
//! [`Sequential`](layers::Sequential) of layers, [`compile`](Compile::compile) it
//! with an optimizer, a loss, metrics and a [`Strategy`], then [`fit`](Model::fit),
//! [`evaluate`](Model::evaluate) and [`predict`](Model::predict).
//!
//! How the pieces connect:
//! - [`layers`]: recipes (`Conv2D`, `BatchNormalization`, `Dense`, `Concat`, ...) that are
//!   declared without input sizes and built lazily for an input shape;
//! - [`Strategy`]: where the variables live and how a training step runs across devices.
//!   [`OneDeviceStrategy`] lives here; `kandle-strategies` adds Mirrored, CentralStorage and
//!   MultiWorkerMirrored behind the same trait, so `fit` never changes;
//! - [`Model`]: the compiled model, owning the epoch loop;
//! - [`callbacks`]: progress, history, checkpoints, CSV, plots, early stopping, schedules;
//! - [`data`]: datasets, the prefetching loader and the bundled digits set.
//!
//! ```
//! use kandle::prelude::*;
//!
//! let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, 42)?;
//! let net = Sequential::new()
//!     .add(Flatten)
//!     .add(Dense::new(32))
//!     .add(Activation::Relu)
//!     .add(Dense::new(10))
//!     .add(Activation::Softmax);
//! let mut model = net.compile(
//!     Adam::new(1e-2),
//!     SparseCategoricalCrossentropy::new(),
//!     [Accuracy],
//!     &OneDeviceStrategy::cpu(),
//! )?;
//! let history = model.fit(&train, FitOptions { epochs: 3, batch_size_per_replica: 32, ..Default::default() })?;
//! assert_eq!(history.epochs, vec![0, 1, 2]);
//! let logs = model.evaluate(&test, 64)?;
//! assert!(logs.get("accuracy").unwrap_or(0.0) > 0.5);
//! # Ok::<(), kandle::Error>(())
//! ```

// The one item that needs `unsafe` (the allocator setting, `mallopt`) allows it itself, with
// its SAFETY comments; the CPU kernels' unsafe code lives in the `kandle-kernels` crate.
#![deny(unsafe_code)]

mod allocator;
pub mod callbacks;
pub mod checkpoint;
mod compute_path;
mod cross_replica;
pub mod data;
pub mod devices;
mod error;
pub mod functional;
pub mod layers;
pub mod losses;
pub mod metrics;
pub mod mixed_precision;
mod model;
mod network;
mod objective;
pub mod optimizers;
pub mod params;
pub mod preemption;
pub mod pretrained;
mod replica;
pub mod schedules;
pub mod strategy;
pub mod timeline;
pub mod training_state;

pub use allocator::keep_freed_memory;
pub use compute_path::ComputePath;
pub use error::{Error, Result};
/// The CPU kernels the layers call for `f32` tensors on the CPU (the `kandle-kernels` crate).
use kandle_kernels as kernels;
/// The vector instruction sets kandle's CPU kernels run; a cap on them (`KANDLE_MAX_SIMD`, or
/// [`SimdLevel::set_cap`]) makes a CPU with AVX-512 run the AVX2 kernels.
///
/// ```
/// use kandle::SimdLevel;
///
/// assert!(SimdLevel::in_use() <= SimdLevel::detected());
/// assert_eq!("avx2".parse::<SimdLevel>()?, SimdLevel::Avx2);
/// assert!("avx1024".parse::<SimdLevel>().is_err());
///
/// SimdLevel::Avx2.set_cap();
/// assert!(SimdLevel::in_use() <= SimdLevel::Avx2);
/// # Ok::<(), kandle::Error>(())
/// ```
pub use kandle_kernels::SimdLevel;

/// The README's code, compiled as a doc test so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
pub use losses::Loss;
pub use metrics::{Metric, Metrics};
pub use mixed_precision::{DTypePolicy, LossScale};
pub use model::{Compile, EvaluateOptions, FitOptions, Model, PredictOptions};
pub use network::Network;
pub use objective::Objective;
pub use strategy::{OneDeviceStrategy, Strategy};

/// The names most programs need, in one import.
pub mod prelude {
    pub use crate::callbacks::{Callback, History, LearningRateScheduler, Logs, Verbosity};
    pub use crate::data::{Dataset, Targets};
    pub use crate::functional::{Functional, Input, LayerCall};
    pub use crate::layers::{
        Activation, AveragePooling2D, BatchNormalization, CandleLayer, Concat, Conv2D, Dense,
        Dropout, Embedding, Flatten, GlobalAveragePooling2D, LayerSpecExt, MaxPooling2D, Padding,
        Sequential,
    };
    pub use crate::losses::{
        BinaryCrossentropy, CategoricalCrossentropy, Huber, MeanSquaredError,
        SparseCategoricalCrossentropy,
    };
    pub use crate::metrics::{Accuracy, BinaryAccuracy, TopKCategoricalAccuracy};
    pub use crate::optimizers::{Adam, AdamW, Sgd};
    pub use crate::schedules::{CosineDecay, LinearWarmup, PolynomialDecay, Schedule, StepDecay};
    pub use crate::{
        Compile, Error, EvaluateOptions, FitOptions, Loss, Metric, Metrics, Model,
        OneDeviceStrategy, PredictOptions, Result, Strategy,
    };
}
