//! What the strategy tests share: the equivalence run, and comparing trained weights with one
//! device's.

// Each test crate uses its own part of the run.
#[allow(dead_code)]
pub mod equivalence_run;
// Only the tests that launch mpirun use it.
#[allow(dead_code)]
pub mod launch;

use std::path::Path;

use kandle::params::Weights;
use kandle::training_state::TrainingState;

/// Asserts that `other` has the same tensors as `reference`, each within 1e-5 of the
/// reference's largest magnitude (at least 1e-2).
pub fn assert_close(reference: &Weights, other: &Weights, what: &str) -> anyhow::Result<()> {
    assert_within(reference, other, 1e-5, what)
}

/// Asserts that `other` has the same tensors as `reference`, each within `tolerance` of the
/// reference's largest magnitude (at least 1e-2).
pub fn assert_within(
    reference: &Weights,
    other: &Weights,
    tolerance: f32,
    what: &str,
) -> anyhow::Result<()> {
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        other.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, want) in reference {
        // In f64: a state also holds f64 tensors (positions of random streams).
        let want = want.to_dtype(candle_core::DType::F64)?;
        let got = other[name].to_dtype(candle_core::DType::F64)?;
        let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f64>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-2);
        assert!(
            diff / scale <= f64::from(tolerance),
            "{what}: `{name}` differs by {diff} (scale {scale})"
        );
    }
    Ok(())
}

/// Asserts that two final training states in files (weights, optimizer slots and scalars)
/// agree within `tolerance` relative to each tensor's scale.
// Only the tests that resume runs use it.
#[allow(dead_code)]
pub fn assert_states_within(a: &Path, b: &Path, tolerance: f32) -> anyhow::Result<()> {
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
// Only the tests that resume runs use it.
#[allow(dead_code)]
pub fn assert_resumed_as_uninterrupted(
    outcome: &launch::Outcome,
    backup: &Path,
    uninterrupted: &Path,
    out: &Path,
    tolerance: f32,
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
