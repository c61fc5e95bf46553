//! An optimizer's state as values: what [`Optimizer::state`](super::Optimizer::state) exports
//! and [`Optimizer::load_state`](super::Optimizer::load_state) imports.
//!
//! [`OptimizerState`] is what an optimizer knows: its kind (`SGD`, `Adam`, ...), per-variable
//! *slots* (SGD's `momentum`, Adam's `m` and `v`), each one tensor per variable in the order the
//! optimizer was built with, and named scalars (Adam's `step`). [`NamedOptimizerState`] is the
//! same state with each slot keyed by the variables' canonical names instead of positions: what
//! strategies exchange and training-state files hold, so a state moves between strategies as
//! weights do. [`Replica`](crate::strategy::Replica) converts between the two.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor, Var};

use crate::params::{list, Weights};
use crate::{Error, Result};

/// An optimizer's state, by position: per-variable slots and named scalars.
///
/// A stateless optimizer exports [`OptimizerState::default`]: no kind, no slot, no scalar.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::optimizers::OptimizerState;
///
/// let momentum = vec![Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)?];
/// let state = OptimizerState::new("MySgd")
///     .with_slot("momentum", momentum)
///     .with_scalar("step", 4.0);
/// assert_eq!(state.scalar("step"), Some(4.0));
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct OptimizerState {
    /// Which optimizer wrote it (`SGD`, `Adam`, `AdamW`, or a user optimizer's own name); empty
    /// for an optimizer that keeps no state. Loading checks it.
    pub kind: String,
    /// Per-variable state by slot name (no dot in it): one tensor per variable, in the order of
    /// the variables the optimizer was built with.
    pub slots: BTreeMap<String, Vec<Tensor>>,
    /// Named scalars, such as Adam's step count. Integers up to 2^53 are exact.
    pub scalars: BTreeMap<String, f64>,
}

impl OptimizerState {
    /// An empty state of optimizer `kind`.
    pub fn new(kind: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            ..Self::default()
        }
    }

    /// With slot `name` holding one tensor per variable.
    pub fn with_slot(mut self, name: impl Into<String>, tensors: Vec<Tensor>) -> Self {
        self.slots.insert(name.into(), tensors);
        self
    }

    /// With scalar `name`.
    pub fn with_scalar(mut self, name: impl Into<String>, value: f64) -> Self {
        self.scalars.insert(name.into(), value);
        self
    }

    /// Slot `name`, if the state has it.
    pub fn slot(&self, name: &str) -> Option<&[Tensor]> {
        self.slots.get(name).map(Vec::as_slice)
    }

    /// Scalar `name`, if the state has it.
    pub fn scalar(&self, name: &str) -> Option<f64> {
        self.scalars.get(name).copied()
    }

    /// Whether it holds no slot and no scalar.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty() && self.scalars.is_empty()
    }

    /// Checks, before an optimizer of `kind` loads this state, that it was written by the same
    /// kind and holds no slot or scalar besides `slots` and `scalars`. The error says what
    /// differs.
    pub fn check(&self, kind: &str, slots: &[&str], scalars: &[&str]) -> Result<()> {
        if self.kind != kind {
            return Err(Error::invalid(format!(
                "the optimizer state was written by {}, but this optimizer is {}",
                describe_kind(&self.kind),
                describe_kind(kind)
            )));
        }
        let unknown_slots: Vec<&str> = self
            .slots
            .keys()
            .map(String::as_str)
            .filter(|s| !slots.contains(s))
            .collect();
        let unknown_scalars: Vec<&str> = self
            .scalars
            .keys()
            .map(String::as_str)
            .filter(|s| !scalars.contains(s))
            .collect();
        if !unknown_slots.is_empty() || !unknown_scalars.is_empty() {
            return Err(Error::invalid(format!(
                "state of {}: unknown slots {:?} and scalars {:?} (it keeps slots {slots:?} and \
                 scalars {scalars:?})",
                describe_kind(kind),
                unknown_slots,
                unknown_scalars
            )));
        }
        Ok(())
    }

    /// Slot `name` checked against `params` (one tensor per variable, each of its variable's
    /// shape), as copies on the variables' devices and dtypes; `None` when the state has no
    /// such slot.
    pub fn slot_for(&self, name: &str, params: &[Var]) -> Result<Option<Vec<Tensor>>> {
        let Some(tensors) = self.slots.get(name) else {
            return Ok(None);
        };
        let kind = describe_kind(&self.kind);
        if tensors.len() != params.len() {
            return Err(Error::invalid(format!(
                "state of {kind}: slot `{name}` holds {} tensors for {} variables",
                tensors.len(),
                params.len()
            )));
        }
        for (i, (t, p)) in tensors.iter().zip(params).enumerate() {
            if t.dims() != p.dims() {
                return Err(Error::invalid(format!(
                    "state of {kind}: slot `{name}` has shape {:?} for variable {i}, whose \
                     shape is {:?}",
                    t.dims(),
                    p.dims()
                )));
            }
        }
        tensors
            .iter()
            .zip(params)
            .map(|(t, p)| {
                Ok(t.to_device(p.device())?
                    .to_dtype(p.dtype())?
                    .detach()
                    // Only this slot's elements, though it may be a view of a larger storage.
                    .force_contiguous()?)
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Scalar `name`, required, checked to be a whole number in `[0, 2^53]`.
    pub fn count(&self, name: &str) -> Result<u64> {
        let kind = describe_kind(&self.kind);
        let value = self.scalar(name).ok_or_else(|| {
            Error::invalid(format!("state of {kind}: scalar `{name}` is missing"))
        })?;
        if value.is_finite() && value >= 0.0 && value.fract() == 0.0 && value <= 2f64.powi(53) {
            Ok(value as u64)
        } else {
            Err(Error::invalid(format!(
                "state of {kind}: scalar `{name}` must be a whole number >= 0, got {value}"
            )))
        }
    }

    /// The same state keyed by variable name: `names[i]` names the i-th variable. Fails when a
    /// slot does not hold one tensor per name, or a slot name is empty or has a dot.
    pub fn into_named(self, names: &[String]) -> Result<NamedOptimizerState> {
        let kind = describe_kind(&self.kind);
        let slots = self
            .slots
            .into_iter()
            .map(|(slot, tensors)| {
                check_slot_name(&slot)?;
                if tensors.len() != names.len() {
                    return Err(Error::invalid(format!(
                        "state of {kind}: slot `{slot}` holds {} tensors for {} variables",
                        tensors.len(),
                        names.len()
                    )));
                }
                Ok((slot, names.iter().cloned().zip(tensors).collect()))
            })
            .collect::<Result<_>>()?;
        Ok(NamedOptimizerState {
            kind: self.kind,
            slots,
            scalars: self.scalars,
        })
    }
}

/// An optimizer's state by canonical variable name: the form strategies exchange and
/// training-state files hold (as `optimizer.<slot>.<variable>`), whatever the strategy.
#[derive(Debug, Clone, Default)]
pub struct NamedOptimizerState {
    /// Which optimizer wrote it; see [`OptimizerState::kind`].
    pub kind: String,
    /// Per-variable state: slot name (no dot in it), then the variable's canonical name
    /// (`conv2d_1.weight`).
    pub slots: BTreeMap<String, Weights>,
    /// Named scalars, such as Adam's `step`.
    pub scalars: BTreeMap<String, f64>,
}

impl NamedOptimizerState {
    /// The same state with every tensor on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        let slots = self
            .slots
            .iter()
            .map(|(slot, tensors)| {
                let moved = tensors
                    .iter()
                    .map(|(name, t)| Ok((name.clone(), t.to_device(device)?)))
                    .collect::<Result<Weights>>()?;
                Ok((slot.clone(), moved))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            kind: self.kind.clone(),
            slots,
            scalars: self.scalars.clone(),
        })
    }

    /// The part of the state that belongs to the variables `names` (every slot keeps only
    /// their tensors; the scalars are kept whole): what a process that updates only those
    /// variables holds, such as a parameter server.
    pub fn restricted_to(&self, names: &[String]) -> Self {
        let slots = self
            .slots
            .iter()
            .map(|(slot, tensors)| {
                let kept = tensors
                    .iter()
                    .filter(|(name, _)| names.contains(name))
                    .map(|(name, t)| (name.clone(), t.clone()))
                    .collect();
                (slot.clone(), kept)
            })
            .collect();
        Self {
            kind: self.kind.clone(),
            slots,
            scalars: self.scalars.clone(),
        }
    }

    /// The states of disjoint sets of variables joined into one (the inverse of
    /// [`restricted_to`](Self::restricted_to)): the slots' tensors together, the first part's
    /// kind and scalars. Fails when the parts come from optimizers of different kinds or a
    /// variable appears in two parts.
    pub fn join(parts: impl IntoIterator<Item = Self>) -> Result<Self> {
        let mut parts = parts.into_iter();
        let Some(mut whole) = parts.next() else {
            return Ok(Self::default());
        };
        for part in parts {
            if part.kind != whole.kind {
                return Err(Error::invalid(format!(
                    "cannot join the optimizer states of {} and {}",
                    describe_kind(&whole.kind),
                    describe_kind(&part.kind)
                )));
            }
            for (slot, tensors) in part.slots {
                let into = whole.slots.entry(slot.clone()).or_default();
                for (name, t) in tensors {
                    if into.insert(name.clone(), t).is_some() {
                        return Err(Error::invalid(format!(
                            "cannot join optimizer states: `{slot}` of `{name}` is in two parts"
                        )));
                    }
                }
            }
        }
        Ok(whole)
    }

    /// The state by position for the variables `vars`, named `names` (in the optimizer's
    /// order). Every slot must hold exactly these names, each tensor of its variable's shape;
    /// the error names every missing, unexpected or mis-shaped tensor.
    pub fn to_positional(&self, names: &[String], vars: &[Var]) -> Result<OptimizerState> {
        let mut problems = Vec::new();
        let mut slots = BTreeMap::new();
        for (slot, tensors) in &self.slots {
            check_slot_name(slot)?;
            let missing: Vec<&str> = names
                .iter()
                .filter(|n| !tensors.contains_key(*n))
                .map(String::as_str)
                .collect();
            let unexpected: Vec<&str> = tensors
                .keys()
                .filter(|k| !names.contains(k))
                .map(String::as_str)
                .collect();
            if !missing.is_empty() {
                problems.push(format!("slot `{slot}` misses {}", list(&missing)));
            }
            if !unexpected.is_empty() {
                problems.push(format!(
                    "slot `{slot}` has {}, which the optimizer does not update",
                    list(&unexpected)
                ));
            }
            for (name, var) in names.iter().zip(vars) {
                if let Some(t) = tensors.get(name) {
                    if t.dims() != var.dims() {
                        problems.push(format!(
                            "`{slot}` of `{name}` is {:?} in the state but the variable is {:?}",
                            t.dims(),
                            var.dims()
                        ));
                    }
                }
            }
            let ordered = names
                .iter()
                .filter_map(|n| tensors.get(n).cloned())
                .collect();
            slots.insert(slot.clone(), ordered);
        }
        if !problems.is_empty() {
            return Err(Error::invalid(format!(
                "optimizer state: {}",
                problems.join("; ")
            )));
        }
        Ok(OptimizerState {
            kind: self.kind.clone(),
            slots,
            scalars: self.scalars.clone(),
        })
    }
}

/// A kind for messages: `SGD`, or "a stateless optimizer" for the empty kind.
pub(crate) fn describe_kind(kind: &str) -> String {
    if kind.is_empty() {
        "a stateless optimizer".into()
    } else {
        kind.to_string()
    }
}

/// Slot names become part of a tensor's name (`optimizer.<slot>.<variable>`): not empty, no dot.
pub(crate) fn check_slot_name(slot: &str) -> Result<()> {
    if slot.is_empty() || slot.contains('.') {
        Err(Error::invalid(format!(
            "optimizer slot name `{slot}` must be non-empty and contain no dot"
        )))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(kind: &str, vars: &[(&str, f32)]) -> Result<NamedOptimizerState> {
        let mut momentum = Weights::new();
        for &(name, v) in vars {
            momentum.insert(name.into(), Tensor::full(v, 2, &Device::Cpu)?);
        }
        Ok(NamedOptimizerState {
            kind: kind.into(),
            slots: BTreeMap::from([("momentum".to_string(), momentum)]),
            scalars: BTreeMap::from([("step".to_string(), 3.0)]),
        })
    }

    #[test]
    fn parts_restricted_to_disjoint_variables_join_back_into_the_whole() -> Result<()> {
        let whole = state("SGD", &[("a", 1.0), ("b", 2.0), ("c", 3.0)])?;
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let first = whole.restricted_to(&names(&["a", "c"]));
        let second = whole.restricted_to(&names(&["b"]));
        assert_eq!(first.slots["momentum"].len(), 2);
        assert_eq!(second.scalars, whole.scalars);
        let joined = NamedOptimizerState::join([second, first.clone()])?;
        assert_eq!(joined.kind, "SGD");
        for (name, t) in &whole.slots["momentum"] {
            let got = joined.slots["momentum"][name].to_vec1::<f32>()?;
            assert_eq!(got, t.to_vec1::<f32>()?, "`{name}`");
        }
        let err = NamedOptimizerState::join([first.clone(), first.clone()])
            .expect_err("a variable in two parts must fail");
        assert!(err.to_string().contains("in two parts"), "{err}");
        let adam = state("Adam", &[("b", 2.0)])?;
        let err = NamedOptimizerState::join([first, adam]).expect_err("two kinds must fail");
        assert!(err.to_string().contains("cannot join"), "{err}");
        Ok(())
    }
}
