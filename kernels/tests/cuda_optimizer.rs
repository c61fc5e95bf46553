//! kandle's CUDA optimizer updates (`kandle_kernels::cuda::{sgd_step, adam_step}`) on a GPU
//! against the CPU kernels (`kandle_kernels::optimizer`): SGD without momentum, with momentum,
//! Nesterov's and weight decay, Adam with and without its L2 penalty and AdamW, over several
//! steps (the state carried, the learning rate changing), on variables of odd sizes and sizes
//! around the kernel's chunk in one launch, with a gradient that is a view into a larger buffer,
//! hundreds of small variables, NaNs and infinities; and errors for operands the kernels cannot
//! take. The values are compared within 1e-5 of the largest magnitude (the kernels make the
//! CPU's operations, so they are expected equal bit for bit; each test says whether they were).
//!
//! Built with `cuda` and `test-support`. The GPU tests are `#[ignore]`d (`gpu/check.sh` runs
//! them with `--include-ignored`); the test of a CPU tensor's error runs anywhere the binary
//! starts.

#[allow(dead_code)]
mod cuda_support;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use cuda_support::{assert_invalid, assert_matches, gpu, host};
use kandle_kernels::cuda::{self, MomentumBuffers};
use kandle_kernels::optimizer::adam::{AdamStep, FirstMoment, SecondMoment, WeightDecay};
use kandle_kernels::optimizer::sgd::{Descent, Momentum};
use kandle_kernels::test_support::{random, SPECIAL_VALUES};

/// The tolerance, times the largest magnitude (at least one).
const TOL: f32 = 1e-5;

/// Odd sizes, sizes around the kernels' chunk of 4,096 values and its block of 256 threads, and
/// a large one, updated in one launch.
const SIZES: [usize; 9] = [1, 7, 255, 256, 4095, 4096, 4097, 10_007, 70_001];

/// Steps per test, each with its own learning rate.
const STEPS: usize = 4;

/// One optimizer's tensors on the CPU and on the GPU.
struct Copies {
    cpu: Vec<Tensor>,
    gpu: Vec<Tensor>,
}

impl Copies {
    /// Seeded tensors of `sizes` around `offset`, `f32` on the CPU and copies on `dev`.
    fn random(sizes: &[usize], seed: u64, offset: f32, dev: &Device) -> Result<Self> {
        let cpu = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| random(&[n], seed + i as u64, offset))
            .collect::<Result<Vec<_>>>()?;
        Self::of(cpu, dev)
    }

    /// `cpu` and copies of it on `dev`.
    fn of(cpu: Vec<Tensor>, dev: &Device) -> Result<Self> {
        let gpu = cpu
            .iter()
            .map(|t| Ok(t.to_device(dev)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { cpu, gpu })
    }

    fn gpu_refs(&self) -> Vec<&Tensor> {
        self.gpu.iter().collect()
    }

    /// Fails naming `what` unless the GPU's tensors match the CPU's; returns whether they are
    /// equal bit for bit.
    fn assert_match(&self, what: &str) -> Result<bool> {
        let mut exact = true;
        for (i, (g, c)) in self.gpu.iter().zip(&self.cpu).enumerate() {
            assert_matches(&format!("{what}, tensor {i}"), g, c, TOL)?;
            let bits = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            exact &= bits(host(g)?) == bits(host(c)?);
        }
        Ok(exact)
    }
}

/// `t` with special values (NaN, infinities, signed zeros) at a few places.
fn with_specials(t: &Tensor, seed: usize) -> Result<Tensor> {
    let mut v = t.to_vec1::<f32>()?;
    let n = v.len();
    for (k, s) in SPECIAL_VALUES.iter().enumerate() {
        if n > 1 {
            v[(seed * 31 + k * 7919) % n] = *s;
        }
    }
    Ok(Tensor::from_vec(v, n, &Device::Cpu)?)
}

/// `STEPS` steps of SGD with `(momentum, nesterov, weight_decay)` on the CPU kernels and on the
/// GPU, compared after each; returns whether every step was equal bit for bit.
fn check_sgd(
    sizes: &[usize],
    (momentum, nesterov, weight_decay): (f64, bool, f64),
    specials: bool,
    seed: u64,
) -> Result<bool> {
    let dev = gpu()?;
    let what = |step: usize, part: &str| {
        format!(
            "SGD momentum {momentum} nesterov {nesterov} decay {weight_decay}, step {step}: {part}"
        )
    };
    let mut params = Copies::random(sizes, seed, 0.0, &dev)?;
    if specials {
        let cpu = (params.cpu.iter().enumerate())
            .map(|(i, t)| with_specials(t, i))
            .collect::<Result<Vec<_>>>()?;
        params = Copies::of(cpu, &dev)?;
    }
    let buffers = Copies::of(
        (params.cpu.iter())
            .map(|p| Ok(p.zeros_like()?))
            .collect::<Result<Vec<_>>>()?,
        &dev,
    )?;
    let mut exact = true;
    for step in 0..STEPS {
        let mut grads = Copies::random(sizes, seed + 100 * (step as u64 + 1), 0.0, &dev)?;
        if specials {
            let cpu = (grads.cpu.iter().enumerate())
                .map(|(i, t)| with_specials(t, i + 3 * step))
                .collect::<Result<Vec<_>>>()?;
            grads = Copies::of(cpu, &dev)?;
        }
        let descent = Descent {
            learning_rate: 0.05 / (step + 1) as f64,
            momentum,
            nesterov,
            weight_decay,
        };
        for ((p, g), b) in params.cpu.iter().zip(&grads.cpu).zip(&buffers.cpu) {
            if momentum != 0.0 {
                // A zero buffer takes the gradient on the first step, as the GPU's `Start`.
                let m = Momentum {
                    momentum,
                    weight_decay,
                };
                b.inplace_op3(g, p, &m)?;
                p.inplace_op3(b, g, &descent)?;
            } else {
                p.inplace_op3(g, g, &descent)?;
            }
        }
        let gpu_buffers = buffers.gpu_refs();
        let state = match (momentum != 0.0, step) {
            (false, _) => MomentumBuffers::None,
            (true, 0) => MomentumBuffers::Start(&gpu_buffers),
            (true, _) => MomentumBuffers::Update(&gpu_buffers),
        };
        cuda::sgd_step(&params.gpu_refs(), &grads.gpu_refs(), state, &descent)?;
        exact &= params.assert_match(&what(step, "variables"))?;
        if momentum != 0.0 {
            exact &= buffers.assert_match(&what(step, "buffers"))?;
        }
    }
    Ok(exact)
}

/// `STEPS` steps of Adam (`decoupled`: AdamW) with `weight_decay` on the CPU kernels and on the
/// GPU, compared after each; returns whether every step was equal bit for bit.
fn check_adam(sizes: &[usize], weight_decay: f64, decoupled: bool, specials: bool) -> Result<bool> {
    let dev = gpu()?;
    let (beta_1, beta_2, epsilon) = (0.9, 0.999, 1e-7);
    let seed = 40;
    let what = |step: usize, part: &str| {
        format!("Adam decay {weight_decay} decoupled {decoupled}, step {step}: {part}")
    };
    let mut params = Copies::random(sizes, seed, 0.0, &dev)?;
    if specials {
        let cpu = (params.cpu.iter().enumerate())
            .map(|(i, t)| with_specials(t, i))
            .collect::<Result<Vec<_>>>()?;
        params = Copies::of(cpu, &dev)?;
    }
    let zeros = || -> Result<Copies> {
        Copies::of(
            (params.cpu.iter())
                .map(|p| Ok(p.zeros_like()?))
                .collect::<Result<Vec<_>>>()?,
            &dev,
        )
    };
    let (m, v) = (zeros()?, zeros()?);
    let decay = match (weight_decay != 0.0, decoupled) {
        (true, false) => WeightDecay::L2(weight_decay),
        _ => WeightDecay::None,
    };
    let first = FirstMoment {
        beta: beta_1,
        decay,
    };
    let second = SecondMoment {
        beta: beta_2,
        decay,
    };
    let mut exact = true;
    for step in 0..STEPS {
        let t = step as i32 + 1;
        let mut grads = Copies::random(sizes, seed + 100 * t as u64, 0.0, &dev)?;
        if specials {
            let cpu = (grads.cpu.iter().enumerate())
                .map(|(i, g)| with_specials(g, i + 3 * step))
                .collect::<Result<Vec<_>>>()?;
            grads = Copies::of(cpu, &dev)?;
        }
        let lr = 1e-2 / t as f64;
        let adam = AdamStep {
            step_size: lr / (1.0 - f64::powi(beta_1, t)),
            inv_sqrt_bc2: 1.0 / (1.0 - f64::powi(beta_2, t)).sqrt(),
            epsilon,
            decay_factor: (decoupled && weight_decay != 0.0).then_some(1.0 - lr * weight_decay),
        };
        for (((p, g), m), v) in params.cpu.iter().zip(&grads.cpu).zip(&m.cpu).zip(&v.cpu) {
            m.inplace_op3(g, p, &first)?;
            v.inplace_op3(g, p, &second)?;
            p.inplace_op3(m, v, &adam)?;
        }
        cuda::adam_step(
            &params.gpu_refs(),
            &grads.gpu_refs(),
            (&m.gpu_refs(), &v.gpu_refs()),
            (&first, &second),
            &adam,
        )?;
        exact &= params.assert_match(&what(step, "variables"))?;
        exact &= m.assert_match(&what(step, "first moments"))?;
        exact &= v.assert_match(&what(step, "second moments"))?;
    }
    Ok(exact)
}

/// The SGD flavours of the CPU kernels' own test.
const SGD_FLAVOURS: [(f64, bool, f64); 5] = [
    (0.0, false, 0.0),
    (0.0, false, 1e-3),
    (0.9, false, 0.0),
    (0.9, true, 5e-4),
    (0.5, false, 1e-2),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgd_matches_the_cpu_kernels() -> Result<()> {
    for (i, flavour) in SGD_FLAVOURS.into_iter().enumerate() {
        let exact = check_sgd(&SIZES, flavour, false, 10 + i as u64)?;
        println!("SGD {flavour:?}: bit for bit {exact}");
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adam_and_adamw_match_the_cpu_kernels() -> Result<()> {
    for (weight_decay, decoupled) in [(0.0, false), (1e-2, false), (1e-2, true), (0.0, true)] {
        let exact = check_adam(&SIZES, weight_decay, decoupled, false)?;
        println!("Adam decay {weight_decay} decoupled {decoupled}: bit for bit {exact}");
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nans_and_infinities_propagate_as_on_the_cpu() -> Result<()> {
    let sizes = [9, 300, 5000];
    for (i, flavour) in SGD_FLAVOURS.into_iter().enumerate() {
        check_sgd(&sizes, flavour, true, 60 + i as u64)?;
    }
    for (weight_decay, decoupled) in [(0.0, false), (1e-2, false), (1e-2, true)] {
        check_adam(&sizes, weight_decay, decoupled, true)?;
    }
    Ok(())
}

/// Hundreds of small variables (a network's biases and BatchNorm parameters) between large
/// ones: the chunks find their variables.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hundreds_of_variables_in_one_launch() -> Result<()> {
    let sizes: Vec<usize> = (0..400)
        .map(|i| match i % 50 {
            0 => 20_000 + i,
            _ => 1 + i % 37,
        })
        .collect();
    check_sgd(&sizes, (0.9, true, 1e-4), false, 7)?;
    check_adam(&sizes, 4e-3, true, false)?;
    Ok(())
}

/// Gradients that are views into one fused buffer, as a training step hands them over.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gradients_may_be_views_into_a_fused_buffer() -> Result<()> {
    let dev = gpu()?;
    let sizes = [5usize, 4099, 300];
    let total: usize = sizes.iter().sum();
    let fused = random(&[total + 3], 5, 0.0)?;
    let mut offset = 3;
    let mut grads_cpu = Vec::new();
    for &n in &sizes {
        grads_cpu.push(fused.narrow(0, offset, n)?);
        offset += n;
    }
    let fused_gpu = fused.to_device(&dev)?;
    let mut offset = 3;
    let mut grads_gpu = Vec::new();
    for &n in &sizes {
        grads_gpu.push(fused_gpu.narrow(0, offset, n)?);
        offset += n;
    }
    let params = Copies::random(&sizes, 9, 0.0, &dev)?;
    let descent = Descent {
        learning_rate: 0.1,
        momentum: 0.0,
        nesterov: false,
        weight_decay: 1e-3,
    };
    for (p, g) in params.cpu.iter().zip(&grads_cpu) {
        p.inplace_op3(g, g, &descent)?;
    }
    let grads: Vec<&Tensor> = grads_gpu.iter().collect();
    cuda::sgd_step(&params.gpu_refs(), &grads, MomentumBuffers::None, &descent)?;
    params.assert_match("SGD with gradient views")?;
    // The fused buffer is only read.
    assert_matches("fused gradients", &fused_gpu, &fused, 0.0)?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn operands_the_kernels_cannot_take_are_errors_naming_the_op() -> Result<()> {
    let dev = gpu()?;
    let p = Tensor::zeros(8, DType::F32, &dev)?;
    let g = p.ones_like()?;
    let descent = Descent {
        learning_rate: 0.1,
        momentum: 0.9,
        nesterov: false,
        weight_decay: 0.0,
    };
    let plain = Descent {
        momentum: 0.0,
        ..descent
    };
    let none = MomentumBuffers::None;
    assert_invalid(
        cuda::sgd_step(&[&p], &[&g], none, &descent),
        &["cuda_sgd_step", "momentum buffers"],
    )?;
    assert_invalid(
        cuda::sgd_step(&[&p], &[&g], MomentumBuffers::Start(&[&g]), &plain),
        &["cuda_sgd_step", "without momentum"],
    )?;
    assert_invalid(
        cuda::sgd_step(&[&p], &[], none, &plain),
        &["cuda_sgd_step", "0 gradients for 1 variables"],
    )?;
    let short = Tensor::zeros(7, DType::F32, &dev)?;
    assert_invalid(
        cuda::sgd_step(&[&p], &[&short], none, &plain),
        &["cuda_sgd_step", "gradient of variable 0", "8 values"],
    )?;
    let f64s = p.to_dtype(DType::F64)?;
    assert_invalid(
        cuda::sgd_step(&[&f64s], &[&f64s], none, &plain),
        &["cuda_sgd_step", "F64"],
    )?;
    let strided = Tensor::zeros((4, 2), DType::F32, &dev)?.t()?;
    assert_invalid(
        cuda::sgd_step(&[&p.reshape((2, 4))?], &[&strided], none, &plain),
        &["cuda_sgd_step", "with strides"],
    )?;
    let cpu_grad = Tensor::zeros(8, DType::F32, &Device::Cpu)?;
    assert_invalid(
        cuda::sgd_step(&[&p], &[&cpu_grad], none, &plain),
        &["cuda_sgd_step", "Cpu"],
    )?;
    let first = FirstMoment {
        beta: 0.9,
        decay: WeightDecay::None,
    };
    let second = SecondMoment {
        beta: 0.999,
        decay: WeightDecay::None,
    };
    let adam = AdamStep {
        step_size: 0.1,
        inv_sqrt_bc2: 1.0,
        epsilon: 1e-7,
        decay_factor: None,
    };
    assert_invalid(
        cuda::adam_step(&[&p], &[&g], (&[&g], &[]), (&first, &second), &adam),
        &["cuda_adam_step", "0 states for 1 variables"],
    )?;
    // Nothing to update is no error.
    cuda::adam_step(&[], &[], (&[], &[]), (&first, &second), &adam)?;
    Ok(())
}

#[test]
fn a_cpu_variable_is_an_error_pointing_to_the_cpu_kernels() -> Result<()> {
    let p = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
    let descent = Descent {
        learning_rate: 0.1,
        momentum: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    };
    assert_invalid(
        cuda::sgd_step(&[&p], &[&p], MomentumBuffers::None, &descent),
        &["cuda_sgd_step", "kandle_kernels::optimizer"],
    )
}
