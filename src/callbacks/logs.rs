//! `Logs`: the flat, ordered `name -> value` map that callbacks read.

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

    /// Keras's one-line form: `loss: 0.1234 - accuracy: 0.9612 - lr: 5.0000e-03`.
    pub fn to_line(&self) -> String {
        self.entries
            .iter()
            .map(|(k, v)| format!("{k}: {}", format_value(*v)))
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
}
