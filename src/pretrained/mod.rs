//! Weights trained elsewhere: PyTorch state dicts, saved as safetensors or with `torch.save`
//! (`.pth`, `.pt`, `.bin`: PyTorch's zip format, read by candle's pickle reader), loaded into a
//! built model by name.
//!
//! kandle's layers keep PyTorch's layouts (a `Conv2D` weight is `(out, in, kh, kw)`, a `Dense`
//! weight `(units, features)`, a BatchNorm has `weight`, `bias`, `running_mean` and
//! `running_var`), so a state dict maps onto a model whose variables have the same names: the
//! torchvision ResNets of `kandle-models` take torchvision's files as they are. Where the names
//! differ ([timm](https://github.com/huggingface/pytorch-image-models)'s, a `module.` prefix
//! left by `DataParallel`, a model nested in another), [`ImportOptions`] renames them by prefix
//! or with a function. It also says whether variables the file lacks (`allow_missing`) or
//! tensors the model lacks (`allow_unexpected`) are acceptable, and skips the integer buffers
//! PyTorch keeps beside the weights (`num_batches_tracked`) unless told not to. Float16,
//! bfloat16 and float64 tensors are converted to `f32`.
//!
//! [`Model::load_weights_from`](crate::Model::load_weights_from) checks every name and shape
//! before it changes anything: a file that does not fit leaves the model as it was, and the
//! error names the file and each problem (a shape mismatch with both shapes). On success it
//! returns a [`LoadReport`] (loaded, missing, unexpected, skipped) that prints as a summary.
//!
//! ```
//! use std::collections::HashMap;
//! use candle_core::{DType, Device, Tensor};
//! use kandle::prelude::*;
//! use kandle::pretrained::ImportOptions;
//!
//! let mut model = Sequential::new()
//!     .input_shape(&[4])
//!     .add(Dense::new(3).named("fc"))
//!     .compile(Sgd::new(0.1), MeanSquaredError, (), &OneDeviceStrategy::cpu())?;
//!
//! // A state dict as PyTorch's `DataParallel` saves it: every name under `module.`, float64
//! // values, and an integer buffer beside them.
//! let cpu = Device::Cpu;
//! let state_dict = HashMap::from([
//!     ("module.fc.weight", Tensor::ones((3, 4), DType::F64, &cpu)?),
//!     ("module.fc.bias", Tensor::zeros(3, DType::F64, &cpu)?),
//!     ("module.steps", Tensor::new(&[7i64], &cpu)?),
//! ]);
//! let path = std::env::temp_dir().join(format!("kandle-doc-{}.safetensors", std::process::id()));
//! candle_core::safetensors::save(&state_dict, &path)?;
//!
//! let options = ImportOptions::new().rename_prefix("module.", "");
//! let report = model.load_weights_from(&path, &options)?;
//! assert_eq!(report.loaded, ["fc.bias", "fc.weight"]);
//! assert_eq!(report.skipped.len(), 1);
//! println!("{report}");
//! assert_eq!(model.get_weights()?["fc.weight"].sum_all()?.to_scalar::<f32>()?, 12.0);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), kandle::Error>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::checkpoint::Stored;
use crate::params::Weights;
use crate::{Error, Result};

mod pth;

/// How many names a message or a report lists before it says how many more there are.
const LISTED: usize = 5;

/// A function that renames a tensor of the file, or drops it (`None`).
type RenameFn = dyn Fn(&str) -> Option<String> + Send + Sync;

/// One renaming step, applied to every name in the order given.
#[derive(Clone)]
enum Rename {
    Prefix { from: String, to: String },
    With(Arc<RenameFn>),
}

impl Rename {
    fn apply(&self, name: String) -> Option<String> {
        match self {
            Rename::Prefix { from, to } => Some(match name.strip_prefix(from.as_str()) {
                Some(rest) => format!("{to}{rest}"),
                None => name,
            }),
            Rename::With(f) => f(&name),
        }
    }
}

/// How a file's names are matched to a model's variables: what may be missing or left over,
/// what is skipped, how names are rewritten.
///
/// The default ([`ImportOptions::new`]) is strict about names (every variable of the model
/// must be in the file and every tensor of the file in the model) and skips tensors that are
/// not floats, such as PyTorch's `num_batches_tracked`. A shape that differs is always an
/// error.
///
/// ```
/// use kandle::pretrained::ImportOptions;
///
/// // A timm checkpoint saved from `DataParallel`, for a model whose classifier is new: the
/// // prefix stripped, timm's `head.fc` named as torchvision's `fc`, and the file's classifier
/// // dropped so the model keeps its own.
/// let options = ImportOptions::new()
///     .rename_prefix("module.", "")
///     .rename(|name| (!name.starts_with("head.fc.")).then(|| name.to_string()))
///     .allow_missing(true);
/// # let _ = options;
/// ```
#[derive(Clone)]
pub struct ImportOptions {
    allow_missing: bool,
    allow_unexpected: bool,
    skip_non_float: bool,
    key: Option<String>,
    renames: Vec<Rename>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            allow_missing: false,
            allow_unexpected: false,
            skip_non_float: true,
            key: None,
            renames: Vec::new(),
        }
    }
}

impl fmt::Debug for ImportOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let renames: Vec<String> = self
            .renames
            .iter()
            .map(|r| match r {
                Rename::Prefix { from, to } => format!("prefix `{from}` -> `{to}`"),
                Rename::With(_) => "function".to_string(),
            })
            .collect();
        f.debug_struct("ImportOptions")
            .field("allow_missing", &self.allow_missing)
            .field("allow_unexpected", &self.allow_unexpected)
            .field("skip_non_float", &self.skip_non_float)
            .field("key", &self.key)
            .field("renames", &renames)
            .finish()
    }
}

impl ImportOptions {
    /// Strict names, non-float tensors skipped, no renaming: what loads torchvision's files
    /// into `kandle-models`' ResNets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allows variables of the model that the file lacks, or not (the default); those keep
    /// their values and are listed in [`LoadReport::missing`]. For a new head on a pretrained
    /// body.
    pub fn allow_missing(mut self, allow: bool) -> Self {
        self.allow_missing = allow;
        self
    }

    /// Allows tensors of the file that the model lacks, or not (the default); those are
    /// ignored and listed in [`LoadReport::unexpected`]. For a body without the file's head.
    pub fn allow_unexpected(mut self, allow: bool) -> Self {
        self.allow_unexpected = allow;
        self
    }

    /// Skips tensors whose dtype is not a float (the default), such as the int64
    /// `num_batches_tracked` PyTorch's BatchNorm keeps, listing them in
    /// [`LoadReport::skipped`]. With `false` they count as any other tensor: unexpected unless
    /// the model has a variable of that name, and then an error, since kandle's variables are
    /// floats.
    pub fn skip_non_float(mut self, skip: bool) -> Self {
        self.skip_non_float = skip;
        self
    }

    /// The key of the state dict in a `.pth` file that holds more than the state dict (such
    /// as `torch.save({"epoch": 3, "state_dict": ...})`). Without it, the top level is read,
    /// and if it holds no tensor, the first of `state_dict`, `model_state_dict`, `model`,
    /// `module` and `net` that does. Safetensors files have no keys; it is ignored for them.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Renames every tensor whose name starts with `from` to start with `to` instead
    /// (`rename_prefix("module.", "")` strips `DataParallel`'s prefix). Renames apply in the
    /// order they were given, each to the result of the one before.
    pub fn rename_prefix(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.renames.push(Rename::Prefix {
            from: from.into(),
            to: to.into(),
        });
        self
    }

    /// Renames tensors with a function: it gets a name (after the renames given before it) and
    /// returns the model's name for it, or `None` to drop the tensor (listed in
    /// [`LoadReport::skipped`]).
    pub fn rename(mut self, f: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> Self {
        self.renames.push(Rename::With(Arc::new(f)));
        self
    }

    /// The model's name for the file's tensor `name`, or `None` if a rename drops it.
    fn renamed(&self, name: &str) -> Option<String> {
        self.renames
            .iter()
            .try_fold(name.to_string(), |name, r| r.apply(name))
    }
}

/// Why a tensor of the file was not considered.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// Its dtype (as the file names it, e.g. `I64`) is not a float.
    NotFloat(String),
    /// A rename function dropped it.
    Dropped,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::NotFloat(dtype) => write!(f, "{dtype}, not a float"),
            SkipReason::Dropped => write!(f, "dropped by a rename"),
        }
    }
}

/// A tensor of the file that was not considered, under its name in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Its name in the file, before any renaming.
    pub name: String,
    /// Why.
    pub reason: SkipReason,
}

/// What a load did, by name; it prints as a short summary (each list cut after a few names).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadReport {
    /// The model's variables set from the file, sorted.
    pub loaded: Vec<String>,
    /// The model's variables the file lacks, which kept their values, sorted.
    pub missing: Vec<String>,
    /// The file's tensors (after renaming) the model has no variable for, sorted.
    pub unexpected: Vec<String>,
    /// The file's tensors not considered, with the reason, sorted by name.
    pub skipped: Vec<Skipped>,
}

impl LoadReport {
    /// Whether every variable was loaded and every tensor of the file used (skipped tensors
    /// aside).
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty()
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.loaded.len() + self.missing.len();
        writeln!(f, "loaded: {} of {total} variables", self.loaded.len())?;
        writeln!(f, "missing: {}", listed(&self.missing))?;
        writeln!(f, "unexpected: {}", listed(&self.unexpected))?;
        let skipped: Vec<String> = self
            .skipped
            .iter()
            .map(|s| format!("{} ({})", s.name, s.reason))
            .collect();
        write!(f, "skipped: {}", listed(&skipped))
    }
}

/// `none`, or the count and the first few items, with how many more there are.
fn listed(items: &[String]) -> String {
    if items.is_empty() {
        return "none".to_string();
    }
    let shown: Vec<&str> = items.iter().take(LISTED).map(String::as_str).collect();
    let more = items.len().saturating_sub(LISTED);
    let tail = if more > 0 {
        format!(", and {more} more")
    } else {
        String::new()
    };
    format!("{} ({}{tail})", items.len(), shown.join(", "))
}

/// A state dict as read and renamed: its float tensors as `f32` on the CPU, its other tensors
/// (when not skipped) and what was skipped.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct StateDict {
    /// The float tensors by their (renamed) name, converted to `f32`, on the CPU.
    pub weights: Weights,
    /// The tensors that are not floats, by their (renamed) name: their dtype. Empty unless
    /// [`ImportOptions::skip_non_float`] is `false`.
    pub non_float: BTreeMap<String, String>,
    /// What was not considered, by the file's name.
    pub skipped: Vec<Skipped>,
}

/// Reads a PyTorch state dict from a safetensors file or a `torch.save` file (PyTorch's zip
/// format, whatever its extension: told apart by their first bytes), and renames and skips as
/// `options` say. A missing, corrupt or unreadable file is an error naming it, as are two
/// tensors that renaming gives the same name.
pub fn read_state_dict(path: impl AsRef<Path>, options: &ImportOptions) -> Result<StateDict> {
    let path = path.as_ref();
    let tensors = match pth::format_of(path)? {
        pth::Format::Zip => pth::read(path, options.key.as_deref())?,
        pth::Format::Safetensors => crate::checkpoint::read_tensors(path)?,
    };
    let mut dict = StateDict::default();
    let mut origin: BTreeMap<String, String> = BTreeMap::new();
    for (name, stored) in tensors {
        let Some(renamed) = options.renamed(&name) else {
            dict.skipped.push(Skipped {
                name,
                reason: SkipReason::Dropped,
            });
            continue;
        };
        if let Some(first) = origin.get(&renamed) {
            return Err(Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("`{first}` and `{name}` are both renamed `{renamed}`"),
            });
        }
        match stored {
            Stored::Float(t) => {
                dict.weights.insert(renamed.clone(), t);
            }
            Stored::Other { dtype, .. } if options.skip_non_float => {
                dict.skipped.push(Skipped {
                    name,
                    reason: SkipReason::NotFloat(dtype),
                });
                continue;
            }
            Stored::Other { dtype, .. } => {
                dict.non_float.insert(renamed.clone(), dtype);
            }
        }
        origin.insert(renamed, name);
    }
    dict.skipped.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(dict)
}

impl StateDict {
    /// The model's weights with this state dict's tensors in place of theirs, and the report,
    /// or every reason it does not fit `current` (the model's weights) under `options`.
    pub(crate) fn fit_to(
        self,
        current: &Weights,
        options: &ImportOptions,
    ) -> std::result::Result<(Weights, LoadReport), String> {
        let mut merged = current.clone();
        let mut report = LoadReport {
            skipped: self.skipped,
            ..LoadReport::default()
        };
        // Tensors the model has a variable for, but that cannot go into it.
        let mut misfits: BTreeMap<String, String> = BTreeMap::new();
        for (name, tensor) in self.weights {
            match current.get(&name) {
                Some(variable) if variable.dims() == tensor.dims() => {
                    merged.insert(name.clone(), tensor);
                    report.loaded.push(name);
                }
                Some(variable) => {
                    let why = format!(
                        "`{name}` is {:?} in the file but {:?} in the model",
                        tensor.dims(),
                        variable.dims()
                    );
                    misfits.insert(name, why);
                }
                None => report.unexpected.push(name),
            }
        }
        for (name, dtype) in self.non_float {
            match current.get(&name) {
                Some(variable) => {
                    let why = format!(
                        "`{name}` is {dtype} in the file but {:?} in the model",
                        variable.dtype()
                    );
                    misfits.insert(name, why);
                }
                None => report.unexpected.push(name),
            }
        }
        report.unexpected.sort();
        report.missing = current
            .keys()
            .filter(|k| !merged_from_file(&report.loaded, k) && !misfits.contains_key(*k))
            .cloned()
            .collect();
        let mut problems = Vec::new();
        if !misfits.is_empty() {
            let whys: Vec<String> = misfits.into_values().collect();
            problems.push(whys.join("; "));
        }
        if !report.missing.is_empty() && !options.allow_missing {
            problems.push(format!(
                "the file lacks {} of the model's variables (see ImportOptions::allow_missing): {}",
                report.missing.len(),
                listed(&report.missing)
            ));
        }
        if !report.unexpected.is_empty() && !options.allow_unexpected {
            problems.push(format!(
                "the model has no variable for {} of the file's tensors (see \
                 ImportOptions::allow_unexpected and the renames): {}",
                report.unexpected.len(),
                listed(&report.unexpected)
            ));
        }
        if problems.is_empty() && report.loaded.is_empty() && !current.is_empty() {
            let model_names: Vec<String> = current.keys().cloned().collect();
            problems.push(format!(
                "no tensor of the file matches a variable of the model (the model's: {}; the \
                 file's: {})",
                listed(&model_names),
                listed(&report.unexpected)
            ));
        }
        if problems.is_empty() {
            Ok((merged, report))
        } else {
            Err(problems.join("; "))
        }
    }
}

/// Whether `name` is among the `loaded` names (sorted, as the file's names are).
fn merged_from_file(loaded: &[String], name: &str) -> bool {
    loaded.binary_search_by(|l| l.as_str().cmp(name)).is_ok()
}

#[cfg(test)]
mod tests;
