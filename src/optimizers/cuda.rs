//! The optimizers' updates of `f32` variables on a CUDA device through kandle's CUDA kernels
//! (the `cuda` feature): every variable of the device that the kernels take, with its gradient
//! and state, updated in place in one launch (`kandle_kernels::cuda::{sgd_step, adam_step}`),
//! with the CPU kernels' arithmetic. The others (other dtypes and devices, strided tensors) are
//! left to the caller, which updates them with candle's ops. An optimizer built on the
//! device-generic path ([`ComputePath::DeviceGeneric`](crate::ComputePath::DeviceGeneric), what
//! `KANDLE_COMPUTE=device-generic` selects) keeps candle's ops for every variable, for
//! comparison.

use candle_core::{DType, Device, Tensor, Var};

use super::gated::LiveRates;
use super::sgd::Sgd;
use crate::kernels::cuda::{adam_step, adam_step_live, sgd_step, sgd_step_live, MomentumBuffers};
use crate::kernels::optimizer::adam::{AdamStep, FirstMoment, SecondMoment};
use crate::kernels::optimizer::sgd::Descent;
use crate::Result;

/// The CUDA device of the first variable on one, if any: the device whose variables one launch
/// updates.
fn device(params: &[Var]) -> Option<Device> {
    params
        .iter()
        .map(|p| p.device())
        .find(|d| d.is_cuda())
        .cloned()
}

/// Whether the kernels take `t` on `device`: a contiguous `f32` tensor there.
fn fits(t: &Tensor, device: &Device) -> bool {
    t.device().same_device(device) && t.dtype() == DType::F32 && t.is_contiguous()
}

/// SGD's step at learning rate `lr` for the variables the kernels take, their momentum buffers
/// made on their first step with momentum (as copies of the decayed gradient, as candle's ops
/// make them); returns which variables it updated.
pub(super) fn sgd(
    params: &[Var],
    grads: &[Tensor],
    buffers: &mut [Option<Tensor>],
    config: Sgd,
    lr: f64,
) -> Result<Vec<bool>> {
    let mut done = vec![false; params.len()];
    let Some(device) = device(params) else {
        return Ok(done);
    };
    let momentum = config.momentum != 0.0;
    // Variables whose buffers exist (or that need none), and those taking their first step.
    let (mut running, mut starting) = (Vec::new(), Vec::new());
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        if !(fits(p.as_tensor(), &device) && fits(g, &device)) {
            continue;
        }
        match &buffers[i] {
            _ if !momentum => running.push(i),
            Some(b) if fits(b, &device) => running.push(i),
            None => starting.push(i),
            Some(_) => {}
        }
    }
    let descent = Descent {
        learning_rate: lr,
        momentum: config.momentum,
        nesterov: config.nesterov,
        weight_decay: config.weight_decay,
    };
    let operands = |group: &[usize]| -> (Vec<&Tensor>, Vec<&Tensor>) {
        let p = group.iter().map(|&i| params[i].as_tensor()).collect();
        let g = group.iter().map(|&i| &grads[i]).collect();
        (p, g)
    };
    if !running.is_empty() {
        let (p, g) = operands(&running);
        let b: Vec<&Tensor> = running
            .iter()
            .filter_map(|&i| buffers[i].as_ref())
            .collect();
        let state = if momentum {
            MomentumBuffers::Update(&b)
        } else {
            MomentumBuffers::None
        };
        sgd_step(&p, &g, state, &descent)?;
    }
    if !starting.is_empty() {
        let (p, g) = operands(&starting);
        let fresh = p
            .iter()
            .map(|p| p.zeros_like())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let b: Vec<&Tensor> = fresh.iter().collect();
        sgd_step(&p, &g, MomentumBuffers::Start(&b), &descent)?;
        for (&i, buffer) in starting.iter().zip(fresh) {
            buffers[i] = Some(buffer);
        }
    }
    for i in running.into_iter().chain(starting) {
        done[i] = true;
    }
    Ok(done)
}

/// Adam's or AdamW's step (the CPU kernels' three ops, fused) for the variables the kernels
/// take with their moments `(m, v)`; returns which variables it updated.
pub(super) fn adam(
    params: &[Var],
    grads: &[Tensor],
    (m, v): (&[Tensor], &[Tensor]),
    ops: (&FirstMoment, &SecondMoment, &AdamStep),
) -> Result<Vec<bool>> {
    let mut done = vec![false; params.len()];
    let Some(device) = device(params) else {
        return Ok(done);
    };
    let group: Vec<usize> = (0..params.len())
        .filter(|&i| {
            [params[i].as_tensor(), &grads[i], &m[i], &v[i]]
                .into_iter()
                .all(|t| fits(t, &device))
        })
        .collect();
    if group.is_empty() {
        return Ok(done);
    }
    let p: Vec<&Tensor> = group.iter().map(|&i| params[i].as_tensor()).collect();
    let (g, mg, vg) = (pick(grads, &group), pick(m, &group), pick(v, &group));
    let (first, second, step) = ops;
    adam_step(&p, &g, (&mg, &vg), (first, second), step)?;
    for i in group {
        done[i] = true;
    }
    Ok(done)
}

/// SGD's gated update ([`crate::optimizers::gated`]) of `params`, all of them on one CUDA
/// device (`prepare_gated` checked), with their momentum `buffers` (none without momentum): one
/// launch that reads the gate and the rates on the device.
pub(super) fn sgd_gated(
    params: &[Var],
    grads: &[Tensor],
    buffers: &[&Tensor],
    config: Sgd,
    live: &LiveRates<'_>,
) -> Result<()> {
    let descent = Descent {
        learning_rate: 0.0,
        momentum: config.momentum,
        nesterov: config.nesterov,
        weight_decay: config.weight_decay,
    };
    let state = match config.momentum != 0.0 {
        true => MomentumBuffers::Update(buffers),
        false => MomentumBuffers::None,
    };
    let p: Vec<&Tensor> = params.iter().map(|p| p.as_tensor()).collect();
    let g: Vec<&Tensor> = grads.iter().collect();
    sgd_step_live(&p, &g, state, &descent, &live.for_kernels())?;
    Ok(())
}

/// Adam's or AdamW's gated update of `params`, all of them on one CUDA device, with their
/// moments `(m, v)` and the kernels' ops (whose rates the launch reads on the device instead).
pub(super) fn adam_gated(
    params: &[Var],
    grads: &[Tensor],
    (m, v): (&[Tensor], &[Tensor]),
    ops: (&FirstMoment, &SecondMoment, &AdamStep),
    live: &LiveRates<'_>,
) -> Result<()> {
    let p: Vec<&Tensor> = params.iter().map(|p| p.as_tensor()).collect();
    let all: Vec<usize> = (0..params.len()).collect();
    let (g, mg, vg) = (pick(grads, &all), pick(m, &all), pick(v, &all));
    let (first, second, step) = ops;
    adam_step_live(
        &p,
        &g,
        (&mg, &vg),
        (first, second),
        step,
        &live.for_kernels(),
    )?;
    Ok(())
}

/// The tensors of `list` at `indices`.
fn pick<'a>(list: &'a [Tensor], indices: &[usize]) -> Vec<&'a Tensor> {
    indices.iter().map(|&i| &list[i]).collect()
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};
    use kandle_kernels::test_support::{assert_close, random};

    use crate::optimizers::{Adam, AdamW, Optimizer, Sgd};

    /// Variables of odd sizes and sizes around the kernels' chunk, and a bias-like one.
    const SHAPES: [&[usize]; 5] = [&[7], &[64, 3, 3, 3], &[4097], &[10, 33], &[1]];

    /// Seeded variables of [`SHAPES`] on `dev`.
    fn variables(dev: &Device) -> anyhow::Result<Vec<Var>> {
        SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Ok(Var::from_tensor(
                    &random(s, 3 + i as u64, 0.0)?.to_device(dev)?,
                )?)
            })
            .collect()
    }

    /// Builds an optimizer for the variables, told whether to use kandle's CUDA kernels.
    type Build = dyn Fn(Vec<Var>, bool) -> crate::Result<Box<dyn Optimizer>>;

    /// Four steps of the optimizer `build` makes on `dev` at falling learning rates, with
    /// gradients that are views into one fused buffer (as a training step hands them over).
    /// Returns the variables and the state's slots.
    fn train(
        build: &Build,
        dev: &Device,
        kernels: bool,
    ) -> anyhow::Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
        let params = variables(dev)?;
        let mut optimizer = build(params.clone(), kernels)?;
        let sizes: Vec<usize> = params.iter().map(|p| p.elem_count()).collect();
        for step in 0..4u64 {
            let fused = random(&[sizes.iter().sum()], 50 + step, 0.0)?.to_device(dev)?;
            let mut offset = 0;
            let mut grads = Vec::new();
            for (p, &n) in params.iter().zip(&sizes) {
                grads.push(fused.narrow(0, offset, n)?.reshape(p.shape())?);
                offset += n;
            }
            optimizer.step(&grads, 0.05 / (step + 1) as f64)?;
        }
        let values = params
            .iter()
            .map(|p| p.as_tensor().copy())
            .collect::<candle_core::Result<_>>()?;
        let state = optimizer.state()?;
        Ok((values, state.slots.into_values().collect()))
    }

    /// On a CUDA device SGD (plain, momentum, Nesterov, weight decay), Adam (with its L2
    /// penalty) and AdamW update their `f32` variables with kandle's CUDA kernels, which give
    /// the CPU kernels' values, and agree with the same optimizers on candle's ops (the
    /// device-generic path, `KANDLE_COMPUTE=device-generic`) in the variables and the state
    /// after several steps.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_kernels_match_the_device_generic_path() -> anyhow::Result<()> {
        let gpu = crate::devices::cuda(0)?;
        let sgd = |config: Sgd| -> Box<Build> { Box::new(move |p, k| config.build_with(p, k)) };
        let configs: Vec<(&str, Box<Build>)> = vec![
            ("SGD", sgd(Sgd::new(0.1))),
            ("SGD decay", sgd(Sgd::new(0.1).weight_decay(1e-3))),
            ("SGD momentum", sgd(Sgd::new(0.1).momentum(0.9))),
            (
                "SGD Nesterov decay",
                sgd(Sgd::new(0.1)
                    .momentum(0.9)
                    .nesterov(true)
                    .weight_decay(5e-4)),
            ),
            ("Adam", Box::new(|p, k| Adam::new(1e-2).build_with(p, k))),
            (
                "Adam L2",
                Box::new(|p, k| Adam::new(1e-2).weight_decay(1e-2).build_with(p, k)),
            ),
            (
                "AdamW",
                Box::new(|p, k| AdamW::new(1e-2).weight_decay(1e-2).build_with(p, k)),
            ),
        ];
        for (name, build) in &configs {
            let (values, state) = train(build.as_ref(), &gpu, true)?;
            let (generic, generic_state) = train(build.as_ref(), &gpu, false)?;
            let (cpu, cpu_state) = train(build.as_ref(), &Device::Cpu, true)?;
            let mut bit_for_bit = true;
            for (i, ((v, g), c)) in values.iter().zip(&generic).zip(&cpu).enumerate() {
                assert_close(&format!("{name}: variable {i}"), v, g, 1e-5)?;
                let bits = |t: &Tensor| -> anyhow::Result<Vec<u32>> {
                    let values = t.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
                    Ok(values.iter().map(|v| v.to_bits()).collect())
                };
                bit_for_bit &= bits(v)? == bits(c)?;
            }
            anyhow::ensure!(state.len() == generic_state.len() && state.len() == cpu_state.len());
            for (k, (slot, generic_slot)) in state.iter().zip(&generic_state).enumerate() {
                for (i, (s, g)) in slot.iter().zip(generic_slot).enumerate() {
                    assert_close(&format!("{name}: state {k} of variable {i}"), s, g, 1e-5)?;
                }
            }
            println!("{name}: the CUDA kernels give the CPU kernels' bits: {bit_for_bit}");
        }
        Ok(())
    }
}
