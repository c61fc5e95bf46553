//! Mixed precision: the dtype policy a model computes in (Keras's `float32`, `mixed_float16`,
//! `mixed_bfloat16`) and the dynamic loss scale that keeps float16 gradients from underflowing.
//!
//! Under a mixed policy, variables, optimizer state, batch-norm statistics, the loss and the
//! final softmax stay `float32`; convolutions and dense layers compute in the policy's dtype
//! on the device-generic path (what CUDA runs: each casts its input and its variables, and
//! candle's autograd casts the gradients back to `float32`; kandle's CUDA batch norm takes
//! half-precision activations and keeps its statistics in `float32`). kandle's CPU kernels stay
//! `float32`, so on the CPU's default path a mixed policy changes only the loss scaling.
//!
//! The loss scale is Keras's `LossScaleOptimizer`'s: the loss is multiplied by the scale
//! before the backward pass and the gradients divided by it after, on every replica; a step
//! whose scaled gradients are not finite is skipped (weights unchanged) and halves the scale;
//! after [`LossScale::growth_steps`] applied steps in a row it doubles. Every replica and
//! worker reads the same step totals and so keeps the same scale; it is a variable of the
//! model (`loss_scale`: the scale and the count of applied steps since it last changed), saved
//! with the weights, in training states and in backups.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor, Var};

use crate::params::Param;
use crate::{ComputePath, Error, Result};

/// The name of the loss-scale variable in a model's weights.
pub const LOSS_SCALE: &str = "loss_scale";

/// The dtypes a model computes in: Keras's `keras.mixed_precision.Policy`.
///
/// ```
/// use candle_core::DType;
/// use kandle::DTypePolicy;
///
/// let policy: DTypePolicy = "mixed_float16".parse()?;
/// assert_eq!(policy.compute_dtype(), DType::F16);
/// assert_eq!(policy.variable_dtype(), DType::F32);
/// assert!(policy.loss_scale().is_some());
/// assert!(DTypePolicy::mixed_bfloat16().loss_scale().is_none());
/// assert_eq!(DTypePolicy::default().to_string(), "float32");
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DTypePolicy {
    compute: DType,
    loss_scale: Option<LossScale>,
}

impl Default for DTypePolicy {
    /// `float32`.
    fn default() -> Self {
        Self::float32()
    }
}

impl DTypePolicy {
    /// Everything in `float32` (the default).
    pub fn float32() -> Self {
        Self {
            compute: DType::F32,
            loss_scale: None,
        }
    }

    /// Computes in `float16` with `float32` variables, and a dynamic loss scale
    /// ([`LossScale::default`]).
    pub fn mixed_float16() -> Self {
        Self {
            compute: DType::F16,
            loss_scale: Some(LossScale::default()),
        }
    }

    /// Computes in `bfloat16` with `float32` variables; `bfloat16` has `float32`'s range, so
    /// no loss scale.
    pub fn mixed_bfloat16() -> Self {
        Self {
            compute: DType::BF16,
            loss_scale: None,
        }
    }

    /// The same policy with another loss scale (`None`: no loss scaling).
    pub fn with_loss_scale(mut self, loss_scale: Option<LossScale>) -> Self {
        self.loss_scale = loss_scale;
        self
    }

    /// The dtype layers compute in.
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// The dtype variables are kept in: always `float32`.
    pub fn variable_dtype(&self) -> DType {
        DType::F32
    }

    /// The dynamic loss scale, if the policy scales the loss.
    pub fn loss_scale(&self) -> Option<LossScale> {
        self.loss_scale
    }

    /// Whether layers compute in another dtype than their variables'.
    pub fn is_mixed(&self) -> bool {
        self.compute != DType::F32
    }

    /// The dtype the layers of a network built for `path` on `device` compute in: the policy's
    /// on the device-generic path, `float32` where kandle's CPU kernels run.
    pub fn compute_dtype_on(&self, path: ComputePath, device: &Device) -> DType {
        if path.uses_kernels() && device.is_cpu() {
            DType::F32
        } else {
            self.compute
        }
    }

    /// Checks that candle runs what a network needs in the compute dtype on `device` (a
    /// matrix product and a convolution), so that a policy the device cannot run fails when
    /// the model is built, naming the op and the dtype.
    pub fn check_on(&self, path: ComputePath, device: &Device) -> Result<()> {
        let dtype = self.compute_dtype_on(path, device);
        if dtype == DType::F32 {
            return Ok(());
        }
        let unsupported = |op: &str, e: candle_core::Error| {
            // The first line: candle's message without its backtrace.
            let e = e.to_string();
            let reason = e.lines().next().unwrap_or_default();
            Error::invalid(format!(
                "dtype policy {self}: candle cannot run {op} in {dtype:?} on {device:?} \
                 ({reason}); use float32 there, or mixed precision on a GPU"
            ))
        };
        let a = Tensor::ones((2, 2), dtype, device).map_err(|e| unsupported("ones", e))?;
        a.matmul(&a).map_err(|e| unsupported("matmul", e))?;
        let x = Tensor::ones((1, 1, 3, 3), dtype, device).map_err(|e| unsupported("ones", e))?;
        let w = Tensor::ones((1, 1, 2, 2), dtype, device).map_err(|e| unsupported("ones", e))?;
        x.conv2d(&w, 0, 1, 1, 1)
            .map_err(|e| unsupported("conv2d", e))?;
        Ok(())
    }
}

impl fmt::Display for DTypePolicy {
    /// Keras's name: `float32`, `mixed_float16` or `mixed_bfloat16`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.compute {
            DType::F16 => "mixed_float16",
            DType::BF16 => "mixed_bfloat16",
            _ => "float32",
        })
    }
}

impl FromStr for DTypePolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "float32" => Ok(Self::float32()),
            "mixed_float16" => Ok(Self::mixed_float16()),
            "mixed_bfloat16" => Ok(Self::mixed_bfloat16()),
            other => Err(Error::invalid(format!(
                "unknown dtype policy `{other}`: expected float32, mixed_float16 or \
                 mixed_bfloat16"
            ))),
        }
    }
}

/// A dynamic loss scale, as Keras's `LossScaleOptimizer`: it starts at `initial`, halves when
/// a step's gradients are not finite (the step is skipped), and doubles after `growth_steps`
/// applied steps in a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// The scale the first step uses (Keras: 2^15).
    pub initial: f64,
    /// Applied steps in a row after which the scale doubles (Keras: 2,000).
    pub growth_steps: usize,
}

impl Default for LossScale {
    fn default() -> Self {
        Self {
            initial: 32768.0,
            growth_steps: 2000,
        }
    }
}

impl LossScale {
    /// The model variable holding this scale's state, [`LOSS_SCALE`]: the scale, starting at
    /// [`Self::initial`], and the count of applied steps since it last changed.
    pub(crate) fn param(&self, device: &Device) -> Result<Param> {
        let value = Tensor::new(&[self.initial as f32, 0.0], device)?;
        Ok(Param {
            name: LOSS_SCALE.into(),
            var: Var::from_tensor(&value)?,
            trainable: false,
            statistic: false,
            generator: true,
        })
    }

    /// Moves `var`, a [`Self::param`], on after a step of `samples` samples that `applied` or
    /// was skipped: a step without samples changes nothing.
    pub(crate) fn update(&self, var: &Var, samples: usize, applied: bool) -> Result<()> {
        if samples == 0 {
            return Ok(());
        }
        let state = var.as_tensor().to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let (scale, good) = self.next((state[0], state[1]), applied);
        var.set(&Tensor::new(&[scale as f32, good as f32], var.device())?)?;
        Ok(())
    }

    /// The state after a step that had samples: `(scale, applied steps since the last
    /// change)`, from the state before it and whether it applied.
    pub fn next(&self, (scale, good): (f64, f64), applied: bool) -> (f64, f64) {
        if !applied {
            ((scale / 2.0).max(1.0), 0.0)
        } else if good + 1.0 >= self.growth_steps as f64 {
            (scale * 2.0, 0.0)
        } else {
            (scale, good + 1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_halves_on_overflow_and_doubles_after_its_growth_steps() {
        let scale = LossScale {
            initial: 8.0,
            growth_steps: 3,
        };
        let mut state = (scale.initial, 0.0);
        state = scale.next(state, false);
        assert_eq!(state, (4.0, 0.0));
        state = scale.next(state, true);
        state = scale.next(state, true);
        assert_eq!(state, (4.0, 2.0));
        state = scale.next(state, true);
        assert_eq!(state, (8.0, 0.0));
        assert_eq!(scale.next((1.0, 5.0), false), (1.0, 0.0), "never below 1");
    }

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() -> Result<()> {
        for name in ["float32", "mixed_float16", "mixed_bfloat16"] {
            assert_eq!(name.parse::<DTypePolicy>()?.to_string(), name);
        }
        let err = "float16"
            .parse::<DTypePolicy>()
            .expect_err("not a policy")
            .to_string();
        assert!(
            err.contains("float16") && err.contains("mixed_float16"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn kernels_keep_float32_and_the_device_generic_path_takes_the_policy() {
        let policy = DTypePolicy::mixed_float16();
        assert_eq!(
            policy.compute_dtype_on(ComputePath::Auto, &Device::Cpu),
            DType::F32
        );
        assert_eq!(
            policy.compute_dtype_on(ComputePath::DeviceGeneric, &Device::Cpu),
            DType::F16
        );
    }
}
