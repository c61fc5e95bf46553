//! The switch that captures a model's steps on CUDA devices as CUDA graphs
//! ([`set_cuda_graphs`], or `KANDLE_CUDA_GRAPHS=1`): a replica built while it is on captures its
//! training step, its evaluation and its prediction, each after two eager warm-up steps of a
//! batch shape, and replays them, one launch per step, falling back to eager steps, with a
//! warning naming the reason, for a model whose step cannot be captured. Off by default; it
//! does nothing on the CPU.

use std::sync::atomic::{AtomicU8, Ordering};

/// The environment variable that, set to `1`, `on` or `true`, turns graphs on when
/// [`set_cuda_graphs`] has not been called.
pub const GRAPHS_VAR: &str = "KANDLE_CUDA_GRAPHS";

/// [`set_cuda_graphs`]'s choice: not made, off, on.
static CHOICE: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

/// Turns the capture of steps (training, evaluation, prediction) as CUDA graphs on or off for
/// the models built from now on in this process, whatever [`GRAPHS_VAR`] says.
///
/// ```
/// kandle::devices::set_cuda_graphs(false);
/// assert!(!kandle::devices::cuda_graphs());
/// ```
pub fn set_cuda_graphs(on: bool) {
    CHOICE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Whether models built now capture their steps on CUDA devices as graphs: what
/// [`set_cuda_graphs`] chose, else what [`GRAPHS_VAR`] says, else off.
pub fn cuda_graphs() -> bool {
    match CHOICE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => asks_for_graphs(std::env::var(GRAPHS_VAR).ok().as_deref()),
    }
}

/// Whether a value of [`GRAPHS_VAR`] asks for graphs: `1`, `on` or `true`, in any case.
fn asks_for_graphs(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "on" | "true"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_reads_one_on_and_true() {
        for (value, on) in [
            (Some("1"), true),
            (Some("on"), true),
            (Some(" TRUE "), true),
            (Some("0"), false),
            (Some("off"), false),
            (Some(""), false),
            (None, false),
        ] {
            assert_eq!(asks_for_graphs(value), on, "{value:?}");
        }
    }

    #[test]
    fn the_call_overrides_the_variable() {
        // The only test that sets the switch; CPU replicas never read it.
        set_cuda_graphs(true);
        assert!(cuda_graphs());
        set_cuda_graphs(false);
        assert!(!cuda_graphs());
    }
}
