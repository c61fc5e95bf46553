//! CIFAR-10 from the official binary version: 60,000 colour images of 32×32 pixels in 10
//! classes, 50,000 for training (`data_batch_1.bin` to `data_batch_5.bin`) and 10,000 for
//! testing (`test_batch.bin`).
//!
//! Each file is a sequence of 3,073-byte records: one label byte (0..9, see [`CLASS_NAMES`]),
//! then the 3,072 pixel bytes of the image in `(channel, row, column)` order, the red plane
//! first, then green, then blue. [`load`] reads the six files from a directory (or from its
//! `cifar-10-batches-bin/` subdirectory, as the official archive unpacks); [`load_or_download`]
//! first fetches and verifies the official archive when the files are missing (cargo feature
//! `download`, on by default). Without the files and without a download, the error says which
//! files to put where. [`save`] writes any set of 32×32 colour images in the same format.
//!
//! A [`Cifar10Dataset`] keeps the pixels as bytes (150 MB for the training set, against 600 MB
//! as `f32`) and converts one sample at a time in [`read`](Dataset::read), inside the loader's
//! parallel batch assembly. Samples are `[3, 32, 32]` `f32`, the raw byte values 0..255 unless
//! [`with_scale`](Cifar10Dataset::with_scale) says otherwise; targets are class indices, or
//! one-hot rows after [`one_hot`](Cifar10Dataset::one_hot).
//!
//! The tutorial's pipeline (mean subtraction, one-hot labels, shifts and flips):
//!
//! ```
//! use std::sync::Arc;
//! use kandle::data::{cifar10, Dataset, Loader, LoaderOptions, MeanImage, RandomShiftFlip};
//!
//! # let dir = std::env::temp_dir().join(format!("kandle-cifar-doc-{}", std::process::id()));
//! # let set = |n: usize| {
//! #     let pixels = (0..n * cifar10::IMAGE_LEN).map(|i| (i % 251) as u8).collect();
//! #     cifar10::Cifar10Dataset::new(pixels, (0..n).map(|i| (i % 10) as u8).collect())
//! # };
//! # cifar10::save(&dir, &cifar10::Cifar10 { train: set(100)?, test: set(10)? })?;
//! let data = cifar10::load(&dir)?.one_hot();
//! let mean = MeanImage::compute(&data.train)?; // on the training set only
//! let (train, test) = (mean.subtract_from(data.train)?, mean.subtract_from(data.test)?);
//! let loader = Loader::new(&train, LoaderOptions {
//!     batch_size: 64,
//!     shuffle: true,
//!     augment: Some(Arc::new(RandomShiftFlip::default())),
//!     ..Default::default()
//! })?;
//! let batch = loader.iter(0).next().unwrap()?;
//! assert_eq!(batch.inputs[0].dims(), &[64, 3, 32, 32]);
//! assert_eq!(batch.targets[0].dims(), &[64, 10]);
//! # assert_eq!(test.len(), 10);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), kandle::Error>(())
//! ```
//!
//! Learning Multiple Layers of Features from Tiny Images, Alex Krizhevsky, 2009;
//! <https://www.cs.toronto.edu/~kriz/cifar.html>.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Dataset, MeanImage, MeanSubtracted, Targets};
use crate::{Error, Result};

/// The official archive of the binary version.
pub const URL: &str = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz";

/// The MD5 digest of the archive at [`URL`].
pub const ARCHIVE_MD5: &str = "c32a1d4ab5d03f1284b67883e8d87530";

/// The directory the archive unpacks into.
pub const ARCHIVE_DIR: &str = "cifar-10-batches-bin";

/// The training files, 10,000 records each in the official set.
pub const TRAIN_FILES: [&str; 5] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
];

/// The test file, 10,000 records in the official set.
pub const TEST_FILE: &str = "test_batch.bin";

/// Number of classes.
pub const NUM_CLASSES: usize = 10;

/// The class names, by label.
pub const CLASS_NAMES: [&str; NUM_CLASSES] = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
];

/// Shape of one sample: `(channels, height, width)`.
pub const SAMPLE_SHAPE: [usize; 3] = [3, 32, 32];

/// Bytes of one image: 3 × 32 × 32.
pub const IMAGE_LEN: usize = 3 * 32 * 32;

/// Bytes of one record: the label byte and the image.
pub const RECORD_LEN: usize = 1 + IMAGE_LEN;

/// Records per file in the official set. The reader accepts any whole number of records.
pub const RECORDS_PER_FILE: usize = 10_000;

/// The six file names, training files first.
fn all_files() -> impl Iterator<Item = &'static str> {
    TRAIN_FILES.into_iter().chain([TEST_FILE])
}

/// The training and test sets.
#[derive(Debug, Clone)]
pub struct Cifar10 {
    /// The 50,000 training images (`data_batch_1.bin` to `data_batch_5.bin`, in that order),
    /// named `cifar10 (train)`.
    pub train: Cifar10Dataset,
    /// The 10,000 test images (`test_batch.bin`), named `cifar10 (test)`.
    pub test: Cifar10Dataset,
}

impl Cifar10 {
    /// Both sets with one-hot targets (`Values([10])`).
    pub fn one_hot(self) -> Self {
        Self {
            train: self.train.one_hot(),
            test: self.test.one_hot(),
        }
    }

    /// Both sets with the training set's [`MeanImage`] subtracted, as in the tutorial.
    pub fn mean_subtracted(
        self,
    ) -> Result<(
        MeanSubtracted<Cifar10Dataset>,
        MeanSubtracted<Cifar10Dataset>,
    )> {
        let mean = MeanImage::compute(&self.train)?;
        Ok((
            mean.subtract_from(self.train)?,
            mean.subtract_from(self.test)?,
        ))
    }
}

/// CIFAR-format images held as bytes, converted to `f32` one sample at a time.
///
/// Sample `i` is `pixels[i * 3072..(i + 1) * 3072]` times the [scale](Self::with_scale) (1 by
/// default: values 0..255, as the tutorial feeds them before mean subtraction), shaped
/// `[3, 32, 32]`. Its target is the class index `labels[i]` or, after
/// [`one_hot`](Self::one_hot), a one-hot row of 10. Cloning shares the bytes.
#[derive(Clone)]
pub struct Cifar10Dataset {
    name: String,
    labels: Arc<Vec<u8>>,
    pixels: Arc<Vec<u8>>,
    scale: f32,
    one_hot: bool,
}

impl std::fmt::Debug for Cifar10Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cifar10Dataset")
            .field("name", &self.name)
            .field("len", &self.labels.len())
            .field("scale", &self.scale)
            .field("one_hot", &self.one_hot)
            .finish_non_exhaustive()
    }
}

impl Cifar10Dataset {
    /// A dataset from `labels` (one byte per image, 0..9) and `pixels` (3,072 bytes per image,
    /// CHW, red plane first), named `cifar10`.
    ///
    /// Errors when `pixels` does not hold 3,072 bytes for each label, or a label is above 9.
    pub fn new(pixels: Vec<u8>, labels: Vec<u8>) -> Result<Self> {
        if pixels.len() != labels.len() * IMAGE_LEN {
            return Err(Error::invalid(format!(
                "{} labels need {} pixel bytes ({IMAGE_LEN} per image), got {}",
                labels.len(),
                labels.len() * IMAGE_LEN,
                pixels.len()
            )));
        }
        if let Some(i) = labels.iter().position(|&l| usize::from(l) >= NUM_CLASSES) {
            return Err(Error::invalid(format!(
                "label {} of image {i} is not a CIFAR-10 class 0..9",
                labels[i]
            )));
        }
        Ok(Self {
            name: "cifar10".to_string(),
            labels: Arc::new(labels),
            pixels: Arc::new(pixels),
            scale: 1.0,
            one_hot: false,
        })
    }

    /// Sets the name used in error messages and logs.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Targets become one-hot rows of 10 (`Values([10])`), for the categorical losses.
    pub fn one_hot(mut self) -> Self {
        self.one_hot = true;
        self
    }

    /// Targets become class indices again (`Classes(10)`), for the sparse losses.
    pub fn sparse(mut self) -> Self {
        self.one_hot = false;
        self
    }

    /// Multiplies every pixel byte by `scale` when reading, e.g. `1.0 / 255.0` for values in
    /// `[0, 1]`. Errors for a scale that is not a finite number.
    pub fn with_scale(mut self, scale: f32) -> Result<Self> {
        if !scale.is_finite() {
            return Err(Error::invalid(format!(
                "the pixel scale must be a finite number, got {scale}"
            )));
        }
        self.scale = scale;
        Ok(self)
    }

    /// The factor pixel bytes are multiplied by (1 unless set).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Whether targets are one-hot rows.
    pub fn is_one_hot(&self) -> bool {
        self.one_hot
    }

    /// The label of every image, 0..9.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The pixel bytes of every image, one after another.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// The 3,072 pixel bytes of image `index` (CHW), or `None` past the end.
    pub fn image(&self, index: usize) -> Option<&[u8]> {
        let start = index.checked_mul(IMAGE_LEN)?;
        self.pixels.get(start..start.checked_add(IMAGE_LEN)?)
    }
}

impl Dataset for Cifar10Dataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn sample_shape(&self) -> &[usize] {
        &SAMPLE_SHAPE
    }

    fn targets(&self) -> Targets {
        if self.one_hot {
            Targets::Values(vec![NUM_CLASSES])
        } else {
            Targets::Classes(NUM_CLASSES)
        }
    }

    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
        let width = if self.one_hot { NUM_CLASSES } else { 1 };
        let (Some(image), Some(&label)) = (self.image(index), self.labels.get(index)) else {
            return Err(super::out_of_range(&self.name, index, self.labels.len()));
        };
        super::check_buffers(&self.name, x, y, IMAGE_LEN, width)?;
        let scale = self.scale;
        for (v, &p) in x.iter_mut().zip(image) {
            *v = f32::from(p) * scale;
        }
        super::write_class(y, usize::from(label), self.one_hot);
        Ok(())
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// The directory under `dir` that holds all six files: `dir` itself or
/// `dir/cifar-10-batches-bin`, or `None` when neither does.
///
/// A file counts as there when an entry of its name is, whatever it is: [`load`] then says
/// what is wrong with one that is not a regular file rather than calling it missing.
pub fn find(dir: impl AsRef<Path>) -> Option<PathBuf> {
    let dir = dir.as_ref();
    [dir.to_path_buf(), dir.join(ARCHIVE_DIR)]
        .into_iter()
        .find(|d| all_files().all(|f| present(&d.join(f))))
}

/// Whether `path` names an entry of any kind (a broken symbolic link included).
fn present(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
}

/// Loads the training and test sets from `dir` or `dir/cifar-10-batches-bin`. Never touches
/// the network.
///
/// Each file may hold any whole, non-zero number of records (the official files hold 10,000;
/// test fixtures hold fewer).
///
/// Errors:
/// - [`Error::Data`] naming `dir` when a file is missing, saying which six files to put where
///   and where to get them;
/// - [`Error::Io`] naming the file when it cannot be read;
/// - [`Error::Data`] naming the file when it is not a regular file (a directory, a device such
///   as `/dev/zero`, a pipe, or a symbolic link to one of those or to nothing; none is read),
///   is empty, is not a whole number of 3,073-byte records (truncated: the message gives the
///   size and names the record cut short; nothing is read), or holds a label byte above 9 (the
///   message names the record).
pub fn load(dir: impl AsRef<Path>) -> Result<Cifar10> {
    let dir = dir.as_ref();
    let Some(found) = find(dir) else {
        return Err(missing_files(
            dir,
            "call `cifar10::load_or_download` to download them",
        ));
    };
    let paths: Vec<PathBuf> = TRAIN_FILES.iter().map(|f| found.join(f)).collect();
    let train = read_files(&paths)?.named("cifar10 (train)");
    let test = read_files(&[found.join(TEST_FILE)])?.named("cifar10 (test)");
    Ok(Cifar10 { train, test })
}

/// Loads one CIFAR-10 binary file, named after it (e.g. `cifar10 test_batch.bin`). Errors as
/// [`load`] does for a file.
pub fn load_file(path: impl AsRef<Path>) -> Result<Cifar10Dataset> {
    let path = path.as_ref();
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    Ok(read_files(&[path.to_path_buf()])?.named(format!("cifar10 {name}")))
}

/// [`load`], after downloading the official archive into `dir` when the files are missing
/// (see [`download`]).
///
/// When the download is impossible (no network, or kandle built without the `download`
/// feature) or fails, the error is the one [`load`] gives for missing files, with the reason
/// the download failed.
pub fn load_or_download(dir: impl AsRef<Path>) -> Result<Cifar10> {
    let dir = dir.as_ref();
    if find(dir).is_none() {
        download(dir)?;
    }
    load(dir)
}

/// Downloads the official archive from [`URL`], checks its MD5 ([`ARCHIVE_MD5`]) and unpacks
/// it into `dir/cifar-10-batches-bin`, which it returns. About 163 MB; prints one line to
/// standard error when it starts.
///
/// It is atomic: the archive goes to a temporary file in `dir` and is unpacked into a
/// temporary directory there, and the files are renamed into place only once the digest
/// matches and all six are present. Files already in `dir/cifar-10-batches-bin` are kept. On
/// failure nothing is left behind, and the error ([`Error::Data`] naming `dir`) says why, which
/// files to put where by hand, and where to get them.
///
/// Needs the cargo feature `download` (on by default); without it, this only returns that
/// error.
pub fn download(dir: impl AsRef<Path>) -> Result<PathBuf> {
    let dir = dir.as_ref();
    #[cfg(feature = "download")]
    {
        fetch::install(dir, URL, ARCHIVE_MD5).map_err(|e| {
            // A download error's reason names the URL already.
            let cause = match e {
                Error::Data { reason, .. } => reason,
                other => other.to_string(),
            };
            missing_files(dir, &format!("the download failed: {cause}"))
        })
    }
    #[cfg(not(feature = "download"))]
    {
        Err(missing_files(
            dir,
            "this build of kandle cannot download them: it lacks the cargo feature `download`",
        ))
    }
}

/// The error for missing files under `dir`, with a `note` on why they were not downloaded.
fn missing_files(dir: &Path, note: &str) -> Error {
    // Report the place that holds more of the files (the archive's layout when neither does).
    let sub = dir.join(ARCHIVE_DIR);
    let count = |d: &Path| all_files().filter(|f| present(&d.join(f))).count();
    let place = if count(dir) > count(&sub) { dir } else { &sub };
    let missing: Vec<&str> = all_files().filter(|f| !present(&place.join(f))).collect();
    let files = format!("{}, {TEST_FILE}", TRAIN_FILES.join(", "));
    Error::Data {
        path: dir.to_path_buf(),
        reason: format!(
            "the CIFAR-10 binary files are missing ({} not found in `{}`); {note}. To install \
             them by hand, put the six files {files} in `{}` or in `{}`: download {URL} (MD5 \
             {ARCHIVE_MD5}) and run `tar xzf cifar-10-binary.tar.gz -C {}`, which creates \
             `{ARCHIVE_DIR}/`",
            missing.join(", "),
            place.display(),
            sub.display(),
            dir.display(),
            dir.display(),
        ),
    }
}

/// Reads CIFAR-10 files one after another into one dataset.
fn read_files(paths: &[PathBuf]) -> Result<Cifar10Dataset> {
    let mut labels = Vec::new();
    let mut pixels = Vec::new();
    for path in paths {
        let bytes = read_file(path)?;
        parse_records(&bytes, path, &mut labels, &mut pixels)?;
    }
    Cifar10Dataset::new(pixels, labels)
}

/// The bytes of the CIFAR-10 file at `path`, after checking, before reading anything, that it
/// is a regular file (after symbolic links) of a size that holds whole records. Reads no more
/// than the size it checked, so a file that grows (or a device that never ends) is not read
/// to the end.
fn read_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let io_error = |e| Error::io("cannot read the CIFAR-10 file", path, e);
    let data_error = |reason: String| Error::Data {
        path: path.to_path_buf(),
        reason,
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) => {
            return Err(match std::fs::read_link(path) {
                Ok(target) => data_error(format!(
                    "it is a symbolic link to `{}`, which cannot be read: {e}",
                    target.display()
                )),
                Err(_) => io_error(e),
            });
        }
    };
    if !meta.is_file() {
        let link = std::fs::read_link(path)
            .map(|target| format!(" (a symbolic link to `{}`)", target.display()))
            .unwrap_or_default();
        return Err(data_error(format!(
            "not a regular file: it is {}{link}; CIFAR-10 files are regular files of \
             {RECORD_LEN}-byte records",
            kind_of(&meta.file_type())
        )));
    }
    check_size(meta.len(), path)?;
    let file = std::fs::File::open(path).map_err(io_error)?;
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(meta.len())
        .read_to_end(&mut bytes)
        .map_err(io_error)?;
    if bytes.len() as u64 != meta.len() {
        return Err(data_error(format!(
            "the file changed while it was read: expected {} bytes, read {}",
            meta.len(),
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// What kind of entry `kind` is, with its article, for "not a regular file" errors.
fn kind_of(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_fifo() {
            return "a named pipe";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "neither a regular file nor a directory"
    }
}

/// Checks that a CIFAR-10 file of `len` bytes holds a whole, non-zero number of records;
/// `path` names the file in errors.
fn check_size(len: u64, path: &Path) -> Result<()> {
    let data_error = |reason: String| Error::Data {
        path: path.to_path_buf(),
        reason,
    };
    if len == 0 {
        return Err(data_error("the file is empty: it holds no record".into()));
    }
    let record = RECORD_LEN as u64;
    let (whole, rest) = (len / record, len % record);
    if rest != 0 {
        return Err(data_error(format!(
            "wrong size: expected a whole number of {RECORD_LEN}-byte records ({} bytes for \
             the official {RECORDS_PER_FILE}), got {len} bytes: record {whole} (counting from \
             0) is cut short after {rest} bytes. Truncated download?",
            RECORDS_PER_FILE * RECORD_LEN
        )));
    }
    Ok(())
}

/// Appends the records in `bytes` to `labels` and `pixels`; `path` names the file in errors.
fn parse_records(
    bytes: &[u8],
    path: &Path,
    labels: &mut Vec<u8>,
    pixels: &mut Vec<u8>,
) -> Result<()> {
    let data_error = |reason: String| Error::Data {
        path: path.to_path_buf(),
        reason,
    };
    check_size(bytes.len() as u64, path)?;
    let whole = bytes.len() / RECORD_LEN;
    labels.reserve(whole);
    pixels.reserve(whole * IMAGE_LEN);
    for (i, record) in bytes.chunks_exact(RECORD_LEN).enumerate() {
        let label = record[0];
        if usize::from(label) >= NUM_CLASSES {
            return Err(data_error(format!(
                "record {i} (counting from 0, at byte {}) has label {label}, not a class 0..9. \
                 Is this the CIFAR-100 binary format, with two label bytes?",
                i * RECORD_LEN
            )));
        }
        labels.push(label);
        pixels.extend_from_slice(&record[1..]);
    }
    Ok(())
}

/// Writes `data` into `dir` (created if needed) in the official binary format, so that
/// [`load`]`(dir)` reads it back: the training set split over the five training files in
/// order, as evenly as possible (the first `train.len() % 5` files hold one record more), and
/// the test set in `test_batch.bin`. Each record is the label byte, then the 3,072 pixel
/// bytes. Each file is written through a temporary file and renamed into place. The scale and
/// one-hot setting of the datasets are not stored: the format holds bytes and labels only.
///
/// This turns any labelled set of 32×32 colour images into files that CIFAR-10 programs read.
///
/// Errors when the training set has fewer than 5 images or the test set none (the reader
/// rejects empty files), or a file cannot be written ([`Error::Io`] naming it).
pub fn save(dir: impl AsRef<Path>, data: &Cifar10) -> Result<()> {
    let dir = dir.as_ref();
    let (train, test) = (data.train.len(), data.test.len());
    if train < TRAIN_FILES.len() || test == 0 {
        return Err(Error::invalid(format!(
            "saving a CIFAR-10 set needs at least one record per file: {} training images for \
             the {} training files and one test image, got {train} and {test}",
            TRAIN_FILES.len(),
            TRAIN_FILES.len()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
    let files = TRAIN_FILES.len();
    let mut start = 0;
    for (k, file) in TRAIN_FILES.iter().enumerate() {
        let end = start + train / files + usize::from(k < train % files);
        write_records(&dir.join(file), &data.train, start..end)?;
        start = end;
    }
    write_records(&dir.join(TEST_FILE), &data.test, 0..test)
}

/// Writes the records of images `range` of `data` to `path`, atomically.
fn write_records(path: &Path, data: &Cifar10Dataset, range: std::ops::Range<usize>) -> Result<()> {
    let mut bytes = Vec::with_capacity(range.len() * RECORD_LEN);
    for (&label, image) in data.labels[range.clone()]
        .iter()
        .zip(data.pixels[range.start * IMAGE_LEN..range.end * IMAGE_LEN].chunks_exact(IMAGE_LEN))
    {
        bytes.push(label);
        bytes.extend_from_slice(image);
    }
    crate::checkpoint::write_atomically(path, &bytes)
}

/// The download and atomic install of the official archive.
#[cfg(feature = "download")]
mod fetch {
    use super::*;
    use crate::data::download::{fetch_verified, unpack_tar_gz, TempPath};

    /// Downloads `url`, checks `md5` and moves the six files into `dir/cifar-10-batches-bin`.
    pub(super) fn install(dir: &Path, url: &str, md5: &str) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
        let archive = TempPath::new_in(dir, "cifar-10-binary.tar.gz");
        log::info!(
            "downloading CIFAR-10 (about 163 MB) from {url} into `{}`",
            dir.display()
        );
        fetch_verified(url, md5, archive.path())?;
        let unpacked = TempPath::new_in(dir, "cifar-10-unpack");
        unpack_tar_gz(archive.path(), unpacked.path())?;
        let src = unpacked.path().join(ARCHIVE_DIR);
        if let Some(absent) = all_files().find(|f| !src.join(f).is_file()) {
            return Err(Error::Data {
                path: url.into(),
                reason: format!("the archive has no `{ARCHIVE_DIR}/{absent}`"),
            });
        }
        let target = dir.join(ARCHIVE_DIR);
        if !target.exists() && std::fs::rename(&src, &target).is_ok() {
            return Ok(target);
        }
        // Some files are already there: add the missing ones, one rename each.
        std::fs::create_dir_all(&target).map_err(|e| Error::io("cannot create", &target, e))?;
        for file in all_files() {
            let to = target.join(file);
            if !to.is_file() {
                std::fs::rename(src.join(file), &to)
                    .map_err(|e| Error::io("cannot move the downloaded file to", &to, e))?;
            }
        }
        Ok(target)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use kandle_testing::cifar10_fixture::write_fixture;

    fn fixture(train: usize, test: usize) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write_fixture(dir.path(), train, test, 7).unwrap();
        dir
    }

    #[test]
    fn reads_what_the_fixture_wrote() {
        let dir = fixture(3, 4);
        let data = load(dir.path()).unwrap();
        assert_eq!((data.train.len(), data.test.len()), (15, 4));
        assert_eq!(data.train.name(), "cifar10 (train)");
        assert_eq!(data.test.name(), "cifar10 (test)");
        assert_eq!(data.train.sample_shape(), &[3, 32, 32]);
        assert_eq!(data.train.targets(), Targets::Classes(10));
        // Record 1 of data_batch_2.bin is training sample 4.
        let bytes = std::fs::read(dir.path().join("data_batch_2.bin")).unwrap();
        let record = &bytes[RECORD_LEN..2 * RECORD_LEN];
        let (mut x, mut y) = (vec![0f32; IMAGE_LEN], vec![0f32; 1]);
        data.train.read(4, &mut x, &mut y).unwrap();
        assert_eq!(y[0], f32::from(record[0]));
        // CHW: red plane first; pixel (c, r, col) is byte 1 + c*1024 + r*32 + col.
        for (c, r, col) in [(0, 0, 0), (1, 5, 7), (2, 31, 31)] {
            let at = c * 1024 + r * 32 + col;
            assert_eq!(x[at], f32::from(record[1 + at]));
        }
        assert_eq!(data.train.image(4), Some(&record[1..]));
        assert_eq!(data.train.image(15), None);
        let one = load_file(dir.path().join(TEST_FILE)).unwrap();
        assert_eq!(one.len(), 4);
        assert_eq!(one.name(), "cifar10 test_batch.bin");
    }

    #[test]
    fn finds_the_archive_layout_and_the_fixture_repeats() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join(ARCHIVE_DIR);
        write_fixture(&sub, 2, 2, 3).unwrap();
        assert_eq!(find(dir.path()), Some(sub.clone()));
        let data = load(dir.path()).unwrap();
        let again = fixture(2, 2);
        write_fixture(again.path(), 2, 2, 3).unwrap();
        let same = load(again.path()).unwrap();
        assert_eq!(data.train.pixels(), same.train.pixels());
        assert_eq!(data.test.labels(), same.test.labels());
    }

    #[test]
    fn one_hot_scale_and_bad_reads() {
        let dir = fixture(2, 2);
        let data = load(dir.path()).unwrap().one_hot();
        let train = data.train.with_scale(1.0 / 255.0).unwrap();
        assert_eq!(train.targets(), Targets::Values(vec![10]));
        let (mut x, mut y) = (vec![0f32; IMAGE_LEN], vec![0f32; 10]);
        train.read(1, &mut x, &mut y).unwrap();
        let label = usize::from(train.labels()[1]);
        let mut hot = vec![0f32; 10];
        hot[label] = 1.0;
        assert_eq!(y, hot);
        assert!(x.iter().all(|&v| (0.0..=1.0).contains(&v)));
        assert_eq!(x[9], f32::from(train.image(1).unwrap()[9]) * (1.0 / 255.0));
        assert!(train.read(10, &mut x, &mut y).is_err());
        assert!(train.read(0, &mut x, &mut y[..1]).is_err());
        assert!(train.clone().with_scale(f32::NAN).is_err());
        assert_eq!(train.sparse().targets(), Targets::Classes(10));
        assert!(Cifar10Dataset::new(vec![0; 5], vec![0]).is_err());
        assert!(Cifar10Dataset::new(vec![0; IMAGE_LEN], vec![10]).is_err());
        assert!(write_fixture(dir.path(), 0, 1, 0).is_err());
    }

    #[test]
    fn fixture_labels_are_learnable_and_balanced() {
        let dir = fixture(200, 10);
        let train = load(dir.path()).unwrap().train;
        let mut counts = [0usize; 10];
        for (i, &label) in train.labels().iter().enumerate() {
            counts[usize::from(label)] += 1;
            let image = train.image(i).unwrap();
            let start = usize::from(label % 3) * 1024 + usize::from(label / 3) * 256;
            assert!(image[start..start + 256].iter().all(|&p| p >= 100));
        }
        assert!(counts.iter().all(|&c| c > 60), "{counts:?}");
    }

    #[test]
    fn save_splits_the_training_set_and_load_reads_it_back() {
        // Seven distinct images: the training files hold 2, 2, 1, 1, 1 records.
        let image = |k: u8| -> Vec<u8> { (0..IMAGE_LEN).map(|i| (i % 251) as u8 ^ k).collect() };
        let train = Cifar10Dataset::new(
            (0..7).flat_map(|k| image(k * 30)).collect(),
            vec![3, 1, 4, 1, 5, 9, 2],
        )
        .unwrap()
        .one_hot();
        let test = Cifar10Dataset::new(image(200), vec![6])
            .unwrap()
            .with_scale(0.5)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("made");
        save(
            &out,
            &Cifar10 {
                train: train.clone(),
                test: test.clone(),
            },
        )
        .unwrap();
        let sizes: Vec<u64> = all_files()
            .map(|f| std::fs::metadata(out.join(f)).unwrap().len())
            .collect();
        let records: Vec<u64> = [2, 2, 1, 1, 1, 1].into();
        assert_eq!(
            sizes,
            records
                .iter()
                .map(|r| r * RECORD_LEN as u64)
                .collect::<Vec<_>>()
        );
        let file3 = std::fs::read(out.join("data_batch_3.bin")).unwrap();
        assert_eq!(file3[0], 5); // image 4 is the first of file 3
        assert_eq!(&file3[1..], train.image(4).unwrap());
        let back = load(&out).unwrap();
        assert_eq!(back.train.labels(), train.labels());
        assert_eq!(back.train.pixels(), train.pixels());
        assert_eq!(back.test.labels(), &[6]);
        assert_eq!(back.test.pixels(), test.pixels());
        // Only bytes and labels are stored.
        assert!(!back.train.is_one_hot() && back.test.scale() == 1.0);
        // Too few images for six non-empty files: nothing is written.
        let few = Cifar10 {
            train: Cifar10Dataset::new(image(0).repeat(4), vec![0; 4]).unwrap(),
            test: test.clone(),
        };
        let err = save(dir.path().join("few"), &few).unwrap_err().to_string();
        assert!(err.contains("got 4 and 1"), "{err}");
        assert!(!dir.path().join("few").exists());
        let none = Cifar10 {
            train,
            test: Cifar10Dataset::new(Vec::new(), Vec::new()).unwrap(),
        };
        assert!(save(dir.path().join("none"), &none).is_err());
    }

    #[test]
    fn missing_files_say_what_to_put_where() {
        let dir = tempfile::tempdir().unwrap();
        let err = load(dir.path()).unwrap_err();
        let Error::Data { path, reason } = &err else {
            panic!("expected Error::Data, got {err:?}");
        };
        assert_eq!(path, dir.path());
        let text = err.to_string();
        for name in all_files() {
            assert!(text.contains(name), "{text}");
        }
        assert!(text.contains(URL) && text.contains(ARCHIVE_MD5), "{text}");
        let sub = dir.path().join(ARCHIVE_DIR);
        assert!(reason.contains(&format!("`{}`", sub.display())), "{reason}");
        // With five of six present, the one missing file is named.
        write_fixture(dir.path(), 1, 1, 0).unwrap();
        std::fs::remove_file(dir.path().join("data_batch_4.bin")).unwrap();
        let text = load(dir.path()).unwrap_err().to_string();
        assert!(text.contains("(data_batch_4.bin not found in"), "{text}");
    }

    #[test]
    fn truncated_and_bad_label_files_name_the_file_and_record() {
        let dir = fixture(3, 2);
        let path = dir.path().join("data_batch_3.bin");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..2 * RECORD_LEN + 100]).unwrap();
        match load(dir.path()) {
            Err(Error::Data { path: p, reason }) => {
                assert_eq!(p, path);
                assert!(
                    reason.contains("record 2") && reason.contains("100 bytes"),
                    "{reason}"
                );
            }
            other => panic!("expected Error::Data, got {other:?}"),
        }
        let mut bad = bytes.clone();
        bad[RECORD_LEN] = 12;
        std::fs::write(&path, &bad).unwrap();
        match load(dir.path()) {
            Err(Error::Data { path: p, reason }) => {
                assert_eq!(p, path);
                assert!(
                    reason.contains("record 1") && reason.contains("label 12"),
                    "{reason}"
                );
            }
            other => panic!("expected Error::Data, got {other:?}"),
        }
        std::fs::write(&path, b"").unwrap();
        let err = load(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("data_batch_3.bin") && err.contains("empty"),
            "{err}"
        );
    }

    #[test]
    fn a_truncated_file_is_the_wrong_size_not_missing() {
        let dir = fixture(2, 2);
        let path = dir.path().join(TEST_FILE);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..RECORD_LEN + 7]).unwrap();
        for err in [load(dir.path()).unwrap_err(), load_file(&path).unwrap_err()] {
            let Error::Data { path: p, reason } = &err else {
                panic!("expected Error::Data, got {err:?}");
            };
            assert_eq!(p, &path);
            assert!(
                reason.contains("wrong size")
                    && reason.contains(&format!("got {} bytes", RECORD_LEN + 7))
                    && reason.contains(&format!("{}-byte records", RECORD_LEN))
                    && reason.contains("record 1")
                    && reason.contains("after 7 bytes"),
                "{reason}"
            );
        }
    }

    #[test]
    #[cfg(unix)]
    fn a_symlink_to_dev_zero_is_named_and_never_read() {
        let dir = fixture(1, 1);
        let path = dir.path().join("data_batch_2.bin");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        // Present, so not reported missing: the error says what the file really is.
        assert_eq!(find(dir.path()).as_deref(), Some(dir.path()));
        for err in [load(dir.path()).unwrap_err(), load_file(&path).unwrap_err()] {
            let Error::Data { path: p, reason } = &err else {
                panic!("expected Error::Data, got {err:?}");
            };
            assert_eq!(p, &path);
            assert!(
                reason.contains("not a regular file")
                    && reason.contains("character device")
                    && reason.contains("symbolic link to `/dev/zero`"),
                "{reason}"
            );
            assert!(!reason.contains("not found"), "{reason}");
        }
        // Every file a link to /dev/zero: the first one read is named, none is missing.
        for name in all_files() {
            let file = dir.path().join(name);
            std::fs::remove_file(&file).unwrap();
            std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
        }
        let text = load(dir.path()).unwrap_err().to_string();
        assert!(
            text.contains("data_batch_1.bin") && text.contains("not a regular file"),
            "{text}"
        );
    }

    #[test]
    #[cfg(unix)]
    fn a_directory_or_a_broken_link_in_place_of_a_file_is_named() {
        let dir = fixture(1, 1);
        let path = dir.path().join(TEST_FILE);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let err = load(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(TEST_FILE) && err.contains("not a regular file: it is a directory"),
            "{err}"
        );
        std::fs::remove_dir(&path).unwrap();
        let nowhere = dir.path().join("nowhere");
        std::os::unix::fs::symlink(&nowhere, &path).unwrap();
        let err = load(dir.path()).unwrap_err();
        let Error::Data { path: p, reason } = &err else {
            panic!("expected Error::Data, got {err:?}");
        };
        assert_eq!(p, &path);
        assert!(
            reason.contains(&format!("symbolic link to `{}`", nowhere.display())),
            "{reason}"
        );
    }

    #[test]
    fn mean_subtraction_of_both_sets() {
        let dir = fixture(4, 3);
        let data = load(dir.path()).unwrap();
        let pixels = data.train.pixels().to_vec();
        let (train, test) = data.mean_subtracted().unwrap();
        let mean = train.mean().values().to_vec();
        assert_eq!(test.mean().values(), &mean[..]);
        let expected0: f32 = (0..20)
            .map(|i| f32::from(pixels[i * IMAGE_LEN]))
            .sum::<f32>()
            / 20.0;
        assert!((mean[0] - expected0).abs() < 1e-4);
        let (mut x, mut y) = (vec![0f32; IMAGE_LEN], vec![0f32; 1]);
        test.read(0, &mut x, &mut y).unwrap();
        let raw = test.inner().image(0).unwrap();
        assert_eq!(x[5], f32::from(raw[5]) - mean[5]);
    }

    #[test]
    #[cfg(not(feature = "download"))]
    fn without_the_feature_download_explains() {
        let dir = tempfile::tempdir().unwrap();
        let text = load_or_download(dir.path()).unwrap_err().to_string();
        assert!(
            text.contains("lacks the cargo feature `download`"),
            "{text}"
        );
        assert!(
            text.contains("data_batch_1.bin") && text.contains(URL),
            "{text}"
        );
    }

    /// Reaches the real server: run with `--ignored` where the network allows.
    #[test]
    #[ignore = "downloads 163 MB from www.cs.toronto.edu"]
    fn the_real_archive_or_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        match load_or_download(dir.path()) {
            Ok(data) => assert_eq!((data.train.len(), data.test.len()), (50_000, 10_000)),
            Err(err) => {
                let text = err.to_string();
                eprintln!("{text}");
                assert!(
                    text.contains("test_batch.bin") && text.contains(URL),
                    "{text}"
                );
            }
        }
    }

    #[cfg(feature = "download")]
    mod download {
        use super::*;
        use md5::{Digest, Md5};
        use std::io::{Read, Write};

        /// The fixture as the official archive lays it out, gzip'd tar, and its MD5.
        fn archive(records: usize) -> (Vec<u8>, String) {
            let src = tempfile::tempdir().unwrap();
            write_fixture(src.path().join(ARCHIVE_DIR), records, records, 11).unwrap();
            let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            let mut tar = tar::Builder::new(gz);
            tar.append_dir_all(ARCHIVE_DIR, src.path().join(ARCHIVE_DIR))
                .unwrap();
            let bytes = tar.into_inner().unwrap().finish().unwrap();
            let md5: String = Md5::digest(&bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            (bytes, md5)
        }

        /// Serves `body` over plain HTTP to `requests` requests; returns the URL.
        fn serve(body: Vec<u8>, requests: usize) -> String {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let url = format!(
                "http://{}/cifar-10-binary.tar.gz",
                listener.local_addr().unwrap()
            );
            std::thread::spawn(move || {
                for stream in listener.incoming().take(requests) {
                    let mut stream = stream.unwrap();
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        let n = stream.read(&mut buf).unwrap();
                        if n == 0 {
                            break;
                        }
                        request.extend_from_slice(&buf[..n]);
                    }
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&body);
                }
            });
            url
        }

        /// The names in `dir`, sorted.
        fn entries(dir: &Path) -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }

        #[test]
        fn downloads_verifies_and_installs() {
            let (bytes, md5) = archive(2);
            let url = serve(bytes, 1);
            let dir = tempfile::tempdir().unwrap();
            let target = fetch::install(dir.path(), &url, &md5).unwrap();
            assert_eq!(target, dir.path().join(ARCHIVE_DIR));
            assert_eq!(entries(dir.path()), vec![ARCHIVE_DIR.to_string()]);
            let data = load(dir.path()).unwrap();
            assert_eq!((data.train.len(), data.test.len()), (10, 2));
        }

        #[test]
        fn keeps_files_already_there() {
            let (bytes, md5) = archive(2);
            let url = serve(bytes, 1);
            let dir = tempfile::tempdir().unwrap();
            let sub = dir.path().join(ARCHIVE_DIR);
            write_fixture(&sub, 3, 3, 5).unwrap();
            std::fs::remove_file(sub.join(TEST_FILE)).unwrap();
            fetch::install(dir.path(), &url, &md5).unwrap();
            let data = load(dir.path()).unwrap();
            // Training files kept (3 records each), the test file downloaded (2 records).
            assert_eq!((data.train.len(), data.test.len()), (15, 2));
            assert_eq!(entries(dir.path()), vec![ARCHIVE_DIR.to_string()]);
        }

        #[test]
        fn a_wrong_digest_installs_nothing() {
            let (bytes, _) = archive(1);
            let url = serve(bytes, 1);
            let dir = tempfile::tempdir().unwrap();
            let err = fetch::install(dir.path(), &url, ARCHIVE_MD5)
                .unwrap_err()
                .to_string();
            assert!(err.contains("MD5") && err.contains(ARCHIVE_MD5), "{err}");
            assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
        }

        #[test]
        fn an_unreachable_server_gives_the_instructions() {
            // Nothing listens on a port just released.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let dir = tempfile::tempdir().unwrap();
            let url = format!("http://127.0.0.1:{port}/cifar-10-binary.tar.gz");
            let cause = fetch::install(dir.path(), &url, ARCHIVE_MD5).unwrap_err();
            assert!(cause.to_string().contains(&url), "{cause}");
            let err = missing_files(dir.path(), &format!("the download failed: {cause}"));
            let text = err.to_string();
            assert!(
                text.contains("the download failed") && text.contains(&url),
                "{text}"
            );
            assert!(
                text.contains("test_batch.bin") && text.contains(URL),
                "{text}"
            );
            assert!(entries(dir.path()).is_empty());
        }
    }
}
