//! PyTorch's side of a training step that kandle's is judged against: the float64 step, the
//! float32 steps of PyTorch's configurations, and the ReLU kinks float32 may take either way.
//!
//! A ReLU input that float64 puts closer to zero than float32's forward error at that ReLU can
//! land on either side in a float32 run; the side decides whether that one input's gradient
//! passes, which moves every gradient below it by far more than rounding does. PyTorch's own
//! configurations do this to each other (the channels-last layout, or PyTorch's convolutions
//! instead of oneDNN's, take one such input the other way on most batches). So a float32 step
//! is compared with the float64 step *with the same sides taken*: `kinks.safetensors` holds, for
//! each such input, how float64's step moves when that input's gradient goes the other way, and
//! [`StepReference::sides`] finds the set of kinks that brings a float32 step closest to
//! float64. What remains is arithmetic, judged against PyTorch float32's arithmetic spread.
//!
//! Two kinks interact when one changes the gradient the other passes or stops (through the
//! layers between them, or through a batch norm's statistics across samples), so a set of
//! several is not the sum of its single differences: its float64 step is read whole from
//! `step_f64_kinks_1+4.safetensors` when the script wrote it (`--kink-sets 1+4`), and
//! [`StepReference::missing_sets`] names those a test still needs.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use kandle::{Error, Result};

/// Every floating-point tensor of a safetensors file, as `f64` values by name.
pub type Values = HashMap<String, Vec<f64>>;

/// Reads a safetensors file's float tensors as [`Values`].
pub fn read_values(path: &Path) -> Result<Values> {
    candle_core::safetensors::load(path, &Device::Cpu)?
        .into_iter()
        .filter(|(_, t)| t.dtype().is_float())
        .map(|(name, t)| Ok((name, values(&t)?)))
        .collect()
}

/// A tensor's values as `f64`, flattened.
pub fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
}

/// The largest absolute value.
pub fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// One ReLU input float32 may land on either side of zero.
pub struct Kink {
    /// Where it is and how near zero, as the script wrote it.
    pub label: String,
    /// How each tensor of float64's step moves when that input's gradient goes the other way.
    delta: Values,
}

/// One float32 step of PyTorch's, and the kinks it took the other way.
pub struct Float32Run {
    /// The configuration: `default`, `channels_last` or `native`.
    pub config: &'static str,
    /// The kinks (indices into [`StepReference::kinks`]) it took the other way.
    pub sides: Vec<usize>,
    values: Values,
}

/// The reference a float32 step is judged by.
pub struct StepReference {
    /// The float64 step.
    pub float64: Values,
    /// The ReLU inputs within float32's forward error of zero (none when the directory has no
    /// `kinks.safetensors`).
    pub kinks: Vec<Kink>,
    /// PyTorch's float32 steps, each with the kinks it took the other way.
    pub float32: Vec<Float32Run>,
    /// Float64's steps with several kinks taken, whole, by sorted set.
    sets: HashMap<Vec<usize>, Values>,
    /// The script's arguments that wrote the directory.
    pub command: String,
}

impl StepReference {
    /// Reads `step_f64`, the `step_f32*` files present and `kinks` from `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let float64 = read_values(&dir.join("step_f64.safetensors"))?;
        let (kinks, command) = read_kinks(&dir.join("kinks.safetensors"))?;
        let mut sets = HashMap::new();
        for entry in std::fs::read_dir(dir).map_err(|e| Error::invalid(format!("{e}")))? {
            let path = entry.map_err(|e| Error::invalid(format!("{e}")))?.path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if let Some(set) = name
                .strip_prefix("step_f64_kinks_")
                .and_then(|n| n.strip_suffix(".safetensors"))
            {
                let set: Vec<usize> = set
                    .split('+')
                    .map(|k| k.parse())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|_| Error::invalid(format!("{}: not a kink set", path.display())))?;
                sets.insert(set, read_values(&path)?);
            }
        }
        let mut reference = Self {
            float64,
            kinks,
            float32: Vec::new(),
            sets,
            command,
        };
        for (config, suffix) in [
            ("default", ""),
            ("channels_last", "_channels_last"),
            ("native", "_native"),
        ] {
            let path = dir.join(format!("step_f32{suffix}.safetensors"));
            if !path.exists() {
                continue;
            }
            let values = read_values(&path)?;
            let sides = reference.sides(&values)?;
            reference.float32.push(Float32Run {
                config,
                sides,
                values,
            });
        }
        Ok(reference)
    }

    /// The largest difference of `got`'s tensor `name` from float64's step with the kinks of
    /// `sides` taken the other way.
    pub fn distance(&self, got: &Values, name: &str, sides: &[usize]) -> Result<f64> {
        let got = lookup(got, name)?;
        if let Some(whole) = self.sets.get(sides).filter(|_| sides.len() > 1) {
            let whole = lookup(whole, name)?;
            return Ok((0..got.len()).fold(0.0f64, |m, i| m.max((got[i] - whole[i]).abs())));
        }
        let exact = lookup(&self.float64, name)?;
        let deltas = sides
            .iter()
            .map(|&k| lookup(&self.kinks[k].delta, name))
            .collect::<Result<Vec<_>>>()?;
        Ok((0..exact.len()).fold(0.0f64, |m, i| {
            let reference = exact[i] + deltas.iter().map(|d| d[i]).sum::<f64>();
            m.max((got[i] - reference).abs())
        }))
    }

    /// PyTorch float32's arithmetic spread of tensor `name`: the largest difference of its
    /// configurations' steps from float64's, each with the kinks it took.
    pub fn spread(&self, name: &str) -> Result<f64> {
        self.float32.iter().try_fold(0.0f64, |m, run| {
            Ok(m.max(self.distance(&run.values, name, &run.sides)?))
        })
    }

    /// The kinks `got` took the other way: from none, each kink is toggled where that halves
    /// the worst difference from float64 (each tensor's measured in float32 roundings of its
    /// largest value), twice over the kinks.
    pub fn sides(&self, got: &Values) -> Result<Vec<usize>> {
        let mut sides = Vec::new();
        let mut best = self.roundings(got, &sides)?;
        for _ in 0..2 {
            let mut changed = false;
            for k in 0..self.kinks.len() {
                let mut trial = sides.clone();
                match trial.iter().position(|&s| s == k) {
                    Some(at) => {
                        trial.remove(at);
                    }
                    None => trial.push(k),
                }
                let score = self.roundings(got, &trial)?;
                if score < 0.5 * best {
                    (sides, best, changed) = (trial, score, true);
                }
            }
            if !changed {
                break;
            }
        }
        sides.sort_unstable();
        Ok(sides)
    }

    /// The worst difference of `got` from float64 with `sides` taken, over the trained
    /// tensors, in float32 roundings (`1e-7` of each tensor's largest value).
    fn roundings(&self, got: &Values, sides: &[usize]) -> Result<f64> {
        self.float64
            .iter()
            .filter(|(name, _)| !is_statistic(name))
            .try_fold(0.0f64, |m, (name, exact)| {
                let unit = 1e-7 * max_abs(exact).max(f64::MIN_POSITIVE);
                Ok(m.max(self.distance(got, name, sides)? / unit))
            })
    }

    /// The sets of several kinks among `taken` whose float64 step the directory lacks: their
    /// distances were the sum of single differences, which may differ from the whole.
    pub fn missing_sets<'a>(&self, taken: impl IntoIterator<Item = &'a Vec<usize>>) -> Vec<String> {
        let mut missing: Vec<String> = taken
            .into_iter()
            .filter(|set| set.len() > 1 && !self.sets.contains_key(*set))
            .map(|set| {
                set.iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join("+")
            })
            .collect();
        missing.sort();
        missing.dedup();
        missing
    }

    /// The labels of `sides`' kinks, one per line, or `none`.
    pub fn describe(&self, sides: &[usize]) -> String {
        if sides.is_empty() {
            return "none".into();
        }
        sides
            .iter()
            .map(|&k| format!("\n    {}", self.kinks[k].label))
            .collect()
    }
}

/// Whether `name` is a running statistic, which the step moves by the forward pass's values
/// (the kinks do not change them), not by gradients.
pub fn is_statistic(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}

fn lookup<'a>(values: &'a Values, name: &str) -> Result<&'a [f64]> {
    values
        .get(name)
        .map(Vec::as_slice)
        .ok_or_else(|| Error::invalid(format!("the reference has no `{name}`")))
}

/// The kinks of `path` (`kink{k}.{name}` tensors, `kink{k}` labels and a `kinks` count in the
/// metadata) and the script's arguments; none if the file is absent (a directory written
/// before the script wrote it).
fn read_kinks(path: &Path) -> Result<(Vec<Kink>, String)> {
    if !path.exists() {
        return Ok((Vec::new(), String::new()));
    }
    let bytes =
        std::fs::read(path).map_err(|e| Error::invalid(format!("{}: {e}", path.display())))?;
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::invalid(format!("{}: {e}", path.display())))?;
    let labels = metadata.metadata().clone().unwrap_or_default();
    let count: usize = labels
        .get("kinks")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| Error::invalid(format!("{}: no `kinks` count", path.display())))?;
    let mut kinks: Vec<Kink> = (0..count)
        .map(|k| Kink {
            label: labels.get(&format!("kink{k}")).cloned().unwrap_or_default(),
            delta: Values::new(),
        })
        .collect();
    for (name, v) in read_values(path)? {
        let (k, tensor) = name
            .strip_prefix("kink")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(k, tensor)| Some((k.parse::<usize>().ok()?, tensor)))
            .ok_or_else(|| Error::invalid(format!("{}: unexpected `{name}`", path.display())))?;
        let kink = kinks.get_mut(k).ok_or_else(|| {
            Error::invalid(format!("{}: `{name}` past the count", path.display()))
        })?;
        kink.delta.insert(tensor.to_string(), v);
    }
    Ok((kinks, labels.get("command").cloned().unwrap_or_default()))
}
