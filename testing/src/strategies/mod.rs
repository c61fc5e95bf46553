//! What the strategy tests share: the equivalence run, the steps of a resumed run, and
//! comparing trained weights with one device's within the float32 spread of an equivalent
//! ordering.

pub mod equivalence_run;
pub use crate::launch;

use std::path::Path;

use kandle::params::Weights;
use kandle::training_state::TrainingState;

/// How many times the float32 spread of an equivalent ordering a strategy may differ by.
/// Splitting a batch's sums between replicas is itself a reordering, and over a run its
/// rounding grows as the reordered run's does. Measured on an AMD Zen 4 (AVX-512, and capped
/// at AVX2 and at the baseline), every strategy and resumed run differs by 0.4x to 1.6x the
/// reordered run's spread; the factor leaves room for other machines' sums.
pub const SPREAD_FACTOR: f64 = 10.0;

/// The smallest tolerance, relative to a tensor's scale, whatever the spread.
pub const MIN_TOLERANCE: f64 = 1e-6;

/// One device's trained weights, and how far another run of the same steps may land from them
/// in float32: [`SPREAD_FACTOR`] times the largest relative difference between this run and
/// the same run with each batch's samples in reverse order (at least [`MIN_TOLERANCE`]). The
/// tolerance so follows the rounding of the machine the tests run on (AVX2 or AVX-512 kernels,
/// the `gemm` crate's blocking) instead of one machine's.
#[derive(Debug)]
pub struct Reference {
    /// The reference weights.
    pub weights: Weights,
    /// The largest relative difference of the reordered run.
    pub spread: f64,
}

impl Reference {
    /// The reference `weights`, with the weights `reordered` of the same run in an equivalent
    /// order.
    pub fn new(weights: Weights, reordered: &Weights) -> anyhow::Result<Self> {
        let spread = relative_difference(&weights, reordered)?;
        Ok(Self { weights, spread })
    }

    /// The tolerance relative to each tensor's scale.
    pub fn tolerance(&self) -> f64 {
        (SPREAD_FACTOR * self.spread).max(MIN_TOLERANCE)
    }

    /// Asserts that `other` has the reference's tensors, each within [`Self::tolerance`]
    /// (a mixed-precision run's loss scale aside).
    pub fn assert_matches(&self, other: &Weights, what: &str) -> anyhow::Result<()> {
        let mut other = other.clone();
        if !self
            .weights
            .contains_key(kandle::mixed_precision::LOSS_SCALE)
        {
            other.remove(kandle::mixed_precision::LOSS_SCALE);
        }
        let other = &other;
        let difference = relative_difference(&self.weights, other)?;
        eprintln!(
            "{what}: largest relative difference {difference:.2e}, {:.1}x the reordered run's {:.2e}",
            difference / self.spread,
            self.spread
        );
        let what = format!(
            "{what} (tolerance {:.2e}: {SPREAD_FACTOR} x the reordered run's {:.2e})",
            self.tolerance(),
            self.spread
        );
        assert_within(&self.weights, other, self.tolerance(), &what)
    }
}

/// One device's [`Reference`] for the equivalence run of `net` on `samples` digits.
pub fn one_device_reference<N: Into<kandle::Network>>(
    net: fn() -> N,
    samples: usize,
) -> anyhow::Result<Reference> {
    use equivalence_run::{train_on, Order};
    let one = kandle::OneDeviceStrategy::cpu();
    let run = |order| -> anyhow::Result<Weights> {
        Ok(train_on(net(), &one, samples, None, order)?.get_weights()?)
    };
    Reference::new(run(Order::Fixed)?, &run(Order::ReversedInBatches)?)
}

/// The largest difference between `reference`'s and `other`'s tensors, each relative to the
/// reference tensor's largest magnitude (at least 1e-2).
pub fn relative_difference(reference: &Weights, other: &Weights) -> anyhow::Result<f64> {
    let mut largest = 0f64;
    for (name, want) in reference {
        largest = largest.max(tensor_difference(reference, other, name)? / scale(want)?);
    }
    Ok(largest)
}

/// Asserts that `other` has the same tensors as `reference`, each within `tolerance` of the
/// reference's largest magnitude (at least 1e-2).
pub fn assert_within(
    reference: &Weights,
    other: &Weights,
    tolerance: f64,
    what: &str,
) -> anyhow::Result<()> {
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        other.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, want) in reference {
        let (diff, scale) = (tensor_difference(reference, other, name)?, scale(want)?);
        assert!(
            diff / scale <= tolerance,
            "{what}: `{name}` differs by {diff} (scale {scale})"
        );
    }
    Ok(())
}

/// The largest absolute difference of tensor `name` between `reference` and `other`.
fn tensor_difference(reference: &Weights, other: &Weights, name: &str) -> anyhow::Result<f64> {
    let Some(got) = other.get(name) else {
        anyhow::bail!("`{name}` is missing");
    };
    // In f64: a state also holds f64 tensors (positions of random streams).
    let want = reference[name].to_dtype(candle_core::DType::F64)?;
    let got = got.to_dtype(candle_core::DType::F64)?;
    Ok((got - &want)?.abs()?.max_all()?.to_scalar::<f64>()?)
}

/// A tensor's largest magnitude, at least 1e-2.
fn scale(t: &candle_core::Tensor) -> anyhow::Result<f64> {
    let t = t.to_dtype(candle_core::DType::F64)?;
    Ok(t.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-2))
}

/// Asserts that two final training states in files (weights, optimizer slots and scalars)
/// agree within `tolerance` relative to each tensor's scale.
pub fn assert_states_within(a: &Path, b: &Path, tolerance: f64) -> anyhow::Result<()> {
    let (a, b) = (TrainingState::load(a)?, TrainingState::load(b)?);
    assert_within(&a.weights, &b.weights, tolerance, "weights")?;
    assert_eq!(a.optimizer.scalars, b.optimizer.scalars);
    for (slot, weights) in &a.optimizer.slots {
        assert_within(weights, &b.optimizer.slots[slot], tolerance, slot)?;
    }
    Ok(())
}

/// Asserts that `outcome`, a job run again after it was killed, resumed from `backup`,
/// completed (deleting the backup), and left the final training state `out` within
/// `tolerance` of `uninterrupted`'s.
pub fn assert_resumed_as_uninterrupted(
    outcome: &launch::Outcome,
    backup: &Path,
    uninterrupted: &Path,
    out: &Path,
    tolerance: f64,
) -> anyhow::Result<()> {
    assert!(outcome.status.success(), "{}", outcome.output);
    assert!(
        outcome.output.contains("resuming from"),
        "{}",
        outcome.output
    );
    assert!(!backup.exists(), "the backup is deleted when fit completes");
    assert_states_within(uninterrupted, out, tolerance)
}

/// Global batch `i` of digits (batches of [`GLOBAL_BATCH`](equivalence_run::GLOBAL_BATCH) in
/// the set's order), its samples in `order`.
pub fn global_batch(
    i: usize,
    order: equivalence_run::Order,
) -> anyhow::Result<(candle_core::Tensor, candle_core::Tensor)> {
    use equivalence_run::GLOBAL_BATCH;
    let (x, y) = kandle::data::digits::load()?.to_tensors()?;
    let (x, y) = (
        x.narrow(0, i * GLOBAL_BATCH, GLOBAL_BATCH)?,
        y.narrow(0, i * GLOBAL_BATCH, GLOBAL_BATCH)?,
    );
    let at = order
        .indices(GLOBAL_BATCH, GLOBAL_BATCH)
        .into_iter()
        .map(|i| i as u32)
        .collect::<Vec<_>>();
    let at = candle_core::Tensor::new(at, x.device())?;
    Ok((x.index_select(&at, 0)?, y.index_select(&at, 0)?))
}

/// Trains `model` with `train_on_batch` on the global batches `steps`, in `order`.
pub fn train_steps(
    model: &mut kandle::Model,
    steps: std::ops::Range<usize>,
    order: equivalence_run::Order,
) -> anyhow::Result<()> {
    for i in steps {
        let (x, y) = global_batch(i, order)?;
        model.train_on_batch(&x, &y, None)?;
    }
    Ok(())
}

/// `steps` steps of `net` under `optimizer` on one device, from the initial weights of seed 5:
/// the [`Reference`] a resumed run of the same steps ends within.
pub fn uninterrupted<N: Into<kandle::Network>, O>(
    net: fn() -> N,
    optimizer: O,
    steps: usize,
) -> anyhow::Result<Reference>
where
    O: kandle::optimizers::OptimizerConfig + Clone,
{
    use equivalence_run::Order;
    let run = |order| -> anyhow::Result<Weights> {
        let one = kandle::OneDeviceStrategy::cpu();
        let mut m = equivalence_run::compile(net(), optimizer.clone(), &one, 5)?;
        train_steps(&mut m, 0..steps, order)?;
        Ok(m.get_weights()?)
    };
    Reference::new(run(Order::Fixed)?, &run(Order::ReversedInBatches)?)
}
