//! The timed passes of one op (forward, backward, and for convolutions the backward split into
//! input and weight gradients), for kandle and for the PyTorch reference alike.

use serde_json::{json, Value};

use crate::pytorch::f64_at;

/// Where a convolution's backward split comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitSource {
    /// The op itself, run with the input's gradient on and off (its backward skips the gradient
    /// of a constant input).
    Toggled,
    /// Candle's backward ops timed one by one, because the layer computes both gradients.
    CandleOps,
}

/// A backward pass split into its input and weight gradients, in seconds.
#[derive(Debug, Clone, Copy)]
pub struct Split {
    /// The gradient of the input.
    pub input: f64,
    /// The gradients of the weight and bias.
    pub weight: f64,
    /// How the two were timed.
    pub source: SplitSource,
}

/// Median times of one op, in seconds.
#[derive(Debug, Clone, Copy)]
pub struct Passes {
    /// Forward.
    pub fwd: f64,
    /// Backward: all gradients the op has (input and parameters).
    pub bwd: f64,
    /// For convolutions: the backward split into input and weight gradients.
    pub split: Option<Split>,
}

/// One pass of an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward.
    Fwd,
    /// Backward, all gradients.
    Bwd,
    /// A convolution's input gradient.
    BwdInput,
    /// A convolution's weight (and bias) gradient.
    BwdWeight,
}

impl Pass {
    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Fwd => "fwd",
            Pass::Bwd => "bwd",
            Pass::BwdInput => "bwd-input",
            Pass::BwdWeight => "bwd-weight",
        }
    }
}

impl Passes {
    /// Seconds of `pass`, if it was timed.
    pub fn get(&self, pass: Pass) -> Option<f64> {
        match pass {
            Pass::Fwd => Some(self.fwd),
            Pass::Bwd => Some(self.bwd),
            Pass::BwdInput => self.split.map(|s| s.input),
            Pass::BwdWeight => self.split.map(|s| s.weight),
        }
    }

    /// What the op costs in a training step where its input's gradient is `needed` (it is not
    /// for the network's input): forward and backward, less the input gradient when the op skips
    /// it for a constant input.
    pub fn in_training(&self, needed: bool) -> f64 {
        let skipped = match self.split {
            Some(s) if !needed && s.source == SplitSource::Toggled => s.input,
            _ => 0.0,
        };
        self.fwd + self.bwd - skipped
    }

    /// The passes as the PyTorch script reports them (`fwd`, and `bwd` or `bwd_input` and
    /// `bwd_weight`).
    pub fn from_pytorch(v: &Value) -> Option<Self> {
        let fwd = f64_at(v, &["fwd"])?;
        let split = match (f64_at(v, &["bwd_input"]), f64_at(v, &["bwd_weight"])) {
            (Some(input), Some(weight)) => Some(Split {
                input,
                weight,
                source: SplitSource::Toggled,
            }),
            _ => None,
        };
        let bwd = match split {
            Some(s) => s.input + s.weight,
            None => f64_at(v, &["bwd"])?,
        };
        Some(Self { fwd, bwd, split })
    }

    /// For the `--json` file.
    pub fn to_json(self) -> Value {
        let mut v = json!({"fwd_s": self.fwd, "bwd_s": self.bwd});
        if let Some(s) = self.split {
            v["bwd_input_s"] = json!(s.input);
            v["bwd_weight_s"] = json!(s.weight);
            v["split"] = json!(match s.source {
                SplitSource::Toggled => "input gradient toggled",
                SplitSource::CandleOps => "candle backward ops",
            });
        }
        v
    }
}
