//! The preprocessing layers: training-only randomness, repeatable from a seed and resumable
//! from the saved generator position, and clear errors.

use candle_core::{Device, Tensor};

use crate::layers::{
    BuildContext, Built, LayerSpec, Normalization, RandomCrop, RandomFlip, RandomResizedCrop,
    RandomRotation, RandomZoom, Rescaling,
};
use crate::Result;

fn build(
    spec: &dyn LayerSpec,
    shape: &[usize],
    seed: u64,
) -> Result<(Built, crate::params::ParamStore)> {
    let mut ctx = BuildContext::new(&Device::Cpu, seed);
    let built = spec.build(&mut ctx, shape)?;
    Ok((built, ctx.into_store()))
}

fn images(n: usize) -> Result<Tensor> {
    Ok(Tensor::arange(0f32, (n * 2 * 5 * 6) as f32, &Device::Cpu)?.reshape((n, 2, 5, 6))?)
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

#[test]
fn random_layers_are_the_identity_in_inference() -> Result<()> {
    let x = images(3)?;
    let specs: Vec<Box<dyn LayerSpec>> = vec![
        Box::new(RandomFlip::horizontal_and_vertical()),
        Box::new(RandomRotation::new(0.2)),
        Box::new(RandomZoom::new(-0.3, 0.3)),
    ];
    for spec in specs {
        let (built, _) = build(spec.as_ref(), &[2, 5, 6], 1)?;
        assert_eq!(
            values(&built.layer().forward_t(&x, false)?)?,
            values(&x)?,
            "{}",
            spec.kind()
        );
    }
    Ok(())
}

/// Each image is itself or its mirror image; over 64 images both occur; the draws repeat from
/// the seed and from a saved position.
#[test]
fn random_flip_flips_some_images_repeatably() -> Result<()> {
    let x = images(64)?;
    let mirrored = x.index_select(&Tensor::new(&[5u32, 4, 3, 2, 1, 0], &Device::Cpu)?, 3)?;
    let (built, store) = build(&RandomFlip::horizontal(), &[2, 5, 6], 7)?;
    let saved = store.weights()?;
    let y = built.layer().forward_t(&x, true)?;
    let mut flipped = 0;
    for i in 0..64 {
        let got = values(&y.get(i)?)?;
        if got == values(&mirrored.get(i)?)? {
            flipped += 1;
        } else {
            assert_eq!(got, values(&x.get(i)?)?, "image {i} is neither");
        }
    }
    assert!((16..=48).contains(&flipped), "{flipped} of 64 flipped");
    let again = build(&RandomFlip::horizontal(), &[2, 5, 6], 7)?.0;
    assert_eq!(
        values(&again.layer().forward_t(&x, true)?)?,
        values(&y)?,
        "the seed repeats"
    );
    let next = values(&built.layer().forward_t(&x, true)?)?;
    assert_ne!(next, values(&y)?, "each call draws anew");
    store.assign(&saved)?;
    assert_eq!(
        values(&built.layer().forward_t(&x, true)?)?,
        values(&y)?,
        "the position resumes"
    );
    Ok(())
}

/// A training crop is a window of its image; inference takes the centred one.
#[test]
fn random_crop_takes_windows() -> Result<()> {
    let x = images(8)?;
    let (built, _) = build(&RandomCrop::new(3, 4), &[2, 5, 6], 3)?;
    assert_eq!(built.output_shape, [2, 3, 4]);
    let y = built.layer().forward_t(&x, true)?;
    for i in 0..8 {
        let got = values(&y.get(i)?)?;
        let found = (0..=2).any(|top| {
            (0..=2).any(|left| {
                let window = x
                    .get(i)
                    .and_then(|im| im.narrow(1, top, 3)?.narrow(2, left, 4));
                window
                    .and_then(|w| w.flatten_all()?.to_vec1::<f32>())
                    .is_ok_and(|w| w == got)
            })
        });
        assert!(found, "crop {i} is not a window of its image");
    }
    let centred = built.layer().forward_t(&x, false)?;
    assert_eq!(
        values(&centred)?,
        values(&x.narrow(2, 1, 3)?.narrow(3, 1, 4)?)?
    );
    Ok(())
}

/// Training crops differ from inference's and per call, repeat from the seed and resume from a saved
/// position; a crop of the whole image at its own size is the image; inference resizes the
/// central window of the output's aspect ratio.
#[test]
fn random_resized_crop_is_seeded_resumable_and_centred_in_inference() -> Result<()> {
    let x = images(16)?;
    let spec = RandomResizedCrop::new(4, 4);
    let (built, store) = build(&spec, &[2, 5, 6], 5)?;
    assert_eq!(built.output_shape, [2, 4, 4]);
    let saved = store.weights()?;
    let y = built.layer().forward_t(&x, true)?;
    assert_eq!(y.dims(), [16, 2, 4, 4]);
    assert_ne!(values(&y)?, values(&built.layer().forward_t(&x, false)?)?);
    let again = build(&spec, &[2, 5, 6], 5)?.0;
    assert_eq!(values(&again.layer().forward_t(&x, true)?)?, values(&y)?);
    assert_ne!(values(&built.layer().forward_t(&x, true)?)?, values(&y)?);
    store.assign(&saved)?;
    assert_eq!(values(&built.layer().forward_t(&x, true)?)?, values(&y)?);
    // Scale and ratio of exactly 1 on a square image: the whole image, unresized.
    let square = images(2)?.narrow(3, 0, 5)?;
    let whole = RandomResizedCrop::new(5, 5).scale(1.0, 1.0).ratio(1.0, 1.0);
    let (layer, _) = build(&whole, &[2, 5, 5], 0)?;
    assert_eq!(
        values(&layer.layer().forward_t(&square, true)?)?,
        values(&square)?
    );
    // Inference on 5x6 images into 5x5: the central 5x5 window, columns 0..5.
    let (centred, _) = build(&RandomResizedCrop::new(5, 5), &[2, 5, 6], 0)?;
    assert_eq!(
        values(&centred.layer().forward_t(&x, false)?)?,
        values(&x.narrow(3, 0, 5)?)?
    );
    Ok(())
}

#[test]
fn rescaling_and_normalization_compose() -> Result<()> {
    let x = Tensor::new(&[[[[0f32, 255.]]], [[[51., 102.]]]], &Device::Cpu)?; // (2, 1, 1, 2)
    let (scale, _) = build(&Rescaling::new(1.0 / 255.0, 0.0), &[1, 1, 2], 0)?;
    let (norm, _) = build(&Normalization::new(&[0.5], &[0.25]), &[1, 1, 2], 0)?;
    let y = norm
        .layer()
        .forward_t(&scale.layer().forward_t(&x, false)?, false)?;
    let want = [-2.0, 2.0, -1.2, -0.4];
    for (a, b) in values(&y)?.iter().zip(want) {
        assert!((a - b).abs() < 1e-5, "{a} against {b}");
    }
    Ok(())
}

#[test]
fn bad_settings_are_errors_naming_the_layer() {
    let message = |spec: &dyn LayerSpec, shape: &[usize]| -> String {
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        match ctx.scoped("pre", |ctx| spec.build(ctx, shape)) {
            Ok(_) => panic!("{} accepted {shape:?}", spec.kind()),
            Err(e) => e.to_string(),
        }
    };
    let cases: Vec<(Box<dyn LayerSpec>, Vec<usize>, &str)> = vec![
        (Box::new(RandomCrop::new(9, 2)), vec![3, 5, 6], "9x2"),
        (
            Box::new(RandomFlip::horizontal()),
            vec![30],
            "(batch, channels, height, width)",
        ),
        (
            Box::new(Normalization::imagenet()),
            vec![1, 4, 4],
            "3 channels",
        ),
        (
            Box::new(Normalization::new(&[0.0], &[0.0])),
            vec![1, 4, 4],
            "standard deviation",
        ),
        (
            Box::new(RandomRotation::new(0.7)),
            vec![1, 4, 4],
            "[0, 0.5]",
        ),
        (
            Box::new(RandomZoom::new(0.5, -0.5)),
            vec![1, 4, 4],
            "lower <= upper",
        ),
        (Box::new(Rescaling::new(f64::NAN, 0.0)), vec![1], "finite"),
        (
            Box::new(RandomResizedCrop::new(4, 4).scale(0.9, 0.1)),
            vec![1, 4, 4],
            "scale low <= high",
        ),
        (
            Box::new(RandomResizedCrop::new(0, 4)),
            vec![1, 4, 4],
            "positive output size",
        ),
    ];
    for (spec, shape, part) in cases {
        let err = message(spec.as_ref(), &shape);
        assert!(
            err.contains("pre") && err.contains(part),
            "`{part}` missing from: {err}"
        );
    }
}
