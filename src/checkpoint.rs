//! Checkpoints: weights as safetensors, written atomically and loadable onto any device.
//!
//! A checkpoint holds every variable under its canonical name (`conv2d_1.weight`,
//! `batch_normalization_1.running_mean`, ...), with no strategy prefix, so a file written under
//! one strategy loads under any other. Writes go to a temporary file in the same directory,
//! are synced, then renamed over the target: a crash mid-write never leaves a torn checkpoint.

use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::params::Weights;
use crate::{Error, Result};

/// Writes `weights` to `path` atomically (temporary file, fsync, rename).
pub fn save(weights: &Weights, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let cpu: Vec<(String, Tensor)> = weights
        .iter()
        .map(|(k, v)| {
            Ok((
                k.clone(),
                v.to_device(&Device::Cpu)?
                    .to_dtype(DType::F32)?
                    .contiguous()?,
            ))
        })
        .collect::<Result<_>>()?;
    let bytes = serialize(&cpu).map_err(|reason| Error::Checkpoint {
        path: path.to_path_buf(),
        reason,
    })?;
    write_atomically(path, &bytes)
}

fn serialize(tensors: &[(String, Tensor)]) -> std::result::Result<Vec<u8>, String> {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(k, t)| {
            let values = t
                .flatten_all()
                .and_then(|f| f.to_vec1::<f32>())
                .map_err(|e| e.to_string())?;
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            Ok((k.clone(), bytes, t.dims().to_vec()))
        })
        .collect::<std::result::Result<_, String>>()?;
    let views = data
        .iter()
        .map(|(k, bytes, shape)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .map(|v| (k.as_str(), v))
                .map_err(|e| e.to_string())
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

/// Writes `bytes` to `path` through a temporary file in the same directory, then renames it.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create directory", &dir, e))?;
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::invalid(format!("`{}` is not a file path", path.display())))?;
    let tmp = dir.join(format!(
        "{}{}.tmp",
        temporary_prefix(&file_name.to_string_lossy()),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename itself survives a power cut once the directory is synced too.
        sync_directory(&dir)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io("cannot write", path, e)
    })
}

/// The start of the temporary file names [`write_atomically`] uses for a file named `name`
/// (the writer's process id and `.tmp` follow).
fn temporary_prefix(name: &str) -> String {
    format!(".{name}.")
}

#[cfg(unix)]
fn sync_directory(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_directory(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

/// Removes the temporary files that processes killed inside [`write_atomically`] left next to
/// `path` (the file itself is untouched: it is the last complete write). Returns how many.
pub(crate) fn remove_torn_writes(path: &Path) -> Result<usize> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Ok(0);
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(0);
    };
    let prefix = temporary_prefix(&name.to_string_lossy());
    let mut removed = 0;
    for entry in entries.flatten() {
        let entry_name = entry.file_name();
        let entry_name = entry_name.to_string_lossy();
        let pid = entry_name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".tmp"));
        if pid.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
            let torn = entry.path();
            match std::fs::remove_file(&torn) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("cannot remove", &torn, e)),
            }
        }
    }
    Ok(removed)
}

/// Reads a checkpoint into CPU tensors.
pub fn load(path: impl AsRef<Path>) -> Result<Weights> {
    let path = path.as_ref();
    read_tensors(path)?
        .into_iter()
        .map(|(name, stored)| match stored {
            Stored::Float(t) => Ok((name, t)),
            Stored::Other { dtype, .. } => Err(Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("tensor `{name}` has unsupported dtype {dtype}"),
            }),
        })
        .collect()
}

/// One tensor of a weights file as kandle reads it.
#[derive(Debug, Clone)]
pub(crate) enum Stored {
    /// A float32, float64, float16 or bfloat16 tensor, as `f32` on the CPU.
    Float(Tensor),
    /// A tensor of another dtype (an integer counter such as PyTorch's `num_batches_tracked`),
    /// not read: its dtype as the file names it (`I64`).
    Other { dtype: String },
}

/// Reads every tensor of a safetensors file in the file's order: floats converted to `f32`,
/// other dtypes described. A missing, truncated or corrupt file is an error naming it.
pub(crate) fn read_tensors(path: &Path) -> Result<Vec<(String, Stored)>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io("cannot read checkpoint", path, e))?;
    let corrupt = |reason: String| Error::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| corrupt(format!("not a valid safetensors file ({e})")))?;
    let mut tensors = Vec::new();
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F64 => DType::F64,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => {
                let dtype = format!("{other:?}");
                tensors.push((name.to_string(), Stored::Other { dtype }));
                continue;
            }
        };
        // The safetensors reader checks the shape against the bytes, but a shape with a zero
        // in it holds no bytes whatever its other dimensions; the strides of a tensor are
        // products of its dimensions, so refuse dimensions whose product overflows.
        let shape = view.shape();
        if shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .is_none()
        {
            return Err(corrupt(format!(
                "tensor `{name}` has shape {shape:?}, too large to address"
            )));
        }
        let t = Tensor::from_raw_buffer(view.data(), dtype, shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|e| corrupt(format!("tensor `{name}`: {e}")))?;
        tensors.push((name.to_string(), Stored::Float(t)));
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("kandle-ckpt-{}", std::process::id()));
        let path = dir.join("w.safetensors");
        let mut w = Weights::new();
        w.insert(
            "a.weight".into(),
            Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?,
        );
        save(&w, &path)?;
        let back = load(&path)?;
        assert_eq!(
            back["a.weight"].to_vec2::<f32>()?,
            vec![vec![1., 2.], vec![3., 4.]]
        );
        let leftovers = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
        assert_eq!(leftovers, 1, "no temporary file may remain");
        let bytes = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
        std::fs::write(&path, &bytes[..bytes.len() / 2])
            .map_err(|e| Error::io("write", &path, e))?;
        let err = load(&path).expect_err("truncated file").to_string();
        assert!(err.contains("not a valid safetensors file"), "{err}");
        let missing = load(dir.join("nope.safetensors"))
            .expect_err("missing")
            .to_string();
        assert!(missing.contains("cannot read checkpoint"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn torn_writes_are_removed_and_nothing_else() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("kandle-torn-{}", std::process::id()));
        let path = dir.join("backup.safetensors");
        write_atomically(&path, b"whole")?;
        let touch = |name: &str| {
            std::fs::write(dir.join(name), b"part").map_err(|e| Error::io("write", &path, e))
        };
        // What processes 17 and 23 left when killed mid-write, and files that only look alike.
        for name in [
            ".backup.safetensors.17.tmp",
            ".backup.safetensors.23.tmp",
            ".backup.safetensors.x.tmp",
            ".other.safetensors.17.tmp",
            "backup.safetensors.17.tmp",
        ] {
            touch(name)?;
        }
        assert_eq!(remove_torn_writes(&path)?, 2);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .map_err(|e| Error::io("list", &dir, e))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".backup.safetensors.x.tmp",
                ".other.safetensors.17.tmp",
                "backup.safetensors",
                "backup.safetensors.17.tmp"
            ]
        );
        assert_eq!(std::fs::read(&path).ok().as_deref(), Some(&b"whole"[..]));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
