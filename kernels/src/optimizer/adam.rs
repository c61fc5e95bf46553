//! Adam's and AdamW's update of one `f32` CPU variable, in place (see the module [`super`]):
//! the first moment ([`FirstMoment`]), the second ([`SecondMoment`]) and the variable
//! ([`AdamStep`]), one pass each, bit for bit kandle's `Adam` composed of candle's ops
//! (torch's order: `step_size = lr / bc1`, `denom = sqrt(v) / sqrt(bc2) + eps`).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use kandle_kernels::optimizer::adam::{AdamStep, FirstMoment, SecondMoment, WeightDecay};
//!
//! let device = Device::Cpu;
//! let p = Tensor::new(&[1f32, -2.0], &device)?;
//! let g = Tensor::new(&[0.5f32, 0.25], &device)?;
//! let (m, v) = (p.zeros_like()?, p.zeros_like()?);
//! let decay = WeightDecay::None;
//! m.inplace_op3(&g, &p, &FirstMoment { beta: 0.9, decay })?;
//! v.inplace_op3(&g, &p, &SecondMoment { beta: 0.999, decay })?;
//! // The first step: bias corrections 0.1 and 0.001.
//! let step = AdamStep { step_size: 0.01 / 0.1, inv_sqrt_bc2: 1.0 / 0.001f64.sqrt(), epsilon: 1e-8, decay_factor: None };
//! p.inplace_op3(&m, &v, &step)?;
//! let got = p.to_vec1::<f32>()?;
//! assert!((got[0] - 0.99).abs() < 1e-6 && (got[1] + 2.01).abs() < 1e-6, "{got:?}");
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{CpuStorage, InplaceOp3, Layout};

use super::{same_lengths, values, values_mut, zip3};

/// How the weight decay enters: not at all, added to the gradient (Adam's L2, `g + wd * p`),
/// or applied to the variable ([`AdamStep::decay_factor`], AdamW's, which leaves the moments'
/// gradient as it is).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightDecay {
    /// No decay, or AdamW's (applied by the step).
    None,
    /// `g + wd * p` in the moments.
    L2(f64),
}

impl WeightDecay {
    /// The gradient the moments take, as candle's `p * wd + g` computes it.
    #[inline(always)]
    fn gradient(self, g: f32, p: f32, wd: f32) -> f32 {
        match self {
            WeightDecay::None => g,
            WeightDecay::L2(_) => (p * wd + 0.0) + g,
        }
    }

    fn factor(self) -> f32 {
        match self {
            WeightDecay::None => 0.0,
            WeightDecay::L2(wd) => wd as f32,
        }
    }
}

/// `m = beta_1 * m + (1 - beta_1) * g`: applied to the first moment with `(gradient, variable)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstMoment {
    /// `beta_1`.
    pub beta: f64,
    /// How the weight decay enters the gradient.
    pub decay: WeightDecay,
}

/// `v = beta_2 * v + (1 - beta_2) * g^2`: applied to the second moment with `(gradient,
/// variable)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SecondMoment {
    /// `beta_2`.
    pub beta: f64,
    /// How the weight decay enters the gradient.
    pub decay: WeightDecay,
}

/// `p = p' - (m / (sqrt(v) * inv_sqrt_bc2 + eps)) * step_size`, `p'` being `p * decay_factor`
/// (AdamW's `1 - lr * wd`) or `p`: applied to the variable with the updated `(m, v)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    /// `lr / (1 - beta_1^t)`.
    pub step_size: f64,
    /// `1 / sqrt(1 - beta_2^t)`.
    pub inv_sqrt_bc2: f64,
    /// `eps`.
    pub epsilon: f64,
    /// AdamW's factor on the variable before the step, if any.
    pub decay_factor: Option<f64>,
}

/// Applies `f(moment, gradient, variable)` to a moment with `(gradient, variable)` operands.
fn moment(
    name: &str,
    (dst, dst_l): (&mut CpuStorage, &Layout),
    (g, g_l): (&CpuStorage, &Layout),
    (p, p_l): (&CpuStorage, &Layout),
    f: impl Fn(f32, f32, f32) -> f32 + Sync,
) -> candle_core::Result<()> {
    let dst = values_mut(name, dst, dst_l)?;
    let (g, p) = (values(name, g, g_l)?, values(name, p, p_l)?);
    same_lengths(name, [dst.len(), g.len(), p.len()])?;
    zip3(dst, (g, p), |dst, g, p| {
        for ((d, &g), &p) in dst.iter_mut().zip(g).zip(p) {
            *d = f(*d, g, p);
        }
    });
    Ok(())
}

impl InplaceOp3 for FirstMoment {
    fn name(&self) -> &'static str {
        "adam-first-moment"
    }

    fn cpu_fwd(
        &self,
        m: &mut CpuStorage,
        m_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
        p: &CpuStorage,
        p_l: &Layout,
    ) -> candle_core::Result<()> {
        let (beta, rest) = (self.beta as f32, (1.0 - self.beta) as f32);
        let (decay, wd) = (self.decay, self.decay.factor());
        let name = InplaceOp3::name(self);
        moment(name, (m, m_l), (g, g_l), (p, p_l), |m, g, p| {
            (m * beta + 0.0) + (decay.gradient(g, p, wd) * rest + 0.0)
        })
    }
}

impl InplaceOp3 for SecondMoment {
    fn name(&self) -> &'static str {
        "adam-second-moment"
    }

    fn cpu_fwd(
        &self,
        v: &mut CpuStorage,
        v_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
        p: &CpuStorage,
        p_l: &Layout,
    ) -> candle_core::Result<()> {
        let (beta, rest) = (self.beta as f32, (1.0 - self.beta) as f32);
        let (decay, wd) = (self.decay, self.decay.factor());
        let name = InplaceOp3::name(self);
        moment(name, (v, v_l), (g, g_l), (p, p_l), |v, g, p| {
            let g = decay.gradient(g, p, wd);
            (v * beta + 0.0) + (g * g * rest + 0.0)
        })
    }
}

impl InplaceOp3 for AdamStep {
    fn name(&self) -> &'static str {
        "adam-step"
    }

    fn cpu_fwd(
        &self,
        p: &mut CpuStorage,
        p_l: &Layout,
        m: &CpuStorage,
        m_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let name = InplaceOp3::name(self);
        let p = values_mut(name, p, p_l)?;
        let (m, v) = (values(name, m, m_l)?, values(name, v, v_l)?);
        same_lengths(name, [p.len(), m.len(), v.len()])?;
        let (step, inv, eps) = (
            self.step_size as f32,
            self.inv_sqrt_bc2 as f32,
            self.epsilon as f32,
        );
        let factor = self.decay_factor.map(|f| f as f32);
        zip3(p, (m, v), |p, m, v| {
            for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
                let denom = v.sqrt() * inv + eps;
                let update = m / denom * step + 0.0;
                let decayed = factor.map_or(*p, |f| *p * f + 0.0);
                *p = decayed - update;
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::{AdamStep, FirstMoment, SecondMoment, WeightDecay};

    /// kandle's `Adam` step composed of candle's ops, for one variable.
    #[allow(clippy::too_many_arguments)]
    fn composed(
        p: &Tensor,
        (m, v): (&Tensor, &Tensor),
        g: &Tensor,
        (beta_1, beta_2, eps): (f64, f64, f64),
        (lr, wd, decoupled): (f64, f64, bool),
        t: i32,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (mut p, mut g) = (p.clone(), g.clone());
        if wd != 0.0 {
            if decoupled {
                p = (p * (1.0 - lr * wd))?;
            } else {
                g = ((&p * wd)? + g)?;
            }
        }
        let step_size = lr / (1.0 - beta_1.powi(t));
        let inv = 1.0 / (1.0 - beta_2.powi(t)).sqrt();
        let m = ((m * beta_1)? + (&g * (1.0 - beta_1))?)?;
        let v = ((v * beta_2)? + (g.sqr()? * (1.0 - beta_2))?)?;
        let denom = v.sqrt()?.affine(inv, eps)?;
        let update = (m.div(&denom)? * step_size)?;
        Ok(((p - update)?, m, v))
    }

    fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    }

    /// Adam, Adam with L2 decay and AdamW, on a small variable and one split over tasks, give
    /// the composition's values bit for bit.
    #[test]
    fn updates_match_candles_composition_bit_for_bit() -> candle_core::Result<()> {
        let device = Device::Cpu;
        let betas = (0.9, 0.999, 1e-7);
        for n in [5, 2 * super::super::CHUNK + 3] {
            let p0 = Tensor::randn(0f32, 1., n, &device)?;
            let g = Tensor::randn(0f32, 1., n, &device)?;
            let m0 = (Tensor::randn(0f32, 1., n, &device)? * 0.1)?;
            let v0 = Tensor::randn(0f32, 1., n, &device)?.sqr()?;
            for (wd, decoupled, t) in [(0.0, false, 1), (1e-2, false, 3), (1e-2, true, 7)] {
                let lr = 1e-3;
                let (want_p, want_m, want_v) =
                    composed(&p0, (&m0, &v0), &g, betas, (lr, wd, decoupled), t)?;
                let (p, m, v) = (p0.copy()?, m0.copy()?, v0.copy()?);
                let decay = match (wd != 0.0, decoupled) {
                    (true, false) => WeightDecay::L2(wd),
                    _ => WeightDecay::None,
                };
                m.inplace_op3(
                    &g,
                    &p,
                    &FirstMoment {
                        beta: betas.0,
                        decay,
                    },
                )?;
                v.inplace_op3(
                    &g,
                    &p,
                    &SecondMoment {
                        beta: betas.1,
                        decay,
                    },
                )?;
                let step = AdamStep {
                    step_size: lr / (1.0 - betas.0.powi(t)),
                    inv_sqrt_bc2: 1.0 / (1.0 - betas.1.powi(t)).sqrt(),
                    epsilon: betas.2,
                    decay_factor: (decoupled && wd != 0.0).then_some(1.0 - lr * wd),
                };
                p.inplace_op3(&m, &v, &step)?;
                let what = format!("{n} values, wd {wd}, decoupled {decoupled}");
                assert_eq!(bits(&m)?, bits(&want_m)?, "m, {what}");
                assert_eq!(bits(&v)?, bits(&want_v)?, "v, {what}");
                assert_eq!(bits(&p)?, bits(&want_p)?, "p, {what}");
            }
        }
        Ok(())
    }
}
