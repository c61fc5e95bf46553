//! Reading PyTorch's `torch.save` files (a zip archive holding a pickle, since PyTorch 1.6)
//! through candle's pickle reader, and telling them from safetensors files by their first bytes.

use std::path::Path;

use candle_core::DType;

use crate::checkpoint::Stored;
use crate::{Error, Result};

/// The keys a training checkpoint commonly keeps its state dict under, tried in this order
/// when the top level of a `.pth` file holds no tensor and no key was given.
pub(super) const STATE_DICT_KEYS: [&str; 5] =
    ["state_dict", "model_state_dict", "model", "module", "net"];

/// What kind of file a weights file is, by its first bytes.
pub(super) enum Format {
    /// PyTorch's `torch.save` format since 1.6: a zip archive holding a pickle.
    Zip,
    /// Anything else is read as safetensors (whose reader names what is wrong).
    Safetensors,
}

pub(super) fn format_of(path: &Path) -> Result<Format> {
    use std::io::Read;
    let cannot = |e| Error::io("cannot read checkpoint", path, e);
    let mut magic = Vec::with_capacity(4);
    std::fs::File::open(path)
        .map_err(cannot)?
        .take(4)
        .read_to_end(&mut magic)
        .map_err(cannot)?;
    match magic.as_slice() {
        [b'P', b'K', 3, 4] => Ok(Format::Zip),
        // A pickle protocol 2 header and PyTorch's legacy magic number after it.
        [0x80, 0x02, 0x8a, 0x0a] => Err(Error::Checkpoint {
            path: path.to_path_buf(),
            reason: "PyTorch's legacy format (before 1.6), which candle does not read: load it \
                     in PyTorch and save it again with torch.save, or as safetensors"
                .to_string(),
        }),
        _ => Ok(Format::Safetensors),
    }
}

/// Reads a `torch.save` zip file's state dict (at the top level or under `key`), floats as
/// `f32`, in name order. candle's reader panics on some malformed pickles; that becomes an
/// error here.
pub(super) fn read(path: &Path, key: Option<&str>) -> Result<Vec<(String, Stored)>> {
    let corrupt = |reason: String| Error::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let read = std::panic::catch_unwind(|| read_pth_unguarded(path, key));
    match read {
        Ok(Ok(Some(tensors))) => Ok(tensors),
        Ok(Ok(None)) => Err(corrupt(match key {
            Some(key) => format!("no tensor under the key `{key}`"),
            None => format!(
                "no tensor at the top level nor under the keys {}: name the state dict's key \
                 with ImportOptions::key",
                STATE_DICT_KEYS.join(", ")
            ),
        })),
        Ok(Err(e)) => Err(corrupt(format!(
            "cannot be read as a PyTorch checkpoint ({e})"
        ))),
        Err(panic) => Err(corrupt(format!(
            "cannot be read as a PyTorch checkpoint (candle's reader failed: {})",
            crate::error::panic_message(panic.as_ref())
        ))),
    }
}

/// The state dict of the first key that holds one, or `None`; candle's errors as they are.
fn read_pth_unguarded(
    path: &Path,
    key: Option<&str>,
) -> candle_core::Result<Option<Vec<(String, Stored)>>> {
    use candle_core::pickle::PthTensors;
    let pth = match key {
        Some(key) => PthTensors::new(path, Some(key))?,
        None => {
            let top = PthTensors::new(path, None)?;
            let nested = STATE_DICT_KEYS
                .iter()
                // A key the file lacks is an error from candle: try the next one.
                .filter_map(|key| PthTensors::new(path, Some(key)).ok());
            match std::iter::once(top)
                .chain(nested)
                .find(|p| !p.tensor_infos().is_empty())
            {
                Some(pth) => pth,
                None => return Ok(None),
            }
        }
    };
    if pth.tensor_infos().is_empty() {
        return Ok(None);
    }
    let mut names: Vec<&String> = pth.tensor_infos().keys().collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let info = &pth.tensor_infos()[name];
        let stored = if matches!(
            info.dtype,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ) {
            let tensor = pth.get(name)?.ok_or_else(|| {
                candle_core::Error::Msg(format!("tensor `{name}` is listed but absent"))
            })?;
            Stored::Float(tensor.to_dtype(DType::F32)?.contiguous()?)
        } else {
            Stored::Other {
                dtype: format!("{:?}", info.dtype),
            }
        };
        tensors.push((name.clone(), stored));
    }
    Ok(Some(tensors))
}
