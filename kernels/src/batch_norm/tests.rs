//! The fused BatchNorm kernels against candle's ops: forward values, batch statistics and
//! gradients (through candle's autograd) on seeded random shapes, and clear errors on bad
//! shapes; and the same bits at every vector width. (kandle's BatchNorm layer tests its fused
//! path against its composed one.)

use super::*;
use crate::simd::Width;
use crate::test_support::{assert_close, gradients, random, random_var, weighted_sum};
use candle_core::{DType, Device, Tensor, Var};

/// `(shape, mean offset)`: odd sizes, batch 1, one channel, a single value per channel, flat
/// features, and a large mean that a naive one-pass variance would lose. The kernels walk
/// small planes channel by channel when there are enough channels for the threads (the cases
/// with 16 and 24 channels, on up to 8 threads) and stream large planes (of 4 KiB or more:
/// 33x33 and 40x40); the plane sizes leave tails past the vector lanes.
const CASES: &[(&[usize], f32)] = &[
    (&[2, 3, 5, 7], 0.0),
    (&[1, 1, 4, 4], 0.5),
    (&[4, 6, 3, 3], -2.0),
    (&[3, 5, 1, 1], 0.0),
    (&[1, 4, 1, 1], 0.0),
    (&[7, 5], 1.0),
    (&[2, 8, 9, 11], 50.0),
    (&[5, 3, 7, 7], 0.0),
    (&[6, 16, 7, 7], 0.0),
    (&[3, 24, 15, 15], 20.0),
    (&[2, 5, 33, 33], -1.0),
    (&[2, 3, 40, 40], 50.0),
];

const EPSILON: f64 = 1e-3;

/// Training batch normalisation composed from candle ops as the layer composes them (in `f64`
/// for the checks, in `f32` for timing): `(y, mean, var)`.
fn reference(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    relu: bool,
) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    let reduce: Vec<usize> = (0..x.rank()).filter(|&d| d != 1).collect();
    let mut per_channel = vec![1; x.rank()];
    per_channel[1] = x.dim(1)?;
    let per_channel = |v: &Tensor| v.reshape(per_channel.as_slice());
    let mean = x.mean_keepdim(reduce.as_slice())?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(reduce.as_slice())?;
    let (mean, var) = (mean.flatten_all()?, var.flatten_all()?);
    let inv_std = (&var + EPSILON)?.sqrt()?.recip()?;
    let y = x
        .broadcast_sub(&per_channel(&mean)?)?
        .broadcast_mul(&per_channel(&inv_std)?)?
        .broadcast_mul(&per_channel(w)?)?
        .broadcast_add(&per_channel(b)?)?;
    let y = if relu { y.relu()? } else { y };
    Ok((y, mean, var))
}

fn to_f64_var(v: &Var) -> anyhow::Result<Var> {
    Ok(Var::from_tensor(&v.as_tensor().to_dtype(DType::F64)?)?)
}

fn check_train(relu: bool) -> anyhow::Result<()> {
    for (case, &(shape, offset)) in CASES.iter().enumerate() {
        let seed = case as u64 * 10;
        let c = shape[1];
        let x = random_var(shape, seed, offset)?;
        let w = random_var(&[c], seed + 1, 1.0)?;
        let b = random_var(&[c], seed + 2, 0.0)?;
        let (y, stats) = batch_norm_train(x.as_tensor(), Some(&w), Some(&b), EPSILON, relu)?;
        let got = gradients(
            &weighted_sum(&y, seed + 3)?,
            &[x.as_tensor(), w.as_tensor(), b.as_tensor()],
        )?;

        let (x64, w64, b64) = (to_f64_var(&x)?, to_f64_var(&w)?, to_f64_var(&b)?);
        let (y64, mean64, var64) = reference(&x64, &w64, &b64, relu)?;
        let want = gradients(
            &weighted_sum(&y64, seed + 3)?,
            &[x64.as_tensor(), w64.as_tensor(), b64.as_tensor()],
        )?;

        let what = |part: &str| format!("{part} of {shape:?} (relu {relu})");
        assert_close(&what("y"), &y, &y64, 1e-5)?;
        assert_close(&what("mean"), &stats.mean, &mean64, 1e-6)?;
        assert_close(&what("var"), &stats.var, &var64, 1e-5)?;
        for (name, (g, r)) in ["dx", "dweight", "dbias"].iter().zip(got.iter().zip(&want)) {
            assert_close(&what(name), g, r, 1e-4)?;
        }
    }
    Ok(())
}

#[test]
fn training_forward_statistics_and_gradients_match_candle() -> anyhow::Result<()> {
    check_train(false)
}

#[test]
fn fused_relu_matches_batch_norm_then_relu() -> anyhow::Result<()> {
    check_train(true)
}

#[test]
fn without_weight_and_bias_the_offset_is_zero_and_the_scale_one() -> anyhow::Result<()> {
    let x = random(&[3, 2, 4, 5], 1, 0.0)?;
    let (y, _) = batch_norm_train(&x, None, None, EPSILON, false)?;
    let ones = Tensor::ones(2, DType::F32, &Device::Cpu)?;
    let zeros = ones.zeros_like()?;
    let (want, _) = batch_norm_train(&x, Some(&ones), Some(&zeros), EPSILON, false)?;
    assert_eq!(crate::test_support::max_diff(&y, &want)?, 0.0);
    Ok(())
}

/// A range of a larger gradient's channels (a concatenation's branch's) read in place gives
/// the gradients its contiguous copy gives, bit for bit: small planes walked channel by
/// channel, 32x32 planes streamed, and a batch of one.
#[test]
fn a_gradient_that_is_a_channel_range_is_read_in_place() -> anyhow::Result<()> {
    use crate::batch_norm::batch_norm_train_replay;
    for (i, shape) in [[5, 6, 3, 4], [3, 4, 32, 32], [1, 5, 7, 7]]
        .iter()
        .enumerate()
    {
        let seed = 300 + i as u64;
        let x = random(shape, seed, 0.5)?;
        let weight = random(&[shape[1]], seed + 1, 1.0)?;
        let bias = random(&[shape[1]], seed + 2, 0.0)?;
        let mut wide = *shape;
        wide[1] += 5;
        let joined = random(&wide, seed + 3, 0.0)?;
        let view = joined.narrow(1, 2, shape[1])?;
        assert_eq!(view.is_contiguous(), shape[0] == 1);
        for relu in [false, true] {
            let (replay, _) =
                batch_norm_train_replay(&x, Some(&weight), Some(&bias), EPSILON, relu)?;
            let (dx, dw, db) = replay.backward(&view)?;
            let (want_dx, want_dw, want_db) = replay.backward(&view.contiguous()?)?;
            for (name, got, want) in [
                ("dx", dx, want_dx),
                ("dw", dw, want_dw),
                ("db", db, want_db),
            ] {
                let (got, want) = (got.expect("a gradient"), want.expect("a gradient"));
                let diff = crate::test_support::max_diff(&got, &want)?;
                assert_eq!(
                    diff, 0.0,
                    "{name} of {shape:?} (relu {relu}) differs by {diff}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn channel_affine_matches_candle_ops_and_gradients() -> anyhow::Result<()> {
    for relu in [false, true] {
        for (case, &(shape, _)) in CASES.iter().enumerate() {
            let seed = 100 + case as u64;
            let mut per_channel = vec![1; shape.len()];
            per_channel[1] = shape[1];
            let x = random_var(shape, seed, 0.0)?;
            let scale = random_var(&[shape[1]], seed + 1, 0.5)?;
            let shift = random_var(&[shape[1]], seed + 2, 0.0)?;
            let vars = [x.as_tensor(), scale.as_tensor(), shift.as_tensor()];

            let y = channel_affine(&x, &scale, &shift, relu)?;
            let got = gradients(&weighted_sum(&y, seed)?, &vars)?;
            let want_y = x
                .broadcast_mul(&scale.reshape(per_channel.as_slice())?)?
                .broadcast_add(&shift.reshape(per_channel.as_slice())?)?;
            let want_y = if relu { want_y.relu()? } else { want_y };
            let want = gradients(&weighted_sum(&want_y, seed)?, &vars)?;

            assert_close(&format!("affine y {shape:?}"), &y, &want_y, 1e-6)?;
            for (name, (g, r)) in ["dx", "dscale", "dshift"].iter().zip(got.iter().zip(&want)) {
                assert_close(&format!("affine {name} {shape:?} relu {relu}"), g, r, 1e-5)?;
            }
        }
    }
    Ok(())
}

/// NaNs propagate as in PyTorch: in training a NaN makes its channel's mean and variance NaN
/// and so the whole channel's output (with the ReLU too) and its gradients, the other channels
/// untouched; in inference only the NaN's own output is NaN, and the ReLU passes its gradient.
/// Small planes walked channel by channel and 40x40 planes streamed.
#[test]
fn a_nan_spreads_over_its_channel_in_training_and_stays_put_in_inference() -> anyhow::Result<()> {
    for (i, shape) in [[3, 4, 5, 5], [2, 3, 40, 40]].iter().enumerate() {
        let seed = 400 + i as u64;
        let c = shape[1];
        let mut values = random(shape, seed, 0.5)?.flatten_all()?.to_vec1::<f32>()?;
        let at = ((shape[0] - 1) * c + 1) * shape[2] * shape[3] + 7;
        values[at] = f32::NAN;
        let x = Var::from_vec(values, shape.as_slice(), &Device::Cpu)?;
        let w = random_var(&[c], seed + 1, 1.0)?;
        let b = random_var(&[c], seed + 2, 0.0)?;
        let vars = [x.as_tensor(), w.as_tensor(), b.as_tensor()];
        // Whether each element is NaN, channel by channel.
        let nans = |t: &Tensor| -> anyhow::Result<Vec<Vec<bool>>> {
            let t = t.transpose(0, 1)?.flatten_from(1)?.to_vec2::<f32>()?;
            Ok(t.iter()
                .map(|ch| ch.iter().map(|v| v.is_nan()).collect())
                .collect())
        };
        for relu in [false, true] {
            let what = format!("{shape:?}, relu {relu}");
            let (y, stats) = batch_norm_train(&x, Some(&w), Some(&b), EPSILON, relu)?;
            for (ch, ch_nans) in nans(&y)?.iter().enumerate() {
                assert!(
                    ch_nans.iter().all(|&n| n == (ch == 1)),
                    "{what}: channel {ch}"
                );
            }
            for stat in [&stats.mean, &stats.var] {
                let stat = stat.to_vec1::<f32>()?;
                assert!(
                    stat.iter()
                        .enumerate()
                        .all(|(ch, v)| v.is_nan() == (ch == 1)),
                    "{what}"
                );
            }
            let [dx, dw, db] = <[Tensor; 3]>::try_from(gradients(&weighted_sum(&y, 5)?, &vars)?)
                .map_err(|_| anyhow::anyhow!("three gradients"))?;
            for (ch, ch_nans) in nans(&dx)?.iter().enumerate() {
                assert!(
                    ch_nans.iter().all(|&n| n == (ch == 1)),
                    "{what}: dx channel {ch}"
                );
            }
            assert!(dw
                .to_vec1::<f32>()?
                .iter()
                .enumerate()
                .all(|(ch, v)| v.is_nan() == (ch == 1)));
            assert!(
                db.to_vec1::<f32>()?.iter().all(|v| v.is_finite()),
                "{what}: the bias"
            );

            let scale = random_var(&[c], seed + 3, 0.5)?;
            let shift = random_var(&[c], seed + 4, 0.0)?;
            let affine_vars = [x.as_tensor(), scale.as_tensor(), shift.as_tensor()];
            let y = channel_affine(&x, &scale, &shift, relu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            assert!(
                y.iter().enumerate().all(|(j, v)| v.is_nan() == (j == at)),
                "{what}"
            );
            let grads = gradients(
                &weighted_sum(&channel_affine(&x, &scale, &shift, relu)?, 6)?,
                &affine_vars,
            )?;
            // The NaN's own gradient passes the ReLU, and is finite: `scale * dy`.
            assert!(grads[0]
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .all(|v| v.is_finite()));
            let dscale = grads[1].to_vec1::<f32>()?;
            assert!(
                dscale
                    .iter()
                    .enumerate()
                    .all(|(ch, v)| v.is_nan() == (ch == 1)),
                "{what}"
            );
            assert!(
                grads[2].to_vec1::<f32>()?.iter().all(|v| v.is_finite()),
                "{what}"
            );
        }
    }
    Ok(())
}

#[test]
fn bad_shapes_and_dtypes_name_the_op_and_both_shapes() -> anyhow::Result<()> {
    let x = random(&[2, 4, 5, 5], 0, 0.0)?;
    let w = random(&[3], 1, 0.0)?;
    let err = batch_norm_train(&x, Some(&w), None, EPSILON, false)
        .expect_err("3 weights for 4 channels")
        .to_string();
    assert!(
        err.contains("batch_norm") && err.contains("[3]") && err.contains("[2, 4, 5, 5]"),
        "{err}"
    );

    let err = channel_affine(&x, &random(&[4], 2, 0.0)?, &w, false)
        .expect_err("3 shifts for 4 channels")
        .to_string();
    assert!(
        err.contains("channel_affine") && err.contains("shift") && err.contains("[3]"),
        "{err}"
    );

    let err = batch_norm_train(&x.to_dtype(DType::F64)?, None, None, EPSILON, false)
        .expect_err("f64 is not supported")
        .to_string();
    assert!(err.contains("batch_norm") && err.contains("F64"), "{err}");

    let err = batch_norm_train(&random(&[4], 3, 0.0)?, None, None, EPSILON, false)
        .expect_err("one axis")
        .to_string();
    assert!(err.contains("batch_norm") && err.contains("[4]"), "{err}");

    let empty = Tensor::zeros((0, 4, 2, 2), DType::F32, &Device::Cpu)?;
    let err = batch_norm_train(&empty, None, None, EPSILON, false)
        .expect_err("no elements")
        .to_string();
    assert!(
        err.contains("batch_norm") && err.contains("[0, 4, 2, 2]"),
        "{err}"
    );
    Ok(())
}

/// The `(C, H, W)` inputs of MiniGoogLeNet's 19 BatchNorm layers on 32x32 images.
const MINI_GOOGLENET_BN: &[(usize, usize)] = &[
    (96, 32),
    (32, 32),
    (32, 32),
    (32, 32),
    (48, 32),
    (80, 15),
    (112, 15),
    (48, 15),
    (96, 15),
    (64, 15),
    (80, 15),
    (80, 15),
    (48, 15),
    (96, 15),
    (96, 7),
    (176, 7),
    (160, 7),
    (176, 7),
    (160, 7),
];

/// Prints forward and backward times of the composed path and the kernels for MiniGoogLeNet's
/// BatchNorm layers at batch 64, with and without the following ReLU. Run with
/// `cargo test --release -p kandle-kernels --lib time_mini_googlenet_batch_norm -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run on demand"]
fn time_mini_googlenet_batch_norm() -> anyhow::Result<()> {
    use crate::test_support::fwd_bwd_ms;
    let reps = 5;
    println!(
        "{:>14} | {:>15} | {:>15} | {:>15} | {:>15} | {:>15} | {:>15}",
        "(C, H, W)",
        "composed",
        "kernel",
        "composed+relu",
        "kernel, relu",
        "fused relu",
        "identity"
    );
    let mut totals = [(0.0, 0.0); 6];
    for (i, &(c, hw)) in MINI_GOOGLENET_BN.iter().enumerate() {
        let shape = [64, c, hw, hw];
        let x = random_var(&shape, i as u64, 0.0)?;
        let w = random_var(&[c], 1, 1.0)?;
        let b = random_var(&[c], 2, 0.0)?;
        let composed = |relu: bool| {
            let (x, w, b) = (&x, &w, &b);
            move || Ok(reference(x, w, b, relu)?.0)
        };
        let kernel = |relu_op: bool, fused: bool| {
            let (x, w, b) = (&x, &w, &b);
            move || {
                let y = batch_norm_train(x, Some(w), Some(b), EPSILON, fused)?.0;
                Ok(if relu_op { y.relu()? } else { y })
            }
        };
        let times = [
            fwd_bwd_ms(reps, composed(false))?,
            fwd_bwd_ms(reps, kernel(false, false))?,
            fwd_bwd_ms(reps, composed(true))?,
            fwd_bwd_ms(reps, kernel(true, false))?,
            fwd_bwd_ms(reps, kernel(false, true))?,
            fwd_bwd_ms(reps, || Ok(x.as_tensor().clone()))?,
        ];
        let cells: Vec<String> = times
            .iter()
            .map(|(f, b)| format!("{f:6.2} + {b:6.2}"))
            .collect();
        println!("{:>14} | {}", format!("{c}x{hw}x{hw}"), cells.join(" | "));
        for (t, (f, b)) in totals.iter_mut().zip(times) {
            t.0 += f;
            t.1 += b;
        }
    }
    let cells: Vec<String> = totals
        .iter()
        .map(|(f, b)| format!("{f:6.1} + {b:6.1}"))
        .collect();
    println!("{:>14} | {}", "network total", cells.join(" | "));
    println!("(forward ms + backward ms, medians of {reps})");
    Ok(())
}

/// Deterministic values in `[-2, 2)`.
fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 8) as f32 / (1u32 << 22) as f32 - 2.0
        })
        .collect()
}

/// A channel's sums and output values (as bits) through `kernel`, compiled for `width`.
fn channel_bits<K: ChannelKernel>(
    width: Width,
    kernel: &K,
    a: &[f32],
    b: &[f32],
    s: usize,
    sums_of: impl Fn(&K::Channel) -> [f64; 2],
) -> (Vec<u64>, Vec<u32>) {
    width.run(
        #[inline(always)]
        || {
            let mut sums = PairSums::default();
            for (pa, pb) in a.chunks(s).zip(b.chunks(s)) {
                kernel.sums(0, pa, pb, &mut sums);
            }
            let channel = kernel.finish(0, sums.total());
            let out = a.iter().zip(b);
            let out = out.map(|(&x, &y)| kernel.value(&channel, x, y).to_bits());
            let sums = sums_of(&channel).map(f64::to_bits).to_vec();
            (sums, out.collect())
        },
    )
}

#[test]
fn every_vector_width_gives_the_same_bits() {
    // Three planes of 37 values: full lanes and a tail, a ReLU that masks about half.
    let s = 37;
    let (x, dy) = (values(3 * s, 1), values(3 * s, 2));
    let map = ChannelMap {
        scale: vec![0.7],
        shift: vec![0.1],
    };
    let backward = Backward::<true, true, _> {
        map: &map,
        center: &[0.2],
        linear: |_, [a, b]: [f64; 2]| Linear {
            dy: 0.9,
            centered: (a * 1e-3) as f32,
            constant: (b * 1e-3) as f32,
        },
    };
    let normalize = Normalize::<true> {
        x: &x,
        s,
        count: (3 * s) as f64,
        weight: &[1.5],
        bias: &[-0.25],
        epsilon: 1e-3,
    };
    let widths = Width::available();
    let grad = |w| channel_bits(w, &backward, &x, &dy, s, |c| c.sums);
    let norm = |w| channel_bits(w, &normalize, &x, &x, s, |c| [c.mean, c.var]);
    let (grad0, norm0) = (grad(widths[0]), norm(widths[0]));
    // The ReLU clamps some of the normalised values (and masks their gradients).
    assert!(norm0.1.contains(&0) && norm0.1.iter().any(|&v| v != 0));
    for &width in &widths[1..] {
        assert_eq!(grad(width), grad0, "backward at {width:?}");
        assert_eq!(norm(width), norm0, "normalisation at {width:?}");
    }
}

/// The same NaNs at every width: a NaN in the channel makes the statistics and every output
/// NaN (with the ReLU), and the gradient's sums NaN; the sums of a channel without a NaN,
/// whose pre-activation a NaN scale makes NaN, pass the ReLU everywhere.
#[test]
fn every_vector_width_keeps_the_same_nans() {
    let s = 37;
    let mut x = values(3 * s, 3);
    x[s + 5] = f32::NAN;
    let dy = values(3 * s, 4);
    let normalize = Normalize::<true> {
        x: &x,
        s,
        count: (3 * s) as f64,
        weight: &[1.5],
        bias: &[-0.25],
        epsilon: 1e-3,
    };
    let map = ChannelMap {
        scale: vec![f32::NAN],
        shift: vec![0.1],
    };
    let backward = Backward::<true, true, _> {
        map: &map,
        center: &[0.2],
        linear: |_, _| Linear {
            dy: 0.9,
            centered: 0.0,
            constant: 0.0,
        },
    };
    let clean = values(3 * s, 5);
    for width in Width::available() {
        let (stats, out) = channel_bits(width, &normalize, &x, &x, s, |c| [c.mean, c.var]);
        assert!(
            stats.iter().all(|&v| f64::from_bits(v).is_nan()),
            "{width:?}"
        );
        assert!(out.iter().all(|&v| f32::from_bits(v).is_nan()), "{width:?}");
        // A NaN pre-activation passes the ReLU: every `dy` reaches the input gradient.
        let (_, dx) = channel_bits(width, &backward, &clean, &dy, s, |c| c.sums);
        for (&got, &g) in dx.iter().zip(&dy) {
            assert_eq!(f32::from_bits(got), 0.9 * g, "{width:?}");
        }
    }
}
