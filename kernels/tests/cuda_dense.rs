//! kandle's cuBLASLt Dense product (`kandle_kernels::cuda::dense`) on a GPU against a float64
//! reference on the CPU: `x W^T + b` with and without the bias in the epilogue,
//! and the gradients of the input, the weight and the bias of a weighted sum of the output
//! (through candle's autograd), on a Dense layer's shapes (a 10-class head at batch 64 and 256,
//! a hidden layer, one sample, odd sizes, an input starting at an address cuBLASLt's fastest
//! algorithms do not take); in `f32` within 1e-4 of the largest magnitude (FMA math, no TF32:
//! TF32 would miss it by about 1e-3), and `f16` and `bf16` within two of their roundings; a
//! second call gives the same bits; an empty batch; NaNs propagate to their rows; and errors for
//! inputs the product cannot take.
//!
//! Built with `cuda` and `test-support`. The GPU tests are `#[ignore]`d (`gpu/check.sh` runs
//! them with `--include-ignored`); the test of a CPU tensor's error runs anywhere the binary
//! starts.

mod cuda_support;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use cuda_support::{assert_invalid, assert_matches, gpu, gradients, host, weighted_sum};
use kandle_kernels::cuda;
use kandle_kernels::test_support::random;

/// `(batch, features, units)`.
const SHAPES: [(usize, usize, usize); 7] = [
    (64, 256, 10),
    (256, 256, 10),
    (128, 784, 128),
    (1, 64, 32),
    (7, 33, 5),
    (3, 1, 17),
    (33, 100, 1),
];

/// The output and the input's, weight's and bias's gradients of a weighted sum of it, in
/// `f64` on the CPU through candle's ops, from the same (rounded) values.
fn reference(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Vec<Tensor>> {
    let cpu = |t: &Tensor| -> Result<Var> {
        Ok(Var::from_tensor(
            &t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?,
        )?)
    };
    let (x, w) = (cpu(x)?, cpu(w)?);
    let b = b.map(cpu).transpose()?;
    let mut y = x.matmul(&w.t()?)?;
    if let Some(b) = &b {
        y = y.broadcast_add(b)?;
    }
    let loss = weighted_sum(&y, 7, DType::BF16)?;
    let mut vars = vec![&x, &w];
    vars.extend(b.as_ref());
    let mut out = vec![y.to_dtype(DType::F32)?];
    out.extend(gradients(&loss, &vars)?);
    Ok(out)
}

/// The same through the kernel on the GPU, in `dtype`.
fn on_gpu(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Vec<Tensor>> {
    let (x, w) = (Var::from_tensor(x)?, Var::from_tensor(w)?);
    let b = b.map(Var::from_tensor).transpose()?;
    let y = cuda::dense(&x, &w, b.as_ref().map(|b| b.as_tensor()))?;
    let loss = weighted_sum(&y, 7, DType::BF16)?;
    let mut vars = vec![&x, &w];
    vars.extend(b.as_ref());
    let mut out = vec![y.to_device(&Device::Cpu)?.to_dtype(DType::F32)?];
    out.extend(gradients(&loss, &vars)?);
    Ok(out)
}

/// Seeded operands of a shape on the GPU in `dtype`.
fn operands(
    (n, k, u): (usize, usize, usize),
    dtype: DType,
    seed: u64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = gpu()?;
    let put = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(&dev)?) };
    Ok((
        put(random(&[n, k], seed, 0.0)?)?,
        put((random(&[u, k], seed + 1, 0.0)? / (k as f64).sqrt())?)?,
        put((random(&[u], seed + 2, 0.0)? * 0.5)?)?,
    ))
}

fn check(dtype: DType, tol: f32) -> Result<()> {
    for (i, &shape) in SHAPES.iter().enumerate() {
        let (x, w, b) = operands(shape, dtype, 10 * i as u64)?;
        for bias in [true, false] {
            let b = bias.then_some(&b);
            let got = on_gpu(&x, &w, b)?;
            let want = reference(&x, &w, b)?;
            for (what, (g, r)) in ["output", "input grad", "weight grad", "bias grad"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                assert_matches(
                    &format!("{dtype:?} {shape:?} bias {bias}: {what}"),
                    g,
                    r,
                    tol,
                )?;
            }
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU: run by gpu/check.sh"]
fn f32_products_and_gradients_match_float64() -> Result<()> {
    check(DType::F32, 1e-4)
}

/// `f16` rounds to 2^-11 and `bf16` to 2^-8 of a value; the output is rounded once, the
/// gradients after candle's GEMMs in the same dtype.
#[test]
#[ignore = "needs a CUDA GPU: run by gpu/check.sh"]
fn half_precision_products_and_gradients_match_float64() -> Result<()> {
    check(DType::F16, 2.0 * 2f32.powi(-11) * 4.0)?;
    check(DType::BF16, 2.0 * 2f32.powi(-8) * 4.0)
}

/// The same call twice gives the same bits (the plan is made once, then looked up); an input
/// and a bias that start 4 bytes into their buffers (parts of larger tensors) give what tensors
/// of their own give.
#[test]
#[ignore = "needs a CUDA GPU: run by gpu/check.sh"]
fn repeated_calls_agree_bit_for_bit_and_unaligned_inputs_are_taken() -> Result<()> {
    let (x, w, b) = operands((64, 256, 10), DType::F32, 3)?;
    let first = host(&cuda::dense(&x, &w, Some(&b))?)?;
    let second = host(&cuda::dense(&x, &w, Some(&b))?)?;
    assert_eq!(
        first.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        second.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );

    // One value in: the rows start 4 bytes past a 256-byte boundary.
    let flat = random(&[1 + 63 * 255], 5, 0.0)?.to_device(&gpu()?)?;
    let shifted = flat.narrow(0, 1, 63 * 255)?.reshape((63, 255))?;
    let w = w.narrow(1, 0, 255)?.contiguous()?;
    let own = shifted.force_contiguous()?; // a buffer of its own
    assert_matches(
        "an input 4 bytes into its buffer",
        &cuda::dense(&shifted, &w, Some(&b))?,
        &cuda::dense(&own, &w, Some(&b))?,
        1e-5,
    )?;

    // A bias 4 bytes into its buffer is copied to a start the epilogue takes.
    let biases = random(&[11], 6, 0.0)?.to_device(&gpu()?)?;
    let shifted = biases.narrow(0, 1, 10)?;
    assert_matches(
        "a bias 4 bytes into its buffer",
        &cuda::dense(&own, &w, Some(&shifted))?,
        &cuda::dense(&own, &w, Some(&shifted.force_contiguous()?))?,
        0.0,
    )?;
    Ok(())
}

/// An empty batch gives an empty output; a NaN in an input row makes that row's outputs NaN
/// and leaves the other rows alone.
#[test]
#[ignore = "needs a CUDA GPU: run by gpu/check.sh"]
fn empty_batches_and_nans() -> Result<()> {
    let dev = gpu()?;
    let (x, w, b) = operands((4, 8, 3), DType::F32, 9)?;
    let empty = cuda::dense(&x.narrow(0, 0, 0)?, &w, Some(&b))?;
    assert_eq!(empty.dims(), &[0, 3]);

    let mut values = host(&x)?;
    values[8] = f32::NAN; // row 1
    let x = Tensor::from_vec(values, (4, 8), &dev)?;
    let y = host(&cuda::dense(&x, &w, Some(&b))?)?;
    assert!(y[3..6].iter().all(|v| v.is_nan()), "{y:?}");
    assert!(y[..3].iter().chain(&y[6..]).all(|v| v.is_finite()), "{y:?}");
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU: run by gpu/check.sh"]
fn inputs_the_product_cannot_take_are_errors() -> Result<()> {
    let dev = gpu()?;
    let (x, w, b) = operands((4, 8, 3), DType::F32, 1)?;
    assert_invalid(
        cuda::dense(&x.to_dtype(DType::F64)?, &w, None),
        &["dense", "F64"],
    )?;
    assert_invalid(
        cuda::dense(&x, &w.narrow(1, 0, 7)?, None),
        &["dense", "the weight", "(units, 8)"],
    )?;
    assert_invalid(
        cuda::dense(&x, &w.to_dtype(DType::F16)?, None),
        &["dense", "the weight", "F16"],
    )?;
    assert_invalid(
        cuda::dense(&x, &w, Some(&b.narrow(0, 0, 2)?)),
        &["dense", "the bias", "(3)"],
    )?;
    assert_invalid(
        cuda::dense(&x.reshape((2, 2, 8))?, &w, None),
        &["dense", "[2, 2, 8]", "(batch, features)"],
    )?;
    assert_invalid(
        cuda::dense(&x, &Tensor::zeros((3, 8), DType::F32, &Device::Cpu)?, None),
        &["dense", "the weight", "Cpu"],
    )?;
    let _ = dev;
    Ok(())
}

#[test]
fn a_cpu_input_is_an_error_naming_the_device() -> Result<()> {
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
    let w = Tensor::zeros((4, 3), DType::F32, &Device::Cpu)?;
    assert_invalid(cuda::dense(&x, &w, None), &["dense", "CUDA device", "Cpu"])
}
