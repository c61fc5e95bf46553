//! The training state as one file: weights, optimizer state and learning rate, saved and loaded
//! as one thing, so training resumes where it stopped.
//!
//! A [`TrainingState`] file is a safetensors file. Its tensors are the weights under their
//! canonical names (`conv2d_1.weight`, `batch_normalization_1.running_mean`) and the
//! optimizer's slots as `optimizer.<slot>.<variable>` (`optimizer.momentum.conv2d_1.weight`),
//! in the dtype they had (`f32` or `f64`), so a resumed run continues bit for bit. Its
//! safetensors metadata holds the rest as text:
//!
//! | key | value |
//! |---|---|
//! | `format` | `kandle.training_state` |
//! | `format_version` | [`FORMAT_VERSION`], e.g. `1` |
//! | `optimizer` | the optimizer's kind (`SGD`, `Adam`, `AdamW`, ...); empty without state |
//! | `optimizer.<scalar>` | each optimizer scalar (Adam's `optimizer.step`), exactly |
//! | `learning_rate` | the learning rate of the next step, exactly |
//! | `extra` | a JSON object for the rest of a run's state ([`TrainingState::extra`]) |
//!
//! Names never carry a strategy or replica prefix: a state saved under one strategy loads under
//! any other. Files are written atomically ([`crate::checkpoint::write_atomically`]). Reading
//! checks the whole file before returning, and every error is an [`Error::Checkpoint`] naming
//! the file and what is wrong with it: truncated, not safetensors, another format (a weights
//! checkpoint), a newer format version, a malformed entry.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::optimizers::NamedOptimizerState;
use crate::params::Weights;
use crate::{Error, Result};

/// The `format` that marks a kandle training state in the file's metadata.
pub const FORMAT: &str = "kandle.training_state";

/// The version of the file layout this kandle writes; it reads this version and older ones.
pub const FORMAT_VERSION: u32 = 1;

/// The prefix of the optimizer's tensors and scalars in the file.
const OPTIMIZER: &str = "optimizer";

/// Everything training needs to continue: what [`Model::save`](crate::Model::save) writes and
/// [`Model::load`](crate::Model::load) restores.
#[derive(Debug, Clone, Default)]
pub struct TrainingState {
    /// Every variable by canonical name: trainable weights and moving statistics.
    pub weights: Weights,
    /// The optimizer's state by canonical variable name.
    pub optimizer: NamedOptimizerState,
    /// The learning rate of the next step.
    pub learning_rate: f64,
    /// The rest of a run's state (epoch, step, callbacks' state), as a JSON object that parts
    /// of kandle and users add to; [`Model::load`](crate::Model::load) ignores it. JSON numbers
    /// are read back with serde_json's float precision: store a float that must survive bit
    /// for bit as a string (`format!("{x:?}")`) or an integer.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl TrainingState {
    /// Writes the state to `path` atomically (temporary file, fsync, rename): a crash never
    /// leaves a torn file, and the previous file survives until the new one is complete.
    /// Fails when a weight's name starts with `optimizer.` (the optimizer's namespace) or an
    /// optimizer slot's name is empty or has a dot.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.encode().map_err(|reason| Error::Checkpoint {
            path: path.to_path_buf(),
            reason: format!("cannot write the training state: {reason}"),
        })?;
        crate::checkpoint::write_atomically(path, &bytes)
    }

    /// Reads a state written by [`TrainingState::save`], its tensors on the CPU. The whole file
    /// is checked first; an error names the file and says what is wrong.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes =
            std::fs::read(path).map_err(|e| Error::io("cannot read training state", path, e))?;
        Self::decode(&bytes).map_err(|reason| Error::Checkpoint {
            path: path.to_path_buf(),
            reason,
        })
    }

    /// The state as the bytes of its file, to send it elsewhere whole (a parameter server
    /// sends its shard's state this way). Fails as [`TrainingState::save`] does.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.encode()
            .map_err(|reason| Error::invalid(format!("cannot encode the training state: {reason}")))
    }

    /// A state from the bytes [`TrainingState::to_bytes`] made, checked as
    /// [`TrainingState::load`] checks a file.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Self::decode(bytes)
            .map_err(|reason| Error::invalid(format!("not a training state: {reason}")))
    }

    /// The file's bytes.
    fn encode(&self) -> std::result::Result<Vec<u8>, String> {
        let mut tensors: Vec<(String, Raw)> = Vec::new();
        for (name, t) in &self.weights {
            if name.starts_with(&format!("{OPTIMIZER}.")) {
                return Err(format!(
                    "variable `{name}` has a name in the optimizer's namespace (`{OPTIMIZER}.`): \
                     rename its layer"
                ));
            }
            tensors.push((
                name.clone(),
                Raw::of(t).map_err(|e| format!("`{name}`: {e}"))?,
            ));
        }
        for (slot, values) in &self.optimizer.slots {
            crate::optimizers::check_slot_name(slot).map_err(|e| e.to_string())?;
            for (var, t) in values {
                let name = format!("{OPTIMIZER}.{slot}.{var}");
                tensors.push((
                    name.clone(),
                    Raw::of(t).map_err(|e| format!("`{name}`: {e}"))?,
                ));
            }
        }
        let mut metadata = HashMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("format_version".to_string(), FORMAT_VERSION.to_string()),
            (OPTIMIZER.to_string(), self.optimizer.kind.clone()),
            (
                "learning_rate".to_string(),
                format!("{:?}", self.learning_rate),
            ),
            (
                "extra".to_string(),
                serde_json::Value::Object(self.extra.clone()).to_string(),
            ),
        ]);
        for (name, value) in &self.optimizer.scalars {
            if name.is_empty() {
                return Err("an optimizer scalar has an empty name".into());
            }
            metadata.insert(format!("{OPTIMIZER}.{name}"), format!("{value:?}"));
        }
        let views = tensors
            .iter()
            .map(|(name, raw)| {
                safetensors::tensor::TensorView::new(raw.dtype, raw.shape.clone(), &raw.bytes)
                    .map(|view| (name.as_str(), view))
                    .map_err(|e| format!("`{name}`: {e}"))
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        safetensors::serialize(views, Some(metadata)).map_err(|e| e.to_string())
    }

    /// Parses and checks a file's bytes; the error says what is wrong (the caller names the
    /// file).
    fn decode(bytes: &[u8]) -> std::result::Result<Self, String> {
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| format!("truncated or not a safetensors file ({e})"))?;
        let metadata = header.metadata().as_ref().ok_or_else(|| {
            "not a kandle training state: it has no metadata (a weights checkpoint? \
             Model::load_weights reads those)"
                .to_string()
        })?;
        check_format(metadata)?;
        let text = |key: &str| {
            metadata
                .get(key)
                .ok_or_else(|| format!("the training state has no `{key}` in its metadata"))
        };
        let kind = text(OPTIMIZER)?.clone();
        let learning_rate = parse_f64("learning_rate", text("learning_rate")?)?;
        if !(learning_rate.is_finite() && learning_rate >= 0.0) {
            return Err(format!(
                "the learning rate must be finite and >= 0, got {learning_rate}"
            ));
        }
        let extra = match metadata.get("extra") {
            None => serde_json::Map::new(),
            Some(json) => match serde_json::from_str(json) {
                Ok(serde_json::Value::Object(map)) => map,
                Ok(_) => return Err("`extra` in the metadata is not a JSON object".into()),
                Err(e) => return Err(format!("`extra` in the metadata is not valid JSON ({e})")),
            },
        };
        let mut scalars = BTreeMap::new();
        for (key, value) in metadata {
            if let Some(name) = key.strip_prefix(&format!("{OPTIMIZER}.")) {
                scalars.insert(name.to_string(), parse_f64(key, value)?);
            }
        }
        let file = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| format!("truncated or not a safetensors file ({e})"))?;
        let mut weights = Weights::new();
        let mut slots: BTreeMap<String, Weights> = BTreeMap::new();
        for (name, view) in file.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::F64 => DType::F64,
                safetensors::Dtype::F16 => DType::F16,
                safetensors::Dtype::BF16 => DType::BF16,
                other => return Err(format!("tensor `{name}` has unsupported dtype {other:?}")),
            };
            let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)
                .map_err(|e| format!("tensor `{name}`: {e}"))?;
            match name.strip_prefix(&format!("{OPTIMIZER}.")) {
                Some(rest) => match rest.split_once('.') {
                    Some((slot, var)) if !slot.is_empty() && !var.is_empty() => {
                        slots
                            .entry(slot.to_string())
                            .or_default()
                            .insert(var.to_string(), t);
                    }
                    _ => {
                        return Err(format!(
                            "tensor `{name}` is not named `{OPTIMIZER}.<slot>.<variable>`"
                        ))
                    }
                },
                None => {
                    weights.insert(name, t);
                }
            }
        }
        Ok(Self {
            weights,
            optimizer: NamedOptimizerState {
                kind,
                slots,
                scalars,
            },
            learning_rate,
            extra,
        })
    }
}

/// Checks the `format` and `format_version` of a file's metadata.
fn check_format(metadata: &HashMap<String, String>) -> std::result::Result<(), String> {
    match metadata.get("format") {
        Some(format) if format == FORMAT => {}
        Some(other) => {
            return Err(format!(
                "not a kandle training state: its format is `{other}`, not `{FORMAT}`"
            ))
        }
        None => {
            return Err(format!(
                "not a kandle training state: its metadata has no `format` (`{FORMAT}` \
                 expected; a weights checkpoint? Model::load_weights reads those)"
            ))
        }
    }
    let version = metadata
        .get("format_version")
        .ok_or("the training state has no `format_version` in its metadata")?;
    match version.parse::<u32>() {
        Ok(v) if (1..=FORMAT_VERSION).contains(&v) => Ok(()),
        Ok(v) if v > FORMAT_VERSION => Err(format!(
            "format version {v} is newer than this kandle reads (up to {FORMAT_VERSION}): it was \
             written by a newer kandle"
        )),
        _ => Err(format!("unknown format version `{version}`")),
    }
}

fn parse_f64(key: &str, value: &str) -> std::result::Result<f64, String> {
    value
        .parse::<f64>()
        .map_err(|_| format!("`{key}` in the metadata is not a number: `{value}`"))
}

/// A tensor's bytes as safetensors stores them (little-endian), in `f64` if it was, `f32`
/// otherwise.
struct Raw {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Raw {
    fn of(t: &Tensor) -> Result<Self> {
        let shape = t.dims().to_vec();
        let flat = t.to_device(&Device::Cpu)?.flatten_all()?;
        Ok(match flat.dtype() {
            DType::F64 => Self {
                dtype: safetensors::Dtype::F64,
                shape,
                bytes: flat
                    .to_vec1::<f64>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            },
            _ => Self {
                dtype: safetensors::Dtype::F32,
                shape,
                bytes: flat
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> Result<TrainingState> {
        let mut weights = Weights::new();
        weights.insert(
            "dense_1.weight".into(),
            Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?,
        );
        weights.insert(
            "dense_1.bias".into(),
            Tensor::new(&[0.5f64, -0.5], &Device::Cpu)?,
        );
        let mut m = Weights::new();
        m.insert(
            "dense_1.weight".into(),
            Tensor::new(&[[0.1f32, 0.2], [0.3, 0.4]], &Device::Cpu)?,
        );
        let mut extra = serde_json::Map::new();
        extra.insert("epoch".into(), serde_json::json!(3));
        Ok(TrainingState {
            weights,
            optimizer: NamedOptimizerState {
                kind: "Adam".into(),
                slots: BTreeMap::from([("m".to_string(), m)]),
                scalars: BTreeMap::from([("step".to_string(), 7.0)]),
            },
            learning_rate: 0.1 + 0.2,
            extra,
        })
    }

    #[test]
    fn round_trip_is_exact() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("cannot create", "tempdir", e))?;
        let path = dir.path().join("state.safetensors");
        let saved = state()?;
        saved.save(&path)?;
        let back = TrainingState::load(&path)?;
        assert_eq!(back.learning_rate.to_bits(), saved.learning_rate.to_bits());
        assert_eq!(back.optimizer.kind, "Adam");
        assert_eq!(back.optimizer.scalars["step"], 7.0);
        assert_eq!(back.extra["epoch"], serde_json::json!(3));
        assert_eq!(back.weights["dense_1.bias"].dtype(), DType::F64);
        assert_eq!(
            back.weights["dense_1.weight"].to_vec2::<f32>()?,
            vec![vec![1., 2.], vec![3., 4.]]
        );
        assert_eq!(
            back.optimizer.slots["m"]["dense_1.weight"].to_vec2::<f32>()?,
            vec![vec![0.1, 0.2], vec![0.3, 0.4]]
        );
        // A state sent as bytes arrives whole.
        let bytes = saved.to_bytes()?;
        let sent = TrainingState::from_bytes(&bytes)?;
        assert_eq!(sent.optimizer.scalars, back.optimizer.scalars);
        assert_eq!(
            sent.optimizer.slots["m"]["dense_1.weight"].to_vec2::<f32>()?,
            vec![vec![0.1, 0.2], vec![0.3, 0.4]]
        );
        let err = TrainingState::from_bytes(&bytes[..bytes.len() / 2])
            .expect_err("a truncated state must fail");
        assert!(err.to_string().contains("not a training state"), "{err}");
        Ok(())
    }

    #[test]
    fn a_name_in_the_optimizer_namespace_is_refused() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("cannot create", "tempdir", e))?;
        let path = dir.path().join("s.safetensors");
        let mut s = state()?;
        s.weights.insert(
            "optimizer.weight".into(),
            Tensor::new(&[1f32], &Device::Cpu)?,
        );
        let err = s.save(&path).expect_err("a clashing name").to_string();
        assert!(err.contains("optimizer's namespace"), "{err}");
        assert!(!path.exists());
        Ok(())
    }
}
