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
    /// In a functional model that is not a chain, what each call of the layer takes, as
    /// Keras's "Connected to" column writes it (`conv2d_1[0][0]`: the layer, which of its
    /// calls, which output); empty otherwise.
    pub connected_to: Vec<String>,
    /// The shapes of its further outputs, without the batch dimension: a functional model of
    /// several outputs called as a layer (the table writes them all, `[(None, 2), (None, 3)]`).
    pub more_output_shapes: Vec<Vec<usize>>,
}

/// What `summary()` reports: one row per layer and the totals.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The model's inputs: each one's name (`input` for a `Sequential`'s) and shape without the
    /// batch dimension.
    pub inputs: Vec<(String, Vec<usize>)>,
    /// Top-level layers, with nested rows inside composites.
    pub rows: Vec<SummaryRow>,
    /// Trainable parameters in all.
    pub trainable: usize,
    /// Non-trainable parameters in all.
    pub non_trainable: usize,
    /// The stages of a model cut into a pipeline, in order; empty for a model on one device.
    pub stages: Vec<StageSummary>,
}

/// One stage of a pipeline in a [`Summary`]: where it lives and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct StageSummary {
    /// The device holding its variables, e.g. `cpu` or `cuda:1` (or a worker's rank).
    pub device: String,
    /// Its first and last top-level layers.
    pub layers: (String, String),
    /// Its parameters (trainable and not).
    pub params: usize,
    /// Bytes of the layer outputs of one sample that the stage keeps from a forward pass to
    /// its backward pass (its top-level layers' outputs, in `float32`).
    pub activation_bytes_per_sample: usize,
    /// Micro-batches whose activations the stage holds at once under its schedule (GPipe:
    /// all of a step's; 1F1B: at most the stages from it to the last).
    pub micro_batches_held: usize,
}

impl StageSummary {
    /// The stage's activation memory for micro-batches of `samples` samples: what one
    /// micro-batch keeps, times the micro-batches held at once.
    pub fn activation_bytes(&self, samples: usize) -> usize {
        self.activation_bytes_per_sample * samples * self.micro_batches_held
    }
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
        if i > 0 && (s.len() - i).is_multiple_of(3) {
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

/// A row's output shape, or all of them in brackets as Keras writes several.
fn output_shapes(row: &SummaryRow) -> String {
    if row.more_output_shapes.is_empty() {
        return shape(&row.output_shape);
    }
    let all: Vec<String> = std::iter::once(&row.output_shape)
        .chain(&row.more_output_shapes)
        .map(|s| shape(s))
        .collect();
    format!("[{}]", all.join(", "))
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn lines(rows: &[SummaryRow], depth: usize, out: &mut Vec<[String; 4]>) {
            for r in rows {
                let mut connected = r.connected_to.iter();
                out.push([
                    format!("{}{} ({})", "  ".repeat(depth), r.name, r.class_name),
                    output_shapes(r),
                    thousands(r.trainable + r.non_trainable),
                    connected.next().cloned().unwrap_or_default(),
                ]);
                // Keras writes one connection a line.
                for more in connected {
                    out.push([String::new(), String::new(), String::new(), more.clone()]);
                }
                lines(&r.children, depth + 1, out);
            }
        }
        let mut body = Vec::new();
        lines(&self.rows, 0, &mut body);
        let connections = body.iter().any(|r| !r[3].is_empty());
        let header = [
            "Layer (type)".to_string(),
            "Output Shape".into(),
            "Param #".into(),
            if connections { "Connected to" } else { "" }.into(),
        ];
        let mut widths = [0usize; 4];
        for row in body.iter().chain(std::iter::once(&header)) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let gaps = if connections { 6 } else { 4 };
        let width = widths.iter().sum::<usize>() + gaps;
        let rule = |c: char| c.to_string().repeat(width);
        let row = |f: &mut fmt::Formatter<'_>, r: &[String; 4]| {
            let line = format!(
                "{:<a$}  {:<b$}  {:>c$}  {}",
                r[0],
                r[1],
                r[2],
                r[3],
                a = widths[0],
                b = widths[1],
                c = widths[2]
            );
            writeln!(f, "{}", line.trim_end())
        };
        match &self.inputs[..] {
            [(_, only)] => writeln!(f, "Model input: {}", shape(only))?,
            inputs => {
                let each: Vec<String> = inputs
                    .iter()
                    .map(|(name, dims)| format!("`{name}` {}", shape(dims)))
                    .collect();
                writeln!(f, "Model inputs: {}", each.join(", "))?
            }
        }
        writeln!(f, "{}", rule('─'))?;
        row(f, &header)?;
        writeln!(f, "{}", rule('═'))?;
        for r in &body {
            row(f, r)?;
        }
        writeln!(f, "{}", rule('─'))?;
        writeln!(f, "Total params: {}", thousands(self.total()))?;
        writeln!(f, "Trainable params: {}", thousands(self.trainable))?;
        writeln!(f, "Non-trainable params: {}", thousands(self.non_trainable))?;
        if !self.stages.is_empty() {
            writeln!(f, "Pipeline stages:")?;
            for (i, stage) in self.stages.iter().enumerate() {
                writeln!(
                    f,
                    "  stage {i} on {}: {} to {}, {} params, activations {} per sample x {} \
                     micro-batch(es) held",
                    stage.device,
                    stage.layers.0,
                    stage.layers.1,
                    thousands(stage.params),
                    bytes(stage.activation_bytes_per_sample),
                    stage.micro_batches_held
                )?;
            }
        }
        Ok(())
    }
}

/// A byte count in the unit that keeps it short (`1.5 MiB`).
fn bytes(n: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{n} B"),
        _ => format!("{value:.1} {}", UNITS[unit]),
    }
}

#[cfg(test)]
mod tests {
    use super::{bytes, thousands};

    #[test]
    fn writes_bytes_in_short_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
    }

    #[test]
    fn groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_656_250), "1,656,250");
    }
}
