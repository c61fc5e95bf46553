//! The UCI "Optical Recognition of Handwritten Digits" set: 1,797 grayscale 8×8 images of the
//! digits 0–9, small enough to ship inside the crate and real enough to show that training
//! learns, with no download.
//!
//! The file is the gzip'd CSV that scikit-learn bundles (`data/digits/digits.csv.gz`: one
//! image a line, 64 pixel values 0..16 in row-major order, then the label). [`load`] reads the
//! copy embedded in the library; [`load_from`] reads a file in the same format. Samples are
//! `[1, 8, 8]` with pixels scaled to `[0, 1]`, and the targets are class indices
//! (`Classes(10)`). Original data by E. Alpaydin and C. Kaynak, UCI Machine Learning
//! Repository, CC BY 4.0.
//!
//! ```
//! use kandle::data::{digits, Dataset};
//!
//! let (train, test) = digits::load()?.train_test_split(0.2, 42)?;
//! assert_eq!((train.len(), test.len()), (1437, 360));
//! # Ok::<(), kandle::Error>(())
//! ```

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use flate2::read::MultiGzDecoder;

use super::{InMemoryDataset, Targets};
use crate::{Error, Result};

/// Number of samples in the bundled set.
pub const LEN: usize = 1797;

/// Number of classes: the digits 0 to 9.
pub const NUM_CLASSES: usize = 10;

/// Shape of one sample: one channel of 8×8 pixels.
pub const SAMPLE_SHAPE: [usize; 3] = [1, 8, 8];

/// The largest raw pixel value; pixels are divided by it.
const MAX_PIXEL: f32 = 16.0;

const PIXELS: usize = 64;

const EMBEDDED: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/digits/digits.csv.gz"
));

/// Loads the copy of the digits set embedded in the library, named `digits`.
///
/// ```
/// use kandle::data::{digits, Dataset, Targets};
///
/// let ds = digits::load()?;
/// assert_eq!(ds.len(), 1797);
/// assert_eq!(ds.sample_shape(), &[1, 8, 8]);
/// assert_eq!(ds.targets(), Targets::Classes(10));
/// # Ok::<(), kandle::Error>(())
/// ```
pub fn load() -> Result<InMemoryDataset> {
    parse(EMBEDDED, Path::new("<embedded>/data/digits/digits.csv.gz"))
}

/// Loads a digits file in the same gzip'd CSV format from `path`, named `digits`. A file of
/// several gzip members (`cat a.csv.gz b.csv.gz`) is read whole, as `gzip -d` reads it.
///
/// Errors: [`Error::Io`] naming the path when the file cannot be read; [`Error::Data`] naming
/// the path when the gzip stream is corrupt or truncated, or naming the line and what is wrong
/// with it (not UTF-8 text, longer than 64 KiB, field count, a value that is not a number, a
/// pixel outside 0..16, a label outside 0..9), or when the file holds no sample.
pub fn load_from(path: impl AsRef<Path>) -> Result<InMemoryDataset> {
    let path = path.as_ref();
    let bytes =
        std::fs::read(path).map_err(|e| Error::io("cannot read the digits file", path, e))?;
    parse(&bytes, path)
}

/// The longest line accepted, in bytes: 65 numbers need far less, and a corrupt file without
/// line breaks must not be read into memory whole.
const MAX_LINE: usize = 64 * 1024;

/// Parses the gzip'd CSV in `gz`; `path` only names the source in errors.
fn parse(gz: &[u8], path: &Path) -> Result<InMemoryDataset> {
    let data_error = |reason: String| Error::Data {
        path: path.to_path_buf(),
        reason,
    };
    let mut x = Vec::with_capacity(LEN * PIXELS);
    let mut y = Vec::with_capacity(LEN);
    // All gzip members, as `gzip -d` reads them: a file made with `cat a.gz b.gz` is valid.
    let mut reader = BufReader::new(MultiGzDecoder::new(gz));
    let mut line = Vec::new();
    let mut line_no = 0usize;
    loop {
        line.clear();
        // At most one byte past the limit, so that a longer line is seen and refused.
        let read = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| {
                data_error(format!(
                    "cannot decompress after line {line_no} (corrupt or truncated gzip?): {e}"
                ))
            })?;
        if read == 0 {
            break;
        }
        line_no += 1;
        if line.len() > MAX_LINE && line.last() != Some(&b'\n') {
            return Err(data_error(format!(
                "line {line_no}: longer than {MAX_LINE} bytes (not a digits CSV file?)"
            )));
        }
        let text = std::str::from_utf8(&line).map_err(|e| {
            data_error(format!(
                "line {line_no}: not UTF-8 text (an invalid byte at offset {} in the line)",
                e.valid_up_to()
            ))
        })?;
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        if fields.len() != PIXELS + 1 {
            return Err(data_error(format!(
                "line {line_no}: expected {} comma-separated values (64 pixels, then the \
                 label), found {}",
                PIXELS + 1,
                fields.len()
            )));
        }
        for (col, field) in fields.iter().enumerate() {
            let value: f32 = field.parse().map_err(|_| {
                data_error(format!(
                    "line {line_no}, field {}: `{field}` is not a number",
                    col + 1
                ))
            })?;
            if col < PIXELS {
                if !(0.0..=MAX_PIXEL).contains(&value) {
                    return Err(data_error(format!(
                        "line {line_no}, field {}: pixel value {value} is outside 0..16",
                        col + 1
                    )));
                }
                x.push(value / MAX_PIXEL);
            } else {
                if !(value.fract() == 0.0 && (0.0..NUM_CLASSES as f32).contains(&value)) {
                    return Err(data_error(format!(
                        "line {line_no}: label `{field}` is not a digit 0..9"
                    )));
                }
                y.push(value);
            }
        }
    }
    if y.is_empty() {
        return Err(data_error("the file holds no sample".to_string()));
    }
    Ok(
        InMemoryDataset::from_vecs(x, &SAMPLE_SHAPE, y, Targets::Classes(NUM_CLASSES))?
            .named("digits"),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::data::Dataset;
    use flate2::write::GzEncoder;
    use flate2::Compression;
    use std::io::Write;

    fn gzip(text: &str) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        enc.write_all(text.as_bytes()).unwrap();
        enc.finish().unwrap()
    }

    fn line(label: &str) -> String {
        let mut fields = vec!["3"; PIXELS];
        fields.push(label);
        fields.join(",")
    }

    #[test]
    fn embedded_set() {
        let ds = load().unwrap();
        assert_eq!(ds.len(), LEN);
        assert_eq!(ds.sample_shape(), &SAMPLE_SHAPE);
        assert_eq!(ds.targets(), Targets::Classes(NUM_CLASSES));
        assert_eq!(ds.name(), "digits");
        let mut counts = [0usize; NUM_CLASSES];
        for &label in ds.target_values() {
            counts[label as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c > 150), "{counts:?}");
        let (min, max) = ds
            .input_values()
            .iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        assert_eq!((min, max), (0.0, 1.0));
        // First row of the file: 0,0,5,13,9,1,0,0, ... label 0.
        assert_eq!(
            &ds.input_values()[..4],
            &[0.0, 0.0, 5.0 / 16.0, 13.0 / 16.0]
        );
        assert_eq!(ds.target_values()[0], 0.0);
    }

    #[test]
    fn train_test_split_of_digits() {
        let ds = load().unwrap();
        let (train, test) = ds.train_test_split(0.2, 42).unwrap();
        assert_eq!((train.len(), test.len()), (1437, 360));
        assert_eq!(train.name(), "digits (train)");
        assert_eq!(test.targets(), Targets::Classes(10));
        let (train2, test2) = ds.train_test_split(0.2, 42).unwrap();
        assert_eq!(train.input_values(), train2.input_values());
        assert_eq!(test.target_values(), test2.target_values());
        let (_, test3) = ds.train_test_split(0.2, 43).unwrap();
        assert_ne!(test.input_values(), test3.input_values());
    }

    #[test]
    fn load_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("digits.csv.gz");
        std::fs::write(&path, gzip(&format!("{}\n{}\n", line("4"), line("9")))).unwrap();
        let ds = load_from(&path).unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.target_values(), &[4.0, 9.0]);
        assert_eq!(ds.input_values()[0], 3.0 / 16.0);
    }

    #[test]
    fn missing_file_is_an_io_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.csv.gz");
        match load_from(&path) {
            Err(err @ Error::Io { .. }) => {
                assert!(err.to_string().contains("nope.csv.gz"), "{err}")
            }
            other => panic!("expected Error::Io, got {other:?}"),
        }
    }

    #[test]
    fn truncated_or_corrupt_gzip_is_a_data_error() {
        let dir = tempfile::tempdir().unwrap();
        let full = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/data/digits/digits.csv.gz"
        ))
        .unwrap();
        let cases = [
            ("truncated.csv.gz", full[..full.len() / 2].to_vec()),
            ("no-trailer.csv.gz", full[..full.len() - 4].to_vec()),
            ("plain.csv.gz", line("1").into_bytes()),
            ("empty.csv.gz", Vec::new()),
        ];
        for (name, bytes) in cases {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            match load_from(&path) {
                Err(err @ Error::Data { .. }) => {
                    assert!(err.to_string().contains(name), "{err}")
                }
                other => panic!("{name}: expected Error::Data, got {other:?}"),
            }
        }
    }

    #[test]
    fn malformed_lines_name_the_line_and_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let good = line("1");
        let short = good.rsplit_once(',').unwrap().0.to_string();
        let cases = [
            (format!("{good}\n{short}\n"), "line 2: expected 65"),
            (
                format!("{good}\n{good}\n{}\n", line("x")),
                "line 3, field 65: `x`",
            ),
            (format!("{}\n", line("10")), "line 1: label `10`"),
            (format!("{}\n", line("2.5")), "line 1: label `2.5`"),
            (
                format!("{}\n", good.replacen('3', "17", 1)),
                "line 1, field 1: pixel value 17",
            ),
            ("\n".to_string(), "no sample"),
        ];
        let path = dir.path().join("bad.csv.gz");
        for (text, expected) in cases {
            std::fs::write(&path, gzip(&text)).unwrap();
            match load_from(&path) {
                Err(err @ Error::Data { .. }) => {
                    let msg = err.to_string();
                    assert!(
                        msg.contains(expected) && msg.contains("bad.csv.gz"),
                        "{msg}"
                    );
                }
                other => panic!("expected Error::Data for {expected:?}, got {other:?}"),
            }
        }
    }
}
