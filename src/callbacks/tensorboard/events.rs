//! TensorBoard's event files: `Event` protobuf messages (TensorFlow's `event.proto` and
//! `summary.proto`, the fields a training run writes) in TFRecord frames, each frame its length,
//! the length's masked CRC-32C, the message, and the message's masked CRC-32C.
//!
//! Scalars are written as `simple_value` and weight histograms as `HistogramProto`, the forms
//! TensorBoard reads from every writer (it migrates both to its scalar and histogram plugins).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use crate::{Error, Result};

/// `tensorflow.Event`: one record of an event file.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub(crate) wall_time: f64,
    /// The step (TensorBoard's x axis).
    #[prost(int64, tag = "2")]
    pub(crate) step: i64,
    /// The file's format, in its first record: `brain.Event:2`.
    #[prost(string, optional, tag = "3")]
    pub(crate) file_version: Option<String>,
    /// The values of this step.
    #[prost(message, optional, tag = "5")]
    pub(crate) summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub(crate) value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: a tagged scalar or histogram.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SummaryValue {
    #[prost(string, tag = "1")]
    pub(crate) tag: String,
    #[prost(float, optional, tag = "2")]
    pub(crate) simple_value: Option<f32>,
    #[prost(message, optional, tag = "5")]
    pub(crate) histo: Option<HistogramProto>,
}

/// `tensorflow.HistogramProto`: counts in buckets, each bucket's right edge in `bucket_limit`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct HistogramProto {
    #[prost(double, tag = "1")]
    pub(crate) min: f64,
    #[prost(double, tag = "2")]
    pub(crate) max: f64,
    #[prost(double, tag = "3")]
    pub(crate) num: f64,
    #[prost(double, tag = "4")]
    pub(crate) sum: f64,
    #[prost(double, tag = "5")]
    pub(crate) sum_squares: f64,
    #[prost(double, repeated, tag = "6")]
    pub(crate) bucket_limit: Vec<f64>,
    #[prost(double, repeated, tag = "7")]
    pub(crate) bucket: Vec<f64>,
}

impl HistogramProto {
    /// The histogram of `values` in `buckets` buckets of equal width between their minimum and
    /// maximum (one bucket when they are all equal). Values that are not finite are left out of
    /// the buckets and the sums, as TensorFlow's summary does.
    pub(crate) fn of(values: &[f32], buckets: usize) -> Self {
        let finite = values
            .iter()
            .filter(|v| v.is_finite())
            .map(|&v| f64::from(v));
        let (mut min, mut max, mut num, mut sum, mut sum_squares) =
            (f64::INFINITY, f64::NEG_INFINITY, 0.0, 0.0, 0.0);
        for v in finite.clone() {
            (min, max) = (min.min(v), max.max(v));
            num += 1.0;
            sum += v;
            sum_squares += v * v;
        }
        if num == 0.0 {
            return Self {
                min: 0.0,
                max: 0.0,
                num: 0.0,
                sum: 0.0,
                sum_squares: 0.0,
                bucket_limit: vec![0.0],
                bucket: vec![0.0],
            };
        }
        let buckets = if max > min { buckets.max(1) } else { 1 };
        let width = (max - min) / buckets as f64;
        let mut bucket = vec![0.0; buckets];
        for v in finite {
            let i = (((v - min) / width) as usize).min(buckets - 1);
            bucket[i] += 1.0;
        }
        let bucket_limit = (1..=buckets)
            .map(|i| match i == buckets {
                true => max,
                false => min + width * i as f64,
            })
            .collect();
        Self {
            min,
            max,
            num,
            sum,
            sum_squares,
            bucket_limit,
            bucket,
        }
    }
}

/// An event file being written: `dir/events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2`, the
/// name TensorFlow gives them, which TensorBoard looks for.
pub(crate) struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` and a new event file in it, with its `file_version` record.
    pub(crate) fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io("cannot create the TensorBoard directory", dir, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into());
        let seconds = now().floor() as u64;
        let pid = std::process::id();
        let mut n = 0;
        let path = loop {
            let name = format!("events.out.tfevents.{seconds}.{host}.{pid}.{n}.v2");
            let path = dir.join(name);
            if !path.exists() {
                break path;
            }
            n += 1;
        };
        let file = File::create(&path)
            .map_err(|e| Error::io("cannot create the TensorBoard event file", &path, e))?;
        let mut writer = Self {
            path,
            file: BufWriter::new(file),
        };
        writer.write(&Event {
            wall_time: now(),
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(writer)
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `values` as one event at `step`.
    pub(crate) fn summary(&mut self, step: i64, values: Vec<SummaryValue>) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        self.write(&Event {
            wall_time: now(),
            step,
            file_version: None,
            summary: Some(Summary { value: values }),
        })
    }

    /// Writes one record.
    fn write(&mut self, event: &Event) -> Result<()> {
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        let mut frame = Vec::with_capacity(data.len() + 16);
        frame.extend_from_slice(&length);
        frame.extend_from_slice(&masked_crc(&length).to_le_bytes());
        frame.extend_from_slice(&data);
        frame.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file
            .write_all(&frame)
            .map_err(|e| Error::io("cannot write the TensorBoard event file", &self.path, e))
    }

    /// Pushes what was written to the file, so TensorBoard sees it while the run goes on.
    pub(crate) fn flush(&mut self) -> Result<()> {
        self.file
            .flush()
            .map_err(|e| Error::io("cannot write the TensorBoard event file", &self.path, e))
    }
}

/// A scalar value.
pub(crate) fn scalar(tag: impl Into<String>, value: f64) -> SummaryValue {
    SummaryValue {
        tag: tag.into(),
        simple_value: Some(value as f32),
        histo: None,
    }
}

/// A histogram value.
pub(crate) fn histogram(tag: impl Into<String>, histo: HistogramProto) -> SummaryValue {
    SummaryValue {
        tag: tag.into(),
        simple_value: None,
        histo: Some(histo),
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's checksum: CRC-32C, rotated right by 15 bits, plus a constant.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_masked_crc_is_tfrecord_s() {
        // TensorFlow's crc32c_test: the CRC-32C of 32 zero bytes is 0x8a9136aa; masking
        // rotates it right by 15 and adds 0xa282ead8.
        let crc = crc32c::crc32c(&[0u8; 32]);
        assert_eq!(crc, 0x8a91_36aa);
        assert_eq!(
            masked_crc(&[0u8; 32]),
            0x8a91_36aau32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn a_histogram_counts_every_finite_value_once() {
        let h = HistogramProto::of(&[0.0, 1.0, 2.0, 3.0, f32::NAN, 4.0], 4);
        assert_eq!(
            (h.min, h.max, h.num, h.sum, h.sum_squares),
            (0.0, 4.0, 5.0, 10.0, 30.0)
        );
        assert_eq!(h.bucket_limit, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(h.bucket, [1.0, 1.0, 1.0, 2.0]);
        let flat = HistogramProto::of(&[2.5; 3], 30);
        assert_eq!((flat.bucket_limit, flat.bucket), (vec![2.5], vec![3.0]));
    }
}
