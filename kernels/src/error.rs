//! The crate's error type: an input the kernels cannot take, or an error from candle.

/// What went wrong in a kernel call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation inside candle failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// Inputs or options the kernel cannot take: a shape, dtype, device or window that does
    /// not fit, or a name that is not a [`SimdLevel`](crate::SimdLevel). The message names the
    /// op and what it got.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

/// `Result` with the kernels' [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::InvalidInput`] from anything printable.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidInput(msg.into())
    }
}
