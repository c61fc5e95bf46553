//! The distinct op shapes of MiniGoogLeNet: every convolution, batch norm, pooling and
//! concatenation with its input shape, how often it occurs, and its arithmetic.
//!
//! The list is walked from the Keras tutorial's definition (stem, three stages of inception and
//! downsample modules, average pool) and checked against the summary of
//! `kandle_models::mini_googlenet`, layer by layer (kind, output shape, parameters), so it
//! cannot drift from the model the training step runs.

use anyhow::{bail, Result};
use kandle::layers::{Padding, SummaryRow};
use serde_json::{json, Value};

/// A stage: its inception modules' `(k1x1, k3x3)` filters, then an optional downsample's filters.
type Stage = (&'static [(usize, usize)], Option<usize>);

/// MiniGoogLeNet's stages, as in `kandle_models`.
const STAGES: [Stage; 3] = [
    (&[(32, 32), (32, 48)], Some(80)),
    (&[(112, 48), (96, 64), (80, 80), (48, 96)], Some(96)),
    (&[(176, 160), (176, 160)], None),
];

/// What an op computes.
#[derive(Debug, Clone, PartialEq)]
pub enum OpKind {
    /// A convolution with a bias.
    Conv {
        /// Output channels.
        filters: usize,
        /// Square window size.
        kernel: usize,
        /// Stride along both axes.
        stride: usize,
        /// Border handling.
        padding: Padding,
    },
    /// Batch normalisation in training mode.
    BatchNorm,
    /// Max pooling.
    MaxPool {
        /// Square window size.
        window: usize,
        /// Stride along both axes.
        stride: usize,
    },
    /// Average pooling with the stride equal to the window.
    AvgPool {
        /// Square window size.
        window: usize,
    },
    /// Concatenation on channels of parts with these channel counts.
    Concat {
        /// Channels of each part.
        parts: Vec<usize>,
    },
}

/// One distinct op shape and where it occurs.
#[derive(Debug, Clone)]
pub struct OpShape {
    /// What it computes.
    pub kind: OpKind,
    /// Input `(C, H, W)`; for a concatenation, the common `(_, H, W)` with the total channels.
    pub input: [usize; 3],
    /// Output `(C, H, W)`.
    pub output: [usize; 3],
    /// The layers that have this shape, e.g. `inception_1.branch_1x1.conv`.
    pub layers: Vec<String>,
    /// Whether it reads the network's input, whose gradient training never needs.
    pub on_network_input: bool,
}

impl OpShape {
    /// Occurrences per forward pass.
    pub fn count(&self) -> usize {
        self.layers.len()
    }

    /// A short label: the first layer with this shape, and how many more there are.
    pub fn label(&self) -> String {
        match self.layers.len() {
            0 | 1 => self.layers.concat(),
            n => format!("{} (+{})", self.layers[0], n - 1),
        }
    }

    /// The shape in words, e.g. `96x32x32 -> 32x32x32, 1x1/1 same`.
    pub fn shape(&self) -> String {
        let dims = |d: &[usize; 3]| format!("{}x{}x{}", d[0], d[1], d[2]);
        match &self.kind {
            OpKind::Conv {
                kernel,
                stride,
                padding,
                ..
            } => format!(
                "{} -> {}, {kernel}x{kernel}/{stride} {}",
                dims(&self.input),
                dims(&self.output),
                padding_name(*padding)
            ),
            OpKind::MaxPool { window, stride } => {
                format!("{}, {window}x{window}/{stride}", dims(&self.input))
            }
            OpKind::AvgPool { window } => format!("{}, {window}x{window}", dims(&self.input)),
            OpKind::Concat { parts } => {
                let parts: Vec<String> = parts.iter().map(usize::to_string).collect();
                format!(
                    "{} -> {}x{}x{}",
                    parts.join(" + "),
                    self.output[0],
                    self.output[1],
                    self.output[2]
                )
            }
            OpKind::BatchNorm => dims(&self.input),
        }
    }

    /// Multiply-accumulates of one pass of a convolution at `batch` (0 for other ops). Forward,
    /// backward-input and backward-weight each take this many.
    pub fn conv_macs(&self, batch: usize) -> u64 {
        match self.kind {
            OpKind::Conv { kernel, .. } => {
                let [c, _, _] = self.input;
                let [f, oh, ow] = self.output;
                (batch * f * oh * ow * c * kernel * kernel) as u64
            }
            _ => 0,
        }
    }

    /// Explicit `(top, bottom, left, right)` padding, as TensorFlow splits `same`.
    pub fn pads(&self) -> [usize; 4] {
        let OpKind::Conv {
            kernel,
            stride,
            padding: Padding::Same,
            ..
        } = self.kind
        else {
            return [0; 4];
        };
        let along = |input: usize, output: usize| {
            let total = ((output - 1) * stride + kernel).saturating_sub(input);
            (total / 2, total - total / 2)
        };
        let (t, b) = along(self.input[1], self.output[1]);
        let (l, r) = along(self.input[2], self.output[2]);
        [t, b, l, r]
    }

    /// The op as the PyTorch reference script reads it.
    pub fn to_json(&self, name: &str) -> Value {
        let (c, h, w) = (self.input[0], self.input[1], self.input[2]);
        match &self.kind {
            OpKind::Conv {
                filters,
                kernel,
                stride,
                ..
            } => json!({
                "kind": "conv", "name": name, "input": [c, h, w], "filters": filters,
                "kernel": [kernel, kernel], "stride": [stride, stride], "pad": self.pads(),
            }),
            OpKind::BatchNorm => json!({"kind": "batch_norm", "name": name, "input": [c, h, w]}),
            OpKind::MaxPool { window, stride } => json!({
                "kind": "max_pool", "name": name, "input": [c, h, w],
                "window": [window, window], "stride": [stride, stride],
            }),
            OpKind::AvgPool { window } => json!({
                "kind": "avg_pool", "name": name, "input": [c, h, w],
                "window": [window, window], "stride": [window, window],
            }),
            OpKind::Concat { parts } => {
                let parts: Vec<[usize; 3]> = parts.iter().map(|&p| [p, h, w]).collect();
                json!({"kind": "concat", "name": name, "parts": parts})
            }
        }
    }

    /// The summary's `kind` for this op.
    fn summary_kind(&self) -> &'static str {
        match self.kind {
            OpKind::Conv { .. } => "conv2d",
            OpKind::BatchNorm => "batch_normalization",
            OpKind::MaxPool { .. } => "max_pooling2d",
            OpKind::AvgPool { .. } => "average_pooling2d",
            OpKind::Concat { .. } => "concat",
        }
    }

    /// Trainable parameters of one occurrence (`None` for a concatenation, whose summary row
    /// counts its branches).
    fn trainable(&self) -> Option<usize> {
        match self.kind {
            OpKind::Conv {
                filters, kernel, ..
            } => Some(filters * (self.input[0] * kernel * kernel + 1)),
            OpKind::BatchNorm => Some(2 * self.input[0]),
            OpKind::MaxPool { .. } | OpKind::AvgPool { .. } => Some(0),
            OpKind::Concat { .. } => None,
        }
    }
}

fn padding_name(p: Padding) -> &'static str {
    match p {
        Padding::Same => "same",
        Padding::Valid => "valid",
        Padding::Explicit { .. } => "explicit",
    }
}

/// Walks the network in execution order, recording one entry per op occurrence (the first one
/// reads the network's input).
#[derive(Default)]
struct Walk {
    ops: Vec<OpShape>,
}

impl Walk {
    fn push(&mut self, layer: String, kind: OpKind, input: [usize; 3], output: [usize; 3]) {
        self.ops.push(OpShape {
            kind,
            input,
            output,
            layers: vec![layer],
            on_network_input: self.ops.is_empty(),
        });
    }

    /// Conv -> BatchNorm -> ReLU.
    fn conv_module(
        &mut self,
        path: &str,
        input: [usize; 3],
        filters: usize,
        kernel: usize,
        stride: usize,
        padding: Padding,
    ) -> [usize; 3] {
        let size = |n: usize, (before, after): (usize, usize)| match padding {
            Padding::Same => n.div_ceil(stride),
            Padding::Valid | Padding::Explicit { .. } => (n + before + after - kernel) / stride + 1,
        };
        let (rows, columns) = padding.explicit();
        let output = [filters, size(input[1], rows), size(input[2], columns)];
        let conv = OpKind::Conv {
            filters,
            kernel,
            stride,
            padding,
        };
        self.push(format!("{path}.conv"), conv, input, output);
        self.push(format!("{path}.bn"), OpKind::BatchNorm, output, output);
        output
    }

    fn concat(&mut self, path: &str, parts: [[usize; 3]; 2]) -> [usize; 3] {
        let channels = parts[0][0] + parts[1][0];
        let output = [channels, parts[0][1], parts[0][2]];
        let kind = OpKind::Concat {
            parts: vec![parts[0][0], parts[1][0]],
        };
        self.push(path.to_string(), kind, output, output);
        output
    }

    fn inception(&mut self, path: &str, input: [usize; 3], k1: usize, k3: usize) -> [usize; 3] {
        let a = self.conv_module(
            &format!("{path}.branch_1x1"),
            input,
            k1,
            1,
            1,
            Padding::Same,
        );
        let b = self.conv_module(
            &format!("{path}.branch_3x3"),
            input,
            k3,
            3,
            1,
            Padding::Same,
        );
        self.concat(path, [a, b])
    }

    fn downsample(&mut self, path: &str, input: [usize; 3], filters: usize) -> [usize; 3] {
        let branch = format!("{path}.branch_conv");
        let a = self.conv_module(&branch, input, filters, 3, 2, Padding::Valid);
        let pooled = [input[0], (input[1] - 3) / 2 + 1, (input[2] - 3) / 2 + 1];
        let pool = OpKind::MaxPool {
            window: 3,
            stride: 2,
        };
        self.push(format!("{path}.branch_pool"), pool, input, pooled);
        self.concat(path, [a, pooled])
    }
}

/// Every op occurrence of MiniGoogLeNet on 3x32x32 inputs, in execution order.
fn occurrences() -> Vec<OpShape> {
    let mut walk = Walk::default();
    let mut shape = walk.conv_module("stem", [3, 32, 32], 96, 3, 1, Padding::Same);
    let (mut inceptions, mut downsamples) = (0, 0);
    for (modules, downsample) in STAGES {
        for &(k1, k3) in modules {
            inceptions += 1;
            shape = walk.inception(&format!("inception_{inceptions}"), shape, k1, k3);
        }
        if let Some(filters) = downsample {
            downsamples += 1;
            shape = walk.downsample(&format!("downsample_{downsamples}"), shape, filters);
        }
    }
    let pooled = [shape[0], 1, 1];
    walk.push(
        "avg_pool".into(),
        OpKind::AvgPool { window: 7 },
        shape,
        pooled,
    );
    walk.ops
}

/// `(kind, output shape, trainable parameters)` of the summary's timed layers, in execution
/// order (a concatenation after its branches).
fn summary_layers(rows: &[SummaryRow], out: &mut Vec<(String, Vec<usize>, Option<usize>)>) {
    for row in rows {
        summary_layers(&row.children, out);
        match row.kind.as_str() {
            "conv2d" | "batch_normalization" | "max_pooling2d" | "average_pooling2d" => out.push((
                row.kind.clone(),
                row.output_shape.clone(),
                Some(row.trainable),
            )),
            "concat" => out.push((row.kind.clone(), row.output_shape.clone(), None)),
            _ => {}
        }
    }
}

/// MiniGoogLeNet's distinct op shapes, in order of first occurrence, after checking the walk
/// against the summary of `kandle_models::mini_googlenet(10)`.
pub fn mini_googlenet_ops() -> Result<Vec<OpShape>> {
    let all = occurrences();
    let summary = kandle_models::mini_googlenet(10).summary(&[3, 32, 32])?;
    let mut expected = Vec::new();
    summary_layers(&summary.rows, &mut expected);
    let walked: Vec<(String, Vec<usize>, Option<usize>)> = all
        .iter()
        .map(|op| {
            (
                op.summary_kind().to_string(),
                op.output.to_vec(),
                op.trainable(),
            )
        })
        .collect();
    if walked != expected {
        let first = walked
            .iter()
            .zip(&expected)
            .position(|(a, b)| a != b)
            .unwrap_or(walked.len().min(expected.len()));
        bail!(
            "the benchmark's MiniGoogLeNet op list no longer matches kandle_models::mini_googlenet \
             at layer {first}: walked {:?}, summary {:?}",
            walked.get(first),
            expected.get(first)
        );
    }
    let mut distinct: Vec<OpShape> = Vec::new();
    for op in all {
        match distinct
            .iter_mut()
            .find(|d| d.kind == op.kind && d.input == op.input)
        {
            Some(d) => d.layers.extend(op.layers),
            None => distinct.push(op),
        }
    }
    Ok(distinct)
}
