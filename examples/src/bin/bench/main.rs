//! kandle against PyTorch on this CPU (or a CUDA GPU), measured side by side in one run: the
//! training step (forward, loss, backward, SGD update, as `fit` runs it) and inference of
//! MiniGoogLeNet or a ResNet (`--model`; `--image-size 224` for ImageNet's networks, the
//! transfer-learning workload) as images/s, then every distinct op shape of that
//! network (convolution forward, backward-input and backward-weight, batch norm, pooling,
//! concatenation; `inventory`), and the convolutions' achieved GFLOP/s against the machine's
//! fp32 peak. The PyTorch reference is
//! `bench/pytorch_minigooglenet.py`, run as a subprocess with the same batch, threads and
//! iterations. `--threads-study` adds two CPU replicas against one device, with and without a
//! per-replica thread budget.
//!
//! `--device cuda:0` (a build with the `cuda` feature) times the training step, inference and
//! the per-op tables on that GPU instead, PyTorch's too (kandle's ops through its CUDA kernels,
//! and its convolutions through cuDNN in a build with the `cudnn` feature, candle's otherwise);
//! `--epoch-images 50000` adds PyTorch's epoch of training steps. The backward-pass comparison
//! and the threads study are the CPU's only.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin bench
//! cargo run --release -p kandle-examples --bin bench -- --no-ops --threads-study --json bench.json
//! cargo run --release -p kandle-examples --bin bench -- --model resnet50 --image-size 224 --batch 16 --frozen-base
//! cargo run --release -p kandle-examples --features cuda --bin bench -- --device cuda:0 --batch 256
//! cargo run --release -p kandle-examples --features cudnn --bin bench -- --device cuda:0 --ops-only
//! ```
//!
//! Whole steps report the median of the timed runs, single ops the fastest (see `timing`); they
//! are measurements, never pass/fail tests.

mod inventory;
mod kandle_ops;
mod machine;
mod model;
mod passes;
mod pytorch;
mod report;
mod threads_study;
mod timing;
mod workload;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Parser;
use kandle::ComputePath;
use kandle::OneDeviceStrategy;
use serde_json::{json, Value};

use crate::passes::Passes;
use crate::report::{ms, ratio, OpTimes};
use crate::timing::Timer;
use crate::workload::{BenchModel, Workload};

#[derive(Parser, Debug)]
#[command(
    about = "kandle vs PyTorch: MiniGoogLeNet or a ResNet and its ops on the CPU or a GPU, side by side"
)]
struct Args {
    /// The network whose training step, inference and distinct op shapes (the per-op tables)
    /// are timed.
    #[arg(long, value_enum, default_value = "mini-googlenet")]
    model: BenchModel,
    /// Height and width of the images (default 32, CIFAR-10's; 224 for resnet50). At a size
    /// other than 32 a ResNet is torchvision's ImageNet network (7x7 stem, max pool, 1,000
    /// classes).
    #[arg(long, value_parser = kandle_examples::at_least_one())]
    image_size: Option<usize>,
    /// Where both sides run: cpu, or cuda:N (a build with the cuda feature; the model's
    /// step and inference, and the per-op tables).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// kandle's dtype policy: float32, mixed_float16 or mixed_bfloat16 (half precision on the
    /// device-generic path, a GPU's; the CPU's kernels stay float32). Compare with PyTorch's
    /// autocast configurations (--pytorch-configs channels_last+amp, channels_last+bf16).
    #[arg(long, default_value = "float32")]
    dtype_policy: kandle::DTypePolicy,
    /// Also time PyTorch's epoch of this many images of training steps (0: none).
    #[arg(long, default_value_t = 0)]
    epoch_images: usize,
    /// Images per batch.
    #[arg(long, default_value_t = 64, value_parser = kandle_examples::at_least_one())]
    batch: usize,
    /// Timed runs per measurement (whole steps report the median, single ops the fastest).
    #[arg(long, default_value_t = 10, value_parser = kandle_examples::at_least_one())]
    iters: usize,
    /// Untimed runs before each measurement.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Threads for kandle (rayon and candle's matmul) and PyTorch; default: candle's count (the
    /// physical cores, or RAYON_NUM_THREADS).
    #[arg(long, value_parser = kandle_examples::at_least_one())]
    threads: Option<usize>,
    /// Skip the PyTorch reference.
    #[arg(long)]
    no_pytorch: bool,
    /// Only the per-op tables.
    #[arg(long, conflicts_with_all = ["no_ops", "threads_study_only"])]
    ops_only: bool,
    /// Skip the per-op tables.
    #[arg(long)]
    no_ops: bool,
    /// Add the study of two CPU replicas with and without a per-replica thread budget.
    #[arg(long)]
    threads_study: bool,
    /// Only the threads study.
    #[arg(long)]
    threads_study_only: bool,
    /// The machine's fp32 peak in GFLOP/s, instead of the estimate from its CPU features (with
    /// --device cuda:N, the GPU's: its per-op tables give a fraction of the peak only with it).
    #[arg(long)]
    peak_gflops: Option<f64>,
    /// Also time the training step with every layer frozen but the classifier (transfer
    /// learning's first phase: a frozen base under a new head) against the whole network's.
    #[arg(long)]
    frozen_base: bool,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The Python interpreter with torch.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The PyTorch reference script.
    #[arg(long)]
    pytorch_script: Option<PathBuf>,
    /// PyTorch configurations of the model to time, comma-separated (default all: eager,
    /// channels_last, compile, channels_last+compile); kandle is compared with the fastest.
    #[arg(long)]
    pytorch_configs: Option<String>,
}

/// Which sections run.
struct Sections {
    model: bool,
    ops: bool,
    threads_study: bool,
}

impl Args {
    fn sections(&self) -> Sections {
        if self.device != "cpu" {
            return Sections {
                model: !self.ops_only,
                ops: !self.no_ops,
                threads_study: false,
            };
        }
        if self.threads_study_only {
            return Sections {
                model: false,
                ops: false,
                threads_study: true,
            };
        }
        Sections {
            model: !self.ops_only,
            ops: !self.no_ops,
            threads_study: self.threads_study && !self.ops_only,
        }
    }
}

/// The device `--device` names: `cpu`, `cuda` (the first GPU) or `cuda:N`.
fn parse_device(name: &str) -> Result<Device> {
    let index = match name.split_once(':') {
        None if name == "cpu" => return Ok(Device::Cpu),
        None if name == "cuda" => 0,
        Some(("cuda", i)) => i
            .parse()
            .with_context(|| format!("--device {name}: `{i}` is not a GPU index"))?,
        _ => bail!("--device {name}: expected `cpu`, `cuda` or `cuda:N`"),
    };
    Ok(kandle::devices::cuda(index)?)
}

fn load_line() -> String {
    machine::load_average().map_or("unknown".into(), |[a, b, c]| {
        format!("{a:.2} {b:.2} {c:.2}")
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    if let Some(n) = args.threads {
        // Read once, when rayon's global pool and candle's thread count are first used.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
    }
    let threads = candle_core::utils::get_num_threads();
    let workload = Workload::new(args.model, args.image_size)?;
    let sections = args.sections();
    let device = parse_device(&args.device)?;
    let on_cpu = device.is_cpu();
    if !on_cpu && (args.threads_study || args.threads_study_only) {
        bail!("the threads study times the CPU: leave out --device");
    }
    let timer = Timer {
        warmup: args.warmup,
        iters: args.iters,
    };
    // The estimate from the CPU's features is no GPU's: there only --peak-gflops gives one.
    let peak = machine::peak(threads, args.peak_gflops);
    let ops_peak = if on_cpu {
        peak.gflops
    } else {
        args.peak_gflops
    };
    let kandle_path = kandle_ops::KandlePath::on(&device);
    let load_at_start = load_line();
    println!(
        "# kandle vs PyTorch: {} on {}",
        workload.title(),
        if on_cpu {
            "the CPU".to_string()
        } else {
            kandle::devices::label(&device)
        }
    );
    println!();
    println!(
        "- machine: {}, {} logical cores; load average (1/5/15 min) at start: {load_at_start}",
        machine::cpu_name(),
        machine::cores()
    );
    println!(
        "- threads: {threads} (kandle: rayon and candle's matmul; PyTorch: torch.set_num_threads)"
    );
    println!(
        "- batch {}, kandle's dtype policy {}, random 3x{size}x{size} inputs; {} warm-up runs, \
         then {} timed runs: the median for whole steps, the fastest for single ops",
        args.batch,
        args.dtype_policy,
        args.warmup,
        args.iters,
        size = workload.image_size,
    );
    println!("- fp32 peak: {}", peak.how);
    println!();

    let ops = if sections.ops {
        inventory::ops(&workload)?
    } else {
        Vec::new()
    };
    let mut kandle_model = None;
    let mut backward_paths = None;
    let mut frozen_step = None;
    if sections.model {
        let strategy = OneDeviceStrategy::new(device.clone());
        eprintln!(
            "kandle: {} training step, batch {}",
            workload.title(),
            args.batch
        );
        let policy = (workload, args.dtype_policy);
        let train = model::train_step_time(policy, &strategy, &device, args.batch, timer)?;
        eprintln!("kandle: inference, batch {}", args.batch);
        let infer = model::inference_time(policy, &strategy, &device, args.batch, timer)?;
        kandle_model = Some((train, infer));
        if args.frozen_base {
            eprintln!("kandle: training step with the base frozen");
            let frozen =
                model::frozen_base_step_time(policy, &strategy, &device, args.batch, timer)?;
            frozen_step = Some((frozen, train));
        }
        if on_cpu {
            eprintln!("kandle: one replica's step, recorded backward pass and candle's autograd");
            let replica = |path| model::replica_step_time(workload, path, args.batch, timer);
            let recorded = replica(ComputePath::Auto)?;
            let autograd = replica(ComputePath::Autograd)?;
            backward_paths = Some((recorded, autograd));
        }
    }
    let mut kandle_ops = Vec::with_capacity(ops.len());
    let op_timer = kandle_ops::OpTimer {
        device: &device,
        timer,
    };
    for op in &ops {
        eprintln!("kandle: {} {}", op.label(), op.shape());
        kandle_ops.push(kandle_ops::time_op(op, args.batch, op_timer)?);
    }
    let torch = if args.no_pytorch || !(sections.model || sections.ops) {
        None
    } else {
        reference(&args, &workload, threads, &sections, &ops)?
    };

    let mut out = json!({
        "machine": {"cpu": machine::cpu_name(), "cores": machine::cores(),
                    "load_average_at_start": load_at_start,
                    "peak_gflops": peak.gflops, "peak": peak.how},
        "device": args.device,
        "dtype_policy": args.dtype_policy.to_string(),
        "threads": threads, "batch": args.batch, "warmup": args.warmup, "iters": args.iters,
    });
    if let Some((train, infer)) = kandle_model {
        let configs = torch
            .as_ref()
            .map(pytorch::model_configs)
            .unwrap_or_default();
        out["vs_pytorch_best"] = print_model(&workload, args.batch, train, infer, &configs);
        out["kandle"] = json!({"train_step_s": train, "inference_s": infer});
    }
    if let Some((frozen, whole)) = frozen_step {
        let configs = torch
            .as_ref()
            .map(pytorch::model_configs)
            .unwrap_or_default();
        out["vs_pytorch_best"]["frozen_base"] =
            print_frozen_base(&workload, args.batch, (frozen, whole), &configs);
        out["kandle"]["train_step_frozen_base_s"] = json!(frozen);
    }
    if let Some((recorded, autograd)) = backward_paths {
        print_backward_paths(args.batch, recorded, autograd);
        out["kandle"]["replica_step_recorded_s"] = json!(recorded);
        out["kandle"]["replica_step_candle_autograd_s"] = json!(autograd);
    }
    if let Some(t) = &torch {
        print_pytorch_device(t);
        out["pytorch"] = t.clone();
    }
    if sections.ops {
        let rows = op_rows(&ops, &kandle_ops, torch.as_ref());
        if !on_cpu {
            print_ops_device(&device, kandle_path, torch.as_ref());
            out["ops_kandle_path"] = json!(kandle_path.name());
        }
        print_ops(
            &rows,
            &workload,
            args.batch,
            ops_peak,
            kandle_model.map(|m| m.0),
            torch.as_ref(),
        );
        out["ops"] = Value::Array(
            rows.iter()
                .map(|r| {
                    json!({"layers": r.op.layers, "shape": r.op.shape(),
                           "conv_flops_per_pass": 2 * r.op.conv_macs(args.batch),
                           "kandle": r.kandle.to_json(),
                           "pytorch": r.torch.map(|t| t.to_json())})
                })
                .collect(),
        );
    }
    if sections.threads_study {
        println!("## Two replicas on one CPU (MiniGoogLeNet training step)");
        println!();
        out["threads_study"] = threads_study::run(args.batch, threads, timer)?;
        println!();
    }
    let load_at_end = load_line();
    println!("Load average (1/5/15 min) at the end: {load_at_end}");
    out["machine"]["load_average_at_end"] = json!(load_at_end);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("Results written to {}", path.display());
    }
    Ok(())
}

/// The PyTorch reference's results, or `None` (with the reason printed) when torch is missing.
fn reference(
    args: &Args,
    workload: &Workload,
    threads: usize,
    sections: &Sections,
    ops: &[inventory::OpShape],
) -> Result<Option<Value>> {
    if let Some(why) = pytorch::unavailable(&args.python) {
        println!("PyTorch reference skipped: {why}.");
        println!(
            "Install the CPU build with `pip install torch --index-url \
             https://download.pytorch.org/whl/cpu`, or pass --python, or --no-pytorch."
        );
        println!();
        return Ok(None);
    }
    let script = args
        .pytorch_script
        .clone()
        .unwrap_or_else(pytorch::default_script);
    let request = pytorch::Request {
        python: &args.python,
        script: &script,
        batch: args.batch,
        threads,
        warmup: args.warmup,
        iters: args.iters,
        model: sections.model,
        which: workload.pytorch_name(),
        image_size: workload.image_size,
        configs: args.pytorch_configs.as_deref(),
        ops: ops
            .iter()
            .enumerate()
            .map(|(i, op)| op.to_json(&format!("op_{i}")))
            .collect(),
        device: &args.device,
        epoch_images: args.epoch_images,
        frozen_base: args.frozen_base && sections.model,
    };
    Ok(Some(pytorch::run(&request)?))
}

/// The GPU PyTorch ran on, and its epoch when it timed one.
fn print_pytorch_device(torch: &Value) {
    if let Some(name) = torch.get("device_name").and_then(Value::as_str) {
        let cudnn = torch.get("cudnn").map_or("-".into(), Value::to_string);
        println!("PyTorch ran on {name} (cuDNN {cudnn}, float32, no TF32).");
        println!();
    }
    if let Some(epoch) = torch.get("epoch") {
        let (images, seconds) = (
            pytorch::f64_at(epoch, &["images"]).unwrap_or(f64::NAN),
            pytorch::f64_at(epoch, &["seconds"]).unwrap_or(f64::NAN),
        );
        println!(
            "PyTorch's epoch of {images} images of training steps ({}, data already on the \
             device): {seconds:.1} s, {:.0} images/s.",
            epoch.get("config").and_then(Value::as_str).unwrap_or("?"),
            images / seconds
        );
        println!();
    }
}

/// Transfer learning's first phase (the base frozen, the head training) against the whole
/// network's step, kandle's and each PyTorch configuration's; returns kandle against PyTorch's
/// fastest frozen step as JSON.
fn print_frozen_base(
    which: &Workload,
    batch: usize,
    (frozen, whole): (f64, f64),
    configs: &[pytorch::ModelConfig],
) -> Value {
    println!(
        "## Transfer learning: {} training step, batch {batch}",
        which.title()
    );
    println!();
    println!("| | whole network trains, ms | base frozen, head trains, ms | frozen images/s | kandle / it (frozen) |");
    println!("|---|---|---|---|---|");
    let images = |s: f64| format!("{:.1}", batch as f64 / s);
    println!(
        "| kandle | {} | {} | {} | |",
        ms(Some(whole)),
        ms(Some(frozen)),
        images(frozen)
    );
    for c in configs.iter().filter(|c| c.error.is_none()) {
        println!(
            "| PyTorch {} | {} | {} | {} | {} |",
            c.name,
            ms(c.train_step_s),
            ms(c.frozen_base_s),
            c.frozen_base_s.map_or("-".into(), images),
            ratio(c.frozen_base_s, Some(frozen)),
        );
    }
    println!();
    println!(
        "kandle's frozen step takes {:.2}x its whole step's time.",
        frozen / whole
    );
    let best = pytorch::best(configs, |c| c.frozen_base_s);
    if let Some((name, s)) = best {
        println!(
            "Against PyTorch's best frozen step: **{:.2}x** its images/s ({name}).",
            s / frozen
        );
    }
    println!();
    best.map_or(Value::Null, |(name, s)| {
        json!({"pytorch_config": name, "pytorch_s": s, "kandle_s": frozen, "ratio": s / frozen})
    })
}

/// kandle's two ways to compute gradients, side by side.
fn print_backward_paths(batch: usize, recorded: f64, autograd: f64) {
    println!("## kandle's backward pass: recorded layers vs candle's autograd, batch {batch}");
    println!();
    println!("| one replica's step (gradients + SGD) | ms | images/s |");
    println!("|---|---|---|");
    for (label, s) in [
        ("recorded backward pass (the CPU default)", recorded),
        ("candle's autograd (`KANDLE_COMPUTE=autograd`)", autograd),
    ] {
        println!("| {label} | {:.2} | {:.1} |", s * 1e3, batch as f64 / s);
    }
    println!();
    println!(
        "The recorded pass takes {:.2}x the time of candle's autograd.",
        recorded / autograd
    );
    println!();
}

/// kandle's step and inference against every PyTorch configuration, then against the fastest
/// one; returns the latter as JSON.
fn print_model(
    which: &Workload,
    batch: usize,
    train: f64,
    infer: f64,
    configs: &[pytorch::ModelConfig],
) -> Value {
    let images = |s: f64| format!("{:.1} ({} ms)", batch as f64 / s, ms(Some(s)));
    println!("## {} ({:?}), batch {batch}", which.title(), which.model);
    println!();
    println!(
        "| | training images/s (ms per step) | kandle / it | inference images/s (ms) | kandle / it |"
    );
    println!("|---|---|---|---|---|");
    println!("| kandle | {} | | {} | |", images(train), images(infer));
    for c in configs {
        match &c.error {
            Some(e) => println!("| PyTorch {} | cannot run here: {e} | | | |", c.name),
            None => println!(
                "| PyTorch {} | {} | {} | {} | {} |",
                c.name,
                c.train_step_s.map_or("-".into(), images),
                ratio(c.train_step_s, Some(train)),
                c.inference_s.map_or("-".into(), images),
                ratio(c.inference_s, Some(infer)),
            ),
        }
    }
    println!();
    let best_train = pytorch::best(configs, |c| c.train_step_s);
    let best_infer = pytorch::best(configs, |c| c.inference_s);
    let versus = |best: Option<(&str, f64)>, kandle: f64| {
        best.map_or(Value::Null, |(name, s)| {
            json!({"pytorch_config": name, "pytorch_s": s, "kandle_s": kandle, "ratio": s / kandle})
        })
    };
    if let (Some((tn, ts)), Some((inn, is))) = (best_train, best_infer) {
        println!(
            "Against PyTorch's best configuration: training **{:.2}x** its images/s ({tn}), \
             inference **{:.2}x** ({inn}).",
            ts / train,
            is / infer
        );
        println!();
    }
    json!({"training": versus(best_train, train), "inference": versus(best_infer, infer)})
}

/// Which device, and which of kandle's code, the per-op tables measured (a GPU's only: the
/// CPU's tables are kandle's CPU kernels).
fn print_ops_device(device: &Device, path: kandle_ops::KandlePath, torch: Option<&Value>) {
    println!(
        "## The per-op tables below: {}",
        kandle::devices::label(device)
    );
    println!();
    println!("- kandle: {}, in float32.", path.describe());
    if let Some(torch) = torch {
        let name = torch
            .get("device_name")
            .and_then(Value::as_str)
            .unwrap_or("?");
        println!("- PyTorch: {name}, eager, cuDNN benchmark mode, float32 without TF32.");
    }
    println!(
        "- Every timed run ends with the device synchronised; cuDNN's algorithm search falls in \
         the warm-up runs."
    );
    if path == kandle_ops::KandlePath::CudaKernelsCudnn {
        println!(
            "- kandle's cuDNN convolution computes both gradients in one backward: its rows give \
             the whole backward (bwd), PyTorch's its two gradients summed."
        );
    }
    println!();
}

fn op_rows<'a>(
    ops: &'a [inventory::OpShape],
    kandle: &[Passes],
    torch: Option<&Value>,
) -> Vec<OpTimes<'a>> {
    let torch_ops = torch
        .and_then(|t| t.get("ops"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    ops.iter()
        .zip(kandle)
        .enumerate()
        .map(|(i, (op, &kandle))| OpTimes {
            op,
            kandle,
            torch: torch_ops.get(i).and_then(Passes::from_pytorch),
        })
        .collect()
}

fn print_ops(
    rows: &[OpTimes<'_>],
    which: &Workload,
    batch: usize,
    peak: Option<f64>,
    kandle_step: Option<f64>,
    torch: Option<&Value>,
) {
    let title = which.title();
    println!("## {title}'s convolutions, batch {batch} (one row per distinct shape and pass)");
    println!();
    report::print_convs(rows, batch);
    println!();
    println!("## {title}'s convolutions per training step (each shape times its occurrences)");
    println!();
    report::print_conv_totals(rows, batch, peak);
    println!();
    if report::convs_split(rows) {
        println!(
            "The first convolution's bwd-input is left out of the totals: training never needs \
             the gradient of the images."
        );
    } else {
        println!(
            "bwd is each convolution's whole backward, both gradients (the first convolution's \
             input gradient included), kandle's and PyTorch's alike."
        );
    }
    println!();
    println!("## {title}'s other ops (batch norm, pooling, concatenation), batch {batch}");
    println!();
    report::print_others(rows);
    println!();
    // The ops are timed in PyTorch's default layout, eagerly: its eager step is their whole.
    let torch_step = torch
        .map(pytorch::model_configs)
        .and_then(|c| c.into_iter().find(|c| c.name == "eager"))
        .and_then(|c| c.train_step_s);
    println!("## Where {title}'s training step goes, by op family");
    println!();
    report::print_families(rows, kandle_step.map(|k| (k, torch_step)));
    println!();
    println!(
        "Each op is timed alone and counted as often as it occurs. The rest of a step is what \
         the tables leave out (ReLU, dropout, the residual additions, the dense layer), the \
         loss, the SGD update and autograd's bookkeeping; an op timed alone can also cost more \
         than inside the step (cold caches, its own upstream gradient)."
    );
    println!();
}
