//! Reading TensorBoard event files back, independently of the writer in `kandle`: TFRecord
//! frames checked against their masked CRC-32C, and the protobuf wire format decoded by hand
//! against TensorFlow's field numbers (`Event`: wall_time 1, step 2, file_version 3, summary 5;
//! `Summary.Value`: tag 1, simple_value 2, histo 5; `HistogramProto`: min 1 ... bucket 7).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

/// One decoded record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// The step.
    pub step: i64,
    /// The `file_version` of a file's first record.
    pub file_version: Option<String>,
    /// The summary's values.
    pub values: Vec<Value>,
}

/// One `Summary.Value`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Value {
    /// The tag.
    pub tag: String,
    /// A scalar.
    pub simple_value: Option<f32>,
    /// A histogram: `(num, sum, bucket counts)`.
    pub histogram: Option<(f64, f64, Vec<f64>)>,
}

/// Every record of the event file at `path`.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        ensure!(at + 12 <= bytes.len(), "a torn frame header at byte {at}");
        let length_bytes = &bytes[at..at + 8];
        let length = u64::from_le_bytes(length_bytes.try_into()?) as usize;
        ensure!(
            u32::from_le_bytes(bytes[at + 8..at + 12].try_into()?) == masked_crc(length_bytes),
            "bad length CRC at byte {at}"
        );
        let data = bytes
            .get(at + 12..at + 12 + length)
            .context("a torn record")?;
        let crc = bytes
            .get(at + 12 + length..at + 16 + length)
            .context("a torn record CRC")?;
        ensure!(
            u32::from_le_bytes(crc.try_into()?) == masked_crc(data),
            "bad data CRC at byte {at}"
        );
        events.push(event(data)?);
        at += 16 + length;
    }
    Ok(events)
}

/// The one event file in `dir`.
pub fn the_event_file(dir: &Path) -> Result<std::path::PathBuf> {
    let files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("events.out.tfevents.") && n.ends_with(".v2"))
        })
        .collect();
    ensure!(files.len() == 1, "{}: {files:?}", dir.display());
    Ok(files[0].clone())
}

fn masked_crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// A protobuf field: its number and its payload.
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32([u8; 4]),
}

fn varint(bytes: &[u8], at: &mut usize) -> Result<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*at).context("a torn varint")?;
        *at += 1;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    bail!("a varint longer than 10 bytes")
}

fn fields(bytes: &[u8]) -> Result<Vec<(u64, Field<'_>)>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let key = varint(bytes, &mut at)?;
        let (number, wire) = (key >> 3, key & 7);
        let field = match wire {
            0 => Field::Varint(varint(bytes, &mut at)?),
            1 => {
                let b = bytes.get(at..at + 8).context("a torn fixed64")?;
                at += 8;
                Field::Fixed64(b.try_into()?)
            }
            2 => {
                let len = varint(bytes, &mut at)? as usize;
                let b = bytes
                    .get(at..at + len)
                    .context("a torn length-delimited field")?;
                at += len;
                Field::Bytes(b)
            }
            5 => {
                let b = bytes.get(at..at + 4).context("a torn fixed32")?;
                at += 4;
                Field::Fixed32(b.try_into()?)
            }
            w => bail!("wire type {w} of field {number}"),
        };
        out.push((number, field));
    }
    Ok(out)
}

fn event(bytes: &[u8]) -> Result<Event> {
    let mut e = Event::default();
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v as i64,
            (3, Field::Bytes(b)) => e.file_version = Some(String::from_utf8(b.to_vec())?),
            (5, Field::Bytes(b)) => {
                for (n, f) in fields(b)? {
                    if let (1, Field::Bytes(v)) = (n, f) {
                        e.values.push(value(v)?);
                    }
                }
            }
            (n, _) => bail!("Event field {n} of an unexpected type"),
        }
    }
    Ok(e)
}

fn value(bytes: &[u8]) -> Result<Value> {
    let mut v = Value::default();
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Bytes(b)) => v.tag = String::from_utf8(b.to_vec())?,
            (2, Field::Fixed32(b)) => v.simple_value = Some(f32::from_le_bytes(b)),
            (5, Field::Bytes(b)) => v.histogram = Some(histogram(b)?),
            (n, _) => bail!("Summary.Value field {n} of an unexpected type"),
        }
    }
    Ok(v)
}

fn histogram(bytes: &[u8]) -> Result<(f64, f64, Vec<f64>)> {
    let (mut num, mut sum, mut buckets) = (0.0, 0.0, Vec::new());
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (3, Field::Fixed64(b)) => num = f64::from_le_bytes(b),
            (4, Field::Fixed64(b)) => sum = f64::from_le_bytes(b),
            (7, Field::Bytes(packed)) => {
                for chunk in packed.chunks_exact(8) {
                    buckets.push(f64::from_le_bytes(chunk.try_into()?));
                }
            }
            (7, Field::Fixed64(b)) => buckets.push(f64::from_le_bytes(b)),
            (1 | 2 | 5, Field::Fixed64(_)) | (6, _) => {}
            (n, _) => bail!("HistogramProto field {n} of an unexpected type"),
        }
    }
    Ok((num, sum, buckets))
}
