//! How a replica computes gradients: kandle's own recorded backward pass
//! ([`crate::layers::Recorded`]) or candle's autograd over the whole network.
//!
//! The recorded pass is the default on the CPU, where it saves candle's zero-filled gradient
//! buffers and the extra additions into them; on other devices candle's autograd runs, whose
//! ops are the devices' own. Both give the same gradients. `KANDLE_BACKPROP=candle` in the
//! environment selects candle's autograd everywhere, to compare the two.

/// The environment variable that overrides [`Backprop::Auto`].
pub const BACKPROP_ENV: &str = "KANDLE_BACKPROP";

/// How gradients are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backprop {
    /// The recorded backward pass on the CPU, candle's autograd on other devices.
    #[default]
    Auto,
    /// Candle's autograd over the whole network, on every device.
    Candle,
}

impl Backprop {
    /// [`Backprop::Candle`] when `KANDLE_BACKPROP` is `candle`, [`Backprop::Auto`] otherwise.
    pub fn from_env() -> Self {
        match std::env::var(BACKPROP_ENV) {
            Ok(v) if v.eq_ignore_ascii_case("candle") => Backprop::Candle,
            _ => Backprop::Auto,
        }
    }

    /// Whether a replica on `device` runs the recorded backward pass.
    pub fn recorded_on(self, device: &candle_core::Device) -> bool {
        self == Backprop::Auto && device.is_cpu()
    }
}
