//! The CPU convolution kernel against candle's own `conv2d` and autograd: forward values and
//! the gradients of the input and the kernel, over seeded random shapes, strides and paddings.

use super::{
    conv2d, conv2d_affine, conv2d_backward, conv2d_input_grad, conv2d_weight_grad,
    input_grad_adds_in_place, FoldedAffine, KernelCache,
};
use anyhow::Context;
use candle_core::{DType, Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type Padding = (usize, usize, usize, usize);

/// One convolution to check: input `(n, c, h, w)`, kernel `(o, kh, kw)`, strides, padding.
#[derive(Debug, Clone, Copy)]
struct Case {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    stride: (usize, usize),
    pad: Padding,
}

fn random(rng: &mut StdRng, dims: &[usize]) -> anyhow::Result<Tensor> {
    let len = dims.iter().product();
    let data: Vec<f32> = (0..len).map(|_| rng.random_range(-1f32..1f32)).collect();
    Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
}

/// Every `step`-th index along `dim`, differentiably.
fn subsample(x: &Tensor, dim: usize, step: usize) -> anyhow::Result<Tensor> {
    let idx: Vec<u32> = (0..x.dim(dim)?).step_by(step).map(|i| i as u32).collect();
    let idx = Tensor::new(idx, x.device())?;
    Ok(x.index_select(&idx, dim)?)
}

/// Candle's stride-1 convolution of the explicitly zero-padded input, then every `sh`-th row
/// and `sw`-th column. (Candle's own strided backward pass fails with a shape mismatch when the
/// stride does not divide the padded size minus the kernel, so strides are taken this way.)
fn reference(x: &Tensor, w: &Tensor, case: &Case) -> anyhow::Result<Tensor> {
    let (pt, pb, pl, pr) = case.pad;
    let x = x.pad_with_zeros(2, pt, pb)?.pad_with_zeros(3, pl, pr)?;
    let y = x.conv2d(w, 0, 1, 1, 1)?;
    let (sh, sw) = case.stride;
    subsample(&subsample(&y, 2, sh)?, 3, sw)
}

/// Largest absolute difference, relative to the largest reference magnitude (at least 1).
fn rel_err(got: &Tensor, want: &Tensor) -> anyhow::Result<f32> {
    assert_eq!(got.dims(), want.dims());
    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
    let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(diff / scale)
}

/// Checks the forward pass and the gradients of `case` against candle, with a bias when
/// `seed` is even.
fn check(case: Case, seed: u64) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    let x = Var::from_tensor(&random(&mut rng, &[case.n, case.c, case.h, case.w])?)?;
    let w = Var::from_tensor(&random(&mut rng, &[case.o, case.c, case.kh, case.kw])?)?;
    let b = Var::from_tensor(&random(&mut rng, &[case.o])?)?;
    let bias = seed.is_multiple_of(2).then_some(b.as_tensor());

    let mut want = reference(&x, &w, &case)?;
    if let Some(b) = bias {
        want = want.broadcast_add(&b.reshape((1, case.o, 1, 1))?)?;
    }
    let got = conv2d(&x, &w, bias, case.stride, case.pad)?;
    let err = rel_err(&got, &want)?;
    assert!(err < 1e-4, "{case:?}: forward error {err}");

    // A random output gradient: d(sum(y * r))/dy = r.
    let r = random(&mut rng, want.dims())?;
    let want_grads = (want * &r)?
        .sum_all()?
        .backward()
        .with_context(|| format!("{case:?}: candle's gradients"))?;
    let got_grads = (got * &r)?
        .sum_all()?
        .backward()
        .with_context(|| format!("{case:?}: the kernel's gradients"))?;
    let mut vars = vec![("input", x.as_tensor()), ("weight", w.as_tensor())];
    vars.extend(bias.map(|b| ("bias", b)));
    for (name, v) in vars {
        let (Some(g), Some(e)) = (got_grads.get(v), want_grads.get(v)) else {
            panic!("{case:?}: no {name} gradient");
        };
        let err = rel_err(g, e)?;
        assert!(err < 1e-4, "{case:?}: {name} gradient error {err}");
    }
    Ok(())
}

fn case(
    (n, c, h, w): (usize, usize, usize, usize),
    (o, kh, kw): (usize, usize, usize),
    stride: (usize, usize),
    pad: Padding,
) -> Case {
    Case {
        n,
        c,
        h,
        w,
        o,
        kh,
        kw,
        stride,
        pad,
    }
}

#[test]
fn chosen_shapes_match_candle() -> anyhow::Result<()> {
    let cases = [
        // 3x3 same, odd sizes.
        case((2, 3, 7, 9), (4, 3, 3), (1, 1), (1, 1, 1, 1)),
        // Valid stride 2, batch 1, one channel.
        case((1, 1, 8, 8), (2, 3, 3), (2, 2), (0, 0, 0, 0)),
        // 1x1 stride 1: the GEMMs read the input directly.
        case((3, 5, 9, 7), (6, 1, 1), (1, 1), (0, 0, 0, 0)),
        // 1x1 stride 2: some stride phases of the input get no gradient.
        case((2, 4, 8, 9), (3, 1, 1), (2, 2), (0, 0, 0, 0)),
        // Rectangular kernel and strides, unequal padding (TensorFlow `same` with stride 2).
        case((2, 4, 10, 11), (3, 2, 3), (2, 1), (0, 1, 1, 1)),
        case((1, 3, 6, 5), (2, 5, 1), (1, 2), (2, 2, 0, 0)),
        // MiniGoogLeNet's downsample at a smaller width: 3x3 stride 2 valid on 15x15.
        case((2, 6, 15, 15), (5, 3, 3), (2, 2), (0, 0, 0, 0)),
        // Stride 3 with uneven padding, and padding wider than the kernel.
        case((2, 3, 9, 10), (4, 3, 3), (3, 3), (1, 2, 0, 1)),
        case((1, 2, 4, 4), (3, 3, 3), (1, 1), (3, 3, 2, 4)),
        // Kernel as large as the padded input: a single output position.
        case((2, 3, 5, 4), (2, 5, 4), (1, 1), (0, 0, 0, 0)),
        // Deep inputs (channels x kernel width >= 64): one GEMM per kernel row and stride
        // phase instead of a full im2col, also in the input gradient's phases.
        case((2, 24, 9, 11), (32, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((2, 40, 15, 15), (36, 3, 3), (2, 2), (0, 0, 0, 0)),
        case((1, 33, 10, 9), (40, 3, 2), (2, 1), (1, 1, 0, 1)),
        // Stride 2 across, deep enough not to fold: input rows split into even and odd
        // columns, with padding (a kernel column reading before the row) on an odd width.
        case((2, 24, 11, 13), (10, 3, 3), (2, 2), (1, 1, 1, 1)),
        case((1, 22, 9, 16), (7, 5, 4), (1, 2), (2, 0, 3, 1)),
        case((2, 70, 7, 7), (33, 3, 3), (1, 1), (1, 1, 1, 1)),
        // Several row tiles per image (32x32), one of them the 1x1 direct path.
        case((2, 16, 32, 32), (8, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((2, 32, 32, 32), (24, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((3, 24, 32, 32), (5, 1, 1), (1, 1), (0, 0, 0, 0)),
        // Output channels and positions that are not multiples of the 16-wide blocks the
        // output gradient and the kernel are transposed in, at unit and double strides.
        case((2, 3, 18, 21), (20, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((2, 20, 11, 13), (35, 3, 3), (2, 2), (1, 1, 1, 1)),
        // 3x3 at unit strides, 16 channels or more on both sides and 4 tiles of 4x4 or more:
        // Winograd's F(4x4, 3x3) in the forward pass, the input gradient and the kernel
        // gradient, `same` on odd sizes (part tiles at the edges) and `valid`, blocks of tiles
        // across images (7x7) and several blocks per image (32x32, above).
        case((3, 64, 15, 15), (72, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((2, 66, 18, 17), (64, 3, 3), (1, 1), (0, 0, 0, 0)),
        case((5, 20, 7, 7), (18, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((3, 17, 8, 8), (130, 3, 3), (1, 1), (1, 1, 1, 1)),
        // Planes of one tile (4x4, ResNet's last stage on 32x32 images) and of one part tile
        // (3x3), tiles across images in every block; a 2x2 plane stays direct.
        case((9, 24, 4, 4), (40, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((5, 16, 3, 3), (17, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((3, 32, 2, 2), (16, 3, 3), (1, 1), (1, 1, 1, 1)),
        // One image of several blocks (40x40, 100 tiles), whatever the thread count: the
        // kernel gradient's first block starts its sum and the next adds to it.
        case((1, 16, 40, 40), (20, 3, 3), (1, 1), (1, 1, 1, 1)),
        // Planes too small to fill the micro-kernel's column blocks: several images per GEMM
        // (a last group one image short, row-shift expansions whose shifted rows are taken as
        // the images are put side by side, a folded one, a read of the input itself),
        // ResNet's stride-2 layers into 4x4 planes among them.
        case((9, 40, 7, 7), (20, 1, 1), (1, 1), (0, 0, 0, 0)),
        case((8, 30, 15, 15), (14, 3, 3), (2, 2), (0, 0, 0, 0)),
        case((9, 40, 8, 8), (48, 3, 3), (2, 2), (1, 1, 1, 1)),
        case((7, 24, 8, 8), (40, 1, 1), (2, 2), (0, 0, 0, 0)),
        case((6, 5, 5, 6), (8, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((7, 20, 6, 5), (9, 3, 1), (1, 1), (0, 0, 0, 0)),
        // Stride-2 layers into 7x7 planes (ResNet-50's last stage): every stride phase of the
        // input gradient is 7x7, several images to a GEMM; a 1x1 kernel leaves three phases
        // without taps.
        case((7, 24, 14, 14), (20, 3, 3), (2, 2), (1, 1, 1, 1)),
        case((7, 24, 14, 14), (40, 1, 1), (2, 2), (0, 0, 0, 0)),
        // Deep enough that an image's expansion passes a tile's budget (two tiles of rows
        // image by image), yet several images to a GEMM.
        case((4, 400, 14, 14), (8, 3, 3), (2, 2), (1, 1, 1, 1)),
    ];
    for (i, c) in cases.into_iter().enumerate() {
        check(c, i as u64)?;
    }
    Ok(())
}

#[test]
fn random_shapes_match_candle() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(2024);
    for i in 0..40 {
        let kh: usize = rng.random_range(1..=4);
        let kw: usize = rng.random_range(1..=4);
        let stride = (rng.random_range(1..=3), rng.random_range(1..=3));
        let mut p = || rng.random_range(0..=2);
        let pad = (p(), p(), p(), p());
        let h = rng.random_range(kh.saturating_sub(pad.0 + pad.1).max(1)..=13);
        let w = rng.random_range(kw.saturating_sub(pad.2 + pad.3).max(1)..=13);
        let c = case(
            (rng.random_range(1..=4), rng.random_range(1..=6), h, w),
            (rng.random_range(1..=6), kh, kw),
            stride,
            pad,
        );
        check(c, 100 + i)?;
    }
    Ok(())
}

#[test]
fn random_deep_shapes_match_candle() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(77);
    for i in 0..12 {
        let (kh, kw): (usize, usize) = (rng.random_range(1..=3), rng.random_range(2..=3));
        let stride = (rng.random_range(1..=2), rng.random_range(1..=2));
        let pad = (kh / 2, (kh - 1) / 2, kw / 2, (kw - 1) / 2);
        let (h, w) = (rng.random_range(3..=12), rng.random_range(3..=12));
        let c = case(
            (rng.random_range(1..=3), rng.random_range(22..=48), h, w),
            (rng.random_range(24..=48), kh, kw),
            stride,
            pad,
        );
        check(c, 200 + i)?;
    }
    Ok(())
}

#[test]
fn one_thread_pool_and_non_contiguous_input() -> anyhow::Result<()> {
    // Fewer images than threads splits the GEMMs instead; a one-thread pool runs serially.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    pool.install(|| check(case((3, 4, 9, 9), (5, 3, 3), (2, 2), (1, 1, 1, 1)), 7))?;
    check(case((1, 8, 20, 20), (4, 3, 3), (1, 1), (1, 1, 1, 1)), 8)?;

    // A transposed view: the kernel makes it contiguous first.
    let mut rng = StdRng::seed_from_u64(9);
    let xt = random(&mut rng, &[2, 3, 6, 5])?;
    let x = xt.transpose(2, 3)?;
    assert!(!x.is_contiguous());
    let w = random(&mut rng, &[4, 3, 3, 2])?;
    let got = conv2d(&x, &w, None, (1, 1), (1, 1, 0, 1))?;
    let want = reference(&x, &w, &case((2, 3, 5, 6), (4, 3, 2), (1, 1), (1, 1, 0, 1)))?;
    assert!(rel_err(&got, &want)? < 1e-4);
    Ok(())
}

#[test]
fn gradient_ops_called_directly() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(11);
    let c = case((2, 3, 9, 8), (4, 3, 3), (2, 2), (1, 1, 1, 1));
    let x = Var::from_tensor(&random(&mut rng, &[c.n, c.c, c.h, c.w])?)?;
    let w = Var::from_tensor(&random(&mut rng, &[c.o, c.c, c.kh, c.kw])?)?;
    let y = reference(&x, &w, &c)?;
    let dy = random(&mut rng, y.dims())?;
    let grads = (y * &dy)?.sum_all()?.backward()?;
    let dx = conv2d_input_grad(&dy, &w, (c.h, c.w), c.stride, c.pad)?;
    let dw = conv2d_weight_grad(&x, &dy, (c.kh, c.kw), c.stride, c.pad)?;
    let (Some(ex), Some(ew)) = (grads.get(&x), grads.get(&w)) else {
        anyhow::bail!("candle returned no gradients");
    };
    assert!(rel_err(&dx, ex)? < 1e-4);
    assert!(rel_err(&dw, ew)? < 1e-4);
    Ok(())
}

#[test]
fn input_without_variables_gets_no_gradient() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(12);
    let x = random(&mut rng, &[2, 3, 6, 6])?;
    let w = Var::from_tensor(&random(&mut rng, &[4, 3, 3, 3])?)?;
    let b = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
    let grads = conv2d(&x, &w, Some(&b), (1, 1), (1, 1, 1, 1))?
        .sum_all()?
        .backward()?;
    assert!(grads.get(&x).is_none());
    assert!(grads.get(&b).is_none());
    assert!(grads.get(&w).is_some());
    Ok(())
}

#[test]
fn folded_affine_and_relu_match_candle() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(17);
    // Winograd's (3x3, unit stride, 16+ channels), a 1x1 product of several panels, a strided
    // valid window; with and without the ReLU.
    let cases = [
        case((3, 20, 12, 12), (24, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((2, 32, 8, 8), (40, 1, 1), (1, 1), (0, 0, 0, 0)),
        case((2, 5, 11, 9), (7, 3, 3), (2, 2), (0, 0, 0, 0)),
    ];
    for (case, relu) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
        let x = random(&mut rng, &[case.n, case.c, case.h, case.w])?;
        let w = random(&mut rng, &[case.o, case.c, case.kh, case.kw])?;
        let scale = random(&mut rng, &[case.o])?;
        let shift = random(&mut rng, &[case.o])?;
        let affine = FoldedAffine {
            scale: &scale,
            shift: &shift,
            relu,
            cache: None,
        };
        let got = conv2d_affine(&x, &w, affine, (case.stride, case.pad))?;
        let per_channel = |v: &Tensor| v.reshape((1, case.o, 1, 1));
        let want = reference(&x, &w, &case)?
            .broadcast_mul(&per_channel(&scale)?)?
            .broadcast_add(&per_channel(&shift)?)?;
        let want = if relu { want.relu()? } else { want };
        let err = rel_err(&got, &want)?;
        assert!(err < 1e-5, "{case:?}, relu {relu}: relative error {err}");
        if relu {
            let negative = got.lt(0f32)?.sum_all()?.to_scalar::<u8>()?;
            assert_eq!(negative, 0, "{case:?}: negative values after the ReLU");
        }
    }
    let x = Tensor::zeros((1, 3, 6, 6), DType::F32, &Device::Cpu)?;
    let w = Tensor::zeros((4, 3, 3, 3), DType::F32, &Device::Cpu)?;
    let (four, five) = (
        Tensor::ones(4, DType::F32, &Device::Cpu)?,
        Tensor::ones(5, DType::F32, &Device::Cpu)?,
    );
    let affine = FoldedAffine {
        scale: &four,
        shift: &five,
        relu: true,
        cache: None,
    };
    let err = conv2d_affine(&x, &w, affine, ((1, 1), (0, 0, 0, 0)))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("[5]") && err.contains("[4, 3, 3, 3]"), "{err}");
    Ok(())
}

/// A NaN in the input reaches every output whose window holds it, and the fused ReLU keeps
/// it: in the direct correlation exactly those (candle's NaNs), in Winograd's at least those
/// (a NaN spreads over the 4x4 output tiles whose input tiles hold it); every other output is
/// candle's. Products in the micro-kernel (several images) and in `gemm` (one image on four
/// threads, its ReLU in a pass of its own); the training op's kernel gradient is NaN too.
#[test]
fn a_nan_reaches_the_outputs_whose_window_holds_it() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(23);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build()?;
    let cases = [
        (case((2, 16, 9, 9), (16, 3, 3), (1, 1), (1, 1, 1, 1)), true),
        (case((1, 16, 9, 9), (16, 3, 3), (1, 1), (1, 1, 1, 1)), true),
        (case((3, 8, 7, 7), (12, 1, 1), (1, 1), (0, 0, 0, 0)), false),
        (case((1, 5, 11, 9), (7, 3, 3), (2, 2), (1, 0, 1, 0)), false),
    ];
    for (case, winograd) in cases {
        let mut x = random(&mut rng, &[case.n, case.c, case.h, case.w])?
            .flatten_all()?
            .to_vec1::<f32>()?;
        x[((case.n - 1) * case.c + 2) * case.h * case.w + 4 * case.w + 5] = f32::NAN;
        let x = Var::from_vec(x, (case.n, case.c, case.h, case.w), &Device::Cpu)?;
        let w = random(&mut rng, &[case.o, case.c, case.kh, case.kw])?;
        let want = reference(&x, &w, &case)?;
        let nan_mask = |t: &Tensor| -> anyhow::Result<Vec<bool>> {
            Ok(t.flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.is_nan())
                .collect())
        };
        let want_nan = nan_mask(&want)?;
        assert!(want_nan.iter().any(|&n| n) && !want_nan.iter().all(|&n| n));
        for relu in [false, true] {
            let (scale, shift) = (
                Tensor::ones(case.o, DType::F32, &Device::Cpu)?,
                random(&mut rng, &[case.o])?,
            );
            let affine = FoldedAffine {
                scale: &scale,
                shift: &shift,
                relu,
                cache: None,
            };
            let got = pool.install(|| conv2d_affine(&x, &w, affine, (case.stride, case.pad)))?;
            let shifted = want.broadcast_add(&shift.reshape((1, case.o, 1, 1))?)?;
            let what = format!("{case:?}, relu {relu}");
            let got_nan = nan_mask(&got)?;
            for (i, (&g, &n)) in got_nan.iter().zip(&want_nan).enumerate() {
                assert!(g || !n, "{what}: output {i} should be NaN");
                assert!(winograd || g == n, "{what}: output {i} should not be NaN");
            }
            let (got, shifted) = (
                got.flatten_all()?.to_vec1::<f32>()?,
                shifted.flatten_all()?.to_vec1::<f32>()?,
            );
            for (i, (&g, &v)) in got
                .iter()
                .zip(&shifted)
                .enumerate()
                .filter(|(i, _)| !got_nan[*i])
            {
                let v = if relu && v < 0.0 { 0.0 } else { v };
                assert!(
                    (g - v).abs() < 1e-4 * v.abs().max(1.0),
                    "{what}: output {i}: {g} vs {v}"
                );
            }
        }
        // The training op: the same NaNs, a kernel gradient NaN where a tap met the NaN (on
        // its channel), and a finite input gradient (which does not read the input).
        let w = Var::from_tensor(&w)?;
        let y = conv2d(&x, &w, None, case.stride, case.pad)?;
        let y_nan = nan_mask(&y)?;
        let same = |(&g, &n): (&bool, &bool)| (g || !n) && (winograd || g == n);
        assert!(y_nan.iter().zip(&want_nan).all(same), "{case:?}: training");
        let grads = y.sum_all()?.backward()?;
        let (Some(dx), Some(dw)) = (grads.get(x.as_tensor()), grads.get(w.as_tensor())) else {
            anyhow::bail!("{case:?}: a gradient is missing");
        };
        assert!(
            dx.flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .all(|v| v.is_finite()),
            "{case:?}"
        );
        let taps = case.kh * case.kw;
        let dw_nan = nan_mask(dw)?;
        assert!(
            dw_nan.iter().any(|&n| n),
            "{case:?}: no NaN in the kernel gradient"
        );
        for (i, &n) in dw_nan.iter().enumerate() {
            assert!(
                !n || i / taps % case.c == 2,
                "{case:?}: kernel gradient {i}"
            );
        }
    }
    Ok(())
}

#[test]
fn a_cached_kernel_serves_only_the_values_it_was_made_from() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(29);
    // Winograd's lowering and the direct correlation's packing.
    for case in [
        case((2, 16, 8, 8), (16, 3, 3), (1, 1), (1, 1, 1, 1)),
        case((2, 12, 9, 9), (10, 1, 1), (1, 1), (0, 0, 0, 0)),
    ] {
        let cache = KernelCache::default();
        let x = random(&mut rng, &[case.n, case.c, case.h, case.w])?;
        let shift = random(&mut rng, &[case.o])?;
        let run = |x: &Tensor, w: &Tensor, scale: &Tensor, cache| -> anyhow::Result<Tensor> {
            let affine = FoldedAffine {
                scale,
                shift: &shift,
                relu: false,
                cache,
            };
            Ok(conv2d_affine(x, w, affine, (case.stride, case.pad))?)
        };
        let check = |x: &Tensor, w: &Tensor, scale: &Tensor, what: &str| -> anyhow::Result<()> {
            let got = run(x, w, scale, Some(&cache))?;
            let want = run(x, w, scale, None)?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{case:?}: {what}");
            Ok(())
        };
        let var = Var::from_tensor(&random(&mut rng, &[case.o, case.c, case.kh, case.kw])?)?;
        let scale = random(&mut rng, &[case.o])?;
        check(&x, var.as_tensor(), &scale, "first call")?;
        check(&x, var.as_tensor(), &scale, "same values again")?;
        // One weight changed in place, as an optimizer step does.
        let mut values = var.flatten_all()?.to_vec1::<f32>()?;
        let middle = values.len() / 2;
        values[middle] += 0.5;
        var.set(&Tensor::from_vec(values, var.dims(), &Device::Cpu)?)?;
        check(&x, var.as_tensor(), &scale, "a weight changed")?;
        check(&x, var.as_tensor(), &(&scale * 2.0)?, "the scale changed")?;
        // Another input size is another plan.
        let wider = random(&mut rng, &[case.n, case.c, case.h, case.w + 4])?;
        check(&wider, var.as_tensor(), &scale, "a wider input")?;
    }
    Ok(())
}

#[test]
fn input_gradient_adds_another_in_place() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(23);
    // The direct correlation per image, several small images per GEMM, strided phases, and
    // Winograd's (which adds in a pass of its own).
    let cases = [
        case((3, 10, 9, 9), (6, 1, 1), (1, 1), (0, 0, 0, 0)),
        case((9, 24, 7, 7), (20, 1, 1), (1, 1), (0, 0, 0, 0)),
        case((2, 6, 15, 15), (5, 3, 3), (2, 2), (0, 0, 0, 0)),
        case((2, 6, 11, 12), (5, 3, 3), (2, 2), (1, 1, 1, 1)),
        case((2, 16, 8, 8), (16, 3, 3), (1, 1), (1, 1, 1, 1)),
    ];
    for case in cases {
        let x = random(&mut rng, &[case.n, case.c, case.h, case.w])?;
        let w = random(&mut rng, &[case.o, case.c, case.kh, case.kw])?;
        let dy = random(&mut rng, reference(&x, &w, &case)?.dims())?;
        let add = random(&mut rng, x.dims())?;
        let plain = conv2d_backward(
            &x,
            &w,
            &dy,
            (true, true, false),
            case.stride,
            case.pad,
            None,
        )?;
        let added = conv2d_backward(
            &x,
            &w,
            &dy,
            (true, true, false),
            case.stride,
            case.pad,
            Some(&add),
        )?;
        let (plain, added) = (plain.input.context("dx")?, added.input.context("dx")?);
        let err = rel_err(&added, &(plain + &add)?)?;
        assert!(err < 1e-5, "{case:?}: relative error {err}");
        let in_place = input_grad_adds_in_place(&x, &w, (case.stride, case.pad));
        assert_eq!(in_place, case.kh == 1 || case.stride != (1, 1), "{case:?}");
    }
    let x = Tensor::zeros((2, 3, 6, 6), DType::F32, &Device::Cpu)?;
    let w = Tensor::zeros((4, 3, 1, 1), DType::F32, &Device::Cpu)?;
    let dy = Tensor::zeros((2, 4, 6, 6), DType::F32, &Device::Cpu)?;
    let wrong = Tensor::zeros((2, 3, 5, 6), DType::F32, &Device::Cpu)?;
    let err = conv2d_backward(
        &x,
        &w,
        &dy,
        (true, true, false),
        (1, 1),
        (0, 0, 0, 0),
        Some(&wrong),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(
        err.contains("[2, 3, 5, 6]") && err.contains("[2, 3, 6, 6]"),
        "{err}"
    );
    Ok(())
}

#[test]
fn bad_shapes_and_types_are_errors() -> anyhow::Result<()> {
    let x = Tensor::zeros((2, 3, 8, 8), DType::F32, &Device::Cpu)?;
    let w = Tensor::zeros((4, 5, 3, 3), DType::F32, &Device::Cpu)?;
    let err = conv2d(&x, &w, None, (1, 1), (0, 0, 0, 0))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("conv2d") && err.contains("[2, 3, 8, 8]") && err.contains("[4, 5, 3, 3]"),
        "{err}"
    );

    let big = Tensor::zeros((4, 3, 9, 3), DType::F32, &Device::Cpu)?;
    let err = conv2d(&x, &big, None, (1, 1), (0, 0, 0, 0))
        .err()
        .map(|e| e.to_string());
    assert!(err.is_some_and(|e| e.contains("smaller than")));

    let x64 = x.to_dtype(DType::F64)?;
    let w3 = Tensor::zeros((4, 3, 3, 3), DType::F32, &Device::Cpu)?;
    let err = conv2d(&x64, &w3, None, (1, 1), (0, 0, 0, 0))
        .err()
        .map(|e| e.to_string());
    assert!(err.is_some_and(|e| e.contains("f32")));

    let b5 = Tensor::zeros(5, DType::F32, &Device::Cpu)?;
    let err = conv2d(&x, &w3, Some(&b5), (1, 1), (0, 0, 0, 0))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("[5]") && err.contains("[4, 3, 3, 3]"), "{err}");

    let flat = Tensor::zeros((3, 8, 8), DType::F32, &Device::Cpu)?;
    assert!(conv2d(&flat, &w3, None, (1, 1), (0, 0, 0, 0)).is_err());
    assert!(conv2d(&x, &w3, None, (0, 1), (0, 0, 0, 0)).is_err());

    // The gradient ops check that the output gradient fits the convolution.
    let dy = Tensor::zeros((2, 4, 5, 6), DType::F32, &Device::Cpu)?;
    let err = conv2d_input_grad(&dy, &w3, (8, 8), (1, 1), (0, 0, 0, 0))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("[2, 4, 5, 6]") && err.contains("[2, 4, 6, 6]"),
        "{err}"
    );
    assert!(conv2d_weight_grad(&x, &dy, (3, 3), (1, 1), (0, 0, 0, 0)).is_err());
    Ok(())
}

/// Median wall time of `f` over `reps` runs after one warm-up, in milliseconds. The test runs on
/// a thread of libtest's, whose glibc arena unmaps its heaps as they fall empty: without the
/// environment above (one arena, the main heap kept, as `kandle::keep_freed_memory` sets for a
/// program), a pass whose buffers pass tens of megabytes (Winograd's transformed kernels of 512
/// channels) faults them in afresh every run and times that too.
fn median_ms(reps: usize, mut f: impl FnMut() -> anyhow::Result<Tensor>) -> anyhow::Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = std::time::Instant::now();
        let y = f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        drop(y);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}

/// One convolution's random operands and the median time of each of its three passes.
struct Timed {
    x: Tensor,
    w: Tensor,
    dy: Tensor,
    /// Output height.
    ho: usize,
    /// Billions of operations of one pass.
    gflop: f64,
    /// Forward, input gradient and kernel gradient, ms.
    ours: [f64; 3],
}

/// Times the three passes of an `(o, c, k, k)` convolution at stride `s` of `n` images of `c x
/// h x h`, padded by `pad`.
fn time_passes(
    rng: &mut StdRng,
    n: usize,
    (c, h, o, k, s): (usize, usize, usize, usize, usize),
    pad: (usize, usize, usize, usize),
) -> anyhow::Result<Timed> {
    let x = random(rng, &[n, c, h, h])?;
    let w = random(rng, &[o, c, k, k])?;
    let y = conv2d(&x, &w, None, (s, s), pad)?;
    let dy = random(rng, y.dims())?;
    let (_, _, ho, wo) = y.dims4()?;
    let gflop = 2.0 * (n * o * c * k * k * ho * wo) as f64 / 1e9;
    let ours = [
        median_ms(5, || Ok(conv2d(&x, &w, None, (s, s), pad)?))?,
        median_ms(5, || Ok(conv2d_input_grad(&dy, &w, (h, h), (s, s), pad)?))?,
        median_ms(5, || Ok(conv2d_weight_grad(&x, &dy, (k, k), (s, s), pad)?))?,
    ];
    Ok(Timed {
        x,
        w,
        dy,
        ho,
        gflop,
        ours,
    })
}

/// Times the three passes of every convolution of MiniGoogLeNet at batch 64 against candle's
/// `conv2d` and the ops its backward pass uses (`conv_transpose2d` for the input, a transposed
/// `conv2d` for the kernel). Run with
/// `MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=536870912 MALLOC_TRIM_THRESHOLD_=4294967295
/// cargo test --release -p kandle-kernels --lib timings_mini_googlenet -- --ignored --nocapture`
/// (see [`median_ms`] for the allocator settings).
#[test]
#[ignore = "timing, run by hand in a release build"]
fn timings_mini_googlenet_batch_64() -> anyhow::Result<()> {
    // (name, C, H, O, k, stride, padding): 3x3 `same` pads 1 on every side.
    let same = (1, 1, 1, 1);
    let none = (0, 0, 0, 0);
    let shapes = [
        ("stem 3x3", 3, 32, 96, 3, 1, same),
        ("inc1 1x1", 96, 32, 32, 1, 1, none),
        ("inc1 3x3", 96, 32, 32, 3, 1, same),
        ("inc2 1x1", 64, 32, 32, 1, 1, none),
        ("inc2 3x3", 64, 32, 48, 3, 1, same),
        ("down1 3x3/2", 80, 32, 80, 3, 2, none),
        ("inc3 1x1", 160, 15, 112, 1, 1, none),
        ("inc3 3x3", 160, 15, 48, 3, 1, same),
        ("inc4 1x1", 160, 15, 96, 1, 1, none),
        ("inc4 3x3", 160, 15, 64, 3, 1, same),
        ("inc5 1x1", 160, 15, 80, 1, 1, none),
        ("inc5 3x3", 160, 15, 80, 3, 1, same),
        ("inc6 1x1", 160, 15, 48, 1, 1, none),
        ("inc6 3x3", 160, 15, 96, 3, 1, same),
        ("down2 3x3/2", 144, 15, 96, 3, 2, none),
        ("inc7 1x1", 240, 7, 176, 1, 1, none),
        ("inc7 3x3", 240, 7, 160, 3, 1, same),
        ("inc8 1x1", 336, 7, 176, 1, 1, none),
        ("inc8 3x3", 336, 7, 160, 3, 1, same),
    ];
    let n = 64;
    let mut rng = StdRng::seed_from_u64(1);
    let mut totals = [0f64; 6];
    println!(
        "{:<12} {:>22} | {:>22} | {:>22} | candle fwd/in/w ms",
        "batch 64", "fwd ms (GFLOP/s)", "input grad ms (GFLOP/s)", "weight grad ms (GFLOP/s)"
    );
    for (name, c, h, o, k, s, pad) in shapes {
        let Timed {
            x,
            w,
            dy,
            ho,
            gflop,
            ours,
        } = time_passes(&mut rng, n, (c, h, o, k, s), pad)?;
        let p = pad.0;
        let out_pad = h - ((ho - 1) * s + k - 2 * p);
        let candle = [
            median_ms(3, || Ok(x.conv2d(&w, p, s, 1, 1)?))?,
            median_ms(3, || Ok(dy.conv_transpose2d(&w, p, out_pad, s, 1)?))?,
            median_ms(3, || {
                let g = x
                    .transpose(0, 1)?
                    .conv2d(&dy.transpose(0, 1)?, p, 1, s, 1)?;
                Ok(g.transpose(0, 1)?.contiguous()?)
            })?,
        ];
        let cell = |ms: f64| format!("{ms:8.2} ({:6.1})", gflop / ms * 1e3);
        println!(
            "{name:<12} {:>22} | {:>22} | {:>22} | {:7.1} {:7.1} {:7.1}",
            cell(ours[0]),
            cell(ours[1]),
            cell(ours[2]),
            candle[0],
            candle[1],
            candle[2]
        );
        for (t, v) in totals.iter_mut().zip(ours.iter().chain(&candle)) {
            *t += v;
        }
    }
    println!(
        "total ms: ours fwd {:.1}, input grad {:.1}, weight grad {:.1}; candle fwd {:.1}, \
         input grad {:.1}, weight grad {:.1}",
        totals[0], totals[1], totals[2], totals[3], totals[4], totals[5]
    );
    Ok(())
}

/// Times the three passes of each distinct convolution of ResNet-50 on 224x224 images at batch
/// 16 (torchvision's shapes: the 7x7 stem, the bottlenecks' 1x1 products, their 3x3 layers and
/// the strided projections), the kernels alone. Run with
/// `MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=536870912 MALLOC_TRIM_THRESHOLD_=4294967295
/// cargo test --release -p kandle-kernels --lib timings_resnet50 -- --ignored --nocapture`
/// (see [`median_ms`] for the allocator settings).
#[test]
#[ignore = "timing, run by hand in a release build"]
fn timings_resnet50_batch_16() -> anyhow::Result<()> {
    // (name, C, H, O, k, stride, count per step), padded by k / 2 on every side.
    let shapes = [
        ("conv1 7x7/2", 3, 224, 64, 7, 2, 1),
        ("l1 1x1 64>64", 64, 56, 64, 1, 1, 1),
        ("l1 3x3", 64, 56, 64, 3, 1, 3),
        ("l1 1x1 64>256", 64, 56, 256, 1, 1, 4),
        ("l1 1x1 256>64", 256, 56, 64, 1, 1, 2),
        ("l2 1x1 256>128", 256, 56, 128, 1, 1, 1),
        ("l2 3x3/2", 128, 56, 128, 3, 2, 1),
        ("l2 1x1 128>512", 128, 28, 512, 1, 1, 4),
        ("l2 proj 1x1/2", 256, 56, 512, 1, 2, 1),
        ("l2 1x1 512>128", 512, 28, 128, 1, 1, 3),
        ("l2 3x3", 128, 28, 128, 3, 1, 3),
        ("l3 1x1 512>256", 512, 28, 256, 1, 1, 1),
        ("l3 3x3/2", 256, 28, 256, 3, 2, 1),
        ("l3 1x1 256>1024", 256, 14, 1024, 1, 1, 6),
        ("l3 proj 1x1/2", 512, 28, 1024, 1, 2, 1),
        ("l3 1x1 1024>256", 1024, 14, 256, 1, 1, 5),
        ("l3 3x3", 256, 14, 256, 3, 1, 5),
        ("l4 1x1 1024>512", 1024, 14, 512, 1, 1, 1),
        ("l4 3x3/2", 512, 14, 512, 3, 2, 1),
        ("l4 1x1 512>2048", 512, 7, 2048, 1, 1, 3),
        ("l4 proj 1x1/2", 1024, 14, 2048, 1, 2, 1),
        ("l4 1x1 2048>512", 2048, 7, 512, 1, 1, 2),
        ("l4 3x3", 512, 7, 512, 3, 1, 2),
    ];
    print_timings(16, &shapes)
}

/// Times the three passes of ResNet-18's convolutions (the small-image variant, CIFAR's 32x32
/// images) at batch 64. Run with
/// `MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=536870912 MALLOC_TRIM_THRESHOLD_=4294967295
/// cargo test --release -p kandle-kernels --lib timings_resnet18 -- --ignored --nocapture`
/// (see [`median_ms`] for the allocator settings).
#[test]
#[ignore = "timing, run by hand"]
fn timings_resnet18_batch_64() -> anyhow::Result<()> {
    // (name, C, H, O, k, stride, count per step), padded by k / 2 on every side.
    let shapes = [
        ("conv1 3x3", 3, 32, 64, 3, 1, 1),
        ("l1 3x3", 64, 32, 64, 3, 1, 4),
        ("l2 3x3/2", 64, 32, 128, 3, 2, 1),
        ("l2 proj 1x1/2", 64, 32, 128, 1, 2, 1),
        ("l2 3x3", 128, 16, 128, 3, 1, 3),
        ("l3 3x3/2", 128, 16, 256, 3, 2, 1),
        ("l3 proj 1x1/2", 128, 16, 256, 1, 2, 1),
        ("l3 3x3", 256, 8, 256, 3, 1, 3),
        ("l4 3x3/2", 256, 8, 512, 3, 2, 1),
        ("l4 proj 1x1/2", 256, 8, 512, 1, 2, 1),
        ("l4 3x3", 512, 4, 512, 3, 1, 3),
    ];
    print_timings(64, &shapes)
}

/// Prints the three passes' times of each `(name, C, H, O, k, stride, count per step)` shape
/// at batch `n`, and their totals over a step.
fn print_timings(
    n: usize,
    shapes: &[(&str, usize, usize, usize, usize, usize, usize)],
) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(1);
    let mut totals = [0f64; 3];
    println!(
        "{:<16} {:>22} | {:>22} | {:>22}",
        format!("batch {n}"),
        "fwd ms (GFLOP/s)",
        "input grad ms (GFLOP/s)",
        "weight grad ms (GFLOP/s)"
    );
    for &(name, c, h, o, k, s, count) in shapes {
        let p = k / 2;
        let Timed { gflop, ours, .. } = time_passes(&mut rng, n, (c, h, o, k, s), (p, p, p, p))?;
        let cell = |ms: f64| format!("{ms:8.2} ({:6.1})", gflop / ms * 1e3);
        println!(
            "{name:<16} {:>22} | {:>22} | {:>22}",
            cell(ours[0]),
            cell(ours[1]),
            cell(ours[2]),
        );
        for (t, v) in totals.iter_mut().zip(&ours) {
            *t += v * count as f64;
        }
    }
    println!(
        "per step (each shape times its count), ms: fwd {:.1}, input grad {:.1}, weight grad {:.1}",
        totals[0], totals[1], totals[2]
    );
    Ok(())
}
