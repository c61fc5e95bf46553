//! `History`: every epoch's logs, which `fit` returns.

use std::collections::BTreeMap;

use super::{Callback, Logs};
use crate::{Model, Result};

/// The per-epoch logs of a `fit` call, as Keras's `History.history`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    /// The epochs that ran, counted from 0.
    pub epochs: Vec<usize>,
    /// Each epoch's logs.
    pub logs: Vec<Logs>,
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
}
