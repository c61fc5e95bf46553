//! The distinct op shapes of the network `bench` times (MiniGoogLeNet, or a ResNet on CIFAR's or
//! ImageNet's images): every convolution, batch norm, pooling and concatenation with its input
//! shape, how often it occurs, and its arithmetic.
//!
//! Each list is walked from the network's definition (MiniGoogLeNet: the Keras tutorial's stem,
//! three stages of inception and downsample modules, average pool; a ResNet: torchvision's stem
//! (on 32x32 images a 3x3 convolution without max pooling, else the 7x7 stride-2 convolution and
//! the padded 3x3 stride-2 max pool), four stages of basic or bottleneck blocks, global average
//! pooling) and
//! checked against the summary of the network `--model` builds, layer by layer (kind, output
//! shape, parameters), so it cannot drift from the model the training step runs. The ops of no
//! timed kind (ReLU, dropout, the residual additions, the dense head) are not in the lists.

use anyhow::{bail, Result};
use kandle::layers::{Padding, SummaryRow};
use kandle_models::Depth;
use serde_json::{json, Value};

use crate::workload::Workload;

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
    /// A convolution.
    Conv {
        /// Output channels.
        filters: usize,
        /// Square window size.
        kernel: usize,
        /// Stride along both axes.
        stride: usize,
        /// Border handling.
        padding: Padding,
        /// Whether it adds a bias.
        bias: bool,
    },
    /// Batch normalisation in training mode.
    BatchNorm,
    /// Max pooling.
    MaxPool {
        /// Square window size.
        window: usize,
        /// Stride along both axes.
        stride: usize,
        /// Padding on every side (never part of a window's maximum).
        pad: usize,
    },
    /// Average pooling with the stride equal to the window.
    AvgPool {
        /// Square window size.
        window: usize,
    },
    /// Average pooling over each whole feature map, `(C, H, W)` to `(C)`.
    GlobalAvgPool,
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

    /// The shape in words, e.g. `96x32x32 -> 32x32x32, 1x1/1 same` or
    /// `64x32x32 -> 128x16x16, 3x3/2 pad 1`.
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
            OpKind::MaxPool {
                window,
                stride,
                pad: 0,
            } => format!("{}, {window}x{window}/{stride}", dims(&self.input)),
            OpKind::MaxPool {
                window,
                stride,
                pad,
            } => format!(
                "{}, {window}x{window}/{stride} pad {pad}",
                dims(&self.input)
            ),
            OpKind::AvgPool { window } => format!("{}, {window}x{window}", dims(&self.input)),
            OpKind::GlobalAvgPool => format!("{}, global", dims(&self.input)),
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

    /// Explicit `(top, bottom, left, right)` padding: `same` split as TensorFlow splits it.
    pub fn pads(&self) -> [usize; 4] {
        let OpKind::Conv {
            kernel,
            stride,
            padding,
            ..
        } = self.kind
        else {
            return [0; 4];
        };
        if padding != Padding::Same {
            let ((t, b), (l, r)) = padding.explicit();
            return [t, b, l, r];
        }
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
                bias,
                ..
            } => json!({
                "kind": "conv", "name": name, "input": [c, h, w], "filters": filters,
                "kernel": [kernel, kernel], "stride": [stride, stride], "pad": self.pads(),
                "bias": bias,
            }),
            OpKind::BatchNorm => json!({"kind": "batch_norm", "name": name, "input": [c, h, w]}),
            OpKind::MaxPool {
                window,
                stride,
                pad,
            } => json!({
                "kind": "max_pool", "name": name, "input": [c, h, w],
                "window": [window, window], "stride": [stride, stride], "pad": [pad, pad],
            }),
            OpKind::AvgPool { window } => json!({
                "kind": "avg_pool", "name": name, "input": [c, h, w],
                "window": [window, window], "stride": [window, window],
            }),
            // One window over the whole map: what PyTorch's adaptive pooling to 1x1 computes.
            OpKind::GlobalAvgPool => json!({
                "kind": "avg_pool", "name": name, "input": [c, h, w],
                "window": [h, w], "stride": [h, w],
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
            OpKind::GlobalAvgPool => "global_average_pooling2d",
            OpKind::Concat { .. } => "concat",
        }
    }

    /// The output shape as the summary gives it.
    fn summary_shape(&self) -> Vec<usize> {
        match self.kind {
            OpKind::GlobalAvgPool => vec![self.output[0]],
            _ => self.output.to_vec(),
        }
    }

    /// Trainable parameters of one occurrence (`None` for a concatenation, whose summary row
    /// counts its branches).
    fn trainable(&self) -> Option<usize> {
        match self.kind {
            OpKind::Conv {
                filters,
                kernel,
                bias,
                ..
            } => Some(filters * (self.input[0] * kernel * kernel + usize::from(bias))),
            OpKind::BatchNorm => Some(2 * self.input[0]),
            OpKind::MaxPool { .. } | OpKind::AvgPool { .. } | OpKind::GlobalAvgPool => Some(0),
            OpKind::Concat { .. } => None,
        }
    }
}

fn padding_name(p: Padding) -> String {
    match p.explicit() {
        _ if p == Padding::Same => "same".into(),
        _ if p == Padding::Valid => "valid".into(),
        ((t, b), (l, r)) if t == b && b == l && l == r => format!("pad {t}"),
        ((t, b), (l, r)) => format!("pad {t},{b},{l},{r}"),
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

    /// The convolution `conv` named `names[0]`, then a BatchNorm named `names[1]` (and in both
    /// networks a ReLU or a residual addition, not timed).
    fn conv_bn(&mut self, names: [String; 2], input: [usize; 3], conv: OpKind) -> [usize; 3] {
        let OpKind::Conv {
            filters,
            kernel,
            stride,
            padding,
            ..
        } = conv
        else {
            unreachable!("conv_bn takes a convolution, not {conv:?}");
        };
        let size = |n: usize, (before, after): (usize, usize)| match padding {
            Padding::Same => n.div_ceil(stride),
            Padding::Valid | Padding::Explicit { .. } => (n + before + after - kernel) / stride + 1,
        };
        let (rows, columns) = padding.explicit();
        let output = [filters, size(input[1], rows), size(input[2], columns)];
        let [conv_name, bn_name] = names;
        self.push(conv_name, conv, input, output);
        self.push(bn_name, OpKind::BatchNorm, output, output);
        output
    }

    /// MiniGoogLeNet's conv module: `<path>.conv`, `<path>.bn` (and a ReLU).
    fn conv_module(
        &mut self,
        path: &str,
        input: [usize; 3],
        filters: usize,
        kernel: usize,
        stride: usize,
        padding: Padding,
    ) -> [usize; 3] {
        let names = [format!("{path}.conv"), format!("{path}.bn")];
        let kind = OpKind::Conv {
            filters,
            kernel,
            stride,
            padding,
            bias: true,
        };
        self.conv_bn(names, input, kind)
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
            pad: 0,
        };
        self.push(format!("{path}.branch_pool"), pool, input, pooled);
        self.concat(path, [a, pooled])
    }

    /// torchvision's convolution in a ResNet: bias-free, padded by `kernel / 2` on every side,
    /// then its BatchNorm.
    fn resnet_conv_bn(
        &mut self,
        names: [String; 2],
        input: [usize; 3],
        filters: usize,
        kernel: usize,
        stride: usize,
    ) -> [usize; 3] {
        let kind = OpKind::Conv {
            filters,
            kernel,
            stride,
            padding: Padding::symmetric(kernel / 2, kernel / 2),
            bias: false,
        };
        self.conv_bn(names, input, kind)
    }

    /// A basic block named `<prefix>...`: conv1, bn1 (ReLU), conv2, bn2, then the 1x1
    /// projection `downsample.0` and its BatchNorm `downsample.1` where the shape changes (and
    /// the residual addition with its ReLU).
    fn basic_block(
        &mut self,
        prefix: &str,
        input: [usize; 3],
        filters: usize,
        stride: usize,
    ) -> [usize; 3] {
        let names = |conv: &str, bn: &str| [format!("{prefix}{conv}"), format!("{prefix}{bn}")];
        let y = self.resnet_conv_bn(names("conv1", "bn1"), input, filters, 3, stride);
        let y = self.resnet_conv_bn(names("conv2", "bn2"), y, filters, 3, 1);
        self.shortcut(prefix, input, filters, stride);
        y
    }

    /// A bottleneck block named `<prefix>...` (torchvision's, the stride on the 3x3): conv1 (1x1
    /// to `width`), conv2 (3x3), conv3 (1x1 to `4 * width`), each with its BatchNorm, then the
    /// shortcut's projection where the shape changes.
    fn bottleneck_block(
        &mut self,
        prefix: &str,
        input: [usize; 3],
        width: usize,
        stride: usize,
    ) -> [usize; 3] {
        let names = |conv: &str, bn: &str| [format!("{prefix}{conv}"), format!("{prefix}{bn}")];
        let y = self.resnet_conv_bn(names("conv1", "bn1"), input, width, 1, 1);
        let y = self.resnet_conv_bn(names("conv2", "bn2"), y, width, 3, stride);
        let y = self.resnet_conv_bn(names("conv3", "bn3"), y, 4 * width, 1, 1);
        self.shortcut(prefix, input, 4 * width, stride);
        y
    }

    /// A block's projection `downsample.0` and its BatchNorm `downsample.1`, where the block
    /// changes the shape (its input is the shortcut otherwise).
    fn shortcut(&mut self, prefix: &str, input: [usize; 3], filters: usize, stride: usize) {
        if stride != 1 || input[0] != filters {
            let names = [
                format!("{prefix}downsample.0"),
                format!("{prefix}downsample.1"),
            ];
            self.resnet_conv_bn(names, input, filters, 1, stride);
        }
    }
}

/// Every op occurrence of MiniGoogLeNet on 3x32x32 inputs, in execution order.
fn mini_googlenet_occurrences() -> Vec<OpShape> {
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

/// Every op occurrence of a ResNet of `depth` on `workload`'s images, in execution order: the
/// stem (CIFAR's 3x3 stride-1 convolution, or ImageNet's 7x7 stride-2 one and its padded 3x3
/// stride-2 max pool), four stages of blocks (64, 128, 256 and 512 filters or bottleneck widths,
/// the first block of each later stage with stride 2), global average pooling.
fn resnet_occurrences(depth: Depth, workload: &Workload) -> Vec<OpShape> {
    let mut walk = Walk::default();
    let stem = ["conv1".to_string(), "bn1".to_string()];
    let input = workload.input_shape();
    let mut shape = if workload.is_cifar() {
        walk.resnet_conv_bn(stem, input, 64, 3, 1)
    } else {
        let y = walk.resnet_conv_bn(stem, input, 64, 7, 2);
        let pool = OpKind::MaxPool {
            window: 3,
            stride: 2,
            pad: 1,
        };
        let pooled = [y[0], (y[1] - 1) / 2 + 1, (y[2] - 1) / 2 + 1];
        walk.push("maxpool".into(), pool, y, pooled);
        pooled
    };
    for (stage, (&count, width)) in depth.blocks().iter().zip([64, 128, 256, 512]).enumerate() {
        for block in 0..count {
            let stride = if block == 0 && stage > 0 { 2 } else { 1 };
            let prefix = format!("layer{}.{block}.", stage + 1);
            shape = match depth.bottleneck() {
                true => walk.bottleneck_block(&prefix, shape, width, stride),
                false => walk.basic_block(&prefix, shape, width, stride),
            };
        }
    }
    let pooled = [shape[0], 1, 1];
    walk.push("avgpool".into(), OpKind::GlobalAvgPool, shape, pooled);
    walk.ops
}

/// `(kind, output shape, trainable parameters)` of the summary's timed layers, in execution
/// order (a concatenation after its branches).
fn summary_layers(rows: &[SummaryRow], out: &mut Vec<(String, Vec<usize>, Option<usize>)>) {
    for row in rows {
        summary_layers(&row.children, out);
        match row.kind.as_str() {
            "conv2d"
            | "batch_normalization"
            | "max_pooling2d"
            | "average_pooling2d"
            | "global_average_pooling2d" => out.push((
                row.kind.clone(),
                row.output_shape.clone(),
                Some(row.trainable),
            )),
            "concat" => out.push((row.kind.clone(), row.output_shape.clone(), None)),
            _ => {}
        }
    }
}

/// Fails, naming the first layer that differs, unless the walked ops are the summary's timed
/// layers, one for one.
fn check(title: &str, all: &[OpShape], rows: &[SummaryRow]) -> Result<()> {
    let mut expected = Vec::new();
    summary_layers(rows, &mut expected);
    let walked: Vec<(String, Vec<usize>, Option<usize>)> = all
        .iter()
        .map(|op| {
            (
                op.summary_kind().to_string(),
                op.summary_shape(),
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
            "the benchmark's {title} op list no longer matches the network's summary at layer \
             {first} ({}): walked {:?}, summary {:?}",
            all.get(first).map_or("-".into(), OpShape::label),
            walked.get(first),
            expected.get(first)
        );
    }
    Ok(())
}

/// The distinct op shapes of `workload`'s network (both forms of MiniGoogLeNet have the same),
/// in order of first occurrence, after checking the walk against the summary of the network it
/// builds (for MiniGoogLeNet, its Sequential form).
pub fn ops(workload: &Workload) -> Result<Vec<OpShape>> {
    let (all, network) = match workload.resnet_depth() {
        None => (
            mini_googlenet_occurrences(),
            Workload::mini_googlenet().network()?,
        ),
        Some(depth) => (resnet_occurrences(depth, workload), workload.network()?),
    };
    let summary = network.summary(&workload.input_shape())?;
    check(&workload.title(), &all, &summary.rows)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::BenchModel;

    fn workload(model: BenchModel, size: Option<usize>) -> Workload {
        Workload::new(model, size).expect("a workload")
    }

    fn count(ops: &[OpShape], family: fn(&OpKind) -> bool) -> usize {
        ops.iter()
            .filter(|op| family(&op.kind))
            .map(OpShape::count)
            .sum()
    }

    fn is_conv(kind: &OpKind) -> bool {
        matches!(kind, OpKind::Conv { .. })
    }

    #[test]
    fn mini_googlenet_inventory_matches_its_summary() -> Result<()> {
        let ops = ops(&Workload::mini_googlenet())?;
        // The stem, two per inception module (8), one per downsample module (2).
        assert_eq!(count(&ops, is_conv), 19);
        assert_eq!(count(&ops, |k| *k == OpKind::BatchNorm), 19);
        assert_eq!(count(&ops, |k| matches!(k, OpKind::Concat { .. })), 10);
        assert!(ops[0].on_network_input && ops.iter().skip(1).all(|o| !o.on_network_input));
        // The functional form has the same ops.
        let functional = super::ops(&workload(BenchModel::MiniGooglenetFunctional, None))?;
        assert_eq!(functional.len(), ops.len());
        Ok(())
    }

    #[test]
    fn resnet18_inventory_matches_its_summary() -> Result<()> {
        let ops = ops(&workload(BenchModel::Resnet18, None))?;
        let shapes: Vec<(String, usize)> = ops
            .iter()
            .filter(|op| is_conv(&op.kind))
            .map(|op| (op.shape(), op.count()))
            .collect();
        let expected = [
            ("3x32x32 -> 64x32x32, 3x3/1 pad 1", 1),
            ("64x32x32 -> 64x32x32, 3x3/1 pad 1", 4),
            ("64x32x32 -> 128x16x16, 3x3/2 pad 1", 1),
            ("128x16x16 -> 128x16x16, 3x3/1 pad 1", 3),
            ("64x32x32 -> 128x16x16, 1x1/2 pad 0", 1),
            ("128x16x16 -> 256x8x8, 3x3/2 pad 1", 1),
            ("256x8x8 -> 256x8x8, 3x3/1 pad 1", 3),
            ("128x16x16 -> 256x8x8, 1x1/2 pad 0", 1),
            ("256x8x8 -> 512x4x4, 3x3/2 pad 1", 1),
            ("512x4x4 -> 512x4x4, 3x3/1 pad 1", 3),
            ("256x8x8 -> 512x4x4, 1x1/2 pad 0", 1),
        ];
        let expected: Vec<(String, usize)> =
            expected.iter().map(|&(s, n)| (s.to_string(), n)).collect();
        assert_eq!(shapes, expected);
        // A batch norm after every convolution, five at each stage's shape.
        let norms: Vec<(String, usize)> = ops
            .iter()
            .filter(|op| op.kind == OpKind::BatchNorm)
            .map(|op| (op.shape(), op.count()))
            .collect();
        let at = |s: &str| (s.to_string(), 5);
        assert_eq!(
            norms,
            [
                at("64x32x32"),
                at("128x16x16"),
                at("256x8x8"),
                at("512x4x4")
            ]
        );
        let pool = ops.last().expect("ops");
        assert_eq!(
            (pool.kind.clone(), pool.shape()),
            (OpKind::GlobalAvgPool, "512x4x4, global".to_string())
        );
        // Only the dense head's weights and the norms' parameters are not convolutions'.
        let conv_weights: usize = ops
            .iter()
            .filter(|op| is_conv(&op.kind))
            .map(|op| op.count() * op.trainable().unwrap_or(0))
            .sum();
        assert_eq!(conv_weights, 11_173_962 - (512 * 10 + 10) - 2 * 4_800);
        assert!(ops[0].on_network_input && ops.iter().skip(1).all(|o| !o.on_network_input));
        // What the PyTorch reference reads: explicit padding, no bias.
        let projection = ops
            .iter()
            .find(|op| op.layers[0] == "layer2.0.downsample.0")
            .expect("a projection");
        let json = projection.to_json("op");
        assert_eq!(json["pad"], json!([0, 0, 0, 0]));
        assert_eq!(json["stride"], json!([2, 2]));
        assert_eq!(json["bias"], json!(false));
        assert_eq!(ops[0].to_json("op")["pad"], json!([1, 1, 1, 1]));
        Ok(())
    }

    #[test]
    fn imagenet_resnets_walk_their_stem_pool_and_bottlenecks() -> Result<()> {
        let ops50 = ops(&workload(BenchModel::Resnet50, None))?;
        // The stem, 16 blocks of three and four projections.
        assert_eq!(count(&ops50, is_conv), 1 + 16 * 3 + 4);
        assert_eq!(count(&ops50, |k| *k == OpKind::BatchNorm), 53);
        assert_eq!(ops50[0].shape(), "3x224x224 -> 64x112x112, 7x7/2 pad 3");
        let pool = ops50
            .iter()
            .find(|op| op.layers[0] == "maxpool")
            .expect("the stem's pool");
        assert_eq!(pool.shape(), "64x112x112, 3x3/2 pad 1");
        assert_eq!(pool.to_json("op")["pad"], json!([1, 1]));
        // ResNet v1.5: the stride on the bottleneck's 3x3.
        let strided = ops50
            .iter()
            .find(|op| op.layers[0] == "layer2.0.conv2")
            .expect("layer2.0.conv2");
        assert_eq!(strided.shape(), "128x56x56 -> 128x28x28, 3x3/2 pad 1");
        let last = ops50.last().expect("ops");
        assert_eq!(last.shape(), "2048x7x7, global");
        let weights: usize = ops50
            .iter()
            .map(|op| op.count() * op.trainable().unwrap_or(0))
            .sum();
        assert_eq!(weights, 25_557_032 - (2048 * 1000 + 1000));
        let ops18 = ops(&workload(BenchModel::Resnet18, Some(224)))?;
        assert_eq!(count(&ops18, is_conv), 20);
        assert_eq!(ops18.last().expect("ops").shape(), "512x7x7, global");
        Ok(())
    }

    #[test]
    fn a_walk_that_drifts_from_the_summary_is_refused() -> Result<()> {
        let resnet18 = workload(BenchModel::Resnet18, None);
        let rows = resnet18.network()?.summary(&[3, 32, 32])?.rows;
        let mut all = resnet_occurrences(Depth::ResNet18, &resnet18);
        check("ResNet-18", &all, &rows)?;
        // A downsample projection forgotten.
        let at = all
            .iter()
            .position(|op| op.layers[0] == "layer2.0.downsample.0")
            .expect("a projection");
        all.remove(at);
        let err = check("ResNet-18", &all, &rows).expect_err("a layer missing");
        let err = err.to_string();
        assert!(
            err.contains("ResNet-18") && err.contains("layer2.0"),
            "{err}"
        );
        Ok(())
    }
}
