//! `Summary`: the Keras-style table of layers (`conv2d_1 (Conv2D)`), output shapes and parameter
//! counts.

use std::fmt;

/// One layer's line in a [`Summary`].
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryRow {
    /// The layer's name within its parent, e.g. `conv2d_1`.
    pub name: String,
    /// The layer kind, e.g. `conv2d` (what automatic names are made of).
    pub kind: String,
    /// The class name the table prints, as Keras does, e.g. `Conv2D`
    /// ([`LayerSpec::class_name`](super::LayerSpec::class_name)).
    pub class_name: String,
    /// Output shape without the batch dimension.
    pub output_shape: Vec<usize>,
    /// Trainable parameters, including those of nested layers.
    pub trainable: usize,
    /// Non-trainable parameters (moving statistics, frozen layers), including nested layers.
    pub non_trainable: usize,
    /// The rows of nested layers, for composites.
    pub children: Vec<SummaryRow>,
}

/// What `summary()` reports: one row per layer and the totals.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The model's input shape without the batch dimension.
    pub input_shape: Vec<usize>,
    /// Top-level layers, with nested rows inside composites.
    pub rows: Vec<SummaryRow>,
    /// Trainable parameters in all.
    pub trainable: usize,
    /// Non-trainable parameters in all.
    pub non_trainable: usize,
}

impl Summary {
    /// All parameters.
    pub fn total(&self) -> usize {
        self.trainable + self.non_trainable
    }
}

/// `1656250` as `1,656,250`.
pub(crate) fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn shape(dims: &[usize]) -> String {
    let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("(None, {})", dims.join(", "))
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn lines(rows: &[SummaryRow], depth: usize, out: &mut Vec<[String; 3]>) {
            for r in rows {
                out.push([
                    format!("{}{} ({})", "  ".repeat(depth), r.name, r.class_name),
                    shape(&r.output_shape),
                    thousands(r.trainable + r.non_trainable),
                ]);
                lines(&r.children, depth + 1, out);
            }
        }
        let mut body = Vec::new();
        lines(&self.rows, 0, &mut body);
        let header = [
            "Layer (type)".to_string(),
            "Output Shape".into(),
            "Param #".into(),
        ];
        let mut widths = [0usize; 3];
        for row in body.iter().chain(std::iter::once(&header)) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let width = widths.iter().sum::<usize>() + 4;
        let rule = |c: char| c.to_string().repeat(width);
        let row = |f: &mut fmt::Formatter<'_>, r: &[String; 3]| {
            writeln!(
                f,
                "{:<a$}  {:<b$}  {:>c$}",
                r[0],
                r[1],
                r[2],
                a = widths[0],
                b = widths[1],
                c = widths[2]
            )
        };
        writeln!(f, "Model input: {}", shape(&self.input_shape))?;
        writeln!(f, "{}", rule('─'))?;
        row(f, &header)?;
        writeln!(f, "{}", rule('═'))?;
        for r in &body {
            row(f, r)?;
        }
        writeln!(f, "{}", rule('─'))?;
        writeln!(f, "Total params: {}", thousands(self.total()))?;
        writeln!(f, "Trainable params: {}", thousands(self.trainable))?;
        writeln!(f, "Non-trainable params: {}", thousands(self.non_trainable))
    }
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_656_250), "1,656,250");
    }
}
