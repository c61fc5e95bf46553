//! The per-op results printed as Markdown tables, kandle and PyTorch side by side, and the
//! convolutions' achieved GFLOP/s against the machine's peak.

use crate::inventory::{OpKind, OpShape};
use crate::passes::{Pass, Passes, SplitSource};

/// One op shape's timings.
pub struct OpTimes<'a> {
    /// The op.
    pub op: &'a OpShape,
    /// kandle's passes.
    pub kandle: Passes,
    /// PyTorch's passes, when the reference ran.
    pub torch: Option<Passes>,
}

impl OpTimes<'_> {
    fn is_conv(&self) -> bool {
        matches!(self.op.kind, OpKind::Conv { .. })
    }

    /// A convolution's rows: the backward split into its two gradients, or whole where kandle's
    /// backward could not be split (kandle's cuDNN convolution).
    fn conv_passes(&self) -> &'static [Pass] {
        if self.kandle.split.is_some() {
            &SPLIT_PASSES
        } else {
            &WHOLE_PASSES
        }
    }
}

/// A convolution's passes with its backward split.
const SPLIT_PASSES: [Pass; 3] = [Pass::Fwd, Pass::BwdInput, Pass::BwdWeight];
/// A convolution's passes with its backward whole.
const WHOLE_PASSES: [Pass; 2] = [Pass::Fwd, Pass::Bwd];

/// Whether every convolution's backward was split (else the totals sum whole backwards).
pub fn convs_split(rows: &[OpTimes<'_>]) -> bool {
    rows.iter()
        .filter(|r| r.is_conv())
        .all(|r| r.kandle.split.is_some())
}

/// Milliseconds, `-` when unknown, and `~0` for a pass timed as a difference that came out
/// negative (below the noise of the two runs it is the difference of).
pub fn ms(seconds: Option<f64>) -> String {
    match seconds {
        Some(s) if s < 0.0 => "~0".into(),
        Some(s) => format!("{:.2}", s * 1e3),
        None => "-".into(),
    }
}

/// `a / b` to two places, or `-`.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

fn gflops(flops: f64, seconds: Option<f64>) -> String {
    match seconds {
        Some(s) if s > 0.0 => format!("{:.1}", flops / s / 1e9),
        _ => "-".into(),
    }
}

/// A convolution pass's FLOPs: two per multiply-add, twice that for a whole backward (both
/// gradients).
fn pass_flops(pass: Pass, macs: u64) -> f64 {
    let gradients = if pass == Pass::Bwd { 2.0 } else { 1.0 };
    gradients * 2.0 * macs as f64
}

/// One row per convolution and pass.
pub fn print_convs(rows: &[OpTimes<'_>], batch: usize) {
    println!(
        "| layer | shape | x | pass | GFLOP | kandle ms | kandle GFLOP/s | PyTorch ms | \
         PyTorch GFLOP/s | kandle / PyTorch time |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut candle_ops = false;
    for r in rows.iter().filter(|r| r.is_conv()) {
        for &pass in r.conv_passes() {
            let flops = pass_flops(pass, r.op.conv_macs(batch));
            let k = r.kandle.get(pass);
            let t = r.torch.and_then(|t| t.get(pass));
            let mark = match r.kandle.split {
                Some(s) if pass != Pass::Fwd && s.source == SplitSource::CandleOps => {
                    candle_ops = true;
                    " (c)"
                }
                _ => "",
            };
            println!(
                "| {} | {} | {} | {} | {:.2} | {}{mark} | {} | {} | {} | {} |",
                r.op.label(),
                r.op.shape(),
                r.op.count(),
                pass.name(),
                flops / 1e9,
                ms(k),
                gflops(flops, k),
                ms(t),
                gflops(flops, t),
                ratio(k, t),
            );
        }
    }
    if candle_ops {
        println!();
        println!(
            "(c): the layer's backward computes the input gradient even for a constant input, so \
             its two gradients cannot be timed apart through it; they are timed as the candle ops \
             candle's convolution backward runs (conv_transpose2d, and conv2d on transposed \
             tensors)."
        );
    }
}

/// One row per other op and pass.
pub fn print_others(rows: &[OpTimes<'_>]) {
    println!("| layer | op | shape | x | pass | kandle ms | PyTorch ms | kandle / PyTorch time |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows.iter().filter(|r| !r.is_conv()) {
        let name = OpFamily::of(&r.op.kind).name();
        for pass in [Pass::Fwd, Pass::Bwd] {
            let k = r.kandle.get(pass);
            let t = r.torch.and_then(|t| t.get(pass));
            println!(
                "| {} | {name} | {} | {} | {} | {} | {} | {} |",
                r.op.label(),
                r.op.shape(),
                r.op.count(),
                pass.name(),
                ms(k),
                ms(t),
                ratio(k, t),
            );
        }
    }
}

/// Per-step sums over every convolution of the network (each shape times its occurrences),
/// per pass, as GFLOP/s and the fraction of `peak`. The first convolution's input gradient is
/// left out (training never needs it) where the backward is split; where kandle's is not (see
/// [`convs_split`]), the totals sum whole backwards.
pub fn print_conv_totals(rows: &[OpTimes<'_>], batch: usize, peak: Option<f64>) {
    println!(
        "| pass | GFLOP per step | kandle ms | kandle GFLOP/s | kandle % of peak | PyTorch ms | \
         PyTorch GFLOP/s | PyTorch % of peak | kandle / PyTorch time |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let percent = |flops: f64, s: Option<f64>| match (peak, s) {
        (Some(p), Some(s)) if s > 0.0 => format!("{:.1}", 100.0 * flops / s / 1e9 / p),
        _ => "-".into(),
    };
    let mut all = (0.0, Some(0.0), Some(0.0));
    let passes: &[Pass] = if convs_split(rows) {
        &SPLIT_PASSES
    } else {
        &WHOLE_PASSES
    };
    for &pass in passes {
        let (mut flops, mut k, mut t) = (0.0, Some(0.0), Some(0.0));
        for r in rows.iter().filter(|r| r.is_conv()) {
            if pass == Pass::BwdInput && r.op.on_network_input {
                continue;
            }
            let n = r.op.count() as f64;
            flops += n * pass_flops(pass, r.op.conv_macs(batch));
            k = k.zip(r.kandle.get(pass)).map(|(a, b)| a + n * b);
            t = t
                .zip(r.torch.and_then(|p| p.get(pass)))
                .map(|(a, b)| a + n * b);
        }
        print_total_row(pass.name(), flops, k, t, &percent);
        all = (
            all.0 + flops,
            all.1.zip(k).map(|(a, b)| a + b),
            all.2.zip(t).map(|(a, b)| a + b),
        );
    }
    print_total_row("all", all.0, all.1, all.2, &percent);
}

fn print_total_row(
    name: &str,
    flops: f64,
    k: Option<f64>,
    t: Option<f64>,
    percent: &dyn Fn(f64, Option<f64>) -> String,
) {
    println!(
        "| {name} | {:.1} | {} | {} | {} | {} | {} | {} | {} |",
        flops / 1e9,
        ms(k),
        gflops(flops, k),
        percent(flops, k),
        ms(t),
        gflops(flops, t),
        percent(flops, t),
        ratio(k, t),
    );
}

/// Per training step, by op family (those the network has): each shape's forward and backward times its occurrences
/// (without the first convolution's input gradient where the op skips it), kandle and PyTorch,
/// then all of them against the measured steps (`None` when the model was not timed).
pub fn print_families(rows: &[OpTimes<'_>], steps: Option<(f64, Option<f64>)>) {
    println!(
        "| per training step | kandle fwd ms | kandle bwd ms | PyTorch fwd ms | PyTorch bwd ms | \
         kandle / PyTorch time |"
    );
    println!("|---|---|---|---|---|---|");
    let mut total = (0.0, Some(0.0));
    for family in OpFamily::ALL {
        let members: Vec<&OpTimes<'_>> = rows
            .iter()
            .filter(|r| OpFamily::of(&r.op.kind) == family)
            .collect();
        if members.is_empty() {
            // Not in this network.
            continue;
        }
        let (mut k, mut t) = ([0.0; 2], Some([0.0; 2]));
        for r in members {
            let n = r.op.count() as f64;
            let needed = !r.op.on_network_input;
            let split = |p: &Passes| [p.fwd, p.in_training(needed) - p.fwd];
            let ks = split(&r.kandle);
            k = [k[0] + n * ks[0], k[1] + n * ks[1]];
            t = t
                .zip(r.torch.as_ref().map(split))
                .map(|(a, b)| [a[0] + n * b[0], a[1] + n * b[1]]);
        }
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            family.name(),
            ms(Some(k[0])),
            ms(Some(k[1])),
            ms(t.map(|t| t[0])),
            ms(t.map(|t| t[1])),
            ratio(Some(k[0] + k[1]), t.map(|t| t[0] + t[1])),
        );
        total = (
            total.0 + k[0] + k[1],
            total.1.zip(t).map(|(a, t)| a + t[0] + t[1]),
        );
    }
    let share = |ops: f64, step: Option<f64>| match step {
        Some(step) => format!("{} ({:.0}% of the step)", ms(Some(ops)), 100.0 * ops / step),
        None => ms(Some(ops)),
    };
    println!(
        "| all of the above, fwd + bwd | {} | | {} | | {} |",
        share(total.0, steps.map(|s| s.0)),
        total
            .1
            .map_or("-".into(), |t| share(t, steps.and_then(|s| s.1))),
        ratio(Some(total.0), total.1),
    );
    if let Some((k, t)) = steps {
        println!(
            "| measured training step | {} | | {} | | {} |",
            ms(Some(k)),
            ms(t),
            ratio(Some(k), t)
        );
    }
}

/// The families of timed ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpFamily {
    Conv,
    BatchNorm,
    MaxPool,
    AvgPool,
    Concat,
}

impl OpFamily {
    const ALL: [OpFamily; 5] = [
        OpFamily::Conv,
        OpFamily::BatchNorm,
        OpFamily::MaxPool,
        OpFamily::AvgPool,
        OpFamily::Concat,
    ];

    fn of(kind: &OpKind) -> Self {
        match kind {
            OpKind::Conv { .. } => OpFamily::Conv,
            OpKind::BatchNorm => OpFamily::BatchNorm,
            OpKind::MaxPool { .. } => OpFamily::MaxPool,
            OpKind::AvgPool { .. } | OpKind::GlobalAvgPool => OpFamily::AvgPool,
            OpKind::Concat { .. } => OpFamily::Concat,
        }
    }

    fn name(self) -> &'static str {
        match self {
            OpFamily::Conv => "convolutions",
            OpFamily::BatchNorm => "batch norm",
            OpFamily::MaxPool => "max pool",
            OpFamily::AvgPool => "avg pool",
            OpFamily::Concat => "concatenation",
        }
    }
}
