//! `Logs`: the flat, ordered `name -> value` map that callbacks read.

/// The log key of the number of training steps in an epoch whose update was skipped: a loss or
/// gradient that was not finite, or a mixed-precision loss-scale overflow. Always in `fit`'s
/// training logs; the one-line form shows it only when it is not 0.
pub const SKIPPED_STEPS: &str = "skipped_steps";

/// Named values in insertion order: `loss`, the metrics, then `val_*`, then `lr`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logs {
    entries: Vec<(String, f64)>,
}

impl Logs {
    /// Empty logs.
    pub fn new() -> Self {
        Self::default()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// Sets `key`, keeping its position if it exists.
    pub fn set(&mut self, key: impl Into<String>, value: f64) {
        let key = key.into();
        match self.entries.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.entries.push((key, value)),
        }
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<f64> {
        let at = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(at).1)
    }

    /// The entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keras's one-line form: `loss: 0.1234 - accuracy: 0.9612 - lr: 5.0000e-03`, and
    /// `skipped_steps: 3` when steps were skipped.
    pub fn to_line(&self) -> String {
        self.entries
            .iter()
            .filter(|(k, v)| !(k == SKIPPED_STEPS && *v == 0.0))
            .map(|(k, v)| match k == SKIPPED_STEPS {
                true => format!("{k}: {v}"),
                false => format!("{k}: {}", format_value(*v)),
            })
            .collect::<Vec<_>>()
            .join(" - ")
    }
}

/// Four decimals, or scientific notation for small non-zero values.
pub(crate) fn format_value(v: f64) -> String {
    if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:.4e}")
    } else {
        format!("{v:.4}")
    }
}

impl<'a> IntoIterator for &'a Logs {
    type Item = (&'a str, f64);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, f64)>,
        fn(&'a (String, f64)) -> (&'a str, f64),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k.as_str(), *v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_and_formats() {
        let mut logs = Logs::new();
        logs.set("loss", 0.5);
        logs.set("accuracy", 0.25);
        logs.set("loss", 0.125);
        logs.set("lr", 5e-5);
        assert_eq!(logs.keys().collect::<Vec<_>>(), ["loss", "accuracy", "lr"]);
        assert_eq!(
            logs.to_line(),
            "loss: 0.1250 - accuracy: 0.2500 - lr: 5.0000e-5"
        );
    }

    #[test]
    fn skipped_steps_show_as_a_count_when_there_are_some() {
        let mut logs = Logs::new();
        logs.set("loss", 0.5);
        logs.set(SKIPPED_STEPS, 0.0);
        assert_eq!(logs.to_line(), "loss: 0.5000");
        logs.set(SKIPPED_STEPS, 3.0);
        assert_eq!(logs.to_line(), "loss: 0.5000 - skipped_steps: 3");
        assert_eq!(logs.remove(SKIPPED_STEPS), Some(3.0));
        assert_eq!(logs.remove(SKIPPED_STEPS), None);
        assert_eq!(logs.keys().collect::<Vec<_>>(), ["loss"]);
    }
}
