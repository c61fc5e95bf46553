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

mod builder;
mod cache;
mod decode;
mod files;
mod resize;
mod split;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use builder::Source;
pub use builder::{
    ColorMode, ImageFolderBuilder, Interpolation, SplitSubset, DEFAULT_IMAGE_SIZE,
    DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, MAX_UNNAMED_CLASSES,
};
use decode::Decode;

use super::{Dataset, Targets};
use crate::Result;

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
