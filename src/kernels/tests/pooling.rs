//! The pooling kernels against candle: the pooling layers on `f32` (the kernels) against the
//! same layers on `f64` (the composed strided-view path), forward and gradients, over seeded
//! random shapes with odd sizes, batch 1, one channel, strides 1 and 2, `same` and `valid`;
//! against candle's own pooling ops where those apply; ties; and errors naming the op.

use super::support::{assert_close, gradients, random, random_var, weighted_sum};
use crate::kernels::pooling::{avg_pool2d, max_pool2d, PoolWindow};
use crate::layers::{
    AveragePooling2D, BuildContext, GlobalAveragePooling2D, LayerSpec, MaxPooling2D, Padding,
};
use candle_core::{DType, Device, Tensor, Var};

/// `(input, window, strides, padding)`.
type Case = (&'static [usize], (usize, usize), (usize, usize), Padding);

const CASES: &[Case] = &[
    (&[2, 3, 9, 11], (3, 3), (2, 2), Padding::Valid),
    (&[1, 1, 8, 7], (3, 3), (2, 2), Padding::Same),
    (&[3, 2, 5, 5], (2, 2), (1, 1), Padding::Same),
    (&[1, 4, 6, 6], (3, 3), (1, 1), Padding::Same),
    (&[2, 3, 8, 8], (2, 2), (2, 2), Padding::Valid),
    (&[2, 3, 7, 9], (2, 2), (2, 2), Padding::Valid),
    (&[2, 5, 7, 7], (7, 7), (7, 7), Padding::Valid),
    (&[2, 2, 9, 8], (3, 3), (2, 2), Padding::Same),
    (&[1, 1, 5, 6], (2, 3), (1, 2), Padding::Same),
    (&[3, 1, 6, 5], (3, 3), (1, 1), Padding::Valid),
    (&[1, 2, 4, 4], (4, 1), (1, 3), Padding::Valid),
    // MiniGoogLeNet's downsampling on a smaller batch: overlapping windows, many planes.
    (&[3, 8, 15, 15], (3, 3), (2, 2), Padding::Valid),
];

/// Runs `spec` built for `x` in training mode; its output and the gradient of `x` under a
/// seeded weighted sum.
fn run(spec: &dyn LayerSpec, x: &Var, seed: u64) -> anyhow::Result<(Tensor, Tensor)> {
    let mut ctx = BuildContext::new(&Device::Cpu, 0);
    let built = spec.build(&mut ctx, &x.dims()[1..])?;
    let y = built.layer().forward_t(x.as_tensor(), true)?;
    anyhow::ensure!(y.dims()[1..] == built.output_shape[..], "output shape");
    let grads = gradients(&weighted_sum(&y, seed)?, &[x.as_tensor()])?;
    Ok((y, grads[0].clone()))
}

/// The kernel path (`f32`) against the composed path (the same layer on `f64`).
fn check_layer(spec: &dyn LayerSpec, shape: &[usize], seed: u64) -> anyhow::Result<()> {
    let x = random_var(shape, seed, 0.0)?;
    let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64)?)?;
    let (y, dx) = run(spec, &x, seed + 1)?;
    let (want_y, want_dx) = run(spec, &x64, seed + 1)?;
    let what = format!("{} on {shape:?}", spec.kind());
    assert_close(&format!("{what}: y"), &y, &want_y, 1e-6)?;
    assert_close(&format!("{what}: dx"), &dx, &want_dx, 1e-6)?;
    Ok(())
}

#[test]
fn max_pooling_matches_the_composed_path() -> anyhow::Result<()> {
    for (i, &(shape, (kh, kw), (sh, sw), padding)) in CASES.iter().enumerate() {
        let spec = MaxPooling2D::new(kh)
            .window(kh, kw)
            .strides(sh, sw)
            .padding(padding);
        check_layer(&spec, shape, i as u64)?;
        // Inference finds the maxima without their positions: the same values.
        let x = random(shape, 50 + i as u64, 0.0)?;
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        let layer = spec.build(&mut ctx, &shape[1..])?.into_layer();
        let (train, infer) = (layer.forward_t(&x, true)?, layer.forward_t(&x, false)?);
        assert_eq!(
            train.flatten_all()?.to_vec1::<f32>()?,
            infer.flatten_all()?.to_vec1::<f32>()?,
            "{shape:?}"
        );
    }
    Ok(())
}

#[test]
fn average_pooling_matches_the_composed_path() -> anyhow::Result<()> {
    for (i, &(shape, (kh, kw), (sh, sw), padding)) in CASES.iter().enumerate() {
        let spec = AveragePooling2D::new(kh)
            .window(kh, kw)
            .strides(sh, sw)
            .padding(padding);
        check_layer(&spec, shape, 50 + i as u64)?;
    }
    Ok(())
}

#[test]
fn global_average_pooling_matches_the_mean() -> anyhow::Result<()> {
    for (i, shape) in [[2, 3, 5, 7], [1, 1, 1, 1], [4, 6, 7, 7]]
        .iter()
        .enumerate()
    {
        check_layer(&GlobalAveragePooling2D, shape, 80 + i as u64)?;
    }
    Ok(())
}

/// Candle's own `max_pool2d`/`avg_pool2d` where their backward passes are right: a window equal
/// to the stride over sizes it divides. (Candle 0.11's max-pool backward scales the gradient by
/// one over the window size, so the max-pool gradient is checked against the mask of maxima.)
#[test]
fn kernels_match_candle_pooling_where_window_equals_stride() -> anyhow::Result<()> {
    let window = PoolWindow {
        window: (2, 2),
        stride: (2, 2),
        pad: (0, 0, 0, 0),
    };
    for (i, shape) in [[2, 3, 8, 8], [1, 1, 6, 4], [3, 2, 4, 6]]
        .iter()
        .enumerate()
    {
        let x = random_var(shape, 90 + i as u64, 0.0)?;
        let (h, w) = (shape[2], shape[3]);

        let y = avg_pool2d(x.as_tensor(), &window)?;
        let want = x.avg_pool2d(2)?;
        let dx = gradients(&weighted_sum(&y, 1)?, &[x.as_tensor()])?;
        let want_dx = gradients(&weighted_sum(&want, 1)?, &[x.as_tensor()])?;
        assert_close(&format!("avg y {shape:?}"), &y, &want, 1e-6)?;
        assert_close(&format!("avg dx {shape:?}"), &dx[0], &want_dx[0], 1e-6)?;

        let y = max_pool2d(x.as_tensor(), &window)?;
        assert_close(&format!("max y {shape:?}"), &y, &x.max_pool2d(2)?, 0.0)?;
        let dx = gradients(&weighted_sum(&y, 1)?, &[x.as_tensor()])?;
        let is_max = x.eq(&y.upsample_nearest2d(h, w)?)?.to_dtype(DType::F32)?;
        let dy = super::support::random(y.dims(), 1, 0.0)?;
        let want_dx = (is_max * dy.upsample_nearest2d(h, w)?)?;
        assert_close(&format!("max dx {shape:?}"), &dx[0], &want_dx, 1e-6)?;
    }
    Ok(())
}

/// The max pool of `x` with a `window` at stride 1, and the gradient of its sum.
fn max_pool_and_gradient(x: &Tensor, window: (usize, usize)) -> anyhow::Result<(Tensor, Tensor)> {
    let x = Var::from_tensor(x)?;
    let window = PoolWindow {
        window,
        stride: (1, 1),
        pad: (0, 0, 0, 0),
    };
    let y = max_pool2d(x.as_tensor(), &window)?;
    let grads = y.sum_all()?.backward()?;
    let dx = grads
        .get(x.as_tensor())
        .ok_or_else(|| anyhow::anyhow!("no gradient"))?
        .clone();
    Ok((y.flatten_all()?, dx.flatten_all()?))
}

#[test]
fn max_pool_ties_send_the_gradient_to_the_first_maximum() -> anyhow::Result<()> {
    let x = Tensor::ones((1, 1, 2, 3), DType::F32, &Device::Cpu)?;
    let (y, dx) = max_pool_and_gradient(&x, (2, 2))?;
    assert_eq!(y.to_vec1::<f32>()?, vec![1., 1.]);
    // Windows start at columns 0 and 1 of the top row.
    assert_eq!(dx.to_vec1::<f32>()?, vec![1., 1., 0., 0., 0., 0.]);

    // One 2x3 window: 5 appears at (0, 2) and (1, 0); row-major order puts (0, 2) first.
    let x = Tensor::new(&[[[[1f32, 2., 5.], [5., 0., 3.]]]], &Device::Cpu)?;
    let (y, dx) = max_pool_and_gradient(&x, (2, 3))?;
    assert_eq!(y.to_vec1::<f32>()?, vec![5.]);
    assert_eq!(dx.to_vec1::<f32>()?, vec![0., 0., 1., 0., 0., 0.]);
    Ok(())
}

#[test]
fn max_pool_propagates_nan() -> anyhow::Result<()> {
    let x = Tensor::new(&[[[[1f32, f32::NAN, 5.], [5., 0., 3.]]]], &Device::Cpu)?;
    let (y, _) = max_pool_and_gradient(&x, (2, 3))?;
    let y = y.to_vec1::<f32>()?;
    assert!(y[0].is_nan(), "{y:?}");
    Ok(())
}

#[test]
fn bad_windows_and_inputs_name_the_op_and_the_shape() -> anyhow::Result<()> {
    let x = Tensor::zeros((1, 2, 2, 2), DType::F32, &Device::Cpu)?;
    let window = PoolWindow {
        window: (3, 3),
        stride: (1, 1),
        pad: (0, 0, 0, 0),
    };
    let err = max_pool2d(&x, &window)
        .expect_err("3x3 window on 2x2")
        .to_string();
    assert!(
        err.contains("max_pool2d") && err.contains("3x3") && err.contains("[1, 2, 2, 2]"),
        "{err}"
    );
    let err = avg_pool2d(&x.flatten_from(2)?, &window)
        .expect_err("three axes")
        .to_string();
    assert!(
        err.contains("avg_pool2d") && err.contains("[1, 2, 4]"),
        "{err}"
    );
    let zero_stride = PoolWindow {
        stride: (0, 1),
        window: (1, 1),
        ..window
    };
    let err = avg_pool2d(&x, &zero_stride)
        .expect_err("zero stride")
        .to_string();
    assert!(
        err.contains("avg_pool2d") && err.contains("(0, 1)"),
        "{err}"
    );
    Ok(())
}

/// Every `step`-th element along `dim` of `x`, by reshaping, as the layers' composed path
/// subsamples.
fn every(x: &Tensor, dim: usize, step: usize) -> candle_core::Result<Tensor> {
    let out = x.dim(dim)?.div_ceil(step);
    let x = x.pad_with_zeros(dim, 0, out * step - x.dim(dim)?)?;
    let mut dims = x.dims().to_vec();
    dims[dim] = out;
    dims.insert(dim + 1, step);
    x.reshape(dims)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)
}

/// The composed path the layers take off the CPU, for an unpadded max pool: the element-wise
/// maximum of the `kh * kw` strided views.
fn max_of_views(x: &Tensor, k: usize, s: usize) -> anyhow::Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
    let mut acc: Option<Tensor> = None;
    for i in 0..k {
        let rows = every(&x.narrow(2, i, s * (oh - 1) + 1)?, 2, s)?;
        for j in 0..k {
            let view = every(&rows.narrow(3, j, s * (ow - 1) + 1)?, 3, s)?;
            acc = Some(match acc {
                None => view,
                Some(a) => a.maximum(&view)?,
            });
        }
    }
    acc.ok_or_else(|| anyhow::anyhow!("empty window"))
}

/// Prints forward and backward times of the composed paths and the kernels for MiniGoogLeNet's
/// pools at batch 64. Run with
/// `cargo test --release -p kandle --test kernels_pooling -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run on demand"]
fn time_mini_googlenet_pooling() -> anyhow::Result<()> {
    use super::support::fwd_bwd_ms;
    let reps = 5;
    let valid = |k: usize, s: usize| PoolWindow {
        window: (k, k),
        stride: (s, s),
        pad: (0, 0, 0, 0),
    };
    println!("{:>28} | {:>15} | {:>15}", "pool", "composed", "kernel");
    let row = |name: &str, old: (f64, f64), new: (f64, f64)| {
        println!(
            "{name:>28} | {:6.2} + {:6.2} | {:6.2} + {:6.2}",
            old.0, old.1, new.0, new.1
        )
    };
    for (i, &(c, hw)) in [(80, 32), (144, 15)].iter().enumerate() {
        let x = random_var(&[64, c, hw, hw], i as u64, 0.0)?;
        let old = fwd_bwd_ms(reps, || max_of_views(&x, 3, 2))?;
        let new = fwd_bwd_ms(reps, || Ok(max_pool2d(&x, &valid(3, 2))?))?;
        row(&format!("max 3x3/2 on 64x{c}x{hw}x{hw}"), old, new);
    }
    let x = random_var(&[64, 336, 7, 7], 3, 0.0)?;
    let old = fwd_bwd_ms(reps, || Ok(x.avg_pool2d(7)?))?;
    let new = fwd_bwd_ms(reps, || Ok(avg_pool2d(&x, &valid(7, 7))?))?;
    row("avg 7x7 on 64x336x7x7", old, new);
    println!("(forward ms + backward ms, medians of {reps})");
    Ok(())
}
