//! The pooling kernels against candle: against candle's own pooling ops where those apply,
//! forward and gradients; ties; NaN; and errors naming the op. (kandle's pooling layers test the
//! kernels against their composed strided-view path over many more shapes.)

use super::{avg_pool2d, max_pool2d, PoolWindow};
use crate::test_support::{assert_close, gradients, random_var, weighted_sum};
use candle_core::{DType, Device, Tensor, Var};

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
        let dy = crate::test_support::random(y.dims(), 1, 0.0)?;
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
    let (y, dx) = max_pool_and_gradient(&x, (2, 3))?;
    let y = y.to_vec1::<f32>()?;
    assert!(y[0].is_nan(), "{y:?}");
    // PyTorch takes the NaN as the window's maximum: its gradient goes there.
    assert_eq!(dx.to_vec1::<f32>()?, vec![0., 1., 0., 0., 0., 0.]);
    Ok(())
}

/// Every window that holds a NaN gives a NaN, and only those, in inference (the maxima
/// alone) and in training (the positions too), over padded and overlapping windows (3x3 at
/// stride 2, MiniGoogLeNet's, with `same` padding), rows long enough for whole vectors; each
/// window's gradient goes to its NaN. An average over a window that holds a NaN is NaN too.
#[test]
fn a_nan_gives_every_window_that_holds_it_a_nan() -> anyhow::Result<()> {
    let (h, w) = (9, 21);
    let mut values = crate::test_support::random(&[2, 3, h, w], 7, 0.0)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    // A NaN inside a plane (image 1, channel 1), one on a plane's padded corner (image 0,
    // channel 2).
    let nans = [(4 * h + 4) * w + 6, (2 * h + 8) * w + 20];
    for &at in &nans {
        values[at] = f32::NAN;
    }
    let x = Var::from_vec(values, (2, 3, h, w), &Device::Cpu)?;
    let window = PoolWindow {
        window: (3, 3),
        stride: (2, 2),
        pad: (1, 1, 1, 1),
    };
    let (oh, ow) = ((h + 2 - 3) / 2 + 1, (w + 2 - 3) / 2 + 1);
    // Which outputs' windows hold a NaN: output (i, j) reads rows 2i-1..=2i+1 and columns
    // 2j-1..=2j+1 of its plane.
    let holds_nan = |o: usize| {
        let (plane, i, j) = (o / (oh * ow), o / ow % oh, o % ow);
        nans.iter().any(|&at| {
            let (p, r, c) = (at / (h * w), at / w % h, at % w);
            let window = |k: usize| 2 * k..=2 * k + 2;
            p == plane && window(i).contains(&(r + 1)) && window(j).contains(&(c + 1))
        })
    };
    let is_nan = |t: &Tensor| -> anyhow::Result<Vec<bool>> {
        Ok(t.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.is_nan())
            .collect())
    };
    let inference = max_pool2d(x.as_tensor(), &window)?;
    let replay = super::max_pool2d_replay(x.as_tensor(), &window)?;
    let average = avg_pool2d(x.as_tensor(), &window)?;
    for (what, y) in [
        ("inference", &inference),
        ("training", replay.output()),
        ("average", &average),
    ] {
        assert_eq!(y.dims(), [2, 3, oh, ow], "{what}");
        for (o, nan) in is_nan(y)?.into_iter().enumerate() {
            assert_eq!(nan, holds_nan(o), "{what}: output {o}");
        }
    }
    // Each output's gradient is 1 + its index: the NaNs' gradients are the sums of their
    // windows'.
    let dy: Vec<f32> = (0..2 * 3 * oh * ow).map(|o| 1.0 + o as f32).collect();
    let want: Vec<f32> = nans
        .iter()
        .map(|&at| {
            let plane = at / (h * w);
            (0..dy.len())
                .filter(|&o| o / (oh * ow) == plane && holds_nan(o))
                .map(|o| dy[o])
                .sum()
        })
        .collect();
    let dy = Tensor::from_vec(dy, (2, 3, oh, ow), &Device::Cpu)?;
    let dx = replay
        .backward(&dy)?
        .ok_or_else(|| anyhow::anyhow!("no gradient"))?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for (&at, want) in nans.iter().zip(want) {
        assert_eq!(dx[at], want, "the gradient of the NaN at {at}");
    }
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
/// `cargo test --release -p kandle-kernels --lib time_mini_googlenet_pooling -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run on demand"]
fn time_mini_googlenet_pooling() -> anyhow::Result<()> {
    use crate::test_support::fwd_bwd_ms;
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
