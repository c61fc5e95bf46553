//! kandle's CUDA pooling (`kandle_kernels::cuda::{max_pool2d, avg_pool2d}` and their `_replay`
//! forms) on a GPU against the CPU kernels (`kandle_kernels::pooling`): outputs and input
//! gradients through candle's autograd and through the kept op, on MiniGoogLeNet's and ResNet's
//! pools and odd windows, strides and paddings (windows with no real value among them), within
//! 1e-4 of the largest magnitude in `f32`; ties (the first maximum takes the gradient); NaNs;
//! `f64`, `f16` and `bf16`; and errors for inputs the kernels cannot take. The max pool written
//! into a range of a larger tensor's channels, and its gradient read from such a range, bit for
//! bit against the same kernels on tensors of their own.
//!
//! Built with `cuda` and `test-support`. The GPU tests are `#[ignore]`d (`gpu/check.sh` runs
//! them with `--include-ignored`); the test of a CPU tensor's error runs anywhere the binary
//! starts.

mod cuda_support;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use cuda_support::{assert_invalid, assert_matches, gpu, gradients, weighted_sum};
use kandle_kernels::pooling::{self as cpu, PoolWindow};
use kandle_kernels::test_support::random;
use kandle_kernels::{cuda, replay::Replay1};

/// An input's dims and a window over it.
type Case = ([usize; 4], PoolWindow);

/// A `window` at `stride` with `pad` (top, bottom, left, right).
fn window(
    window: (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize, usize, usize),
) -> PoolWindow {
    PoolWindow {
        window,
        stride,
        pad,
    }
}

/// MiniGoogLeNet's pools (3x3 at stride 2, Keras's `valid` and `same`, and the 7x7 average),
/// ResNet's (3x3 at stride 2 with padding 1, the 4x4 global average), and odd ones: uneven
/// windows and strides, overlapping windows at stride 1, and padding wider than the window (rows
/// of windows with no real value).
fn cases() -> Vec<Case> {
    vec![
        ([64, 80, 32, 32], window((3, 3), (2, 2), (0, 0, 0, 0))),
        ([64, 144, 15, 15], window((3, 3), (2, 2), (0, 0, 0, 0))),
        ([64, 96, 32, 32], window((3, 3), (2, 2), (0, 1, 0, 1))),
        ([64, 336, 7, 7], window((7, 7), (7, 7), (0, 0, 0, 0))),
        ([64, 64, 16, 16], window((3, 3), (2, 2), (1, 1, 1, 1))),
        ([64, 512, 4, 4], window((4, 4), (4, 4), (0, 0, 0, 0))),
        ([3, 5, 7, 9], window((3, 2), (2, 3), (1, 0, 2, 1))),
        ([2, 3, 5, 5], window((2, 2), (1, 1), (0, 0, 0, 0))),
        ([1, 2, 4, 4], window((2, 2), (1, 1), (3, 0, 0, 0))),
    ]
}

/// The pooling functions of one device, with one signature.
type Pool = fn(&Tensor, &PoolWindow) -> kandle_kernels::Result<Tensor>;

/// `pool` of `x` moved to `dev` in `dtype` and the input's gradient for a weighted sum of the
/// output, its weights rounded to `rounding` (the dtype under test, on both devices).
fn pool_and_gradient(
    pool: Pool,
    x: &Tensor,
    w: &PoolWindow,
    dev: &Device,
    (dtype, rounding): (DType, DType),
) -> Result<(Tensor, Tensor)> {
    let x = Var::from_tensor(&x.to_dtype(dtype)?.to_device(dev)?)?;
    let y = pool(x.as_tensor(), w)?;
    let dx = gradients(&weighted_sum(&y, 5, rounding)?, &[&x])?;
    Ok((y, dx[0].clone()))
}

/// The GPU's `pool` against the CPU's `want` on `x` (rounded to `dtype` for both), within `tol`.
fn check(
    what: &str,
    (pool, want): (Pool, Pool),
    x: &Tensor,
    w: &PoolWindow,
    dtype: DType,
    tol: f32,
) -> Result<()> {
    let dev = gpu()?;
    let x = x.to_dtype(dtype)?.to_dtype(DType::F32)?;
    let (y, dx) = pool_and_gradient(pool, &x, w, &dev, (dtype, dtype))?;
    let (want_y, want_dx) = pool_and_gradient(want, &x, w, &Device::Cpu, (DType::F32, dtype))?;
    anyhow::ensure!(
        y.dtype() == dtype,
        "{what}: y is {:?}, expected {dtype:?}",
        y.dtype()
    );
    let what = format!("{what} {:?} {w:?} {dtype:?}", x.dims());
    assert_matches(&format!("{what}: y"), &y, &want_y, tol)?;
    assert_matches(&format!("{what}: dx"), &dx, &want_dx, tol)
}

const MAX: (Pool, Pool) = (cuda::max_pool2d, cpu::max_pool2d);
const AVG: (Pool, Pool) = (cuda::avg_pool2d, cpu::avg_pool2d);

#[test]
#[ignore = "needs a CUDA GPU"]
fn max_and_average_pooling_match_the_cpu_kernels() -> Result<()> {
    for (i, (dims, w)) in cases().into_iter().enumerate() {
        let x = random(&dims, 100 + i as u64, 0.0)?;
        check("max", MAX, &x, &w, DType::F32, 1e-4)?;
        check("avg", AVG, &x, &w, DType::F32, 1e-4)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pooling_in_f64_and_half_precision() -> Result<()> {
    for (dims, w) in [cases()[0], cases()[6]] {
        let x = random(&dims, 7, 0.0)?;
        for (dtype, tol) in [(DType::F64, 1e-4), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
            check("max", MAX, &x, &w, dtype, tol)?;
            check("avg", AVG, &x, &w, dtype, tol)?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ties_send_the_gradient_to_the_first_maximum() -> Result<()> {
    // Values in {-2, ..., 2}: most windows hold several maxima.
    for (i, (dims, w)) in cases().into_iter().enumerate().skip(4) {
        let x = (random(&dims, 200 + i as u64, 0.0)? * 2.0)?.round()?;
        check("max with ties", MAX, &x, &w, DType::F32, 0.0)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nans_win_as_on_the_cpu() -> Result<()> {
    let dims = [2, 2, 6, 6];
    let mut values = random(&dims, 300, 0.0)?.flatten_all()?.to_vec1::<f32>()?;
    // Two NaNs in the first 3x3 window (the CPU kernel's walk, column by column, meets the one
    // in column 0 first), one alone in another plane, and an infinity.
    for at in [1, 6, 36 + 14, 72 + 20] {
        values[at] = f32::NAN;
    }
    values[108 + 9] = f32::INFINITY;
    let x = Tensor::from_vec(values, &dims[..], &Device::Cpu)?;
    for w in [
        window((3, 3), (2, 2), (0, 1, 0, 1)),
        window((2, 2), (1, 1), (0, 0, 0, 0)),
    ] {
        check("max with NaNs", MAX, &x, &w, DType::F32, 1e-6)?;
        check("avg with NaNs", AVG, &x, &w, DType::F32, 1e-6)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_kept_ops_give_the_cpu_kernels_gradients() -> Result<()> {
    let dev = gpu()?;
    type Replay = fn(&Tensor, &PoolWindow) -> kandle_kernels::Result<Replay1>;
    let kinds: [(&str, Replay, Replay); 2] = [
        ("max", cuda::max_pool2d_replay, cpu::max_pool2d_replay),
        ("avg", cuda::avg_pool2d_replay, cpu::avg_pool2d_replay),
    ];
    for (dims, w) in [cases()[4], cases()[6]] {
        let x = random(&dims, 400, 0.0)?;
        for (name, on_gpu, on_cpu) in kinds {
            let (replay, want) = (on_gpu(&x.to_device(&dev)?, &w)?, on_cpu(&x, &w)?);
            let dy = random(want.output().dims(), 401, 0.0)?;
            assert_matches(&format!("{name} y"), replay.output(), want.output(), 1e-4)?;
            let dx = replay.backward(&dy.to_device(&dev)?)?;
            let want_dx = want.backward(&dy)?;
            let (Some(dx), Some(want_dx)) = (dx, want_dx) else {
                anyhow::bail!("{name}: no gradient");
            };
            assert_matches(&format!("{name} dx"), &dx, &want_dx, 1e-4)?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn strided_inputs_are_made_contiguous() -> Result<()> {
    let dev = gpu()?;
    let x = random(&[4, 3, 9, 7], 500, 0.0)?;
    let w = window((3, 3), (2, 2), (1, 1, 1, 1));
    let y = cuda::max_pool2d(&x.to_device(&dev)?.transpose(2, 3)?, &w)?;
    let want = cpu::max_pool2d(&x.transpose(2, 3)?.contiguous()?, &w)?;
    assert_matches("max of a transposed input", &y, &want, 0.0)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn inputs_the_kernels_cannot_take_are_errors_naming_the_op() -> Result<()> {
    let dev = gpu()?;
    let x = random(&[2, 3, 4, 4], 600, 0.0)?.to_device(&dev)?;
    let w = window((2, 2), (2, 2), (0, 0, 0, 0));
    let (max, avg) = ("cuda_max_pool2d", "cuda_avg_pool2d");
    assert_invalid(
        cuda::max_pool2d(&x.flatten_from(2)?, &w),
        &[max, "(N, C, H, W)"],
    )?;
    assert_invalid(
        cuda::avg_pool2d(&x.to_dtype(DType::U32)?, &w),
        &[avg, "U32"],
    )?;
    let too_large = window((5, 5), (1, 1), (0, 0, 0, 0));
    assert_invalid(cuda::max_pool2d(&x, &too_large), &[max, "does not fit"])?;
    let no_stride = window((2, 2), (0, 1), (0, 0, 0, 0));
    assert_invalid(cuda::avg_pool2d(&x, &no_stride), &[avg, "does not fit"])?;
    Ok(())
}

/// Runs without a GPU: a CPU tensor is an error that names the op and the CPU's kernel.
#[test]
fn a_cpu_tensor_is_an_error_pointing_to_the_cpu_kernel() -> Result<()> {
    let x = random(&[2, 3, 4, 4], 700, 0.0)?;
    let w = window((2, 2), (2, 2), (0, 0, 0, 0));
    assert_invalid(
        cuda::max_pool2d(&x, &w),
        &[
            "cuda_max_pool2d",
            "CUDA device",
            "kandle_kernels::pooling::max_pool2d",
        ],
    )?;
    assert_invalid(
        cuda::avg_pool2d_replay(&x, &w),
        &[
            "cuda_avg_pool2d",
            "CUDA device",
            "kandle_kernels::pooling::avg_pool2d",
        ],
    )
}

/// A concatenation's max-pool branch writes its channels of the joined output (channels `2..5`
/// of 7, the others holding 7.0) and reads its channels of the joined gradient where they lie:
/// the same kernels as on tensors of their own, so the same bits, in `f32` and `f16`, with
/// MiniGoogLeNet's downsampling pool and a padded one; the other channels stay untouched; an
/// output that cannot take the result is an error.
#[test]
#[ignore = "needs a CUDA GPU: run by gpu/check.sh"]
fn a_range_of_channels_is_written_and_read_in_place() -> Result<()> {
    let dev = gpu()?;
    let cases = [
        ([4, 3, 9, 9], window((3, 3), (2, 2), (0, 0, 0, 0))),
        ([2, 3, 6, 5], window((2, 2), (2, 2), (0, 1, 0, 1))),
    ];
    for dtype in [DType::F32, DType::F16] {
        for (dims, win) in &cases {
            let what = format!("{dtype:?} {dims:?} {win:?}");
            let x = random(dims, 50, 0.0)?.to_dtype(dtype)?.to_device(&dev)?;
            let want = cuda::max_pool2d_replay(&x, win)?;
            let mut joined = want.output().dims().to_vec();
            joined[1] = 7;
            let whole = Tensor::full(7f32, joined.as_slice(), &dev)?.to_dtype(dtype)?;
            let part = whole.narrow(1, 2, 3)?;
            let backward = cuda::max_pool2d_train_into(&x, win, &part)?;
            assert_matches(&format!("{what}: y"), &part, want.output(), 0.0)?;
            let seven = |t: &Tensor| -> Result<Tensor> { Ok(t.ones_like()?.affine(7.0, 0.0)?) };
            for (start, len) in [(0, 2), (5, 2)] {
                let rest = whole.narrow(1, start, len)?;
                assert_matches(
                    &format!("{what}: channels {start}.."),
                    &rest,
                    &seven(&rest)?,
                    0.0,
                )?;
            }
            let dy_whole = random(&joined, 51, 0.0)?.to_dtype(dtype)?.to_device(&dev)?;
            let dy = dy_whole.narrow(1, 2, 3)?;
            let dx = backward.backward(&dy)?;
            let dx_want = want
                .backward(&dy.contiguous()?)?
                .expect("an input gradient");
            assert_matches(&format!("{what}: dx"), &dx, &dx_want, 0.0)?;

            // Inference writes the same values, and nothing else.
            let again = Tensor::full(7f32, joined.as_slice(), &dev)?.to_dtype(dtype)?;
            cuda::max_pool2d_into(&x, win, &again.narrow(1, 2, 3)?)?;
            assert_matches(&format!("{what}: inference"), &again, &whole, 0.0)?;
        }
    }
    let x = random(&[2, 3, 4, 4], 52, 0.0)?.to_device(&dev)?;
    let win = window((2, 2), (2, 2), (0, 0, 0, 0));
    let wrong = Tensor::zeros((2, 3, 3, 3), DType::F32, &dev)?;
    assert_invalid(
        cuda::max_pool2d_into(&x, &win, &wrong),
        &["cuda_max_pool2d", "[2, 3, 3, 3]", "[2, 3, 2, 2]"],
    )?;
    let transposed = Tensor::zeros((2, 2, 3, 2), DType::F32, &dev)?.transpose(1, 2)?;
    assert_invalid(
        cuda::max_pool2d_into(&x, &win, &transposed),
        &["cuda_max_pool2d", "each image contiguous"],
    )
}
