//! Finding the images and their classes, in a directory with one subfolder per class or in an
//! explicit list of files, and checking every file (its header, or a full decode) before
//! training starts.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;

use super::builder::Labelled;
use super::decode::Decode;
use super::{ImageFolderBuilder, MAX_UNNAMED_CLASSES};
use crate::{Error, Result};

impl ImageFolderBuilder {
    /// The class names for an explicit file list, checking its labels.
    pub(super) fn label_names(&self, files: &[(PathBuf, usize)]) -> Result<Vec<String>> {
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
    pub(super) fn scan(&self, dir: &Path) -> Result<(Labelled, Vec<String>)> {
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
    pub(super) fn check_files(
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
