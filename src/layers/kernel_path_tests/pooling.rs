//! The pooling layers on `f32` (the kernels) against the same layers on `f64` (the composed
//! strided-view path), forward and gradients, over seeded random shapes with odd sizes, batch
//! 1, one channel, strides 1 and 2, `same` and `valid`; and max pooling's inference (the maxima
//! without their positions) against its training forward.

use super::support::{assert_close, gradients, random, random_var, weighted_sum};
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
    // Rows longer than the max pool's sets of 16 lanes, and more than 16 windows to a row.
    (&[1, 2, 5, 37], (3, 3), (2, 2), Padding::Same),
    (&[1, 2, 4, 35], (2, 3), (1, 1), Padding::Valid),
];

/// Runs `spec` built for `x` in training mode; its output and the gradient of `x` under a
/// seeded weighted sum.
fn run(spec: &dyn LayerSpec, x: &Var, seed: u64) -> anyhow::Result<(Tensor, Tensor)> {
    let mut ctx = BuildContext::new(&Device::Cpu, 0);
    let built = spec.build(&mut ctx, &x.dims()[1..])?;
    let y = built.layer.forward_t(x.as_tensor(), true)?;
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
        let layer = spec.build(&mut ctx, &shape[1..])?.layer;
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
