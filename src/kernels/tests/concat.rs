//! Joining along channels and cutting gradients back, against `Tensor::cat` and `narrow`.

use candle_core::{Device, Tensor};

use super::support::{gradients, random, random_var, weighted_sum};
use crate::kernels::concat::{channel_slice, concat_channels, supported};

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
