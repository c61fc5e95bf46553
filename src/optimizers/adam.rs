//! Adam and AdamW: adaptive moment estimation, with L2 or decoupled weight decay.
//!
//! [`Adam`] and [`AdamW`] are the recipes that `compile` stores; each builds a stateful
//! optimizer holding the first and second moments of every variable. Both are
//! [`AdamFamily`], told apart by the [`WeightDecay`] they apply: [`Adam`] is
//! `AdamFamily<L2Penalty>`, [`AdamW`] is `AdamFamily<DecoupledDecay>`. The update is PyTorch's
//! `torch.optim.Adam` / `AdamW`: at step `t` (from 1), with gradient `g`, variable `p` and
//! learning rate `lr`,
//!
//! ```text
//! g = g + wd * p                       (Adam with weight decay: an L2 penalty)
//! p = p * (1 - lr * wd)                (AdamW: decoupled weight decay)
//! m = b1 * m + (1 - b1) * g
//! v = b2 * v + (1 - b2) * g^2
//! p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//!
//! The epsilon is added after the bias-corrected square root, as in PyTorch. Keras adds it to
//! the uncorrected one, which differs only while `eps` is large against `sqrt(v)`. Defaults are
//! Keras's: `eps = 1e-7`, and AdamW's weight decay 0.004.
//!
//! `f32` variables are updated in place by kandle's kernels: on the CPU one variable at a
//! time, on a CUDA device (the `cuda` feature) all of the device's in one launch, unless the
//! optimizer was built for a model on the device-generic path (`build_on_path`); candle's ops
//! update the rest, with the same values (on the CPU bit for bit).

use std::fmt;
use std::marker::PhantomData;

use candle_core::{Tensor, Var};

use super::gated::{self, LiveRates};
use super::{
    check_grads, check_lr, check_non_negative, check_unit, Optimizer, OptimizerConfig,
    OptimizerState,
};
use crate::kernels::optimizer::adam as kernel;
use crate::{Error, Result};

/// Adam: `Adam::new(1e-3)`, with `.betas(0.9, 0.999)`, `.epsilon(1e-7)` and an optional L2
/// `.weight_decay(wd)` added to the gradient (as `torch.optim.Adam` does).
///
/// Defaults: betas 0.9 and 0.999, epsilon 1e-7 (Keras's), no weight decay. Hyper-parameters
/// are checked when the optimizer is built: the learning rate and weight decay must be finite
/// and `>= 0`, the betas in `[0, 1)` and epsilon finite and `> 0`.
///
/// ```
/// use kandle::optimizers::{Adam, OptimizerConfig};
///
/// let adam = Adam::new(1e-3).betas(0.9, 0.99).weight_decay(1e-4);
/// assert_eq!((adam.learning_rate(), adam.beta_2, adam.weight_decay), (1e-3, 0.99, 1e-4));
/// assert_eq!(Adam::default(), Adam::new(1e-3));
/// ```
pub type Adam = AdamFamily<L2Penalty>;

/// AdamW: Adam with decoupled weight decay, `AdamW::new(1e-3).weight_decay(1e-2)`.
///
/// Before each Adam update, every variable is scaled by `1 - lr * weight_decay`, as in
/// `torch.optim.AdamW`. Defaults: betas 0.9 and 0.999, epsilon 1e-7 and weight decay 0.004
/// (Keras's). Hyper-parameters are checked when the optimizer is built, as for [`Adam`].
///
/// ```
/// use kandle::optimizers::AdamW;
///
/// assert_eq!(AdamW::new(1e-3).weight_decay, 0.004);
/// assert_eq!(AdamW::new(1e-3).weight_decay(1e-2).weight_decay, 1e-2);
/// ```
pub type AdamW = AdamFamily<DecoupledDecay>;

/// An Adam-family recipe: the hyper-parameters, with the kind of weight decay `D` in the type.
/// Written as [`Adam`] (`D` = [`L2Penalty`]) or [`AdamW`] (`D` = [`DecoupledDecay`]).
#[derive(Clone, Copy, PartialEq)]
pub struct AdamFamily<D> {
    /// The initial learning rate.
    pub learning_rate: f64,
    /// Decay rate of the first moment (the running mean of gradients).
    pub beta_1: f64,
    /// Decay rate of the second moment (the running mean of squared gradients).
    pub beta_2: f64,
    /// Added to the denominator for numerical stability.
    pub epsilon: f64,
    /// The weight decay, applied as `D` says: for [`Adam`] an L2 penalty, `weight_decay * p`
    /// added to each gradient; for [`AdamW`] decoupled, each step scaling the variables by
    /// `1 - lr * weight_decay`.
    pub weight_decay: f64,
    /// Batches whose gradients are summed before one update (1: none); see
    /// [`OptimizerConfig::gradient_accumulation_steps`].
    pub gradient_accumulation_steps: usize,
    decay: PhantomData<D>,
}

/// [`Adam`]'s weight decay: an L2 penalty, `weight_decay * p` added to each gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct L2Penalty;

/// [`AdamW`]'s weight decay: decoupled, each step scales the variables by
/// `1 - lr * weight_decay` before the Adam update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoupledDecay;

/// How an [`AdamFamily`] applies its weight decay: [`L2Penalty`] or [`DecoupledDecay`] (no
/// other).
pub trait WeightDecay: decay::Sealed + Copy + PartialEq + Send + Sync + 'static {}

impl WeightDecay for L2Penalty {}
impl WeightDecay for DecoupledDecay {}

mod decay {
    /// What a [`WeightDecay`](super::WeightDecay) is to the Adam code; only kandle implements
    /// it.
    pub trait Sealed {
        /// The optimizer's name, in messages and as the kind of its saved state.
        const NAME: &'static str;
        /// Keras's default weight decay.
        const DEFAULT: f64;
        /// Whether the decay is decoupled from the gradient.
        const DECOUPLED: bool;
    }

    impl Sealed for super::L2Penalty {
        const NAME: &'static str = "Adam";
        const DEFAULT: f64 = 0.0;
        const DECOUPLED: bool = false;
    }

    impl Sealed for super::DecoupledDecay {
        const NAME: &'static str = "AdamW";
        const DEFAULT: f64 = 0.004;
        const DECOUPLED: bool = true;
    }
}

impl<D: WeightDecay> Default for AdamFamily<D> {
    /// Keras's default: learning rate 0.001.
    fn default() -> Self {
        Self::new(1e-3)
    }
}

/// Written as the variant's name: `Adam { learning_rate: 0.001, .. }` or `AdamW { .. }`.
impl<D: WeightDecay> fmt::Debug for AdamFamily<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(D::NAME)
            .field("learning_rate", &self.learning_rate)
            .field("beta_1", &self.beta_1)
            .field("beta_2", &self.beta_2)
            .field("epsilon", &self.epsilon)
            .field("weight_decay", &self.weight_decay)
            .field(
                "gradient_accumulation_steps",
                &self.gradient_accumulation_steps,
            )
            .finish()
    }
}

impl<D: WeightDecay> AdamFamily<D> {
    /// With learning rate `lr` and Keras's other defaults.
    pub fn new(lr: f64) -> Self {
        Self {
            learning_rate: lr,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-7,
            weight_decay: D::DEFAULT,
            gradient_accumulation_steps: 1,
            decay: PhantomData,
        }
    }

    /// Sets the decay rates of the first and second moments.
    pub fn betas(mut self, beta_1: f64, beta_2: f64) -> Self {
        self.beta_1 = beta_1;
        self.beta_2 = beta_2;
        self
    }

    /// Sets the epsilon added to the denominator.
    pub fn epsilon(mut self, epsilon: f64) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// Sets the weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sums the gradients of `steps` batches before each update, as Keras's
    /// `gradient_accumulation_steps`.
    pub fn gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.gradient_accumulation_steps = steps;
        self
    }
}

impl<D: WeightDecay> OptimizerConfig for AdamFamily<D> {
    fn learning_rate(&self) -> f64 {
        self.learning_rate
    }

    fn build(&self, params: Vec<Var>) -> Result<Box<dyn Optimizer>> {
        self.build_on_path(params, crate::ComputePath::from_env())
    }

    fn build_on_path(
        &self,
        params: Vec<Var>,
        path: crate::ComputePath,
    ) -> Result<Box<dyn Optimizer>> {
        self.build_with(params, super::cuda_kernels(path))
    }

    fn clone_config(&self) -> Box<dyn OptimizerConfig> {
        Box::new(*self)
    }

    fn gradient_accumulation_steps(&self) -> usize {
        self.gradient_accumulation_steps
    }
}

impl<D: WeightDecay> AdamFamily<D> {
    /// The optimizer for `params`, updating those on a CUDA device with kandle's CUDA kernels
    /// when `cuda_kernels`.
    pub(super) fn build_with(
        &self,
        params: Vec<Var>,
        cuda_kernels: bool,
    ) -> Result<Box<dyn Optimizer>> {
        let hyper = Hyper {
            name: D::NAME,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            decoupled: D::DECOUPLED,
        };
        hyper.validate(self.learning_rate)?;
        super::check_accumulation(D::NAME, self.gradient_accumulation_steps)?;
        Ok(Box::new(AdamState::new(hyper, params, cuda_kernels)?))
    }
}

/// The hyper-parameters both variants share, and which kind of weight decay applies.
#[derive(Debug, Clone, Copy)]
struct Hyper {
    name: &'static str,
    beta_1: f64,
    beta_2: f64,
    epsilon: f64,
    weight_decay: f64,
    /// AdamW's decoupled decay when true, Adam's L2 penalty when false.
    decoupled: bool,
}

impl Hyper {
    fn validate(&self, lr: f64) -> Result<()> {
        check_lr(self.name, lr)?;
        check_unit(self.name, "beta_1", self.beta_1)?;
        check_unit(self.name, "beta_2", self.beta_2)?;
        check_non_negative(self.name, "weight decay", self.weight_decay)?;
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(Error::invalid(format!(
                "{}: epsilon must be finite and > 0, got {}",
                self.name, self.epsilon
            )));
        }
        Ok(())
    }
}

/// Adam or AdamW bound to its variables, with their moments and the step count.
struct AdamState {
    hyper: Hyper,
    params: Vec<Var>,
    /// Detached first moments, one per variable.
    m: Vec<Tensor>,
    /// Detached second moments, one per variable.
    v: Vec<Tensor>,
    /// Steps taken so far.
    t: u64,
    /// Whether the variables on a CUDA device are updated by kandle's CUDA kernels (not on the
    /// device-generic path).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cuda_kernels: bool,
}

impl AdamState {
    fn new(hyper: Hyper, params: Vec<Var>, cuda_kernels: bool) -> Result<Self> {
        // Two sets of zeros: the steps update the moments in place.
        let zeros = || {
            params
                .iter()
                .map(|p| p.as_tensor().zeros_like())
                .collect::<candle_core::Result<Vec<_>>>()
        };
        let (m, v) = (zeros()?, zeros()?);
        Ok(Self {
            hyper,
            params,
            m,
            v,
            t: 0,
            cuda_kernels,
        })
    }

    /// Updates the variables kandle's CUDA kernels take (those of the first variable's CUDA
    /// device) in one launch; returns which it updated. `rates` as [`update_in_place`]'s.
    #[cfg(feature = "cuda")]
    fn update_on_cuda(&self, grads: &[Tensor], rates: Rates) -> Result<Vec<bool>> {
        if !self.cuda_kernels {
            return Ok(vec![false; self.params.len()]);
        }
        let (first, second, step) = kernel_ops(self.hyper, rates);
        super::cuda::adam(
            &self.params,
            grads,
            (&self.m, &self.v),
            (&first, &second, &step),
        )
    }

    /// Without the `cuda` feature, none.
    #[cfg(not(feature = "cuda"))]
    fn update_on_cuda(&self, _grads: &[Tensor], _rates: Rates) -> Result<Vec<bool>> {
        Ok(vec![false; self.params.len()])
    }

    /// The rates of step `t` (from 1) at learning rate `lr`.
    fn rates(&self, lr: f64, t: u64) -> Rates {
        let h = self.hyper;
        // Written as torch does: `step_size = lr / bc1`, `denom = sqrt(v) / sqrt(bc2) + eps`.
        let bias_correction_1 = 1.0 - h.beta_1.powf(t as f64);
        let bias_correction_2 = 1.0 - h.beta_2.powf(t as f64);
        Rates {
            step_size: lr / bias_correction_1,
            inv_sqrt_bc2: 1.0 / bias_correction_2.sqrt(),
            decay_factor: 1.0 - lr * h.weight_decay,
        }
    }
}

/// What a step's update takes from its learning rate and its count: the step size
/// `lr / (1 - beta_1^t)`, `1 / sqrt(1 - beta_2^t)` and AdamW's factor `1 - lr * wd` on the
/// variables (not read by Adam).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rates {
    step_size: f64,
    inv_sqrt_bc2: f64,
    decay_factor: f64,
}

impl Optimizer for AdamState {
    fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        let h = self.hyper;
        check_grads(h.name, &self.params, grads)?;
        check_lr(h.name, lr)?;
        let t = self.t + 1;
        let rates = self.rates(lr, t);
        let Rates {
            step_size,
            inv_sqrt_bc2,
            decay_factor,
        } = rates;
        let on_cuda = self.update_on_cuda(grads, rates)?;
        let params = self.params.iter().zip(grads).zip(on_cuda);
        for (((param, grad), done), (m, v)) in params.zip(self.m.iter_mut().zip(self.v.iter_mut()))
        {
            if done {
                continue;
            }
            let (p, moments) = (param.as_tensor(), (&*m, &*v));
            if update_in_place(p, grad, moments, h, rates)? {
                continue;
            }
            let mut p = param.as_tensor().detach();
            let mut g = grad.detach();
            if h.weight_decay != 0.0 {
                if h.decoupled {
                    p = (p * decay_factor)?;
                } else {
                    g = ((&p * h.weight_decay)? + g)?;
                }
            }
            let next_m = ((&*m * h.beta_1)? + (&g * (1.0 - h.beta_1))?)?.detach();
            let next_v = ((&*v * h.beta_2)? + (g.sqr()? * (1.0 - h.beta_2))?)?.detach();
            let denom = next_v.sqrt()?.affine(inv_sqrt_bc2, h.epsilon)?;
            let update = (next_m.div(&denom)? * step_size)?;
            param.set(&(p - update)?.detach())?;
            *m = next_m;
            *v = next_v;
        }
        self.t = t;
        Ok(())
    }

    /// Slots `m` and `v` (the moments) and scalar `step` (steps taken); the kind is the
    /// variant's name, `Adam` or `AdamW`.
    /// The moments are copies: the steps update them in place.
    fn state(&self) -> Result<OptimizerState> {
        Ok(OptimizerState::new(self.hyper.name)
            .with_slot(FIRST_MOMENT, copies(&self.m)?)
            .with_slot(SECOND_MOMENT, copies(&self.v)?)
            .with_scalar(STEP, self.t as f64))
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        state.check(self.hyper.name, &[FIRST_MOMENT, SECOND_MOMENT], &[STEP])?;
        let missing = |slot: &str| {
            Error::invalid(format!(
                "state of {}: slot `{slot}` is missing",
                self.hyper.name
            ))
        };
        let m = state
            .slot_for(FIRST_MOMENT, &self.params)?
            .ok_or_else(|| missing(FIRST_MOMENT))?;
        let v = state
            .slot_for(SECOND_MOMENT, &self.params)?
            .ok_or_else(|| missing(SECOND_MOMENT))?;
        let t = state.count(STEP)?;
        // Copies: the steps update them in place, the caller's state stays as it is.
        self.m = copies(&m)?;
        self.v = copies(&v)?;
        self.t = t;
        Ok(())
    }

    /// Yes for `f32` contiguous variables all on the CPU, or all on one CUDA device updated by
    /// kandle's kernels.
    fn prepare_gated(&mut self) -> Result<bool> {
        let Some(device) = gated::kernel_device(&self.params, self.cuda_kernels) else {
            return Ok(false);
        };
        let tensors = self
            .params
            .iter()
            .map(|p| p.as_tensor())
            .chain(&self.m)
            .chain(&self.v);
        Ok(gated::all_fit(tensors, &device))
    }

    /// `[step_size, inv_sqrt_bc2, decay_factor]` of the next step counted.
    fn gated_rates(&self, lr: f64) -> Result<Vec<f64>> {
        check_lr(self.hyper.name, lr)?;
        let r = self.rates(lr, self.t + 1);
        Ok(vec![r.step_size, r.inv_sqrt_bc2, r.decay_factor])
    }

    fn step_gated(&self, grads: &[Tensor], live: &LiveRates<'_>) -> Result<()> {
        let h = self.hyper;
        check_grads(h.name, &self.params, grads)?;
        #[cfg(feature = "cuda")]
        if self.params.first().is_some_and(|p| p.device().is_cuda()) {
            // The rates are read on the device; these are placeholders.
            let (first, second, step) = kernel_ops(h, self.rates(0.0, 1));
            return super::cuda::adam_gated(
                &self.params,
                grads,
                (&self.m, &self.v),
                (&first, &second, &step),
                live,
            );
        }
        let Some(rates) = live.read(h.name, 3)? else {
            return Ok(());
        };
        let rates = Rates {
            step_size: rates[0],
            inv_sqrt_bc2: rates[1],
            decay_factor: rates[2],
        };
        for (i, ((param, grad), (m, v))) in self
            .params
            .iter()
            .zip(grads)
            .zip(self.m.iter().zip(&self.v))
            .enumerate()
        {
            if !update_in_place(param.as_tensor(), grad, (m, v), h, rates)? {
                return Err(Error::invalid(format!(
                    "{}: variable {i} ({:?} {:?}) cannot take a gated update on the CPU",
                    h.name,
                    param.dtype(),
                    param.dims()
                )));
            }
        }
        Ok(())
    }

    /// Counts the step when it applied.
    fn settle_gated(&mut self, applied: bool) -> Result<()> {
        self.t += u64::from(applied);
        Ok(())
    }
}

/// Deep copies of `tensors`.
fn copies(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    Ok(tensors
        .iter()
        .map(Tensor::copy)
        .collect::<candle_core::Result<_>>()?)
}

/// One variable's update through `kandle_kernels::optimizer::adam`, in place, where it applies:
/// an `f32` CPU variable, gradient and moments, all contiguous. Returns `false`, touching
/// nothing, elsewhere (other devices and dtypes), where candle's ops run the same update; both
/// give the same values bit for bit.
fn update_in_place(
    p: &Tensor,
    grad: &Tensor,
    (m, v): (&Tensor, &Tensor),
    h: Hyper,
    rates: Rates,
) -> Result<bool> {
    let fits = |t: &Tensor| {
        t.device().is_cpu() && t.dtype() == candle_core::DType::F32 && t.is_contiguous()
    };
    if ![p, grad, m, v].into_iter().all(fits) {
        return Ok(false);
    }
    let (first, second, step) = kernel_ops(h, rates);
    m.inplace_op3(grad, p, &first)?;
    v.inplace_op3(grad, p, &second)?;
    p.inplace_op3(m, v, &step)?;
    Ok(true)
}

/// The kernels' three ops of a step (the moments' and the variable's) for `h` at `rates`, on
/// the CPU and on CUDA devices alike.
fn kernel_ops(
    h: Hyper,
    rates: Rates,
) -> (kernel::FirstMoment, kernel::SecondMoment, kernel::AdamStep) {
    let decay = match (h.weight_decay != 0.0, h.decoupled) {
        (true, false) => kernel::WeightDecay::L2(h.weight_decay),
        _ => kernel::WeightDecay::None,
    };
    let first = kernel::FirstMoment {
        beta: h.beta_1,
        decay,
    };
    let second = kernel::SecondMoment {
        beta: h.beta_2,
        decay,
    };
    let step = kernel::AdamStep {
        step_size: rates.step_size,
        inv_sqrt_bc2: rates.inv_sqrt_bc2,
        epsilon: h.epsilon,
        decay_factor: (h.weight_decay != 0.0 && h.decoupled).then_some(rates.decay_factor),
    };
    (first, second, step)
}

/// The slot of the first moments.
const FIRST_MOMENT: &str = "m";
/// The slot of the second moments.
const SECOND_MOMENT: &str = "v";
/// The scalar counting the steps taken.
const STEP: &str = "step";
