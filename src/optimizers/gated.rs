//! Gated updates: an optimizer step that decides nothing on the host, so that a CUDA graph of
//! a whole training step (forward, backward and update) can replay it with a new learning rate
//! each time, as PyTorch's capturable optimizers do.
//!
//! A host-decided step ([`Optimizer::step`](super::Optimizer::step)) is told the learning rate
//! and runs only when the host has read that the step is finite. A gated step
//! ([`Optimizer::step_gated`](super::Optimizer::step_gated)) instead reads [`LiveRates`] where
//! the step runs: the rates the learning rate and the step count give
//! ([`Optimizer::gated_rates`](super::Optimizer::gated_rates), written to the device before the
//! step), and a gate, the step's finite-ness probe (0 when every gradient and sum is finite,
//! NaN otherwise), which skips the whole update when it is not 0. What the host keeps (Adam's
//! step count, whether SGD's momentum buffers have started) moves on afterwards, once the host
//! has read whether the step applied
//! ([`Optimizer::settle_gated`](super::Optimizer::settle_gated)). Host-decided and gated steps
//! give the same values bit for bit.
//!
//! On the CPU a gated step reads the gate and the rates itself (a memory read there); on a
//! CUDA device kandle's kernels read them (`kandle_kernels::cuda::sgd_step_live`,
//! `adam_step_live`).

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// What a gated update reads where it runs: its rates and its gate.
#[derive(Debug, Clone, Copy)]
pub struct LiveRates<'a> {
    /// `f64` values on the variables' device, as
    /// [`Optimizer::gated_rates`](super::Optimizer::gated_rates) gave them.
    pub rates: &'a Tensor,
    /// One `f32` value on the variables' device: the update applies when it is 0 and changes
    /// nothing otherwise (NaN: something in the step was not finite).
    pub gate: &'a Tensor,
}

impl LiveRates<'_> {
    /// The first `n` rates read to the host, or `None` when the gate is closed: for updates
    /// that run on the host's side (the CPU kernels).
    pub(crate) fn read(&self, optimizer: &str, n: usize) -> Result<Option<Vec<f64>>> {
        let gate = self
            .gate
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let [gate] = gate[..] else {
            return Err(Error::invalid(format!(
                "{optimizer}: a gated update's gate holds one value, not {}",
                gate.len()
            )));
        };
        if gate != 0.0 {
            return Ok(None);
        }
        let rates = self.rates.flatten_all()?.to_vec1::<f64>()?;
        if rates.len() < n {
            return Err(Error::invalid(format!(
                "{optimizer}: a gated update reads {n} rates, given {}",
                rates.len()
            )));
        }
        Ok(Some(rates[..n].to_vec()))
    }

    /// The kernels' form of these rates, for an update on a CUDA device.
    #[cfg(feature = "cuda")]
    pub(crate) fn for_kernels(&self) -> crate::kernels::cuda::LiveRates<'_> {
        crate::kernels::cuda::LiveRates {
            rates: self.rates,
            gate: self.gate,
        }
    }
}

/// The error of a gated call to an optimizer that makes no gated updates.
pub(crate) fn not_gated(what: &str) -> Error {
    Error::invalid(format!(
        "{what}: this optimizer makes no gated updates (Optimizer::prepare_gated said so)"
    ))
}

/// The device of `params` where kandle's kernels can make their gated updates: the CPU, or a
/// CUDA device when `cuda_kernels` (the optimizer was not built for the device-generic path);
/// `None` elsewhere and without variables.
pub(crate) fn kernel_device(
    params: &[candle_core::Var],
    cuda_kernels: bool,
) -> Option<candle_core::Device> {
    let device = params.first()?.device();
    (device.is_cpu() || (device.is_cuda() && cuda_kernels)).then(|| device.clone())
}

/// Whether every tensor is a contiguous `f32` tensor on `device`: what the kernels of a gated
/// update take.
pub(crate) fn all_fit<'a>(
    tensors: impl IntoIterator<Item = &'a Tensor>,
    device: &candle_core::Device,
) -> bool {
    tensors
        .into_iter()
        .all(|t| t.device().same_device(device) && t.dtype() == DType::F32 && t.is_contiguous())
}

/// Checks that gated steps give the host-decided steps' variables and state bit for bit on
/// `device`, for SGD (plain, with momentum, Nesterov and weight decay), Adam (with its L2
/// penalty) and AdamW: five steps at falling learning rates, the third not applied (its gate
/// NaN, where the host-decided run skips the step), gradients as views of one buffer.
#[cfg(test)]
pub(crate) fn assert_gated_steps_are_host_steps(device: &candle_core::Device) -> Result<()> {
    use super::{Adam, AdamW, OptimizerConfig, Sgd};
    use candle_core::Var;

    let configs: Vec<(&str, Box<dyn OptimizerConfig>)> = vec![
        ("SGD", Box::new(Sgd::new(0.1))),
        ("SGD momentum", Box::new(Sgd::new(0.1).momentum(0.9))),
        (
            "SGD Nesterov decay",
            Box::new(
                Sgd::new(0.1)
                    .momentum(0.9)
                    .nesterov(true)
                    .weight_decay(5e-4),
            ),
        ),
        ("Adam L2", Box::new(Adam::new(1e-2).weight_decay(1e-2))),
        ("AdamW", Box::new(AdamW::new(1e-2).weight_decay(1e-2))),
    ];
    let shapes: [&[usize]; 4] = [&[7], &[16, 3, 3, 3], &[4097], &[1]];
    let skipped = 2;
    for (name, config) in configs {
        let run = |gated: bool| -> Result<(Vec<Tensor>, super::OptimizerState)> {
            let params: Vec<Var> = shapes
                .iter()
                .zip(1..)
                .map(|(s, seed)| {
                    let values = kandle_testing::random::seeded_normal(s, 1.0, seed)?;
                    Var::from_tensor(&values.to_device(device)?)
                })
                .collect::<candle_core::Result<_>>()?;
            let mut optimizer = config.build_on_path(params.clone(), crate::ComputePath::Auto)?;
            let sizes: Vec<usize> = params.iter().map(|p| p.elem_count()).collect();
            for step in 0..5u64 {
                let lr = 0.05 / (step + 1) as f64;
                let fused =
                    kandle_testing::random::seeded_normal(&[sizes.iter().sum()], 1.0, 50 + step)?
                        .to_device(device)?;
                let mut grads = Vec::new();
                let mut offset = 0;
                for (p, &n) in params.iter().zip(&sizes) {
                    grads.push(fused.narrow(0, offset, n)?.reshape(p.shape())?);
                    offset += n;
                }
                let applies = step != skipped;
                if !gated {
                    if applies {
                        optimizer.step(&grads, lr)?;
                    }
                    continue;
                }
                assert!(optimizer.prepare_gated()?, "{name}: no gated updates");
                let rates = Tensor::new(optimizer.gated_rates(lr)?, device)?;
                let gate = Tensor::new(&[if applies { 0f32 } else { f32::NAN }], device)?;
                let live = LiveRates {
                    rates: &rates,
                    gate: &gate,
                };
                optimizer.step_gated(&grads, &live)?;
                optimizer.settle_gated(applies)?;
            }
            let values = params
                .iter()
                .map(|p| p.as_tensor().copy())
                .collect::<candle_core::Result<_>>()?;
            Ok((values, optimizer.state()?))
        };
        let (host, host_state) = run(false)?;
        let (gated, gated_state) = run(true)?;
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            let values = t.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
            Ok(values
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        for (i, (a, b)) in gated.iter().zip(&host).enumerate() {
            assert_eq!(bits(a)?, bits(b)?, "{name}: variable {i}");
        }
        assert_eq!(gated_state.scalars, host_state.scalars, "{name}");
        assert_eq!(
            gated_state.slots.keys().collect::<Vec<_>>(),
            host_state.slots.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (slot, tensors) in &gated_state.slots {
            for (i, (a, b)) in tensors.iter().zip(&host_state.slots[slot]).enumerate() {
                assert_eq!(bits(a)?, bits(b)?, "{name}: {slot} of variable {i}");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    #[test]
    fn gated_steps_are_the_host_decided_steps_on_the_cpu() -> Result<()> {
        assert_gated_steps_are_host_steps(&Device::Cpu)
    }

    /// On a GPU the gated updates run kandle's CUDA kernels, which read the gate and the rates
    /// on the device.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gated_steps_are_the_host_decided_steps_on_a_gpu() -> Result<()> {
        assert_gated_steps_are_host_steps(&crate::devices::cuda(0)?)
    }

    #[test]
    fn a_closed_gate_reads_no_rates_and_bad_rates_are_errors() -> Result<()> {
        let rates = Tensor::new(&[0.5f64, 2.0], &Device::Cpu)?;
        let open = Tensor::new(&[0f32], &Device::Cpu)?;
        let closed = Tensor::new(&[f32::NAN], &Device::Cpu)?;
        let live = |gate| LiveRates {
            rates: &rates,
            gate,
        };
        assert_eq!(live(&open).read("t", 2)?, Some(vec![0.5, 2.0]));
        assert_eq!(live(&closed).read("t", 2)?, None);
        let message = live(&open)
            .read("t", 3)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(message.contains("reads 3 rates, given 2"), "{message}");
        let two = Tensor::new(&[0f32, 0.], &Device::Cpu)?;
        let message = live(&two)
            .read("t", 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(message.contains("one value, not 2"), "{message}");
        Ok(())
    }
}
