//! The crate's one error type.
//!
//! Every fallible function in `kandle` returns [`Result`]. Variants carry enough context to act
//! on: a shape error names the layer and both shapes, an I/O error names the file, a checkpoint
//! error names the tensors that did not match.
//!
//! [`Error`] is `Clone`, so that one failure can be handed to every party that must hear of it
//! (the ranks of a distributed job, the replicas of a step): the sources that are not `Clone`
//! themselves (Candle's errors, I/O errors) are shared behind an [`Arc`].

use std::path::PathBuf;
use std::sync::Arc;

/// What went wrong.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation inside Candle failed.
    #[error(transparent)]
    Candle(Arc<candle_core::Error>),

    /// A layer received an input whose shape it cannot take.
    #[error("layer `{layer}` expected input of shape {expected} but got {got}")]
    Shape {
        /// The layer's name.
        layer: String,
        /// What the layer accepts, e.g. `(batch, 3, H, W)`.
        expected: String,
        /// What it received.
        got: String,
    },

    /// Inputs, labels or options that cannot be used together.
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// A dataset with no samples where samples are needed.
    #[error("dataset `{0}` is empty")]
    EmptyDataset(String),

    /// Reading or writing a file failed.
    #[error("{action} `{path}`: {source}")]
    Io {
        /// What was being done, e.g. "cannot write checkpoint".
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: Arc<std::io::Error>,
    },

    /// A checkpoint that cannot be read or does not fit the model.
    #[error("checkpoint `{path}`: {reason}")]
    Checkpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A dataset file that is missing, truncated or malformed.
    #[error("dataset `{path}`: {reason}")]
    Data {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A device that does not exist or cannot be used.
    #[error("device: {0}")]
    Device(String),

    /// A replica or worker failed or stopped answering during a distributed step.
    #[error("{replica}: {reason}")]
    Replica {
        /// Which replica or worker, e.g. `worker 1` or `replica 0 (cuda:0)`.
        replica: String,
        /// What happened.
        reason: String,
    },

    /// A device ran out of memory during a step: the batch does not fit it.
    #[error(
        "out of memory on {device} with a batch of {samples} samples on it ({reason}): train \
         with a smaller batch_size_per_replica, under mixed precision, or on more replicas"
    )]
    OutOfMemory {
        /// The device, e.g. `cuda:0`.
        device: String,
        /// The samples of the batch (or of the replica's part of it) on that device.
        samples: usize,
        /// The failure as the device's library reported it.
        reason: String,
    },

    /// The model was used before it was built or compiled.
    #[error("model not ready: {0}")]
    NotReady(String),

    /// Drawing a plot failed.
    #[error("plot `{path}`: {reason}")]
    Plot {
        /// The image file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// `Result` with kandle's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl From<candle_core::Error> for Error {
    fn from(error: candle_core::Error) -> Self {
        Error::Candle(Arc::new(error))
    }
}

impl Error {
    /// An [`Error::InvalidInput`] from anything printable.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidInput(msg.into())
    }

    /// Whether this is a device's memory running out: CUDA's `OUT_OF_MEMORY`, an allocation
    /// that cuDNN or cuBLAS reports failed (`ALLOC_FAILED`), or an [`Error::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        if matches!(self, Error::OutOfMemory { .. }) {
            return true;
        }
        let text = self.to_string();
        ["OUT_OF_MEMORY", "ALLOC_FAILED", "cudaErrorMemoryAllocation"]
            .iter()
            .any(|mark| text.contains(mark))
    }

    /// This error as an [`Error::OutOfMemory`] on `device` with a batch of `samples` when it is
    /// a device's memory running out ([`Self::is_out_of_memory`]); otherwise itself.
    ///
    /// ```
    /// let oom = candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
    /// let err = kandle::Error::from(oom).out_of_memory_on("cuda:0", 256);
    /// assert!(err.to_string().starts_with("out of memory on cuda:0 with a batch of 256 samples"));
    /// let other = kandle::Error::invalid("no labels").out_of_memory_on("cuda:0", 256);
    /// assert_eq!(other.to_string(), "invalid input: no labels");
    /// ```
    pub fn out_of_memory_on(self, device: &str, samples: usize) -> Self {
        if matches!(self, Error::OutOfMemory { .. }) || !self.is_out_of_memory() {
            return self;
        }
        Error::OutOfMemory {
            device: device.to_string(),
            samples,
            reason: self.to_string(),
        }
    }

    /// An [`Error::Io`] for `path`.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source: Arc::new(source),
        }
    }
}

/// The CPU kernels' errors, as kandle reports them: the same variant, the same message.
impl From<kandle_kernels::Error> for Error {
    fn from(e: kandle_kernels::Error) -> Self {
        match e {
            kandle_kernels::Error::Candle(e) => Error::Candle(Arc::new(e)),
            kandle_kernels::Error::InvalidInput(msg) => Error::InvalidInput(msg),
            other => Error::InvalidInput(other.to_string()),
        }
    }
}

/// Formats a shape with the batch dimension shown as `batch`, as in error messages.
pub(crate) fn shape_with_batch(dims: &[usize]) -> String {
    let inner: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    if inner.is_empty() {
        "(batch,)".to_string()
    } else {
        format!("(batch, {})", inner.join(", "))
    }
}
/// The message of a caught panic payload (`&str` or `String`), for error reports.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CUDA's, cuDNN's and cuBLAS's allocation failures read as a device's memory running out;
    /// other errors, and errors about memory that are not allocation failures, do not.
    #[test]
    fn allocation_failures_are_out_of_memory_and_name_the_batch() {
        for text in [
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "cuDNN: CUDNN_STATUS_ALLOC_FAILED",
            "cublas error: CUBLAS_STATUS_ALLOC_FAILED",
        ] {
            let err = Error::from(candle_core::Error::Msg(text.into()));
            assert!(err.is_out_of_memory(), "{text}");
            let named = err.out_of_memory_on("cuda:1", 512);
            assert!(matches!(
                &named,
                Error::OutOfMemory { device, samples: 512, reason } if device == "cuda:1" && reason.contains(text)
            ));
            // Naming it again keeps the first device and batch.
            let again = named.clone().out_of_memory_on("cuda:0", 256);
            assert_eq!(again.to_string(), named.to_string());
        }
        for text in ["CUDA_ERROR_ILLEGAL_ADDRESS", "misaligned memory access"] {
            let err = Error::from(candle_core::Error::Msg(text.into()));
            assert!(!err.is_out_of_memory(), "{text}");
            assert!(matches!(
                err.out_of_memory_on("cuda:0", 8),
                Error::Candle(_)
            ));
        }
    }

    /// A copy keeps the variant and the message; the sources shared behind an `Arc` read as
    /// before.
    #[test]
    fn copies_keep_the_variant_and_the_message() {
        let io = Error::io(
            "cannot read checkpoint",
            "w.safetensors",
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        );
        assert_eq!(
            io.to_string(),
            "cannot read checkpoint `w.safetensors`: no such file"
        );
        assert!(std::error::Error::source(&io).is_some());
        let candle = Error::from(candle_core::Error::Msg("bad shape".into()));
        assert_eq!(
            candle.to_string(),
            candle_core::Error::Msg("bad shape".into()).to_string()
        );
        let replica = Error::Replica {
            replica: "worker 1".into(),
            reason: "stalled".into(),
        };
        for error in [io, candle, replica, Error::invalid("no labels")] {
            let copy = error.clone();
            assert_eq!(copy.to_string(), error.to_string());
            assert_eq!(
                std::mem::discriminant(&copy),
                std::mem::discriminant(&error)
            );
        }
    }
}
