//! `History`: every epoch's logs, which `fit` returns.

use std::collections::BTreeMap;

use super::{Callback, CallbackState, Logs};
use crate::preemption::Preempted;
use crate::{Model, Result};

/// The per-epoch logs of a `fit` call, as Keras's `History.history`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    /// The epochs that ran, counted from 0.
    pub epochs: Vec<usize>,
    /// Each epoch's logs.
    pub logs: Vec<Logs>,
    /// Where `fit` stopped for a [`StopSignal`](crate::preemption::StopSignal) (a preemption),
    /// or `None` when it ran to its end (or stopped early for a callback).
    pub preempted: Option<Preempted>,
}

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// The series of `key` across epochs (`NaN` where an epoch lacks it).
    pub fn series(&self, key: &str) -> Vec<f64> {
        self.logs
            .iter()
            .map(|l| l.get(key).unwrap_or(f64::NAN))
            .collect()
    }

    /// The last epoch's value of `key`.
    pub fn last(&self, key: &str) -> Option<f64> {
        self.logs.last().and_then(|l| l.get(key))
    }

    /// Every key with its series, as `History.history` in Keras.
    pub fn to_map(&self) -> BTreeMap<String, Vec<f64>> {
        let mut keys: Vec<&str> = Vec::new();
        for l in &self.logs {
            for k in l.keys() {
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        keys.into_iter()
            .map(|k| (k.to_string(), self.series(k)))
            .collect()
    }

    /// The history as JSON: `{"epoch": [...], "loss": [...], ...}`.
    pub fn to_json(&self) -> String {
        let mut map: BTreeMap<String, serde_json::Value> = self
            .to_map()
            .into_iter()
            .map(|(k, v)| (k, serde_json::json!(v)))
            .collect();
        map.insert("epoch".into(), serde_json::json!(self.epochs));
        serde_json::to_string_pretty(&map).unwrap_or_default()
    }
}

impl Callback for History {
    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, _model: &mut Model) -> Result<()> {
        self.epochs.push(epoch);
        self.logs.push(logs.clone());
        Ok(())
    }

    /// `{"epochs": [...], "logs": [[[key, value], ...], ...]}`, each epoch's logs in order (a
    /// NaN value as `null`).
    fn state(&self) -> Option<CallbackState> {
        let logs: Vec<serde_json::Value> = self
            .logs
            .iter()
            .map(|l| l.iter().map(|(k, v)| serde_json::json!([k, v])).collect())
            .collect();
        Some(serde_json::json!({ "epochs": self.epochs, "logs": logs }))
    }

    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        let bad = || {
            crate::Error::invalid("History: the saved state is not a history of epochs and logs")
        };
        let epochs = state
            .get("epochs")
            .and_then(|e| e.as_array())
            .ok_or_else(bad)?
            .iter()
            .map(|e| e.as_u64().map(|e| e as usize).ok_or_else(bad))
            .collect::<Result<Vec<_>>>()?;
        let logs = state
            .get("logs")
            .and_then(|l| l.as_array())
            .filter(|l| l.len() == epochs.len())
            .ok_or_else(bad)?
            .iter()
            .map(|epoch| {
                let mut logs = Logs::new();
                for pair in epoch.as_array().ok_or_else(bad)? {
                    let key = pair.get(0).and_then(|k| k.as_str()).ok_or_else(bad)?;
                    let value = pair.get(1).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
                    logs.set(key, value);
                }
                Ok(logs)
            })
            .collect::<Result<Vec<_>>>()?;
        *self = History {
            epochs,
            logs,
            preempted: None,
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_with_nan_and_order() -> Result<()> {
        let mut history = History::new();
        for (epoch, loss) in [(3, 0.5), (4, f64::NAN)] {
            let mut logs = Logs::new();
            logs.set("loss", loss);
            logs.set("accuracy", 0.25);
            history.epochs.push(epoch);
            history.logs.push(logs);
        }
        let state = history
            .state()
            .ok_or_else(|| crate::Error::invalid("no state"))?;
        let text =
            serde_json::to_string(&state).map_err(|e| crate::Error::invalid(e.to_string()))?;
        let back: CallbackState =
            serde_json::from_str(&text).map_err(|e| crate::Error::invalid(e.to_string()))?;
        let mut restored = History::new();
        restored.load_state(&back)?;
        assert_eq!(restored.epochs, [3, 4]);
        assert_eq!(
            restored.logs[1].keys().collect::<Vec<_>>(),
            ["loss", "accuracy"]
        );
        assert!(restored.logs[1].get("loss").is_some_and(f64::is_nan));
        assert_eq!(restored.logs[0], history.logs[0]);
        assert!(restored
            .load_state(&serde_json::json!({"epochs": [1]}))
            .is_err());
        Ok(())
    }
}
