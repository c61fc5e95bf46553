//! The pooling layers: overlapping max pooling's values and gradient, its gradient with tied
//! maxima on the device-generic path routed as the kernel routes it, `same` padding; and the
//! layers on `f32` (the kernels) against the same layers on `f64` (the composed strided-view
//! path), forward and gradients, over seeded random shapes with odd sizes, batch 1, one
//! channel, strides 1 and 2, `same` and `valid`, and max pooling's inference (the maxima
//! without their positions) against its training forward. With the `cuda` feature and a GPU
//! (`#[ignore]`d), the max, average and global average pools on kandle's CUDA kernels against
//! the same layers on candle's ops there.

use super::*;
use crate::layers::{
    AveragePooling2D, BuildContext, GlobalAveragePooling2D, LayerSpec, MaxPooling2D, Padding,
};
use crate::ComputePath;
use candle_core::{DType, Device, Tensor, Var};
use kandle_kernels::test_support::{assert_close, gradients, random, random_var, weighted_sum};

fn pool(spec: &dyn LayerSpec, x: &Tensor) -> Result<Tensor> {
    let mut ctx = BuildContext::new(&Device::Cpu, 0);
    let dims = x.dims()[1..].to_vec();
    let built = spec.build(&mut ctx, &dims)?;
    assert_eq!(
        built.output_shape,
        built.layer.forward_t(x, true)?.dims()[1..].to_vec()
    );
    built.layer.forward_t(x, true)
}

#[test]
fn overlapping_max_pool_values_and_gradient() -> Result<()> {
    let x = Var::new(
        &[[[
            [1f32, 2., 3., 4., 5.],
            [6., 7., 8., 9., 10.],
            [11., 12., 13., 14., 15.],
            [16., 17., 18., 19., 20.],
            [21., 22., 23., 24., 25.],
        ]]],
        &Device::Cpu,
    )?;
    let y = pool(&MaxPooling2D::new(3).stride(2), x.as_tensor())?;
    assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, vec![13., 15., 23., 25.]);
    let grads = y.sum_all()?.backward()?;
    let g = grads
        .get(x.as_tensor())
        .map(|g| g.flatten_all()?.to_vec1::<f32>())
        .transpose()?;
    let mut want = vec![0f32; 25];
    for i in [12, 14, 22, 24] {
        want[i] = 1.0;
    }
    assert_eq!(g, Some(want));
    Ok(())
}

/// The max pool's gradient with tied maxima (flat regions, repeated values, a NaN) on the
/// device-generic path, candle's ops and autograd, is the CPU kernel's: each output gradient
/// goes to the window's first maximum in row-major order, and a NaN propagates.
#[test]
fn max_pool_ties_route_the_gradient_like_the_kernel() -> Result<()> {
    let x = Var::new(
        &[[[
            [0f32, 0., 0., 0., 0.],
            [0., 2., 2., 1., 0.],
            [0., 2., 2., 1., 1.],
            [5., 5., 5., 1., 1.],
            [5., 5., 5., 1., f32::NAN],
        ]]],
        &Device::Cpu,
    )?;
    let upstream = Tensor::new(&[1f32, 2., 3., 4., 5., 6., 7., 8., 9.], &Device::Cpu)?;
    let run = |path: ComputePath, spec: &dyn LayerSpec| -> Result<(Vec<f32>, Vec<f32>)> {
        let mut ctx = BuildContext::new(&Device::Cpu, 0).with_compute_path(path);
        let layer = spec.build(&mut ctx, &[1, 5, 5])?.layer;
        let y = layer.forward_t(x.as_tensor(), true)?;
        let n = y.elem_count();
        let weighted = (y.flatten_all()? * upstream.narrow(0, 0, n)?)?;
        // NaN outputs carry no gradient in either path: leave them out of the loss.
        let finite = weighted.eq(&weighted)?;
        let loss = finite
            .where_cond(&weighted, &weighted.zeros_like()?)?
            .sum_all()?;
        let grads = loss.backward()?;
        let g = grads.get(x.as_tensor()).expect("a gradient for x");
        Ok((y.flatten_all()?.to_vec1()?, g.flatten_all()?.to_vec1()?))
    };
    // Whether a window covers the NaN in the corner.
    let specs: [(Box<dyn LayerSpec>, bool); 3] = [
        (Box::new(MaxPooling2D::new(2)), false),
        (Box::new(MaxPooling2D::new(3).stride(2)), true),
        (
            Box::new(MaxPooling2D::new(2).stride(2).padding(Padding::Same)),
            true,
        ),
    ];
    for (spec, covers_nan) in &specs {
        let (want_y, want_g) = run(ComputePath::Auto, spec.as_ref())?;
        let (got_y, got_g) = run(ComputePath::DeviceGeneric, spec.as_ref())?;
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got_y), bits(&want_y), "{spec:?}: outputs");
        assert_eq!(got_g, want_g, "{spec:?}: gradients");
        assert_eq!(
            want_y.iter().any(|v| v.is_nan()),
            *covers_nan,
            "{spec:?}: NaN"
        );
    }
    Ok(())
}

#[test]
fn same_padding_pools() -> Result<()> {
    let x = Tensor::arange(1f32, 10., &Device::Cpu)?.reshape((1, 1, 3, 3))?;
    let m = pool(&MaxPooling2D::new(2).stride(2).padding(Padding::Same), &x)?;
    assert_eq!(m.flatten_all()?.to_vec1::<f32>()?, vec![5., 6., 8., 9.]);
    let a = pool(
        &AveragePooling2D::new(2).stride(2).padding(Padding::Same),
        &x,
    )?;
    assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, vec![3., 4.5, 7.5, 9.]);
    let native = pool(&AveragePooling2D::new(3), &x)?;
    assert_eq!(native.flatten_all()?.to_vec1::<f32>()?, vec![5.]);
    let g = pool(&GlobalAveragePooling2D, &x)?;
    assert_eq!(g.dims(), &[1, 1]);
    Ok(())
}

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

/// On a CUDA device the max and average pools run `kandle_kernels::cuda`'s kernels by default:
/// their outputs are the kernels' bit for bit (and candle's ops give other bits for some average
/// pool, so this tells the paths apart). They agree with the same layers built for
/// [`ComputePath::DeviceGeneric`] (what `KANDLE_COMPUTE=device-generic` runs: candle's ops and
/// autograd) in the output and the input's gradient, through candle's autograd and the recorded
/// backward pass, and in inference, for `f32` and `f16` inputs.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_kernels_match_the_device_generic_path() -> anyhow::Result<()> {
    let gpu = crate::devices::cuda(0)?;
    let values = |t: &Tensor| -> anyhow::Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let mut distinguishable = false;
    for (i, &(shape, window, stride, padding)) in CASES.iter().enumerate() {
        let (kh, kw) = window;
        let specs: [(PoolKind, Box<dyn LayerSpec>); 2] = [
            (
                PoolKind::Max,
                Box::new(
                    MaxPooling2D::new(kh)
                        .window(kh, kw)
                        .strides(stride.0, stride.1)
                        .padding(padding),
                ),
            ),
            (
                PoolKind::Average,
                Box::new(
                    AveragePooling2D::new(kh)
                        .window(kh, kw)
                        .strides(stride.0, stride.1)
                        .padding(padding),
                ),
            ),
        ];
        for (kind, spec) in &specs {
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 1e-2)] {
                let what =
                    |part: &str| format!("{} on {shape:?} in {dtype:?}: {part}", spec.kind());
                let mut ctx = BuildContext::new(&gpu, 0);
                let kernel = spec.build(&mut ctx, &shape[1..])?;
                let pad = Window::resolve(&ctx, &shape[1..], window, stride, padding, "pool")?.pad;
                let mut ctx =
                    BuildContext::new(&gpu, 0).with_compute_path(ComputePath::DeviceGeneric);
                let generic = spec.build(&mut ctx, &shape[1..])?.layer;
                let out_dims: Vec<usize> = shape[..1]
                    .iter()
                    .chain(&kernel.output_shape)
                    .copied()
                    .collect();
                let kernel = kernel.layer;

                let x = random(shape, 90 + i as u64, 0.0)?
                    .to_device(&gpu)?
                    .to_dtype(dtype)?;
                let x = Var::from_tensor(&x)?;
                let dy = random(&out_dims, 7, 0.0)?
                    .to_device(&gpu)?
                    .to_dtype(dtype)?;
                let layers = (kernel.as_ref(), generic.as_ref());
                let (y, want_y) = match_generic(&what, layers, &x, dy, (dtype, tol))?;

                let pool = PoolWindow {
                    window,
                    stride,
                    pad,
                };
                let direct = match kind {
                    PoolKind::Max => kandle_kernels::cuda::max_pool2d(x.as_tensor(), &pool)?,
                    PoolKind::Average => kandle_kernels::cuda::avg_pool2d(x.as_tensor(), &pool)?,
                };
                let direct = values(&direct)?;
                assert_eq!(values(&y)?, direct, "{}", what("the kernel's output"));
                distinguishable |= values(&want_y)? != direct;
            }
        }
    }
    anyhow::ensure!(
        distinguishable,
        "candle's ops gave the kernels' bits in every case: the check cannot tell the paths apart"
    );
    Ok(())
}

/// On a CUDA device global average pooling runs the CUDA average pool over each whole plane:
/// its output, its input's gradient through candle's autograd and through the recorded pass
/// (the kernel's backward), and inference agree with the layer built for
/// [`ComputePath::DeviceGeneric`] (candle's `mean`), for `f32` and `f16` inputs.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn global_average_pool_cuda_kernels_match_the_device_generic_path() -> anyhow::Result<()> {
    let gpu = crate::devices::cuda(0)?;
    for (i, shape) in [[2, 3, 5, 7], [1, 4, 8, 8]].into_iter().enumerate() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 1e-2)] {
            let what =
                |part: &str| format!("global average pool on {shape:?} in {dtype:?}: {part}");
            let build = |path| -> anyhow::Result<Box<dyn FastPath>> {
                let mut ctx = BuildContext::new(&gpu, 0).with_compute_path(path);
                Ok(GlobalAveragePooling2D.build(&mut ctx, &shape[1..])?.layer)
            };
            let (kernel, generic) = (
                build(ComputePath::Auto)?,
                build(ComputePath::DeviceGeneric)?,
            );
            let x = random(&shape, 40 + i as u64, 0.0)?
                .to_device(&gpu)?
                .to_dtype(dtype)?;
            let x = Var::from_tensor(&x)?;
            let dy = random(&shape[..2], 8, 0.0)?
                .to_device(&gpu)?
                .to_dtype(dtype)?;
            let layers = (kernel.as_ref(), generic.as_ref());
            match_generic(&what, layers, &x, dy, (dtype, tol))?;
        }
    }
    Ok(())
}

/// Checks the layer `kernel` (built on the CUDA kernels) against `generic` (the same layer built
/// device-generic) on the input `x` with the output gradient `dy`: the output (of `dtype`) and
/// the input's gradient through candle's autograd, the recorded pass's output and gradient, and
/// inference, each within `tol`. Returns the kernel's training output and the generic one's.
#[cfg(feature = "cuda")]
fn match_generic(
    what: &dyn Fn(&str) -> String,
    (kernel, generic): (&dyn FastPath, &dyn FastPath),
    x: &Var,
    dy: Tensor,
    (dtype, tol): (DType, f32),
) -> anyhow::Result<(Tensor, Tensor)> {
    let pass = |layer: &dyn FastPath| -> anyhow::Result<(Tensor, Tensor)> {
        let y = layer.forward_t(x.as_tensor(), true)?;
        let dx = gradients(&(&y * &dy)?.sum_all()?, &[x.as_tensor()])?;
        Ok((y, dx[0].clone()))
    };
    let (y, dx) = pass(kernel)?;
    let (want_y, want_dx) = pass(generic)?;
    assert_eq!(y.dtype(), dtype, "{}", what("output dtype"));
    assert_close(&what("y"), &y, &want_y, tol)?;
    assert_close(&what("dx"), &dx, &want_dx, tol)?;

    let recorded = kernel.forward_recorded(x.as_tensor(), RecordRequest::output())?;
    let recorded_dx = recorded
        .backward
        .backward(dy, &mut ParamGrads::new(), true)?
        .ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
    assert_close(&what("recorded y"), &recorded.output, &want_y, tol)?;
    assert_close(&what("recorded dx"), &recorded_dx, &want_dx, tol)?;

    let inference = kernel.forward_t(x.as_tensor(), false)?;
    let want_inference = generic.forward_t(x.as_tensor(), false)?;
    assert_close(&what("inference"), &inference, &want_inference, tol)?;
    Ok((y, want_y))
}
