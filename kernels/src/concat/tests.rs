//! Joining along channels and cutting gradients back, against `Tensor::cat` and `narrow`.

use candle_core::{DType, Device, Tensor};

use super::{channel_slice, concat_channels, supported};
use crate::test_support::{gradients, random, random_var, weighted_sum};

#[test]
fn joins_like_cat_with_the_same_gradients() -> anyhow::Result<()> {
    // Images, each part's channels, then the plane (rank 4 and rank 3).
    for (i, (n, ca, cb, plane)) in [
        (2, 3, 5, vec![4, 6]),
        (1, 1, 1, vec![1, 1]),
        (3, 32, 48, vec![7, 7]),
        (4, 2, 7, vec![9]),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 10 * i as u64;
        let dims = |c: usize| [vec![n, c], plane.clone()].concat();
        let (a, b) = (
            random_var(&dims(ca), seed, 0.0)?,
            random_var(&dims(cb), seed + 1, 0.5)?,
        );
        let got = concat_channels(a.as_tensor(), b.as_tensor())?;
        let want = Tensor::cat(&[a.as_tensor(), b.as_tensor()], 1)?;
        assert_eq!(got.dims(), want.dims());
        assert_eq!(
            got.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?
        );
        let vars = [a.as_tensor(), b.as_tensor()];
        let got = gradients(&weighted_sum(&got, seed + 2)?, &vars)?;
        let want = gradients(&weighted_sum(&want, seed + 2)?, &vars)?;
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(
                g.flatten_all()?.to_vec1::<f32>()?,
                w.flatten_all()?.to_vec1::<f32>()?
            );
        }
    }
    Ok(())
}

#[test]
fn slices_channels_like_narrow() -> anyhow::Result<()> {
    let x = random(&[3, 7, 4, 5], 3, 0.0)?;
    for (offset, channels) in [(0, 7), (2, 3), (6, 1), (4, 0)] {
        let got = channel_slice(&x, offset, channels)?;
        let want = x.narrow(1, offset, channels)?;
        assert_eq!(got.dims(), want.dims());
        assert_eq!(
            got.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?
        );
    }
    // A non-contiguous input is read as its values.
    let t = x.transpose(2, 3)?;
    let want = t.narrow(1, 1, 2)?.contiguous()?;
    assert_eq!(
        channel_slice(&t, 1, 2)?.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}

#[test]
fn parts_that_do_not_fit_are_errors() -> anyhow::Result<()> {
    let a = Tensor::zeros((2, 3, 4, 4), candle_core::DType::F32, &Device::Cpu)?;
    let b = Tensor::zeros((2, 3, 4, 5), candle_core::DType::F32, &Device::Cpu)?;
    assert!(!supported(&a, &b));
    let err = concat_channels(&a, &b)
        .map(|_| ())
        .expect_err("mismatched parts")
        .to_string();
    assert!(
        err.contains("[2, 3, 4, 4]") && err.contains("[2, 3, 4, 5]"),
        "{err}"
    );
    let half = a.to_dtype(candle_core::DType::F16)?;
    assert!(!supported(&a, &half));
    let err = channel_slice(&a, 2, 2)
        .map(|_| ())
        .expect_err("channels past the end")
        .to_string();
    assert!(
        err.contains("2..4") && err.contains("[2, 3, 4, 4]"),
        "{err}"
    );
    Ok(())
}

#[test]
fn parts_write_their_channels_in_place() -> anyhow::Result<()> {
    use crate::concat::ConcatOutput;
    use crate::conv2d::{conv2d_affine, conv2d_affine_into, FoldedAffine};
    use crate::pooling::{max_pool2d, max_pool2d_into, PoolWindow};

    // 12x12 planes one image per task; 7x7 planes several images to a GEMM (the 1x1), and
    // Winograd's lanes spanning images (the 3x3).
    for (i, (n, hw)) in [(3, 12), (9, 7)].into_iter().enumerate() {
        let seed = 100 * i as u64;
        let x = random(&[n, 20, hw, hw], seed, 0.0)?;
        let w3 = random(&[24, 20, 3, 3], seed + 1, 0.0)?;
        let w1 = random(&[8, 20, 1, 1], seed + 2, 0.0)?;
        let (scale, shift) = (random(&[24], seed + 3, 0.5)?, random(&[24], seed + 4, 0.0)?);
        let (ones, bias) = (
            Tensor::ones(8, DType::F32, &Device::Cpu)?,
            random(&[8], 5, 0.0)?,
        );
        let pool = PoolWindow {
            window: (3, 3),
            stride: (1, 1),
            pad: (1, 1, 1, 1),
        };
        let other = random(&[n, 5, hw, hw], seed + 6, 0.0)?;
        let folded = |(scale, shift), relu| FoldedAffine {
            scale,
            shift,
            relu,
            cache: None,
        };
        let same = ((1, 1), (1, 1, 1, 1));
        let unit = ((1, 1), (0, 0, 0, 0));
        let want = Tensor::cat(
            &[
                conv2d_affine(&x, &w3, folded((&scale, &shift), true), same)?,
                max_pool2d(&x, &pool)?,
                other.clone(),
                conv2d_affine(&x, &w1, folded((&ones, &bias), true), unit)?,
                Tensor::zeros((n, 2, hw, hw), DType::F32, &Device::Cpu)?,
            ],
            1,
        )?;
        // Written out of order; the last two channels by no part.
        let mut out = ConcatOutput::new(&[n, 24 + 20 + 5 + 8 + 2, hw, hw])?;
        max_pool2d_into(&x, &pool, &mut out.part(24, 20)?)?;
        let conv_in = |out: &mut ConcatOutput, w: &Tensor, at, channels, window| {
            let affine = if channels == 24 {
                folded((&scale, &shift), true)
            } else {
                folded((&ones, &bias), true)
            };
            let mut slot = out.part(at, channels)?;
            conv2d_affine_into(&x, w, affine, window, &mut slot)
        };
        conv_in(&mut out, &w1, 49, 8, unit)?;
        out.part(44, 5)?.copy_from(&other)?;
        conv_in(&mut out, &w3, 0, 24, same)?;
        let got = out.into_tensor()?;
        assert_eq!(got.dims(), want.dims());
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff < 1e-4,
            "{n} images of {hw}x{hw}: max difference {diff}"
        );
    }

    // A part of other channels, or beyond the output's, is refused with both shapes.
    let x = random(&[2, 20, 6, 6], 1, 0.0)?;
    let mut out = ConcatOutput::new(&[2, 10, 6, 6])?;
    let err = out.part(0, 4)?.copy_from(&x).err().map(|e| e.to_string());
    let err = err.unwrap_or_default();
    assert!(
        err.contains("[2, 20, 6, 6]") && err.contains("[2, 4, 6, 6]"),
        "{err}"
    );
    assert!(out.part(8, 3).is_err());
    Ok(())
}
