//! Stochastic gradient descent's update of one `f32` CPU variable, in place (see the module
//! [`super`]): its momentum buffer in one pass ([`Momentum`]), the variable in another
//! ([`Descent`]), bit for bit kandle's `Sgd` composed of candle's ops.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use kandle_kernels::optimizer::sgd::{Descent, Momentum};
//!
//! let device = Device::Cpu;
//! let p = Tensor::new(&[1f32, -2.0], &device)?;
//! let g = Tensor::new(&[0.5f32, 0.25], &device)?;
//! let buf = Tensor::new(&[0.1f32, 0.0], &device)?;
//! let (momentum, weight_decay) = (0.9, 0.0);
//! buf.inplace_op3(&g, &p, &Momentum { momentum, weight_decay })?; // buf = 0.9 buf + g
//! let step = Descent { learning_rate: 0.1, momentum, nesterov: false, weight_decay };
//! p.inplace_op3(&buf, &g, &step)?; // p -= 0.1 buf
//! assert_eq!(p.to_vec1::<f32>()?, [1.0 - 0.1 * (0.9 * 0.1 + 0.5), -2.0 - 0.1 * 0.25]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{CpuStorage, InplaceOp3, Layout};

use super::{same_lengths, values, values_mut, zip3};

/// `buf = mu * buf + g`, where `g` is the gradient plus `weight_decay * p` when the decay is
/// not zero: applied to the buffer with `(gradient, variable)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Momentum {
    /// The momentum factor `mu`.
    pub momentum: f64,
    /// L2 weight decay.
    pub weight_decay: f64,
}

/// `p = p - lr * d`: applied to the variable with `(buffer, gradient)`, where `d` is the
/// buffer (plain momentum), `g + mu * buf` (Nesterov), or `g` without momentum (the buffer
/// operand is then not read: pass the gradient twice), `g` being the gradient plus
/// `weight_decay * p`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Descent {
    /// The learning rate `lr`.
    pub learning_rate: f64,
    /// The momentum factor `mu`; 0 for none.
    pub momentum: f64,
    /// Whether the momentum is Nesterov's.
    pub nesterov: bool,
    /// L2 weight decay.
    pub weight_decay: f64,
}

/// The gradient with the weight decay added, as candle's `p * wd + g` computes it.
#[inline(always)]
fn decayed(g: f32, p: f32, wd: f32) -> f32 {
    if wd != 0.0 {
        (p * wd + 0.0) + g
    } else {
        g
    }
}

impl InplaceOp3 for Momentum {
    fn name(&self) -> &'static str {
        "sgd-momentum"
    }

    fn cpu_fwd(
        &self,
        buf: &mut CpuStorage,
        buf_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
        p: &CpuStorage,
        p_l: &Layout,
    ) -> candle_core::Result<()> {
        let name = InplaceOp3::name(self);
        let buf = values_mut(name, buf, buf_l)?;
        let (g, p) = (values(name, g, g_l)?, values(name, p, p_l)?);
        same_lengths(name, [buf.len(), g.len(), p.len()])?;
        let (mu, wd) = (self.momentum as f32, self.weight_decay as f32);
        zip3(buf, (g, p), |buf, g, p| {
            for ((b, &g), &p) in buf.iter_mut().zip(g).zip(p) {
                *b = (*b * mu + 0.0) + decayed(g, p, wd);
            }
        });
        Ok(())
    }
}

impl InplaceOp3 for Descent {
    fn name(&self) -> &'static str {
        "sgd-descent"
    }

    fn cpu_fwd(
        &self,
        p: &mut CpuStorage,
        p_l: &Layout,
        buf: &CpuStorage,
        buf_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        let name = InplaceOp3::name(self);
        let p = values_mut(name, p, p_l)?;
        let (buf, g) = (values(name, buf, buf_l)?, values(name, g, g_l)?);
        same_lengths(name, [p.len(), buf.len(), g.len()])?;
        let (lr, mu, wd) = (
            self.learning_rate as f32,
            self.momentum as f32,
            self.weight_decay as f32,
        );
        let (momentum, nesterov) = (self.momentum != 0.0, self.nesterov);
        zip3(p, (buf, g), |p, buf, g| {
            for ((p, &b), &g) in p.iter_mut().zip(buf).zip(g) {
                let d = match (momentum, nesterov) {
                    (false, _) => decayed(g, *p, wd),
                    (true, false) => b,
                    (true, true) => (b * mu + 0.0) + decayed(g, *p, wd),
                };
                *p -= d * lr + 0.0;
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::{Descent, Momentum};

    /// Candle's composition of the same update, as kandle's optimizer writes it.
    fn composed(
        p: &Tensor,
        buf: Option<&Tensor>,
        g: &Tensor,
        step: Descent,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let mut g = g.clone();
        if step.weight_decay != 0.0 {
            g = ((p * step.weight_decay)? + g)?;
        }
        let mut buf_out = None;
        if step.momentum != 0.0 {
            let buf = match buf {
                Some(b) => ((b * step.momentum)? + &g)?,
                None => g.force_contiguous()?,
            };
            g = if step.nesterov {
                ((&buf * step.momentum)? + g)?
            } else {
                buf.clone()
            };
            buf_out = Some(buf);
        }
        Ok(((p - (g * step.learning_rate)?)?, buf_out))
    }

    fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    }

    /// Every flavour, on a small variable and one split over tasks, gives candle's
    /// composition's values bit for bit.
    #[test]
    fn updates_match_candles_composition_bit_for_bit() -> candle_core::Result<()> {
        let device = Device::Cpu;
        for n in [7, 3 * super::super::CHUNK + 5] {
            let p0 = Tensor::randn(0f32, 1., n, &device)?;
            let g = Tensor::randn(0f32, 1., n, &device)?;
            let b0 = Tensor::randn(0f32, 1., n, &device)?;
            for (momentum, nesterov, weight_decay) in [
                (0.0, false, 0.0),
                (0.0, false, 1e-3),
                (0.9, false, 0.0),
                (0.9, true, 5e-4),
                (0.5, false, 1e-2),
            ] {
                let step = Descent {
                    learning_rate: 0.05,
                    momentum,
                    nesterov,
                    weight_decay,
                };
                let (want_p, want_buf) = composed(&p0, Some(&b0), &g, step)?;
                let (p, buf) = (p0.copy()?, b0.copy()?);
                if momentum != 0.0 {
                    buf.inplace_op3(
                        &g,
                        &p,
                        &Momentum {
                            momentum,
                            weight_decay,
                        },
                    )?;
                    p.inplace_op3(&buf, &g, &step)?;
                } else {
                    p.inplace_op3(&g, &g, &step)?;
                }
                assert_eq!(bits(&p)?, bits(&want_p)?, "{n} values, {step:?}");
                if let Some(want_buf) = want_buf {
                    assert_eq!(bits(&buf)?, bits(&want_buf)?, "{n} values, {step:?}");
                }
            }
        }
        Ok(())
    }

    /// A tensor of another dtype, or operands of other lengths, are errors naming the op.
    #[test]
    fn other_dtypes_and_lengths_are_refused() -> candle_core::Result<()> {
        let device = Device::Cpu;
        let step = Descent {
            learning_rate: 0.1,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let p = Tensor::zeros(4, candle_core::DType::F64, &device)?;
        let g = Tensor::zeros(4, candle_core::DType::F32, &device)?;
        let err = p
            .inplace_op3(&g, &g, &step)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("sgd-descent"), "{err}");
        let p = Tensor::zeros(5, candle_core::DType::F32, &device)?;
        let err = p
            .inplace_op3(&g, &g, &step)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("5 values to update from 4"), "{err}");
        Ok(())
    }
}
