//! [`ImageFolder`]: labelled images read from files, as Keras's `image_dataset_from_directory`.
//!
//! The images come from a directory with one subfolder per class (`dir/cat/1.jpg`,
//! `dir/dog/2.png`; subfolders of a class folder count for that class) or from an explicit list
//! of `(file, label)` pairs. [`ImageFolder::from_dir`] and [`ImageFolder::from_files`] return an
//! [`ImageFolderBuilder`] whose options follow Keras's arguments; [`build`](ImageFolderBuilder::build)
//! scans the files and checks every image's header, so that unreadable files are found before
//! training starts, and [`build_split`](ImageFolderBuilder::build_split) returns the training
//! and validation subsets at once (Keras's `subset="both"`).
//!
//! Images are decoded with the `image` crate (JPEG, PNG, BMP, GIF, WebP; the format is told by
//! the file's content, the extension only selects which files a directory scan takes) inside
//! [`read`](Dataset::read), so in the loader's parallel workers, then center-cropped to the
//! target aspect ratio when asked and resized as `tf.image.resize` does (half-pixel centers, no
//! antialiasing). Samples are `f32` `(channels, height, width)` with values in `0..=255`, as
//! Keras gives them (scale them in the model, e.g. with a `Rescaling` layer, or divide by 255);
//! targets are class indices or, after [`one_hot`](ImageFolderBuilder::one_hot), one-hot rows.
//! With [`cache`](ImageFolderBuilder::cache), each sample is kept in memory after its first
//! read, so later epochs skip decoding (`4 × channels × height × width` bytes per image).
//!
//! ```
//! use kandle::data::{Dataset, ImageFolder, SplitSubset, Targets};
//!
//! # let dir = tempfile::tempdir()?;
//! # for (class, colour) in [("cat", [200u8, 30, 30]), ("dog", [30, 30, 200])] {
//! #     std::fs::create_dir(dir.path().join(class))?;
//! #     for i in 0..5 {
//! #         let path = dir.path().join(class).join(format!("{i}.png"));
//! #         image::RgbImage::from_pixel(6, 4, image::Rgb(colour)).save(path)?;
//! #     }
//! # }
//! // dir/cat/*.png and dir/dog/*.png
//! let (train, val) = ImageFolder::from_dir(dir.path())
//!     .image_size(32, 32)
//!     .validation_split(0.2)
//!     .seed(42)
//!     .build_split()?;
//! assert_eq!(train.class_names(), ["cat", "dog"]);
//! assert_eq!((train.len(), val.len()), (8, 2));
//! assert_eq!(train.sample_shape(), &[3, 32, 32]);
//! assert_eq!(train.targets(), Targets::Classes(2));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Bad input is never skipped silently and never panics: a missing or unreadable folder, a
//! folder without class subfolders, a class folder without images, a file that is not an image
//! or whose header is corrupt, each is an error naming the path. With
//! [`skip_bad_files`](ImageFolderBuilder::skip_bad_files), files whose header cannot be read
//! are dropped at build time with a logged warning instead. A file whose header reads but
//! whose data is corrupt (a truncated PNG) is found when it is decoded: by
//! [`read`](Dataset::read), as an error naming it, or at build time with
//! [`verify`](ImageFolderBuilder::verify), which decodes every image once.

use std::collections::HashSet;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

use super::{Dataset, Targets};
use crate::{Error, Result};

/// The extensions a directory scan takes by default, as Keras (compared case-insensitively).
pub const IMAGE_EXTENSIONS: [&str; 6] = ["jpg", "jpeg", "png", "bmp", "gif", "webp"];

/// The default [`image_size`](ImageFolderBuilder::image_size), as Keras: 256 × 256.
pub const DEFAULT_IMAGE_SIZE: (usize, usize) = (256, 256);

/// The most classes an explicit file list may have without
/// [`class_names`](ImageFolderBuilder::class_names): labels are below it.
pub const MAX_UNNAMED_CLASSES: usize = 1 << 20;

/// The default [`max_pixels`](ImageFolderBuilder::max_pixels): 100 megapixels.
pub const DEFAULT_MAX_PIXELS: u64 = 100_000_000;

/// The channels of the samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColorMode {
    /// Three channels, red, green, blue (an alpha channel is dropped, as Keras does).
    #[default]
    Rgb,
    /// One channel: the luma `0.299 R + 0.587 G + 0.114 B` (ITU-R 601, as TensorFlow's
    /// decoders), rounded to an integer as a decoded 8-bit image would be.
    Grayscale,
}

impl ColorMode {
    fn channels(self) -> usize {
        match self {
            ColorMode::Rgb => 3,
            ColorMode::Grayscale => 1,
        }
    }
}

/// How images are resized to the target size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Interpolation {
    /// Bilinear, with half-pixel centers and no antialiasing (`tf.image.resize`'s default).
    #[default]
    Bilinear,
    /// Nearest neighbour, with half-pixel centers.
    Nearest,
}

/// Which side of a [`validation_split`](ImageFolderBuilder::validation_split) a dataset is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitSubset {
    /// The first `n - floor(fraction × n)` images of the (shuffled) file list.
    Training,
    /// The last `floor(fraction × n)` images of the (shuffled) file list.
    Validation,
}

/// Image files with their labels.
type Labelled = Vec<(PathBuf, usize)>;

/// Where the images come from.
#[derive(Debug, Clone)]
enum Source {
    Dir(PathBuf),
    Files(Labelled),
}

/// The options of an [`ImageFolder`], set one by one, then [`build`](Self::build) or
/// [`build_split`](Self::build_split). Every setter only records its value: `build` checks
/// them all and returns an error for a bad one.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` or `build_split`"]
pub struct ImageFolderBuilder {
    source: Source,
    class_names: Option<Vec<String>>,
    image_size: (usize, usize),
    color_mode: ColorMode,
    interpolation: Interpolation,
    crop_to_aspect_ratio: bool,
    validation_split: Option<f64>,
    subset: Option<SplitSubset>,
    shuffle: bool,
    seed: u64,
    follow_links: bool,
    extensions: Vec<String>,
    skip_bad_files: bool,
    verify: bool,
    cache: bool,
    one_hot: bool,
    max_pixels: u64,
}

/// Labelled images read from files: scanned and header-checked when built, decoded, cropped
/// and resized in [`read`](Dataset::read), as `(channels, height, width)` `f32` in `0..=255`.
/// Built with [`ImageFolder::from_dir`] or [`ImageFolder::from_files`]; see the [module
/// documentation](self).
pub struct ImageFolder {
    name: String,
    files: Vec<PathBuf>,
    labels: Vec<usize>,
    class_names: Vec<String>,
    sample_shape: [usize; 3],
    decode: Decode,
    one_hot: bool,
    /// One slot per file when caching: the sample as `read` writes it.
    cache: Option<Vec<OnceLock<Arc<[f32]>>>>,
}

/// How a file becomes a sample.
#[derive(Debug, Clone, Copy)]
struct Decode {
    color_mode: ColorMode,
    interpolation: Interpolation,
    crop_to_aspect_ratio: bool,
    size: (usize, usize),
    max_pixels: u64,
}

impl std::fmt::Debug for ImageFolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageFolder")
            .field("name", &self.name)
            .field("len", &self.files.len())
            .field("class_names", &self.class_names)
            .field("sample_shape", &self.sample_shape)
            .field("decode", &self.decode)
            .field("one_hot", &self.one_hot)
            .field("cache", &self.cache.is_some())
            .finish_non_exhaustive()
    }
}

impl ImageFolder {
    /// Images from `dir`, one subfolder per class: the classes are the subfolders' names in
    /// sorted order (labels `0..k`), unless [`class_names`](ImageFolderBuilder::class_names)
    /// gives them. Each class folder is searched recursively for files with an image extension
    /// ([`IMAGE_EXTENSIONS`] unless [`extensions`](ImageFolderBuilder::extensions) says
    /// otherwise); other files are ignored, as are files directly in `dir`.
    pub fn from_dir(dir: impl Into<PathBuf>) -> ImageFolderBuilder {
        ImageFolderBuilder::new(Source::Dir(dir.into()))
    }

    /// Images from an explicit list of `(file, label)` pairs, taken whatever their extension.
    /// The classes are `0..=max label`, named by their numbers unless
    /// [`class_names`](ImageFolderBuilder::class_names) gives them (without names, labels
    /// must be below [`MAX_UNNAMED_CLASSES`]).
    ///
    /// ```
    /// use kandle::data::{Dataset, ImageFolder};
    ///
    /// # let dir = tempfile::tempdir()?;
    /// # let (a, b) = (dir.path().join("a.png"), dir.path().join("b.bmp"));
    /// # image::RgbImage::from_pixel(3, 3, image::Rgb([9, 9, 9])).save(&a)?;
    /// # image::RgbImage::from_pixel(5, 2, image::Rgb([1, 2, 3])).save(&b)?;
    /// let ds = ImageFolder::from_files([(a, 0), (b, 1)])
    ///     .class_names(["ok", "defect"])
    ///     .image_size(4, 4)
    ///     .shuffle(false) // keep the list's order
    ///     .build()?;
    /// let (mut x, mut y) = (vec![0.0; 3 * 4 * 4], [0.0]);
    /// ds.read(1, &mut x, &mut y)?;
    /// assert_eq!((x[0], x[16], x[32], y[0]), (1.0, 2.0, 3.0, 1.0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_files<P: Into<PathBuf>>(
        files: impl IntoIterator<Item = (P, usize)>,
    ) -> ImageFolderBuilder {
        let files = files.into_iter().map(|(p, l)| (p.into(), l)).collect();
        ImageFolderBuilder::new(Source::Files(files))
    }

    /// The class names, by label.
    pub fn class_names(&self) -> &[String] {
        &self.class_names
    }

    /// The image files, in sample order.
    pub fn file_paths(&self) -> &[PathBuf] {
        &self.files
    }

    /// The label of every sample, in sample order.
    pub fn labels(&self) -> &[usize] {
        &self.labels
    }

    /// Sets the name used in error messages and logs.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Whether decoded samples are kept in memory.
    pub fn is_cached(&self) -> bool {
        self.cache.is_some()
    }

    /// Sample `index` as [`read`](Dataset::read) writes it: decoded, or from the cache.
    fn sample(&self, index: usize, path: &Path) -> Result<Arc<[f32]>> {
        let slot = self.cache.as_ref().and_then(|c| c.get(index));
        if let Some(hit) = slot.and_then(OnceLock::get) {
            return Ok(hit.clone());
        }
        let decoded: Arc<[f32]> = self.decode.sample(path)?.into();
        if let Some(slot) = slot {
            // Another worker may have filled it meanwhile: both hold the same values.
            let _ = slot.set(decoded.clone());
        }
        Ok(decoded)
    }
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn sample_shape(&self) -> &[usize] {
        &self.sample_shape
    }

    fn targets(&self) -> Targets {
        let k = self.class_names.len();
        if self.one_hot {
            Targets::Values(vec![k])
        } else {
            Targets::Classes(k)
        }
    }

    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
        let (Some(path), Some(&label)) = (self.files.get(index), self.labels.get(index)) else {
            return Err(super::out_of_range(&self.name, index, self.files.len()));
        };
        let len = self.sample_shape.iter().product();
        super::check_buffers(&self.name, x, y, len, self.targets().width())?;
        x.copy_from_slice(&self.sample(index, path)?);
        super::write_class(y, label, self.one_hot);
        Ok(())
    }

    fn name(&self) -> &str {
        &self.name
    }
}

impl ImageFolderBuilder {
    fn new(source: Source) -> Self {
        Self {
            source,
            class_names: None,
            image_size: DEFAULT_IMAGE_SIZE,
            color_mode: ColorMode::Rgb,
            interpolation: Interpolation::Bilinear,
            crop_to_aspect_ratio: false,
            validation_split: None,
            subset: None,
            shuffle: true,
            seed: 0,
            follow_links: false,
            extensions: IMAGE_EXTENSIONS.iter().map(|e| e.to_string()).collect(),
            skip_bad_files: false,
            verify: false,
            cache: false,
            one_hot: false,
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }

    /// The size every image is resized to, `height × width`. Default 256 × 256, as Keras.
    pub fn image_size(mut self, height: usize, width: usize) -> Self {
        self.image_size = (height, width);
        self
    }

    /// Three channels (default) or one.
    pub fn color_mode(mut self, mode: ColorMode) -> Self {
        self.color_mode = mode;
        self
    }

    /// Bilinear (default) or nearest-neighbour resizing.
    pub fn interpolation(mut self, interpolation: Interpolation) -> Self {
        self.interpolation = interpolation;
        self
    }

    /// Whether to crop the largest centered window of the target aspect ratio before
    /// resizing, so that images are not distorted (Keras's `crop_to_aspect_ratio`). Default
    /// false: the whole image is stretched to the target size.
    pub fn crop_to_aspect_ratio(mut self, crop: bool) -> Self {
        self.crop_to_aspect_ratio = crop;
        self
    }

    /// For a directory, the classes in label order: exactly the subfolders' names (an error
    /// lists those missing or left out), in the order given rather than sorted. For a list of
    /// files, the names of labels `0..names.len()` (every label must be below it).
    pub fn class_names<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.class_names = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// Holds out the last `floor(fraction × n)` images of the file list, after the seeded
    /// shuffle, for validation (Keras's `validation_split`). `fraction` must be strictly
    /// between 0 and 1, and both sides must keep an image. [`build`](Self::build) then needs
    /// a [`subset`](Self::subset); [`build_split`](Self::build_split) returns both.
    pub fn validation_split(mut self, fraction: f64) -> Self {
        self.validation_split = Some(fraction);
        self
    }

    /// Which side of the [`validation_split`](Self::validation_split) [`build`](Self::build)
    /// returns. Built with the same seed and split, the two sides are disjoint and together
    /// hold every image.
    pub fn subset(mut self, subset: SplitSubset) -> Self {
        self.subset = Some(subset);
        self
    }

    /// Whether the file list is shuffled, once and with the [`seed`](Self::seed), before the
    /// validation split. Default true, as Keras. Unshuffled, samples are in class order and a
    /// validation split takes the last files of the last classes. (`fit` shuffles each epoch
    /// on its own; this only sets the dataset's order.)
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed of the file-list shuffle. Default 0: unlike Keras, the order is the same in
    /// every run unless asked otherwise, so a training and a validation subset built
    /// separately never overlap.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether a directory scan follows symbolic links to directories (class folders and
    /// folders inside them); a link cycle is followed once. Default false, as Keras: linked
    /// directories are skipped. Links to files are read either way.
    pub fn follow_links(mut self, follow: bool) -> Self {
        self.follow_links = follow;
        self
    }

    /// The file extensions a directory scan takes, without the dot, compared
    /// case-insensitively. Default [`IMAGE_EXTENSIONS`].
    pub fn extensions<S: Into<String>>(mut self, extensions: impl IntoIterator<Item = S>) -> Self {
        self.extensions = extensions
            .into_iter()
            .map(|e| e.into().trim_start_matches('.').to_ascii_lowercase())
            .collect();
        self
    }

    /// Whether a file whose header cannot be read (not an image, an unknown format, a
    /// corrupt header, a zero or oversized size) is dropped at build time with a logged
    /// warning rather than failing the build. Default false. Dropping happens before the
    /// shuffle and split, so the dataset's length is fixed once built; a class left without
    /// images is still an error. A file that fails to decode later, in `read`, is an error
    /// naming it: see [`verify`](Self::verify).
    pub fn skip_bad_files(mut self, skip: bool) -> Self {
        self.skip_bad_files = skip;
        self
    }

    /// Whether to decode every image at build time (in parallel), so that a file corrupt past
    /// its header is also found then (and dropped with [`skip_bad_files`](Self::skip_bad_files)).
    /// With [`cache`](Self::cache) the decoded samples are kept. Default false: only headers
    /// are read at build time.
    pub fn verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }

    /// Whether each sample is kept in memory after it is first decoded, so later epochs only
    /// copy it: `4 × channels × height × width` bytes per image (768 KiB for 256 × 256 RGB).
    /// Default false.
    pub fn cache(mut self, cache: bool) -> Self {
        self.cache = cache;
        self
    }

    /// Targets become one-hot rows (Keras's `label_mode="categorical"`), for the categorical
    /// losses. Default: class indices (`label_mode="int"`).
    pub fn one_hot(mut self) -> Self {
        self.one_hot = true;
        self
    }

    /// The largest image accepted, in pixels (width × height, before resizing); a larger one
    /// is a bad file. Bounds the memory a decode takes whatever a header declares. Default
    /// [`DEFAULT_MAX_PIXELS`].
    pub fn max_pixels(mut self, max: u64) -> Self {
        self.max_pixels = max;
        self
    }

    /// The dataset: the whole file list, or the [`subset`](Self::subset) of a
    /// [`validation_split`](Self::validation_split).
    ///
    /// Errors ([`Error::Io`] or [`Error::Data`], naming the path) for a folder that is missing
    /// or unreadable, one without class subfolders, a class folder without images, a file
    /// whose header cannot be read (unless skipped), and [`Error::InvalidInput`] for a bad
    /// option. Warns (`log::warn!`) when there is only one class: a classifier needs two.
    pub fn build(self) -> Result<ImageFolder> {
        let subset = match (self.validation_split, self.subset) {
            (None, None) => None,
            (Some(_), Some(subset)) => Some(subset),
            (Some(f), None) => {
                return Err(Error::invalid(format!(
                    "validation_split({f}) needs `subset(SplitSubset::Training)` or \
                     `subset(SplitSubset::Validation)`, or `build_split()` for both"
                )))
            }
            (None, Some(_)) => {
                return Err(Error::invalid(
                    "`subset` needs a `validation_split` fraction to split by",
                ))
            }
        };
        let (all, split_at) = self.collect()?;
        Ok(match subset {
            None => all,
            Some(SplitSubset::Training) => all.split_at(split_at).0,
            Some(SplitSubset::Validation) => all.split_at(split_at).1,
        })
    }

    /// Both sides of the [`validation_split`](Self::validation_split), training first, from
    /// one scan (Keras's `subset="both"`). Errors as [`build`](Self::build), and when no
    /// validation split is set.
    pub fn build_split(self) -> Result<(ImageFolder, ImageFolder)> {
        if self.validation_split.is_none() {
            return Err(Error::invalid(
                "`build_split` needs a `validation_split` fraction",
            ));
        }
        let (all, split_at) = self.collect()?;
        Ok(all.split_at(split_at))
    }

    /// Checks the options, scans, checks, shuffles: the whole dataset, and where a validation
    /// split starts (its length when there is none).
    fn collect(self) -> Result<(ImageFolder, usize)> {
        let (h, w) = self.image_size;
        if h == 0 || w == 0 {
            return Err(Error::invalid(format!(
                "image_size must be positive, got {h} × {w}"
            )));
        }
        let channels = self.color_mode.channels();
        if h.checked_mul(w)
            .and_then(|p| p.checked_mul(channels))
            .is_none()
        {
            return Err(Error::invalid(format!("image_size {h} × {w} is too large")));
        }
        if let Some(f) = self.validation_split {
            if !(f > 0.0 && f < 1.0) {
                return Err(Error::invalid(format!(
                    "the validation split must be strictly between 0 and 1, got {f}"
                )));
            }
        }
        let decode = Decode {
            color_mode: self.color_mode,
            interpolation: self.interpolation,
            crop_to_aspect_ratio: self.crop_to_aspect_ratio,
            size: self.image_size,
            max_pixels: self.max_pixels,
        };
        let (origin, mut files, class_names) = match &self.source {
            Source::Dir(dir) => {
                let (files, names) = self.scan(dir)?;
                (format!("image folder {}", dir.display()), files, names)
            }
            Source::Files(files) => (
                format!("{} image files", files.len()),
                files.clone(),
                self.label_names(files)?,
            ),
        };
        let mut samples = self.check_files(&mut files, &decode)?;
        if files.is_empty() {
            return Err(Error::invalid(format!(
                "every image of {origin} was dropped as unreadable: no image is left"
            )));
        }
        let mut per_class = vec![0usize; class_names.len()];
        for &(_, label) in &files {
            per_class[label] += 1;
        }
        let empty = class_names.iter().zip(&per_class).find(|(_, &n)| n == 0);
        if let (Source::Dir(dir), Some((name, _))) = (&self.source, empty) {
            return Err(Error::Data {
                path: dir.join(name),
                reason: "every image of this class folder was dropped as unreadable; a class \
                         needs at least one image"
                    .into(),
            });
        }
        log::info!(
            "{origin}: {} images in {} classes",
            files.len(),
            class_names.len()
        );
        if class_names.len() == 1 {
            log::warn!(
                "{origin} has a single class, `{}`: a classifier needs at least two",
                class_names[0]
            );
        }
        let n = files.len();
        let mut order: Vec<usize> = (0..n).collect();
        if self.shuffle {
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(self.seed));
        }
        let split_at = match self.validation_split {
            Some(f) => {
                let val = (f * n as f64).floor() as usize;
                if val == 0 || val >= n {
                    return Err(Error::invalid(format!(
                        "a validation split of {f} of the {n} images of {origin} leaves {} for \
                         training and {val} for validation; both need at least one",
                        n.saturating_sub(val)
                    )));
                }
                n - val
            }
            None => n,
        };
        let cache = self.cache.then(|| {
            order
                .iter()
                .map(|&i| {
                    let slot = OnceLock::new();
                    if let Some(sample) = samples.get_mut(i).and_then(Option::take) {
                        let _ = slot.set(sample);
                    }
                    slot
                })
                .collect()
        });
        let dataset = ImageFolder {
            name: origin,
            files: order.iter().map(|&i| files[i].0.clone()).collect(),
            labels: order.iter().map(|&i| files[i].1).collect(),
            class_names,
            sample_shape: [channels, h, w],
            decode,
            one_hot: self.one_hot,
            cache,
        };
        Ok((dataset, split_at))
    }

    /// The class names for an explicit file list, checking its labels.
    fn label_names(&self, files: &[(PathBuf, usize)]) -> Result<Vec<String>> {
        if files.is_empty() {
            return Err(Error::invalid("the list of image files is empty"));
        }
        let max = files.iter().map(|&(_, l)| l).max().unwrap_or(0);
        if self.class_names.is_none() && max >= MAX_UNNAMED_CLASSES {
            let path = files
                .iter()
                .find(|&&(_, l)| l == max)
                .map(|(p, _)| p.as_path());
            return Err(Error::invalid(format!(
                "`{}` has label {max}: without class names, labels must be below \
                 {MAX_UNNAMED_CLASSES} (the classes are 0..=the largest label)",
                path.unwrap_or(Path::new("")).display()
            )));
        }
        match &self.class_names {
            None => Ok((0..=max).map(|l| l.to_string()).collect()),
            Some(names) if max < names.len() => Ok(names.clone()),
            Some(names) => {
                let (path, label) = files
                    .iter()
                    .find(|&&(_, l)| l >= names.len())
                    .map_or((Path::new(""), max), |(p, l)| (p.as_path(), *l));
                Err(Error::invalid(format!(
                    "`{}` has label {label}, but only {} class names are given",
                    path.display(),
                    names.len()
                )))
            }
        }
    }

    /// The `(file, label)` pairs and class names of a directory with one subfolder per class.
    fn scan(&self, dir: &Path) -> Result<(Labelled, Vec<String>)> {
        let meta = std::fs::metadata(dir)
            .map_err(|e| Error::io("cannot read the image folder", dir, e))?;
        if !meta.is_dir() {
            return Err(Error::Data {
                path: dir.to_path_buf(),
                reason: "not a directory: expected a folder with one subfolder per class".into(),
            });
        }
        let mut subdirs = Vec::new();
        let mut loose = 0;
        for entry in read_dir(dir)? {
            if self.is_dir(&entry)? {
                if let Some(name) = entry.file_name().and_then(|n| n.to_str()) {
                    subdirs.push(name.to_string());
                } else {
                    log::warn!(
                        "skipping `{}`: a class folder's name must be valid UTF-8",
                        entry.display()
                    );
                }
            } else if self.has_image_extension(&entry) {
                loose += 1;
            }
        }
        subdirs.sort();
        if subdirs.is_empty() {
            let found = if loose > 0 {
                format!("it holds {loose} images directly; ")
            } else {
                String::new()
            };
            return Err(Error::Data {
                path: dir.to_path_buf(),
                reason: format!(
                    "no class subfolders: {found}expected one subfolder per class, such as \
                     `{}`",
                    dir.join("cats").join("1.jpg").display()
                ),
            });
        }
        let class_names = match &self.class_names {
            None => subdirs,
            Some(names) => {
                let missing: Vec<&str> = names
                    .iter()
                    .filter(|n| !subdirs.contains(n))
                    .map(String::as_str)
                    .collect();
                let extra: Vec<&str> = subdirs
                    .iter()
                    .filter(|s| !names.contains(s))
                    .map(String::as_str)
                    .collect();
                let unique: HashSet<&String> = names.iter().collect();
                if !missing.is_empty() || !extra.is_empty() || unique.len() != names.len() {
                    return Err(Error::Data {
                        path: dir.to_path_buf(),
                        reason: format!(
                            "the class names {names:?} do not match the subfolders {subdirs:?} \
                             (missing folders: {missing:?}; folders not named: {extra:?})"
                        ),
                    });
                }
                names.clone()
            }
        };
        let mut files = Vec::new();
        for (label, name) in class_names.iter().enumerate() {
            let class_dir = dir.join(name);
            let mut found = Vec::new();
            let mut visited = HashSet::new();
            self.walk(&class_dir, &mut found, &mut visited)?;
            if found.is_empty() {
                return Err(Error::Data {
                    path: class_dir,
                    reason: format!(
                        "the class folder holds no image (files ending in .{}); a class needs \
                         at least one image: add some or remove the folder",
                        self.extensions.join(", .")
                    ),
                });
            }
            found.sort();
            files.extend(found.into_iter().map(|f| (f, label)));
        }
        Ok((files, class_names))
    }

    /// Adds the image files under `dir` to `found`, recursively.
    fn walk(
        &self,
        dir: &Path,
        found: &mut Vec<PathBuf>,
        visited: &mut HashSet<PathBuf>,
    ) -> Result<()> {
        // A link cycle only shows when following links: the canonical path repeats.
        if self.follow_links {
            let canonical = std::fs::canonicalize(dir)
                .map_err(|e| Error::io("cannot read the image folder", dir, e))?;
            if !visited.insert(canonical) {
                return Ok(());
            }
        }
        for entry in read_dir(dir)? {
            if self.is_dir(&entry)? {
                self.walk(&entry, found, visited)?;
            } else if self.has_image_extension(&entry) {
                found.push(entry);
            }
        }
        Ok(())
    }

    /// Whether the scan descends into `path`: a directory, or a link to one when following
    /// links.
    fn is_dir(&self, path: &Path) -> Result<bool> {
        let meta = std::fs::symlink_metadata(path)
            .map_err(|e| Error::io("cannot read the image folder entry", path, e))?;
        if meta.file_type().is_symlink() {
            // A broken link is no directory; as a file, its header check names it.
            return Ok(self.follow_links && path.is_dir());
        }
        Ok(meta.is_dir())
    }

    fn has_image_extension(&self, path: &Path) -> bool {
        path.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| self.extensions.iter().any(|x| x.eq_ignore_ascii_case(e)))
    }

    /// Reads every file's header (or decodes it with `verify`), in parallel; drops the bad
    /// ones with a warning when skipping, or returns the first error. Returns the decoded
    /// samples when verifying with a cache (one per remaining file), or nothing.
    fn check_files(
        &self,
        files: &mut Vec<(PathBuf, usize)>,
        decode: &Decode,
    ) -> Result<Vec<Option<Arc<[f32]>>>> {
        let keep = self.verify && self.cache;
        let checked: Vec<Result<Option<Arc<[f32]>>>> = files
            .par_iter()
            .map(|(path, _)| {
                if self.verify {
                    let sample = decode.sample(path)?;
                    Ok(keep.then(|| sample.into()))
                } else {
                    decode.check_header(path).map(|_| None)
                }
            })
            .collect();
        let mut kept_files = Vec::with_capacity(files.len());
        let mut samples = Vec::with_capacity(files.len());
        for (file, result) in files.drain(..).zip(checked) {
            match result {
                Ok(sample) => {
                    kept_files.push(file);
                    samples.push(sample);
                }
                Err(e) if self.skip_bad_files => log::warn!("skipping a bad image file: {e}"),
                Err(e) => return Err(e),
            }
        }
        *files = kept_files;
        Ok(samples)
    }
}

/// The entries of `dir`, as paths.
fn read_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let error = |e| Error::io("cannot read the image folder", dir, e);
    std::fs::read_dir(dir)
        .map_err(error)?
        .map(|entry| entry.map(|e| e.path()).map_err(error))
        .collect()
}

impl ImageFolder {
    /// The samples before `at` (the training side) and from `at` on (the validation side), each
    /// with its cache slots.
    fn split_at(mut self, at: usize) -> (Self, Self) {
        let at = at.min(self.files.len());
        let validation = Self {
            name: format!("{} (validation)", self.name),
            files: self.files.split_off(at),
            labels: self.labels.split_off(at),
            class_names: self.class_names.clone(),
            sample_shape: self.sample_shape,
            decode: self.decode,
            one_hot: self.one_hot,
            cache: self.cache.as_mut().map(|c| c.split_off(at)),
        };
        self.name = format!("{} (training)", self.name);
        (self, validation)
    }
}

impl Decode {
    fn bad(path: &Path, reason: impl Into<String>) -> Error {
        Error::Data {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// An image reader for `path` with its format guessed from the content and the decoder's
    /// allocations bounded.
    fn reader(&self, path: &Path) -> Result<image::io::Reader<BufReader<std::fs::File>>> {
        let mut reader = image::io::Reader::open(path)
            .map_err(|e| Error::io("cannot read the image", path, e))?
            .with_guessed_format()
            .map_err(|e| Error::io("cannot read the image", path, e))?;
        if reader.format().is_none() {
            return Err(Self::bad(
                path,
                "not an image in a known format (JPEG, PNG, BMP, GIF or WebP)",
            ));
        }
        if reader.format() == Some(image::ImageFormat::WebP) {
            // The WebP decoder decodes the whole image when it is created, before any limit
            // applies: check the size its header declares first.
            if let Some((w, h)) = webp_dimensions(path)? {
                self.check_size(path, w, h)?;
            }
        }
        let mut limits = image::io::Limits::default();
        // Eight bytes a pixel covers RGBA at 16 bits, the largest decoded layout.
        limits.max_alloc = Some(self.max_pixels.saturating_mul(8).max(1 << 20));
        reader.limits(limits);
        Ok(reader)
    }

    /// Reads the header of `path`: its width and height, checked against the limit.
    fn check_header(&self, path: &Path) -> Result<(u32, u32)> {
        let reader = self.reader(path)?;
        let (w, h) = catch_decoder_panic(path, || reader.into_dimensions())?
            .map_err(|e| Self::bad(path, format!("cannot read the image header: {e}")))?;
        self.check_size(path, w, h)?;
        Ok((w, h))
    }

    fn check_size(&self, path: &Path, w: u32, h: u32) -> Result<()> {
        if w == 0 || h == 0 {
            return Err(Self::bad(path, format!("the image is empty: {w} × {h}")));
        }
        if u64::from(w) * u64::from(h) > self.max_pixels {
            return Err(Self::bad(
                path,
                format!(
                    "the image is {w} × {h}, more than the limit of {} pixels (see \
                     `max_pixels`)",
                    self.max_pixels
                ),
            ));
        }
        Ok(())
    }

    /// Decodes `path` and turns it into a sample: `(channels, height, width)`, cropped and
    /// resized.
    fn sample(&self, path: &Path) -> Result<Vec<f32>> {
        let reader = self.reader(path)?;
        let image = catch_decoder_panic(path, || reader.decode())?
            .map_err(|e| Self::bad(path, format!("cannot decode the image: {e}")))?;
        let (w, h) = (image.width(), image.height());
        self.check_size(path, w, h)?;
        let rgb = image.into_rgb8();
        let (w, h) = (w as usize, h as usize);
        let pixels = rgb.as_raw();
        let channels = self.color_mode.channels();
        // One plane per channel, 8-bit values as f32, at the source size.
        let mut planes = vec![0f32; channels * h * w];
        match self.color_mode {
            ColorMode::Rgb => {
                for (i, px) in pixels.chunks_exact(3).enumerate() {
                    for (c, &v) in px.iter().enumerate() {
                        planes[c * h * w + i] = f32::from(v);
                    }
                }
            }
            ColorMode::Grayscale => {
                for (out, px) in planes.iter_mut().zip(pixels.chunks_exact(3)) {
                    let [r, g, b] = [px[0], px[1], px[2]].map(f32::from);
                    *out = (0.299 * r + 0.587 * g + 0.114 * b).round().min(255.0);
                }
            }
        }
        let window = if self.crop_to_aspect_ratio {
            crop_window(h, w, self.size)
        } else {
            (0, 0, h, w)
        };
        let (th, tw) = self.size;
        let mut out = vec![0f32; channels * th * tw];
        for (src, dst) in planes
            .chunks_exact(h * w)
            .zip(out.chunks_exact_mut(th * tw))
        {
            resize_plane(src, w, window, dst, self.size, self.interpolation);
        }
        Ok(out)
    }
}

/// The width and height a WebP file's header declares (simple lossy, lossless or extended
/// format), or `None` when the header is not one of those; the decoder then reports it.
fn webp_dimensions(path: &Path) -> Result<Option<(u32, u32)>> {
    use std::io::Read;
    let mut header = [0u8; 30];
    let file =
        std::fs::File::open(path).map_err(|e| Error::io("cannot read the image", path, e))?;
    let mut len = 0;
    let mut reader = file.take(header.len() as u64);
    loop {
        match reader.read(&mut header[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("cannot read the image", path, e)),
        }
    }
    let header = &header[..len];
    let le = |at: usize, n: usize| -> Option<u32> {
        let bytes = header.get(at..at + n)?;
        Some(bytes.iter().rev().fold(0, |v, &b| (v << 8) | u32::from(b)))
    };
    Ok(match header.get(12..16) {
        // Lossy: a 14-bit width and height after the frame tag and start code.
        Some(b"VP8 ") => le(26, 2)
            .zip(le(28, 2))
            .map(|(w, h)| (w & 0x3fff, h & 0x3fff)),
        // Lossless: the signature byte, then 14 bits of width - 1 and of height - 1.
        Some(b"VP8L") => le(21, 4).map(|v| ((v & 0x3fff) + 1, ((v >> 14) & 0x3fff) + 1)),
        // Extended: 24 bits of canvas width - 1 and of height - 1.
        Some(b"VP8X") => le(24, 3).zip(le(27, 3)).map(|(w, h)| (w + 1, h + 1)),
        _ => None,
    })
}

/// Runs a decoder call, turning a panic inside the decoder into an error naming the file.
fn catch_decoder_panic<T>(path: &Path, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        Decode::bad(
            path,
            format!(
                "the image decoder failed on this file: {}",
                crate::error::panic_message(payload.as_ref())
            ),
        )
    })
}

/// The centered window `(top, left, height, width)` of an `h × w` image with the aspect ratio
/// of `target`, as Keras's `smart_resize`.
fn crop_window(h: usize, w: usize, target: (usize, usize)) -> (usize, usize, usize, usize) {
    let (th, tw) = (target.0 as f64, target.1 as f64);
    let crop_h = ((w as f64 * th / tw) as usize).clamp(1, h);
    let crop_w = ((h as f64 * tw / th) as usize).clamp(1, w);
    ((h - crop_h) / 2, (w - crop_w) / 2, crop_h, crop_w)
}

/// Resizes the `window` `(top, left, height, width)` of the plane `src` (row length `stride`)
/// into `dst` of size `size`, as `tf.image.resize` with half-pixel centers.
fn resize_plane(
    src: &[f32],
    stride: usize,
    window: (usize, usize, usize, usize),
    dst: &mut [f32],
    size: (usize, usize),
    interpolation: Interpolation,
) {
    let (top, left, h, w) = window;
    let (th, tw) = size;
    let at = |r: usize, c: usize| src[(top + r) * stride + left + c];
    match interpolation {
        Interpolation::Nearest => {
            let rows: Vec<usize> = (0..th).map(|o| nearest(o, h, th)).collect();
            let cols: Vec<usize> = (0..tw).map(|o| nearest(o, w, tw)).collect();
            for (row, &r) in dst.chunks_exact_mut(tw).zip(&rows) {
                for (v, &c) in row.iter_mut().zip(&cols) {
                    *v = at(r, c);
                }
            }
        }
        Interpolation::Bilinear => {
            let rows: Vec<(usize, usize, f32)> = (0..th).map(|o| linear(o, h, th)).collect();
            let cols: Vec<(usize, usize, f32)> = (0..tw).map(|o| linear(o, w, tw)).collect();
            for (row, &(r0, r1, fr)) in dst.chunks_exact_mut(tw).zip(&rows) {
                for (v, &(c0, c1, fc)) in row.iter_mut().zip(&cols) {
                    let top = at(r0, c0) + (at(r0, c1) - at(r0, c0)) * fc;
                    let bottom = at(r1, c0) + (at(r1, c1) - at(r1, c0)) * fc;
                    *v = top + (bottom - top) * fr;
                }
            }
        }
    }
}

/// The source index of output index `out` for nearest-neighbour resizing of `len` to
/// `target`.
fn nearest(out: usize, len: usize, target: usize) -> usize {
    let scale = len as f64 / target as f64;
    (((out as f64 + 0.5) * scale).floor() as usize).min(len - 1)
}

/// The two source indices and the weight of the second for bilinear resizing of `len` to
/// `target`.
fn linear(out: usize, len: usize, target: usize) -> (usize, usize, f32) {
    let scale = len as f64 / target as f64;
    let x = (out as f64 + 0.5) * scale - 0.5;
    let floor = x.floor();
    let lower = (floor.max(0.0) as usize).min(len - 1);
    let upper = (x.ceil().max(0.0) as usize).min(len - 1);
    (lower, upper, (x - floor) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_and_linear_follow_half_pixel_centers() {
        // Upsampling 2 to 4: output pixel centers at source 0.25, 0.75, 1.25, 1.75 (minus 0.5).
        assert_eq!(
            (0..4).map(|o| nearest(o, 2, 4)).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        assert_eq!(linear(0, 2, 4), (0, 0, 0.75));
        assert_eq!(linear(1, 2, 4), (0, 1, 0.25));
        assert_eq!(linear(3, 2, 4), (1, 1, 0.25));
        // Downsampling 4 to 2 samples between source pixels 0.5 and 2.5.
        assert_eq!(linear(0, 4, 2), (0, 1, 0.5));
        assert_eq!((0..2).map(|o| nearest(o, 4, 2)).collect::<Vec<_>>(), [1, 3]);
    }

    #[test]
    fn crop_window_keeps_the_target_aspect() {
        // A 7 × 5 image to a square: the middle 5 × 5.
        assert_eq!(crop_window(7, 5, (3, 3)), (1, 0, 5, 5));
        // A 4 × 10 image to 1 × 2: the middle 4 × 8.
        assert_eq!(crop_window(4, 10, (1, 2)), (0, 1, 4, 8));
        // Never empty.
        assert_eq!(crop_window(1, 100, (100, 1)), (0, 49, 1, 1));
    }
}
