//! The builder of an [`ImageFolder`] and its options: where the images come from, their size,
//! channels and resizing, the validation split, and what is checked, kept and skipped; `build`
//! checks the options and puts the dataset together from the files found, checked, shuffled
//! and split.

use std::path::PathBuf;

use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::decode::Decode;
use super::{cache, split, ImageFolder};
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
    pub(super) fn channels(self) -> usize {
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
pub(super) type Labelled = Vec<(PathBuf, usize)>;

/// Where the images come from.
#[derive(Debug, Clone)]
pub(super) enum Source {
    Dir(PathBuf),
    Files(Labelled),
}

/// The options of an [`ImageFolder`], set one by one, then [`build`](Self::build) or
/// [`build_split`](Self::build_split). Every setter only records its value: `build` checks
/// them all and returns an error for a bad one.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` or `build_split`"]
pub struct ImageFolderBuilder {
    pub(super) source: Source,
    pub(super) class_names: Option<Vec<String>>,
    pub(super) image_size: (usize, usize),
    pub(super) color_mode: ColorMode,
    pub(super) interpolation: Interpolation,
    pub(super) crop_to_aspect_ratio: bool,
    pub(super) validation_split: Option<f64>,
    pub(super) subset: Option<SplitSubset>,
    pub(super) shuffle: bool,
    pub(super) seed: u64,
    pub(super) follow_links: bool,
    pub(super) extensions: Vec<String>,
    pub(super) skip_bad_files: bool,
    pub(super) verify: bool,
    pub(super) cache: bool,
    pub(super) one_hot: bool,
    pub(super) max_pixels: u64,
}

impl ImageFolderBuilder {
    pub(super) fn new(source: Source) -> Self {
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
        split::check_fraction(self.validation_split)?;
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
        let split_at = split::validation_start(self.validation_split, n, &origin)?;
        let cache = self.cache.then(|| cache::slots(&order, &mut samples));
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
}
