//! kandle's CUDA batch normalisation (`kandle_kernels::cuda::{batch_norm_train,
//! channel_affine}`) on a GPU against the CPU kernels (`kandle_kernels::batch_norm`): the output,
//! the batch statistics, and the gradients of the input, weight and bias through candle's
//! autograd and through the kept op, with and without the fused ReLU, on MiniGoogLeNet's and
//! ResNet's shapes and odd ones, within 1e-4 of the largest magnitude in `f32`; `f64`, `f16` and
//! `bf16`; NaN propagation; strided inputs; and errors for inputs the kernels cannot take. The
//! outputs written into a range of a larger tensor's channels (`batch_norm_train_into`,
//! `channel_affine_into`) and the gradients read from such a range, bit for bit against the
//! same kernels on tensors of their own. SyncBatchNorm's kernels over parts of a batch, their
//! sums added as NCCL adds them, against the CPU kernel over the whole batch.
//!
//! Built with `cuda` and `test-support`. The GPU tests are `#[ignore]`d (`gpu/check.sh` runs
//! them with `--include-ignored`); the test of a CPU tensor's error runs anywhere the binary
//! starts.

mod cuda_support;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use cuda_support::{assert_invalid, assert_matches, gpu, gradients, weighted_sum};
use kandle_kernels::test_support::random;
use kandle_kernels::{batch_norm as cpu, cuda};

/// Keras's default epsilon.
const EPSILON: f64 = 1e-3;

/// MiniGoogLeNet's and ResNet's shapes, odd sizes, a dense layer's `(N, C)` and a
/// three-dimensional one.
const SHAPES: [&[usize]; 6] = [
    &[64, 96, 32, 32],
    &[64, 512, 4, 4],
    &[3, 5, 7, 9],
    &[1, 7, 1, 1],
    &[10, 33],
    &[4, 6, 15],
];

/// Everything a training pass gives: the output, the batch statistics and the gradients of a
/// weighted sum of the output for the input, the weight and the bias.
struct Pass {
    y: Tensor,
    mean: Tensor,
    var: Tensor,
    grads: Vec<Tensor>,
}

/// Seeded input, weight and bias for `dims` (on the CPU, `f32`); the input around `offset`.
fn operands(dims: &[usize], seed: u64, offset: f32) -> Result<[Tensor; 3]> {
    let c = dims[1];
    Ok([
        random(dims, seed, offset)?,
        random(&[c], seed + 1, 1.0)?,
        random(&[c], seed + 2, 0.0)?,
    ])
}

/// A training pass of `train` (the CPU's or the GPU's function, both of one signature) on the
/// operands moved to `dev`, the input in `dtype` and the weight and bias in `param_dtype`; the
/// output gradient's weights rounded to `rounding` (the dtype under test, on both devices).
fn training_pass(
    train: impl Fn(&Tensor, &Tensor, &Tensor) -> kandle_kernels::Result<(Tensor, cpu::BatchStats)>,
    [x, w, b]: &[Tensor; 3],
    dev: &Device,
    (dtype, param_dtype): (DType, DType),
    (seed, rounding): (u64, DType),
) -> Result<Pass> {
    let x = Var::from_tensor(&x.to_dtype(dtype)?.to_device(dev)?)?;
    let w = Var::from_tensor(&w.to_dtype(param_dtype)?.to_device(dev)?)?;
    let b = Var::from_tensor(&b.to_dtype(param_dtype)?.to_device(dev)?)?;
    let (y, stats) = train(x.as_tensor(), w.as_tensor(), b.as_tensor())?;
    let grads = gradients(&weighted_sum(&y, seed, rounding)?, &[&x, &w, &b])?;
    Ok(Pass {
        y,
        mean: stats.mean,
        var: stats.var,
        grads,
    })
}

/// Fails naming `what` unless the two passes agree within `tol`.
fn assert_passes_match(what: &str, got: &Pass, want: &Pass, tol: f32) -> Result<()> {
    assert_matches(&format!("{what}: y"), &got.y, &want.y, tol)?;
    assert_matches(&format!("{what}: mean"), &got.mean, &want.mean, tol)?;
    assert_matches(&format!("{what}: var"), &got.var, &want.var, tol)?;
    for (name, (g, w)) in ["dx", "dweight", "dbias"]
        .iter()
        .zip(got.grads.iter().zip(&want.grads))
    {
        assert_matches(&format!("{what}: {name}"), g, w, tol)?;
    }
    Ok(())
}

/// The GPU's training pass against the CPU's on `dims`, the input in `dtype` (the CPU's on
/// the same values in `f32`), within `tol`.
fn check_training(dims: &[usize], relu: bool, dtype: DType, offset: f32, tol: f32) -> Result<()> {
    let dev = gpu()?;
    let seed = dims.iter().sum::<usize>() as u64 + relu as u64;
    let mut ops = operands(dims, seed, offset)?;
    // The reference sees the input rounded as the GPU does.
    ops[0] = ops[0].to_dtype(dtype)?.to_dtype(DType::F32)?;
    let param_dtype = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let want = training_pass(
        |x, w, b| cpu::batch_norm_train(x, Some(w), Some(b), EPSILON, relu),
        &ops,
        &Device::Cpu,
        (DType::F32, DType::F32),
        (seed, dtype),
    )?;
    let got = training_pass(
        |x, w, b| cuda::batch_norm_train(x, Some(w), Some(b), EPSILON, relu),
        &ops,
        &dev,
        (dtype, param_dtype),
        (seed, dtype),
    )?;
    ensure_dtypes(&got, dtype, param_dtype)?;
    assert_passes_match(&format!("{dims:?} {dtype:?} relu {relu}"), &got, &want, tol)
}

/// Fails unless the GPU's output has the input's dtype and the statistics the parameters'.
fn ensure_dtypes(pass: &Pass, dtype: DType, param_dtype: DType) -> Result<()> {
    anyhow::ensure!(
        pass.y.dtype() == dtype && pass.mean.dtype() == param_dtype,
        "y {:?} and statistics {:?}, expected {dtype:?} and {param_dtype:?}",
        pass.y.dtype(),
        pass.mean.dtype()
    );
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn training_matches_the_cpu_kernel_in_f32() -> Result<()> {
    for dims in SHAPES {
        for relu in [false, true] {
            check_training(dims, relu, DType::F32, 0.0, 1e-4)?;
        }
    }
    // A large mean over a small spread: the sums around each channel's first value keep the
    // variance accurate.
    check_training(&[16, 8, 8, 8], true, DType::F32, 1000.0, 1e-4)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn training_in_f64_and_half_precision() -> Result<()> {
    for dims in [&[64, 96, 32, 32][..], &[3, 5, 7, 9]] {
        check_training(dims, true, DType::F64, 0.0, 1e-4)?;
        check_training(dims, true, DType::F16, 0.0, 2e-3)?;
        check_training(dims, false, DType::BF16, 0.0, 1e-2)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_kept_op_gives_the_cpu_kernels_gradients() -> Result<()> {
    let dev = gpu()?;
    let dims = [8, 12, 6, 5];
    let [x, w, b] = operands(&dims, 7, 0.0)?;
    let dy = random(&dims, 8, 0.0)?;
    let (cpu_replay, cpu_stats) =
        cpu::batch_norm_train_replay(&x, Some(&w), Some(&b), EPSILON, true)?;
    let on_gpu = |t: &Tensor| t.to_device(&dev);
    let (replay, stats) = cuda::batch_norm_train_replay(
        &on_gpu(&x)?,
        Some(&on_gpu(&w)?),
        Some(&on_gpu(&b)?),
        EPSILON,
        true,
    )?;
    assert_matches("y", replay.output(), cpu_replay.output(), 1e-4)?;
    assert_matches("mean", &stats.mean, &cpu_stats.mean, 1e-4)?;
    assert_matches("var", &stats.var, &cpu_stats.var, 1e-4)?;
    let (dx, dw, db) = replay.backward(&on_gpu(&dy)?)?;
    let (want_dx, want_dw, want_db) = cpu_replay.backward(&dy)?;
    for (name, got, want) in [
        ("dx", dx, want_dx),
        ("dweight", dw, want_dw),
        ("dbias", db, want_db),
    ] {
        let (Some(got), Some(want)) = (got, want) else {
            anyhow::bail!("{name}: no gradient");
        };
        assert_matches(name, &got, &want, 1e-4)?;
    }
    // Without weight and bias: ones and zeros.
    let (y, _) = cuda::batch_norm_train(&on_gpu(&x)?, None, None, EPSILON, false)?;
    let (want, _) = cpu::batch_norm_train(&x, None, None, EPSILON, false)?;
    assert_matches("y without weight and bias", &y, &want, 1e-4)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn inference_affine_matches_the_cpu_kernel() -> Result<()> {
    let dev = gpu()?;
    for dims in SHAPES {
        for relu in [false, true] {
            let seed = dims.iter().product::<usize>() as u64 + relu as u64;
            let [x, scale, shift] = operands(dims, seed, 0.0)?;
            let run =
                |dev: &Device,
                 affine: fn(&Tensor, &Tensor, &Tensor, bool) -> kandle_kernels::Result<Tensor>|
                 -> Result<(Tensor, Vec<Tensor>)> {
                    let vars = [&x, &scale, &shift]
                        .map(|t| t.to_device(dev).and_then(|t| Var::from_tensor(&t)));
                    let [x, a, b] = vars;
                    let (x, a, b) = (x?, a?, b?);
                    let y = affine(x.as_tensor(), a.as_tensor(), b.as_tensor(), relu)?;
                    let grads = gradients(&weighted_sum(&y, seed, DType::F32)?, &[&x, &a, &b])?;
                    Ok((y, grads))
                };
            let (y, grads) = run(&dev, cuda::channel_affine)?;
            let (want_y, want_grads) = run(&Device::Cpu, cpu::channel_affine)?;
            let what = format!("{dims:?} relu {relu}");
            assert_matches(&format!("{what}: y"), &y, &want_y, 1e-4)?;
            for (name, (g, w)) in ["dx", "dscale", "dshift"]
                .iter()
                .zip(grads.iter().zip(&want_grads))
            {
                assert_matches(&format!("{what}: {name}"), g, w, 1e-4)?;
            }
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nans_propagate_as_on_the_cpu() -> Result<()> {
    let dev = gpu()?;
    let dims = [4, 3, 5, 5];
    let [x, w, b] = operands(&dims, 11, 0.0)?;
    // One NaN in channel 1 and one infinity in channel 2.
    let mut values = x.flatten_all()?.to_vec1::<f32>()?;
    values[(3 + 1) * 25 + 7] = f32::NAN;
    values[(2 * 3 + 2) * 25 + 3] = f32::INFINITY;
    let x = Tensor::from_vec(values, &dims[..], &Device::Cpu)?;
    let ops = [x.clone(), w.clone(), b.clone()];
    for relu in [false, true] {
        let want = training_pass(
            |x, w, b| cpu::batch_norm_train(x, Some(w), Some(b), EPSILON, relu),
            &ops,
            &Device::Cpu,
            (DType::F32, DType::F32),
            (3, DType::F32),
        )?;
        let got = training_pass(
            |x, w, b| cuda::batch_norm_train(x, Some(w), Some(b), EPSILON, relu),
            &ops,
            &dev,
            (DType::F32, DType::F32),
            (3, DType::F32),
        )?;
        let mean = got.mean.to_vec1::<f32>()?;
        anyhow::ensure!(mean[1].is_nan() && mean[0].is_finite(), "means {mean:?}");
        assert_passes_match(&format!("NaN, relu {relu}"), &got, &want, 1e-4)?;
        // In inference only the NaN's own output is NaN, and its gradient stays finite.
        let y = cuda::channel_affine(
            &x.to_device(&dev)?,
            &w.to_device(&dev)?,
            &b.to_device(&dev)?,
            relu,
        )?;
        let want_y = cpu::channel_affine(&x, &w, &b, relu)?;
        assert_matches(
            &format!("affine with a NaN, relu {relu}"),
            &y,
            &want_y,
            1e-4,
        )?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn strided_inputs_are_made_contiguous() -> Result<()> {
    let dev = gpu()?;
    let x = random(&[6, 4, 5, 8], 21, 0.0)?;
    // (N, C, H, W) seen through a transpose of its last two axes.
    let strided = x.to_device(&dev)?.transpose(2, 3)?;
    let (y, stats) = cuda::batch_norm_train(&strided, None, None, EPSILON, true)?;
    let (want, want_stats) =
        cpu::batch_norm_train(&x.transpose(2, 3)?.contiguous()?, None, None, EPSILON, true)?;
    assert_matches("y", &y, &want, 1e-4)?;
    assert_matches("var", &stats.var, &want_stats.var, 1e-4)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn inputs_the_kernels_cannot_take_are_errors_naming_the_op() -> Result<()> {
    let dev = gpu()?;
    let x = random(&[2, 3, 4, 4], 31, 0.0)?.to_device(&dev)?;
    let ones = |c: usize, dtype: DType| Tensor::ones(c, dtype, &dev);
    let op = "cuda_batch_norm";
    let train =
        |x: &Tensor, w: Option<&Tensor>, eps: f64| cuda::batch_norm_train(x, w, None, eps, false);
    assert_invalid(train(&x.to_dtype(DType::U32)?, None, EPSILON), &[op, "U32"])?;
    assert_invalid(
        train(&x.flatten_all()?, None, EPSILON),
        &[op, "(N, C, ...)"],
    )?;
    assert_invalid(
        train(&x.narrow(0, 0, 0)?, None, EPSILON),
        &[op, "no values"],
    )?;
    assert_invalid(train(&x, None, -1.0), &[op, "epsilon"])?;
    assert_invalid(
        train(&x, Some(&ones(4, DType::F32)?), EPSILON),
        &[op, "weight", "[4]"],
    )?;
    assert_invalid(
        train(&x, Some(&ones(3, DType::F64)?), EPSILON),
        &[op, "weight", "F64"],
    )?;
    let on_cpu = Tensor::ones(3, DType::F32, &Device::Cpu)?;
    assert_invalid(train(&x, Some(&on_cpu), EPSILON), &[op, "weight", "Cpu"])?;
    let affine = "cuda_channel_affine";
    let shift = ones(3, DType::F32)?;
    assert_invalid(
        cuda::channel_affine(&x, &ones(2, DType::F32)?, &shift, true),
        &[affine, "scale"],
    )?;
    let half = x.to_dtype(DType::F16)?;
    assert_invalid(
        cuda::channel_affine(&half, &ones(3, DType::F64)?, &shift, true),
        &[affine, "F64"],
    )?;
    Ok(())
}

/// Runs without a GPU: a CPU tensor is an error that names the op and the CPU's kernel.
#[test]
fn a_cpu_tensor_is_an_error_pointing_to_the_cpu_kernel() -> Result<()> {
    let x = random(&[2, 3, 4, 4], 41, 0.0)?;
    anyhow::ensure!(!cuda::supported(&x), "a CPU tensor reported as supported");
    assert_invalid(
        cuda::batch_norm_train(&x, None, None, EPSILON, true),
        &[
            "cuda_batch_norm",
            "CUDA device",
            "kandle_kernels::batch_norm::batch_norm_train",
        ],
    )?;
    let c = Tensor::ones(3, DType::F32, &Device::Cpu)?;
    assert_invalid(
        cuda::channel_affine(&x, &c, &c, false),
        &[
            "cuda_channel_affine",
            "CUDA device",
            "kandle_kernels::batch_norm::channel_affine",
        ],
    )
}

/// Channels `2..5` of a tensor of 7 channels otherwise holding 7.0, in `dtype`: what a
/// concatenation hands a branch of 3 channels of `dims`.
fn channel_range(dims: &[usize], dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let mut whole_dims = dims.to_vec();
    whole_dims[1] = 7;
    let whole = Tensor::full(7f32, whole_dims, dev)?.to_dtype(dtype)?;
    let part = whole.narrow(1, 2, 3)?;
    Ok((whole, part))
}

/// Fails unless every channel of `whole` outside `2..5` still holds 7.0.
fn assert_rest_untouched(what: &str, whole: &Tensor) -> Result<()> {
    for (start, len) in [(0, 2), (5, 2)] {
        let rest = whole.narrow(1, start, len)?;
        let sevens = rest.ones_like()?.affine(7.0, 0.0)?;
        assert_matches(&format!("{what}: channels {start}.."), &rest, &sevens, 0.0)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_range_of_channels_is_written_and_read_in_place() -> Result<()> {
    // A concatenation's branch writes its channels of the joined output and reads its channels
    // of the joined gradient where they lie: the same kernels as on a tensor of its own, so the
    // same bits.
    let dev = gpu()?;
    for dtype in [DType::F32, DType::F16] {
        for dims in [&[8, 3, 5, 5][..], &[2, 3, 7], &[1, 3, 4, 4]] {
            for relu in [false, true] {
                let what = format!("{dtype:?} {dims:?} relu {relu}");
                let [x, w, b] = operands(dims, 40, 0.5)?;
                let x = x.to_dtype(dtype)?.to_device(&dev)?;
                let (w, b) = (w.to_device(&dev)?, b.to_device(&dev)?);
                let (whole, part) = channel_range(dims, dtype, &dev)?;
                let (backward, stats) =
                    cuda::batch_norm_train_into(&x, Some(&w), Some(&b), EPSILON, relu, &part)?;
                let (replay, want) =
                    cuda::batch_norm_train_replay(&x, Some(&w), Some(&b), EPSILON, relu)?;
                assert_matches(&format!("{what}: y"), &part, replay.output(), 0.0)?;
                assert_matches(&format!("{what}: mean"), &stats.mean, &want.mean, 0.0)?;
                assert_matches(&format!("{what}: var"), &stats.var, &want.var, 0.0)?;
                assert_rest_untouched(&what, &whole)?;

                let (_, joined_dy) = channel_range(dims, dtype, &dev)?;
                let dy_whole = random(joined_dy.dims(), 41, 0.0)?.to_dtype(dtype)?;
                let dy = dy_whole.to_device(&dev)?.narrow(1, 2, 3)?;
                let (dx, dweight, dbias) = backward.backward(&dy)?;
                let copied = replay.backward(&dy.contiguous()?)?;
                let viewed = replay.backward(&dy)?;
                for (name, got, want, kept) in [
                    ("dx", dx, copied.0, viewed.0),
                    ("dweight", dweight, copied.1, viewed.1),
                    ("dbias", dbias, copied.2, viewed.2),
                ] {
                    let want = want.context("a gradient of the kept op is missing")?;
                    let kept = kept.context("a gradient of the kept op is missing")?;
                    assert_matches(&format!("{what}: {name}"), &got, &want, 0.0)?;
                    assert_matches(&format!("{what}: {name} (kept op)"), &kept, &want, 0.0)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_inference_affine_writes_a_range_of_channels() -> Result<()> {
    let dev = gpu()?;
    for relu in [false, true] {
        let what = format!("relu {relu}");
        let dims = [4, 3, 6, 6];
        let [x, scale, shift] = operands(&dims, 42, 0.0)?.map(|t| t.to_device(&dev));
        let (x, scale, shift) = (x?, scale?, shift?);
        let (whole, part) = channel_range(&dims, DType::F32, &dev)?;
        let backward = cuda::channel_affine_into(&x, &scale, &shift, relu, &part)?;
        let vars = [&x, &scale, &shift].map(Var::from_tensor);
        let [xv, av, bv] = vars;
        let (xv, av, bv) = (xv?, av?, bv?);
        let y = cuda::channel_affine(xv.as_tensor(), av.as_tensor(), bv.as_tensor(), relu)?;
        assert_matches(&format!("{what}: y"), &part, &y, 0.0)?;
        assert_rest_untouched(&what, &whole)?;

        let dy = random(&[4, 7, 6, 6], 43, 0.0)?.to_device(&dev)?;
        let dy = dy.narrow(1, 2, 3)?;
        let (dx, dscale, dshift) = backward.backward(&dy)?;
        let grads = (y * &dy.contiguous()?)?.sum_all()?.backward()?;
        for (name, got, var) in [
            ("dx", dx, &xv),
            ("dscale", dscale, &av),
            ("dshift", dshift, &bv),
        ] {
            let want = grads.get(var).context("no autograd gradient")?;
            assert_matches(&format!("{what}: {name}"), &got, want, 0.0)?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_output_that_cannot_take_the_result_is_an_error() -> Result<()> {
    let dev = gpu()?;
    let [x, w, b] = operands(&[2, 3, 4, 4], 44, 0.0)?.map(|t| t.to_device(&dev));
    let (x, w, b) = (x?, w?, b?);
    let wrong_shape = Tensor::zeros((2, 4, 4, 4), DType::F32, &dev)?;
    let wrong_dtype = Tensor::zeros((2, 3, 4, 4), DType::F16, &dev)?;
    // Rows of a transposed tensor: no image is contiguous.
    let scattered = Tensor::zeros((2, 4, 4, 3), DType::F32, &dev)?.permute((0, 3, 1, 2))?;
    for out in [wrong_shape, wrong_dtype, scattered] {
        let result = cuda::batch_norm_train_into(&x, Some(&w), Some(&b), EPSILON, true, &out);
        assert_invalid(
            result,
            &["cuda_channel_affine_into", "cannot take the output"],
        )?;
    }
    let buffer = cuda::channel_buffer(&[2, 5], DType::U8, &dev);
    assert_invalid(buffer, &["channel_buffer", "U8"])?;
    Ok(())
}

/// The sum over "replicas" of their SyncBatchNorm vectors, as NCCL's all-reduce gives it.
fn replicas_sum(parts: &[Tensor]) -> Result<Tensor> {
    let mut total = parts[0].clone();
    for p in &parts[1..] {
        total = (total + p)?;
    }
    Ok(total)
}

/// SyncBatchNorm's kernels over three replicas (parts of 5, 2 and 1 samples of a batch of 8 on
/// the GPU, their vectors summed as NCCL sums them) against the CPU kernel's pass over the whole
/// batch: each part's output and input gradient, the statistics (alike on every part), and the
/// weight's and bias's gradients summed over the parts, within 1e-4; with the ReLU and without,
/// the shift (the moving mean) zero against inputs around 0 and around 3, and at the data's
/// mean.
#[test]
#[ignore = "needs a CUDA GPU"]
fn synchronised_parts_match_one_pass_over_the_whole_batch() -> Result<()> {
    let dev = gpu()?;
    let dims = [8, 12, 6, 5];
    let parts = [(0, 5), (5, 2), (7, 1)];
    for (relu, offset, shift) in [(true, 0.0, 0.0), (false, 3.0, 0.0), (true, 3.0, 3.0)] {
        let what = format!("relu {relu}, inputs around {offset}, shift {shift}");
        let [x, w, b] = operands(&dims, 21, offset)?;
        let dy = random(&dims, 22, 0.0)?;
        let (replay, want) = cpu::batch_norm_train_replay(&x, Some(&w), Some(&b), EPSILON, relu)?;
        let (Some(want_dx), Some(want_dw), Some(want_db)) = replay.backward(&dy)? else {
            anyhow::bail!("{what}: the CPU kernel gave no gradient");
        };
        let on_gpu = |t: &Tensor| t.to_device(&dev);
        let (w, b) = (on_gpu(&w)?, on_gpu(&b)?);
        let shift = Tensor::full(shift, 12, &dev)?;
        let split = |t: &Tensor| -> Result<Vec<Tensor>> {
            parts
                .iter()
                .map(|&(start, n)| Ok(on_gpu(&t.narrow(0, start, n)?)?))
                .collect()
        };
        let (xs, dys) = (split(&x)?, split(&dy)?);
        let local = xs
            .iter()
            .map(|x| Ok(cuda::sync_batch_norm_sums(x, &shift)?))
            .collect::<Result<Vec<_>>>()?;
        let total = replicas_sum(&local)?;
        let (mut ys, mut passes) = (Vec::new(), Vec::new());
        for x in &xs {
            let (y, stats, pass) =
                cuda::sync_batch_norm_apply(x, &total, &shift, Some(&w), Some(&b), EPSILON, relu)?;
            assert_matches(&format!("{what}: mean"), &stats.mean, &want.mean, 1e-4)?;
            assert_matches(&format!("{what}: var"), &stats.var, &want.var, 1e-4)?;
            ys.push(y);
            passes.push(pass);
        }
        assert_matches(
            &format!("{what}: y"),
            &Tensor::cat(&ys, 0)?,
            replay.output(),
            1e-4,
        )?;
        let local = passes
            .iter()
            .zip(&dys)
            .map(|(p, dy)| Ok(p.grad_sums(dy)?))
            .collect::<Result<Vec<_>>>()?;
        let total = replicas_sum(&local)?;
        let (mut dx, mut dw, mut db) = (Vec::new(), Vec::new(), Vec::new());
        for ((pass, dy), local) in passes.iter().zip(&dys).zip(&local) {
            let (x_grad, w_grad, b_grad) = pass.backward(dy, local, &total)?;
            dx.push(x_grad);
            dw.push(w_grad);
            db.push(b_grad);
        }
        assert_matches(
            &format!("{what}: dx"),
            &Tensor::cat(&dx, 0)?,
            &want_dx,
            1e-4,
        )?;
        assert_matches(
            &format!("{what}: dweight"),
            &replicas_sum(&dw)?,
            &want_dw,
            1e-4,
        )?;
        assert_matches(
            &format!("{what}: dbias"),
            &replicas_sum(&db)?,
            &want_db,
            1e-4,
        )?;
    }
    Ok(())
}

/// SyncBatchNorm's kernels refuse an `f64` input (its sums cross replicas in `f32`), summed
/// sums of another length, and an output gradient of another shape.
#[test]
#[ignore = "needs a CUDA GPU"]
fn synchronised_inputs_the_kernels_cannot_take_are_errors() -> Result<()> {
    let dev = gpu()?;
    let x = random(&[4, 3, 2, 2], 1, 0.0)?.to_device(&dev)?;
    let shift = Tensor::zeros(3, DType::F32, &dev)?;
    assert_invalid(
        cuda::sync_batch_norm_sums(&x.to_dtype(DType::F64)?, &shift.to_dtype(DType::F64)?),
        &["cuda_sync_batch_norm_sums", "f64"],
    )?;
    assert_invalid(
        cuda::sync_batch_norm_sums(&x, &Tensor::zeros(2, DType::F32, &dev)?),
        &["cuda_sync_batch_norm_sums", "shift"],
    )?;
    let sums = cuda::sync_batch_norm_sums(&x, &shift)?;
    assert_eq!(sums.dims(), &[7]);
    assert_invalid(
        cuda::sync_batch_norm_apply(&x, &sums.narrow(0, 0, 6)?, &shift, None, None, 1e-3, false),
        &["cuda_sync_batch_norm", "summed sums", "[7]"],
    )?;
    let (_, _, pass) = cuda::sync_batch_norm_apply(&x, &sums, &shift, None, None, 1e-3, false)?;
    assert_invalid(
        pass.grad_sums(&x.narrow(0, 0, 2)?),
        &["output gradient", "[2, 3, 2, 2]"],
    )?;
    Ok(())
}
