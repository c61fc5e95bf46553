//! The PyTorch reference: `bench/pytorch_minigooglenet.py` run as a subprocess in the same run,
//! with the same batch, thread count and iterations, and the ops to time passed on its stdin.
//! It prints one JSON object, read here.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The script beside the workspace.
pub fn default_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/pytorch_minigooglenet.py")
}

/// Why PyTorch cannot be used from `python`, if it cannot.
pub fn unavailable(python: &str) -> Option<String> {
    let out = Command::new(python)
        .args(["-c", "import torch"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    match out {
        Ok(out) if out.status.success() => None,
        Ok(out) => {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or("").to_string();
            Some(format!("`{python} -c \"import torch\"` failed: {last}"))
        }
        Err(e) => Some(format!("cannot run `{python}`: {e}")),
    }
}

/// What to ask the script for.
pub struct Request<'a> {
    /// The interpreter.
    pub python: &'a str,
    /// The script.
    pub script: &'a Path,
    /// Images per batch.
    pub batch: usize,
    /// Threads (`torch.set_num_threads`).
    pub threads: usize,
    /// Warm-up runs.
    pub warmup: usize,
    /// Timed runs.
    pub iters: usize,
    /// Time the model's training step and inference.
    pub model: bool,
    /// Which model (the script's `--model`).
    pub which: &'a str,
    /// The images' height and width (the script's `--image-size`).
    pub image_size: usize,
    /// The configurations of the model to time (the script's `--configs`), or all of them.
    pub configs: Option<&'a str>,
    /// The ops to time, as the script reads them (empty for none).
    pub ops: Vec<Value>,
    /// Where the script runs: `cpu`, or `cuda:N`.
    pub device: &'a str,
    /// Images of an epoch to time in the fastest configuration (0: none).
    pub epoch_images: usize,
    /// Also time the training step with the base frozen (the script's `--frozen-base`).
    pub frozen_base: bool,
}

/// Runs the script and parses its JSON.
pub fn run(req: &Request<'_>) -> Result<Value> {
    let mut cmd = Command::new(req.python);
    cmd.arg(req.script)
        .args(["--batch", &req.batch.to_string()])
        .args(["--threads", &req.threads.to_string()])
        .args(["--warmup", &req.warmup.to_string()])
        .args(["--iters", &req.iters.to_string()])
        .args(["--device", req.device])
        .args(["--model", req.which])
        .args(["--image-size", &req.image_size.to_string()]);
    if req.epoch_images > 0 {
        cmd.args(["--epoch-images", &req.epoch_images.to_string()]);
    }
    if !req.model {
        cmd.arg("--no-model");
    }
    if req.frozen_base {
        cmd.arg("--frozen-base");
    }
    if let Some(configs) = req.configs {
        cmd.args(["--configs", configs]);
    }
    if !req.ops.is_empty() {
        cmd.args(["--ops", "-"]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot run {} {}", req.python, req.script.display()))?;
    if let Some(mut stdin) = child.stdin.take() {
        if !req.ops.is_empty() {
            stdin.write_all(serde_json::to_string(&req.ops)?.as_bytes())?;
        }
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{} exited with {}",
            req.script.display(),
            out.status
                .code()
                .map_or("a signal".into(), |c| c.to_string())
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{'));
    serde_json::from_str(line.unwrap_or(""))
        .with_context(|| format!("{} printed no JSON result: {text:?}", req.script.display()))
}

/// A number in the script's output, e.g. `f64_at(&op, &["fwd"])`.
pub fn f64_at(v: &Value, path: &[&str]) -> Option<f64> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_f64()
}

/// One configuration of PyTorch's model the script timed (`eager`, `channels_last`, `compile`,
/// `channels_last+compile`).
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The configuration's name.
    pub name: String,
    /// Seconds per training step.
    pub train_step_s: Option<f64>,
    /// Seconds per inference batch.
    pub inference_s: Option<f64>,
    /// Seconds per training step with the base frozen (asked for with `--frozen-base`).
    pub frozen_base_s: Option<f64>,
    /// Why it could not run here.
    pub error: Option<String>,
}

/// The configurations in the script's output, in its order.
pub fn model_configs(v: &Value) -> Vec<ModelConfig> {
    let configs = v
        .get("model")
        .and_then(|m| m.get("configs"))
        .and_then(Value::as_array);
    configs
        .into_iter()
        .flatten()
        .map(|c| ModelConfig {
            name: c.get("name").and_then(Value::as_str).unwrap_or("?").into(),
            train_step_s: c.get("train_step_s").and_then(Value::as_f64),
            inference_s: c.get("inference_s").and_then(Value::as_f64),
            frozen_base_s: c.get("train_step_frozen_base_s").and_then(Value::as_f64),
            error: c.get("error").and_then(Value::as_str).map(String::from),
        })
        .collect()
}

/// The fastest configuration by `seconds` (training or inference): its name and time.
pub fn best(
    configs: &[ModelConfig],
    seconds: impl Fn(&ModelConfig) -> Option<f64>,
) -> Option<(&str, f64)> {
    configs
        .iter()
        .filter_map(|c| Some((c.name.as_str(), seconds(c)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
}
