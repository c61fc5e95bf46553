//! Gradient accumulation under every in-process strategy: `k` micro-batches of a `k`-th of the
//! global batch give the weights of one batch of the whole, the last short group included
//! (470 digits: 19 groups and a short one of 14 samples). Batch normalisation normalises each
//! micro-batch with its own statistics, as a replica normalises its part of a batch.

use kandle::params::Weights;
use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy};

use kandle_testing::strategies as support;
use support::equivalence_run::{bn_cnn, plain_cnn, train, train_accumulating, SAMPLES};
use support::{one_device_reference, relative_difference};

/// The equivalence run of `net` in micro-batches accumulated over `k`.
fn accumulating<S: Strategy + Clone + 'static>(
    net: impl Into<kandle::Network>,
    strategy: &S,
    samples: usize,
    k: usize,
) -> anyhow::Result<Weights> {
    Ok(train_accumulating(net, strategy, samples, k)?.get_weights()?)
}

/// Accumulation is a reordering of the sums: within the float32 spread of one, and 1e-5.
#[test]
fn micro_batches_match_one_batch_under_every_strategy() -> anyhow::Result<()> {
    let reference = one_device_reference(plain_cnn, SAMPLES)?;
    let one = kandle::OneDeviceStrategy::cpu();
    let runs: [(&str, Weights); 4] = [
        (
            "one device, k = 3",
            accumulating(plain_cnn(), &one, SAMPLES, 3)?,
        ),
        (
            "one device, k = 2",
            accumulating(plain_cnn(), &one, SAMPLES, 2)?,
        ),
        (
            "mirrored x2, k = 3",
            accumulating(plain_cnn(), &MirroredStrategy::cpu(2)?, SAMPLES, 3)?,
        ),
        (
            "central storage x2, k = 2",
            accumulating(plain_cnn(), &CentralStorageStrategy::cpu(2)?, SAMPLES, 2)?,
        ),
    ];
    for (what, weights) in &runs {
        reference.assert_matches(weights, what)?;
        let difference = relative_difference(&reference.weights, weights)?;
        assert!(difference < 1e-5, "{what}: {difference:.2e}");
    }
    Ok(())
}

/// With batch normalisation, accumulating 2 micro-batches of 12 normalises each with its own
/// statistics: the trainable weights of two replicas each normalising 12 samples (Mirrored,
/// without SyncBatchNorm), not those of one device normalising 24. (The moving statistics
/// differ from both: each micro-batch's forward pass updates them in turn.)
#[test]
fn batch_norm_normalises_each_micro_batch_alone() -> anyhow::Result<()> {
    // 480 digits: 20 full batches of 24, so the replicas' halves are the micro-batches.
    let samples = 480;
    let trainable = |w: Weights| -> Weights {
        w.into_iter()
            .filter(|(name, _)| !name.contains("running"))
            .collect()
    };
    let accumulated = trainable(accumulating(
        bn_cnn(),
        &kandle::OneDeviceStrategy::cpu(),
        samples,
        2,
    )?);
    let halves = trainable(train(bn_cnn(), &MirroredStrategy::cpu(2)?, samples)?.get_weights()?);
    let whole =
        trainable(train(bn_cnn(), &kandle::OneDeviceStrategy::cpu(), samples)?.get_weights()?);
    let to_halves = relative_difference(&halves, &accumulated)?;
    let to_whole = relative_difference(&whole, &accumulated)?;
    eprintln!("accumulated vs two replicas {to_halves:.2e}, vs one batch {to_whole:.2e}");
    assert!(to_halves < 1e-4, "{to_halves:.2e}");
    assert!(to_whole > 100.0 * to_halves.max(1e-7), "{to_whole:.2e}");
    Ok(())
}
