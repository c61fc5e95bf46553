//! Stochastic gradient descent with optional momentum, Nesterov momentum and L2 weight decay.
//!
//! [`Sgd`] is the recipe that `compile` stores; [`OptimizerConfig::build`] turns it into a
//! stateful optimizer holding one momentum buffer per variable. The update is PyTorch's
//! `torch.optim.SGD` without dampening: with gradient `g`, variable `p`, weight decay `wd`,
//! momentum `mu` and learning rate `lr`,
//!
//! ```text
//! g   = g + wd * p
//! buf = mu * buf + g          (on the first step, buf = g)
//! g   = g + mu * buf          (Nesterov)   or   g = buf   (plain momentum)
//! p   = p - lr * g
//! ```
//!
//! Candle's own `SGD` has no momentum, hence this one. `f32` variables are updated in place by
//! kandle's kernels: on the CPU one variable at a time, on a CUDA device (the `cuda` feature)
//! all of the device's in one launch, unless the optimizer was built on the device-generic path
//! (`build_on_path`); candle's ops update the rest, with the same values (on
//! the CPU bit for bit).

use candle_core::{Tensor, Var};

use super::gated::{self, LiveRates};
use super::{
    check_accumulation, check_grads, check_lr, check_non_negative, check_unit, Optimizer,
    OptimizerConfig, OptimizerState,
};
use crate::{Error, Result};

/// Stochastic gradient descent: `Sgd::new(0.01).momentum(0.9).nesterov(true)`.
///
/// Defaults: no momentum, no Nesterov, no weight decay, as in Keras and PyTorch.
/// Hyper-parameters are checked when the optimizer is built: the learning rate must be finite
/// and `>= 0`, momentum in `[0, 1)`, weight decay finite and `>= 0`, and Nesterov needs a
/// momentum above 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sgd {
    /// The initial learning rate.
    pub learning_rate: f64,
    /// The momentum factor `mu`; 0 disables momentum.
    pub momentum: f64,
    /// Whether to use Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty: `weight_decay * p` is added to each gradient.
    pub weight_decay: f64,
    /// Batches whose gradients are summed before one update (1: none); see
    /// [`OptimizerConfig::gradient_accumulation_steps`].
    pub gradient_accumulation_steps: usize,
}

impl Default for Sgd {
    /// Keras's default: learning rate 0.01, no momentum.
    fn default() -> Self {
        Self::new(0.01)
    }
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        Self {
            learning_rate: lr,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            gradient_accumulation_steps: 1,
        }
    }

    /// Sets the momentum factor (Keras and PyTorch commonly use 0.9).
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Turns Nesterov momentum on or off. It needs a momentum above 0.
    pub fn nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }

    /// Sets the L2 weight decay added to each gradient.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sums the gradients of `steps` batches before each update, as Keras's
    /// `gradient_accumulation_steps`: a global batch `steps` times what the devices hold.
    ///
    /// ```
    /// use kandle::optimizers::{OptimizerConfig, Sgd};
    ///
    /// let sgd = Sgd::new(0.1).momentum(0.9).gradient_accumulation_steps(4);
    /// assert_eq!(OptimizerConfig::gradient_accumulation_steps(&sgd), 4);
    /// ```
    pub fn gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.gradient_accumulation_steps = steps;
        self
    }

    /// The optimizer for `params`, updating those on a CUDA device with kandle's CUDA kernels
    /// when `cuda_kernels`.
    pub(super) fn build_with(
        &self,
        params: Vec<Var>,
        cuda_kernels: bool,
    ) -> Result<Box<dyn Optimizer>> {
        self.validate()?;
        let buffers = vec![None; params.len()];
        Ok(Box::new(SgdState {
            config: *self,
            params,
            buffers,
            pending: Vec::new(),
            cuda_kernels,
        }))
    }

    fn validate(&self) -> Result<()> {
        check_lr("SGD", self.learning_rate)?;
        check_unit("SGD", "momentum", self.momentum)?;
        check_non_negative("SGD", "weight decay", self.weight_decay)?;
        check_accumulation("SGD", self.gradient_accumulation_steps)?;
        if self.nesterov && self.momentum == 0.0 {
            return Err(Error::invalid(
                "SGD: Nesterov momentum needs a momentum above 0",
            ));
        }
        Ok(())
    }
}

impl OptimizerConfig for Sgd {
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

/// The kind of SGD's state.
const KIND: &str = "SGD";
/// The slot of its momentum buffers.
const MOMENTUM: &str = "momentum";

/// SGD bound to its variables, with one momentum buffer per variable once stepped.
struct SgdState {
    config: Sgd,
    params: Vec<Var>,
    /// Detached momentum buffers; `None` before the first step or without momentum.
    buffers: Vec<Option<Tensor>>,
    /// The buffers of gated updates before one of them applied: made (zeros) by
    /// `prepare_gated`, they become `buffers` when the first gated update applies (the first
    /// step writes them whole). Empty otherwise.
    pending: Vec<Tensor>,
    /// Whether the variables on a CUDA device are updated by kandle's CUDA kernels (not on the
    /// device-generic path).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cuda_kernels: bool,
}

impl SgdState {
    /// Updates the variables kandle's CUDA kernels take (those of the first variable's CUDA
    /// device) in one launch; returns which it updated.
    #[cfg(feature = "cuda")]
    fn update_on_cuda(&mut self, grads: &[Tensor], lr: f64) -> Result<Vec<bool>> {
        if !self.cuda_kernels {
            return Ok(vec![false; self.params.len()]);
        }
        super::cuda::sgd(&self.params, grads, &mut self.buffers, self.config, lr)
    }

    /// Without the `cuda` feature, none.
    #[cfg(not(feature = "cuda"))]
    fn update_on_cuda(&mut self, _grads: &[Tensor], _lr: f64) -> Result<Vec<bool>> {
        Ok(vec![false; self.params.len()])
    }

    /// Whether the momentum buffers have taken a step (always, without momentum).
    fn started(&self) -> bool {
        self.pending.is_empty()
    }

    /// The buffers a gated update writes: the pending ones until one applied.
    fn gated_buffers(&self) -> Vec<&Tensor> {
        match self.started() {
            true => self.buffers.iter().flatten().collect(),
            false => self.pending.iter().collect(),
        }
    }

    /// A gated update of CPU variables (`prepare_gated` checked them), reading the gate and the
    /// learning rate here.
    fn step_gated_on_cpu(&self, grads: &[Tensor], live: &LiveRates<'_>) -> Result<()> {
        let Some(rates) = live.read("SGD", 2)? else {
            return Ok(());
        };
        let (lr, started) = (rates[0], rates[1] != 0.0);
        let buffers = self.gated_buffers();
        for (i, (param, grad)) in self.params.iter().zip(grads).enumerate() {
            let p = param.as_tensor();
            let buffer = buffers.get(i).copied();
            if let (Some(buf), false) = (buffer, started) {
                // The first step: the buffer takes the decayed gradient, as `step`'s copy.
                let wd = self.config.weight_decay;
                let g = if wd == 0.0 {
                    grad.clone()
                } else {
                    ((p * wd)? + grad)?
                };
                buf.slice_set(&g, 0, 0)?;
                let step = crate::kernels::optimizer::sgd::Descent {
                    learning_rate: lr,
                    momentum: self.config.momentum,
                    nesterov: self.config.nesterov,
                    weight_decay: self.config.weight_decay,
                };
                p.inplace_op3(buf, grad, &step)?;
                continue;
            }
            if !update_in_place(p, grad, buffer, self.config, lr)? {
                return Err(Error::invalid(format!(
                    "SGD: variable {i} ({:?} {:?}) cannot take a gated update on the CPU",
                    p.dtype(),
                    p.dims()
                )));
            }
        }
        Ok(())
    }
}

impl Optimizer for SgdState {
    fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        check_grads("SGD", &self.params, grads)?;
        check_lr("SGD", lr)?;
        let Sgd {
            momentum: mu,
            nesterov,
            weight_decay: wd,
            ..
        } = self.config;
        let on_cuda = self.update_on_cuda(grads, lr)?;
        let vars = self.params.iter().zip(grads).zip(&mut self.buffers);
        for (((param, grad), buffer), done) in vars.zip(on_cuda) {
            if done {
                continue;
            }
            let p = param.as_tensor();
            if update_in_place(p, grad, buffer.as_ref(), self.config, lr)? {
                continue;
            }
            let mut g = grad.detach();
            if wd != 0.0 {
                g = ((p * wd)? + g)?.detach();
            }
            if mu != 0.0 {
                let buf = match buffer.as_ref() {
                    Some(buf) => ((buf * mu)? + &g)?.detach(),
                    // A copy, as torch's `clone`: the caller may reuse the gradient's storage.
                    // Of this gradient's elements only: it is often a view of a fused buffer
                    // of every gradient, which `Tensor::copy` would copy whole.
                    None => g.force_contiguous()?,
                };
                g = if nesterov {
                    ((&buf * mu)? + g)?
                } else {
                    buf.clone()
                };
                *buffer = Some(buf);
            }
            param.set(&(p - (g * lr)?)?.detach())?;
        }
        Ok(())
    }

    /// Slot `momentum` once the buffers exist (after the first step with momentum); no slot
    /// before, or without momentum. The buffers are copies: the steps update them in place.
    fn state(&self) -> Result<OptimizerState> {
        let state = OptimizerState::new(KIND);
        let buffers: Option<Vec<Tensor>> = self
            .buffers
            .iter()
            .map(|b| b.as_ref().map(Tensor::copy).transpose())
            .collect::<candle_core::Result<Vec<Option<Tensor>>>>()?
            .into_iter()
            .collect();
        Ok(match buffers {
            Some(buffers) if !buffers.is_empty() => state.with_slot(MOMENTUM, buffers),
            _ => state,
        })
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        state.check(KIND, &[MOMENTUM], &[])?;
        self.buffers = match state.slot_for(MOMENTUM, &self.params)? {
            // Copies: the steps update them in place, the caller's state stays as it is.
            Some(buffers) => buffers
                .iter()
                .map(|b| Ok(Some(b.copy()?)))
                .collect::<Result<_>>()?,
            None => vec![None; self.params.len()],
        };
        self.pending.clear();
        Ok(())
    }

    /// Yes for `f32` contiguous variables all on the CPU, or all on one CUDA device updated by
    /// kandle's kernels; with a momentum, the buffers of the first steps are made here.
    fn prepare_gated(&mut self) -> Result<bool> {
        let Some(device) = gated::kernel_device(&self.params, self.cuda_kernels) else {
            return Ok(false);
        };
        let buffers_fit = self
            .buffers
            .iter()
            .all(|b| b.as_ref().is_none_or(|b| gated::all_fit([b], &device)));
        if !(buffers_fit && gated::all_fit(self.params.iter().map(|p| p.as_tensor()), &device)) {
            return Ok(false);
        }
        if self.config.momentum != 0.0 && self.buffers.iter().any(Option::is_none) {
            if self.buffers.iter().any(Option::is_some) {
                // Some buffers without the others: only host-decided steps take them.
                return Ok(false);
            }
            if self.pending.is_empty() {
                self.pending = self
                    .params
                    .iter()
                    .map(|p| p.as_tensor().zeros_like())
                    .collect::<candle_core::Result<_>>()?;
            }
        }
        Ok(true)
    }

    /// `[lr, started]`: `started` is 1 once the momentum buffers have taken a step.
    fn gated_rates(&self, lr: f64) -> Result<Vec<f64>> {
        check_lr("SGD", lr)?;
        Ok(vec![lr, f64::from(u8::from(self.started()))])
    }

    fn step_gated(&self, grads: &[Tensor], live: &LiveRates<'_>) -> Result<()> {
        check_grads("SGD", &self.params, grads)?;
        match self.params.first().map(|p| p.device()) {
            #[cfg(feature = "cuda")]
            Some(candle_core::Device::Cuda(_)) => super::cuda::sgd_gated(
                &self.params,
                grads,
                &self.gated_buffers(),
                self.config,
                live,
            ),
            Some(_) => self.step_gated_on_cpu(grads, live),
            None => Ok(()),
        }
    }

    /// The pending buffers become the buffers once a gated update applied.
    fn settle_gated(&mut self, applied: bool) -> Result<()> {
        if applied && !self.pending.is_empty() {
            self.buffers = self.pending.drain(..).map(Some).collect();
        }
        Ok(())
    }
}

/// One variable's update through `kandle_kernels::optimizer::sgd`, in place, where it applies: an `f32`
/// CPU variable and gradient, both contiguous, with a momentum buffer of the same (or no
/// momentum). Returns `false`, touching nothing, elsewhere (other devices and dtypes, and the
/// first step with momentum, which makes the buffer), where candle's ops run the same update.
/// Both give the same values bit for bit.
fn update_in_place(
    p: &Tensor,
    grad: &Tensor,
    buffer: Option<&Tensor>,
    config: Sgd,
    lr: f64,
) -> Result<bool> {
    use crate::kernels::optimizer::sgd::{Descent, Momentum};
    let fits = |t: &Tensor| {
        t.device().is_cpu() && t.dtype() == candle_core::DType::F32 && t.is_contiguous()
    };
    if !(fits(p) && fits(grad)) {
        return Ok(false);
    }
    let step = Descent {
        learning_rate: lr,
        momentum: config.momentum,
        nesterov: config.nesterov,
        weight_decay: config.weight_decay,
    };
    if config.momentum == 0.0 {
        p.inplace_op3(grad, grad, &step)?;
        return Ok(true);
    }
    match buffer {
        Some(buf) if fits(buf) => {
            let momentum = Momentum {
                momentum: config.momentum,
                weight_decay: config.weight_decay,
            };
            buf.inplace_op3(grad, p, &momentum)?;
            p.inplace_op3(buf, grad, &step)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Storage, Tensor, Var};

    use super::*;

    /// Elements held by `t`'s storage, whatever part of it `t` views.
    fn storage_len(t: &Tensor) -> usize {
        match &*t.storage_and_layout().0 {
            Storage::Cpu(s) => s.as_slice::<f32>().map_or(0, <[f32]>::len),
            _ => 0,
        }
    }

    #[test]
    fn momentum_buffers_copy_their_gradient_not_the_fused_buffer() -> Result<()> {
        // Gradients as the step hands them over: views of one fused buffer.
        let fused = Tensor::arange(0f32, 3000., &Device::Cpu)?;
        let params: Vec<Var> = (0..3)
            .map(|_| Var::zeros(1000, DType::F32, &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let grads: Vec<Tensor> = (0..3)
            .map(|i| fused.narrow(0, 1000 * i, 1000))
            .collect::<candle_core::Result<_>>()?;
        let mut sgd = Sgd::new(0.1).momentum(0.9).build(params.clone())?;
        sgd.step(&grads, 0.1)?;
        let state = sgd.state()?;
        let buffers = state.slot(MOMENTUM).expect("momentum after a step");
        for (i, buffer) in buffers.iter().enumerate() {
            assert_eq!(storage_len(buffer), 1000, "buffer {i}");
            assert_eq!(buffer.to_vec1::<f32>()?, grads[i].to_vec1::<f32>()?);
        }
        // The parameters moved by lr times their gradient.
        let moved = params[2].as_tensor().to_vec1::<f32>()?;
        assert_eq!(moved[0], -0.1 * 2000.);
        Ok(())
    }
}
