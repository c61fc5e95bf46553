//! Custom ops kept after their forward pass, so that a caller's own backward pass (kandle's
//! recorded training forward, `Recorded`) calls their `bwd` directly instead of going through candle's
//! autograd. Applying an op this way also records it in candle's graph when an operand is a
//! variable, so the public, autograd-facing functions share the same code.

use std::sync::Arc;

use candle_core::{CustomOp1, CustomOp3, Tensor};

/// A unary op applied to `input`, with its output.
pub struct Replay1 {
    op: Arc<Box<dyn CustomOp1 + Send + Sync>>,
    input: Tensor,
    output: Tensor,
}

impl Replay1 {
    /// Applies `op` to `x`.
    pub(crate) fn apply(
        x: &Tensor,
        op: impl CustomOp1 + Send + Sync + 'static,
    ) -> candle_core::Result<Self> {
        let op: Arc<Box<dyn CustomOp1 + Send + Sync>> = Arc::new(Box::new(op));
        let output = x.apply_op1_arc(Arc::clone(&op))?;
        Ok(Self {
            op,
            input: x.clone(),
            output,
        })
    }

    /// The op's result.
    pub fn output(&self) -> &Tensor {
        &self.output
    }

    /// The gradient of the input, from the gradient of the output.
    pub fn backward(&self, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.op.bwd(&self.input, &self.output, dy)
    }
}

/// A ternary op applied to three operands, with its output.
pub struct Replay3 {
    op: Arc<Box<dyn CustomOp3 + Send + Sync>>,
    operands: [Tensor; 3],
    output: Tensor,
}

impl Replay3 {
    /// Applies `op` to `(a, b, c)`.
    pub(crate) fn apply(
        (a, b, c): (&Tensor, &Tensor, &Tensor),
        op: impl CustomOp3 + Send + Sync + 'static,
    ) -> candle_core::Result<Self> {
        let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(op));
        let output = a.apply_op3_arc(b, c, Arc::clone(&op))?;
        Ok(Self {
            op,
            operands: [a.clone(), b.clone(), c.clone()],
            output,
        })
    }

    /// The op's result.
    pub fn output(&self) -> &Tensor {
        &self.output
    }

    /// The gradients of the three operands, from the gradient of the output.
    pub fn backward(
        &self,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [a, b, c] = &self.operands;
        self.op.bwd(a, b, c, &self.output, dy)
    }
}
