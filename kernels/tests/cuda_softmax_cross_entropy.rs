//! kandle's CUDA softmax cross-entropy (`kandle_kernels::cuda::sparse_softmax_cross_entropy`) on
//! a GPU against what kandle's sparse categorical cross-entropy computes on the CPU from logits
//! (candle's `log_softmax` composition, a gather and a negation, differentiated by candle's
//! autograd): the loss of each sample and the logits' gradient of a weighted sum of the losses,
//! within 1e-5 of the largest magnitude in `f32`, on a dense layer's shapes and odd ones (one
//! class, class counts around a warp, thousands of classes); `f64` and half precision; NaNs and
//! infinities; labels outside the classes (an error, as the CPU's gather); and errors for inputs
//! the kernel cannot take.
//!
//! Built with `cuda` and `test-support`. The GPU tests are `#[ignore]`d (`gpu/check.sh` runs
//! them with `--include-ignored`); the test of a CPU tensor's error runs anywhere the binary
//! starts.

mod cuda_support;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use cuda_support::{assert_invalid, assert_matches, gpu, gradients, weighted_sum};
use kandle_kernels::cuda;
use kandle_kernels::test_support::random;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `(samples, classes)`: CIFAR's ten classes at two batch sizes, one class, class counts
/// around a warp of 32, ImageNet's thousand, and a row longer than a block.
const SHAPES: [(usize, usize); 9] = [
    (64, 10),
    (256, 10),
    (1, 1),
    (7, 31),
    (5, 32),
    (9, 33),
    (3, 1000),
    (2, 4099),
    (1000, 3),
];

/// Seeded labels in `0..classes`.
fn labels(n: usize, classes: usize, seed: u64) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(0..classes as u32))
        .collect()
}

/// kandle's CPU path: `-log_softmax(x)[label]` composed of candle's ops as `candle_nn::ops::
/// log_softmax` composes it.
fn cpu_loss(x: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let diff = x.broadcast_sub(&max)?;
    let sum_exp = diff.exp()?.sum_keepdim(D::Minus1)?;
    let log_p = diff.broadcast_sub(&sum_exp.log()?)?;
    log_p.gather(&labels.unsqueeze(1)?, 1)?.squeeze(1)?.neg()
}

/// The loss and the logits' gradient of a weighted sum of it (its weights rounded to
/// `rounding`), on `dev` in `dtype` (the CPU path on the CPU, the kernel elsewhere), as `f32` on
/// the host.
fn pass(
    x: &Tensor,
    labels: &[u32],
    dev: &Device,
    (dtype, rounding): (DType, DType),
) -> Result<(Tensor, Tensor)> {
    let xv = Var::from_tensor(&x.to_dtype(dtype)?.to_device(dev)?)?;
    let y = Tensor::new(labels, dev)?;
    let loss = if dev.is_cpu() {
        cpu_loss(xv.as_tensor(), &y)?
    } else {
        cuda::sparse_softmax_cross_entropy(xv.as_tensor(), &y)?
    };
    assert_eq!(loss.dtype(), dtype);
    let grads = gradients(&weighted_sum(&loss, 3, rounding)?, &[&xv])?;
    Ok((
        loss.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
        grads[0].clone(),
    ))
}

/// Fails naming `what` unless the kernel's loss and gradient on logits `x` match the CPU path's
/// within `tol`, the CPU path running in `f32` on `x` rounded to `dtype`.
fn check(what: &str, x: &Tensor, labels: &[u32], dtype: DType, tol: f32) -> Result<()> {
    let x = x.to_dtype(dtype)?.to_dtype(DType::F32)?;
    let reference = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let (want_loss, want_dx) = pass(&x, labels, &Device::Cpu, (reference, dtype))?;
    let (loss, dx) = pass(&x, labels, &gpu()?, (dtype, dtype))?;
    assert_matches(&format!("{what}: loss"), &loss, &want_loss, tol)?;
    assert_matches(&format!("{what}: gradient"), &dx, &want_dx, tol)?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loss_and_gradient_match_the_cpu_path_in_f32() -> Result<()> {
    for (i, &(n, c)) in SHAPES.iter().enumerate() {
        // Logits spread over [-4, 4] and around 30, where exp overflows without the maximum.
        for (scale, offset) in [(4.0, 0.0), (1.0, 30.0)] {
            let x = ((random(&[n, c], 20 + i as u64, 0.0)? * scale)? + offset)?;
            let y = labels(n, c, 70 + i as u64);
            check(
                &format!("({n}, {c}) x{scale} +{offset}"),
                &x,
                &y,
                DType::F32,
                1e-5,
            )?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn f64_and_half_precision() -> Result<()> {
    for (i, &(n, c)) in [(64usize, 10usize), (9, 33), (3, 1000)].iter().enumerate() {
        let x = (random(&[n, c], 40 + i as u64, 0.0)? * 3.0)?;
        let y = labels(n, c, 90 + i as u64);
        check(&format!("({n}, {c}) f64"), &x, &y, DType::F64, 1e-5)?;
        check(&format!("({n}, {c}) f16"), &x, &y, DType::F16, 1e-2)?;
        check(&format!("({n}, {c}) bf16"), &x, &y, DType::BF16, 2e-2)?;
    }
    Ok(())
}

/// A saturated softmax: the loss of the unlikely class is its logit's distance, not infinity.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_saturated_softmax_keeps_its_loss() -> Result<()> {
    let dev = gpu()?;
    let x = Tensor::new(&[[200f32, 0.], [0., -200.]], &dev)?;
    let y = Tensor::new(&[1u32, 1], &dev)?;
    let loss = cuda::sparse_softmax_cross_entropy(&x, &y)?.to_vec1::<f32>()?;
    anyhow::ensure!((loss[0] - 200.0).abs() < 1e-3, "{loss:?}");
    anyhow::ensure!((loss[1] - 200.0).abs() < 1e-3, "{loss:?}");
    Ok(())
}

/// NaN logits make their row's loss and gradient NaN; an infinite logit makes its row NaN
/// (`inf - inf`); a label on a `-inf` logit has an infinite loss; other rows are untouched, as
/// on the CPU path.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nans_and_infinities_propagate_as_on_the_cpu() -> Result<()> {
    let (n, c) = (8, 40);
    let mut values = random(&[n, c], 5, 0.0)?.flatten_all()?.to_vec1::<f32>()?;
    values[3] = f32::NAN; // row 0
    values[c + 39] = f32::NAN; // row 1, its last class
    values[2 * c + 7] = f32::INFINITY; // row 2
    values[3 * c + 5] = f32::NEG_INFINITY; // row 3, its label below
    for v in &mut values[4 * c..5 * c] {
        *v = f32::NEG_INFINITY; // row 4: every logit -inf
    }
    let x = Tensor::from_vec(values, (n, c), &Device::Cpu)?;
    let mut y = labels(n, c, 6);
    y[3] = 5;
    check("specials", &x, &y, DType::F32, 1e-5)?;
    Ok(())
}

/// A label outside the classes is an error naming the (first) sample and the label, as the
/// CPU's gather errs, and not a loss; without the read-back, that row's loss is NaN and the
/// others' are those of good labels.
#[test]
#[ignore = "needs a CUDA GPU"]
fn labels_outside_the_classes_are_errors() -> Result<()> {
    let dev = gpu()?;
    let x = random(&[6, 10], 1, 0.0)?.to_device(&dev)?;
    for (bad, at) in [(10u32, 4usize), (11, 0), (1 << 31, 5)] {
        let mut y = labels(6, 10, 2);
        y[at] = bad;
        if at == 0 {
            y[3] = 12; // a second bad label after the first
        }
        let y = Tensor::new(y.as_slice(), &dev)?;
        let cpu = cpu_loss(&x.to_device(&Device::Cpu)?, &y.to_device(&Device::Cpu)?);
        anyhow::ensure!(cpu.is_err(), "the CPU path took label {bad}");
        assert_invalid(
            cuda::sparse_softmax_cross_entropy(&x, &y),
            &[
                "cuda_sparse_softmax_cross_entropy",
                &format!("label {bad} of sample {at}"),
                "0..10",
            ],
        )?;
        let loss = cuda::sparse_softmax_cross_entropy_with(&x, &y, cuda::LabelCheck::NanLoss)?
            .to_vec1::<f32>()?;
        anyhow::ensure!(loss[at].is_nan(), "label {bad}: loss {}", loss[at]);
        let good: Vec<usize> = (0..6)
            .filter(|&i| i != at && !(at == 0 && i == 3))
            .collect();
        anyhow::ensure!(
            good.iter().all(|&i| loss[i].is_finite()),
            "label {bad}: {loss:?}"
        );
    }
    // The device is still usable.
    let y = Tensor::new(labels(6, 10, 2).as_slice(), &dev)?;
    cuda::sparse_softmax_cross_entropy(&x, &y)?.to_vec1::<f32>()?;
    Ok(())
}

/// `u32::MAX`, candle's "no index", gives a zero loss and gradient, as the CPU path's gather.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_no_index_label_gives_a_zero_loss_as_on_the_cpu() -> Result<()> {
    let x = (random(&[5, 12], 8, 0.0)? * 2.0)?;
    let mut y = labels(5, 12, 9);
    y[1] = u32::MAX;
    y[4] = u32::MAX;
    check("no index", &x, &y, DType::F32, 1e-5)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn inputs_the_kernel_cannot_take_are_errors_naming_the_op() -> Result<()> {
    let dev = gpu()?;
    let op = "cuda_sparse_softmax_cross_entropy";
    let x = Tensor::zeros((4, 3), DType::F32, &dev)?;
    let y = Tensor::new(&[0u32, 1, 2, 0], &dev)?;
    assert_invalid(
        cuda::sparse_softmax_cross_entropy(&x.reshape((2, 2, 3))?, &y),
        &[op, "(N, C)"],
    )?;
    assert_invalid(
        cuda::sparse_softmax_cross_entropy(&x, &y.to_dtype(DType::F32)?),
        &[op, "u32"],
    )?;
    assert_invalid(
        cuda::sparse_softmax_cross_entropy(&x, &y.narrow(0, 0, 3)?),
        &[op, "4 u32"],
    )?;
    assert_invalid(
        cuda::sparse_softmax_cross_entropy(&x, &y.to_device(&Device::Cpu)?),
        &[op, "Cpu"],
    )?;
    assert_invalid(
        cuda::sparse_softmax_cross_entropy(&x.to_dtype(DType::U32)?, &y),
        &[op, "U32"],
    )?;
    // A strided input is made contiguous.
    let xt = Tensor::zeros((3, 4), DType::F32, &dev)?.t()?;
    let loss = cuda::sparse_softmax_cross_entropy(&xt, &y)?.to_vec1::<f32>()?;
    anyhow::ensure!(
        loss.iter().all(|l| (l - 3f32.ln()).abs() < 1e-6),
        "{loss:?}"
    );
    Ok(())
}

#[test]
fn a_cpu_tensor_is_an_error_pointing_to_the_cpu_path() -> Result<()> {
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
    let y = Tensor::new(&[0u32, 1], &Device::Cpu)?;
    assert_invalid(
        cuda::sparse_softmax_cross_entropy(&x, &y),
        &["cuda_sparse_softmax_cross_entropy", "log_softmax"],
    )
}
