//! `ImageFolder` against small images written into temporary folders: labels, class names,
//! shapes, pixel values after resizing in all five formats, grayscale, cropping, the seeded
//! validation split, the cache, every error path, skipping bad files, links, and a tiny model
//! that learns an image folder through `fit`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kandle::data::{ColorMode, Dataset, ImageFolder, Interpolation, SplitSubset, Targets};
use kandle::layers::Rescaling;
use kandle::prelude::*;
use kandle_testing::webp::solid_webp;

const RED: [u8; 3] = [200, 30, 40];
const GREEN: [u8; 3] = [20, 180, 60];
const BLUE: [u8; 3] = [10, 40, 220];

/// The five formats, one file each: `i.png`, `i.jpg`, ...
const FORMATS: [&str; 5] = ["png", "jpg", "bmp", "gif", "webp"];

/// Writes a solid `colour` image of `w × h` to `path`, in the format its extension names.
fn solid(path: &Path, w: u32, h: u32, colour: [u8; 3]) {
    if path.extension().is_some_and(|e| e == "webp") {
        std::fs::write(path, solid_webp(w, h, colour)).unwrap();
    } else {
        image::RgbImage::from_pixel(w, h, image::Rgb(colour))
            .save(path)
            .unwrap();
    }
}

/// `dir/a_red`, `dir/b_green`, `dir/c_blue`, each with one 5 × 7 image per format and a text
/// file that is not an image.
fn three_classes() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (class, colour) in [("a_red", RED), ("b_green", GREEN), ("c_blue", BLUE)] {
        let folder = dir.path().join(class);
        std::fs::create_dir(&folder).unwrap();
        for (i, ext) in FORMATS.iter().enumerate() {
            solid(&folder.join(format!("{i}.{ext}")), 5, 7, colour);
        }
        std::fs::write(folder.join("notes.txt"), "not an image").unwrap();
    }
    dir
}

fn read(ds: &dyn Dataset, index: usize) -> (Vec<f32>, Vec<f32>) {
    let mut x = vec![0.0; ds.sample_shape().iter().product()];
    let mut y = vec![0.0; ds.targets().width()];
    ds.read(index, &mut x, &mut y).unwrap();
    (x, y)
}

fn all(ds: &dyn Dataset) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..ds.len()).map(|i| read(ds, i)).collect()
}

/// Whether every value of each channel plane of `x` is within `tolerance` of `colour`.
fn is_colour(x: &[f32], colour: [u8; 3], tolerance: f32) -> bool {
    let plane = x.len() / 3;
    x.chunks_exact(plane)
        .zip(colour)
        .all(|(p, c)| p.iter().all(|&v| (v - f32::from(c)).abs() <= tolerance))
}

fn data_error_path(err: &Error) -> &Path {
    match err {
        Error::Data { path, .. } | Error::Io { path, .. } => path,
        other => panic!("expected an error naming a path, got {other:?}"),
    }
}

#[test]
fn reads_every_format_with_labels_from_sorted_folders() {
    let dir = three_classes();
    let ds = ImageFolder::from_dir(dir.path())
        .image_size(4, 6)
        .shuffle(false)
        .build()
        .unwrap();
    assert_eq!(ds.class_names(), ["a_red", "b_green", "c_blue"]);
    assert_eq!(ds.len(), 15);
    assert_eq!(ds.sample_shape(), &[3, 4, 6]);
    assert_eq!(ds.targets(), Targets::Classes(3));
    assert_eq!(ds.labels(), [[0; 5], [1; 5], [2; 5]].concat());
    // Sorted within a class: 0.png, 1.jpg, 2.bmp, 3.gif, 4.webp.
    let names: Vec<_> = ds.file_paths()[..5]
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["0.png", "1.jpg", "2.bmp", "3.gif", "4.webp"]);
    for (i, (x, y)) in all(&ds).into_iter().enumerate() {
        let colour = [RED, GREEN, BLUE][i / 5];
        // A solid image resizes to exactly its colour; JPEG is lossy by a step or two.
        let tolerance = if i % 5 == 1 { 3.0 } else { 0.0 };
        assert!(is_colour(&x, colour, tolerance), "{i}: {:?}", &x[..6]);
        assert_eq!(y, [(i / 5) as f32]);
    }
}

#[test]
fn extensions_are_case_insensitive_and_selectable() {
    let dir = three_classes();
    solid(&dir.path().join("a_red/UPPER.PNG"), 3, 3, RED);
    let ds = ImageFolder::from_dir(dir.path()).build().unwrap();
    assert_eq!(ds.len(), 16);
    assert_eq!(ds.sample_shape(), &[3, 256, 256]);
    let ds = ImageFolder::from_dir(dir.path())
        .extensions([".PNG", "bmp"])
        .build()
        .unwrap();
    assert_eq!(ds.len(), 7);
}

#[test]
fn resizes_as_tf_image_resize() {
    let dir = tempfile::tempdir().unwrap();
    let checker = dir.path().join("checker.png");
    image::GrayImage::from_raw(2, 2, vec![0, 255, 255, 0])
        .unwrap()
        .save(&checker)
        .unwrap();
    let nearest = ImageFolder::from_files([(&checker, 0)])
        .image_size(4, 4)
        .interpolation(Interpolation::Nearest)
        .color_mode(ColorMode::Grayscale)
        .build()
        .unwrap();
    let (x, _) = read(&nearest, 0);
    #[rustfmt::skip]
    assert_eq!(x, [
        0.0, 0.0, 255.0, 255.0,
        0.0, 0.0, 255.0, 255.0,
        255.0, 255.0, 0.0, 0.0,
        255.0, 255.0, 0.0, 0.0,
    ]);
    let bilinear = ImageFolder::from_files([(&checker, 0)])
        .image_size(4, 4)
        .build()
        .unwrap();
    let (x, _) = read(&bilinear, 0);
    assert_eq!(x.len(), 3 * 16);
    // Half-pixel centers: the corners are the source corners; output (1, 1) sits at source
    // (0.25, 0.25).
    assert_eq!((x[0], x[3], x[12], x[15]), (0.0, 255.0, 255.0, 0.0));
    assert_eq!(x[5], 95.625);
    assert_eq!(&x[..16], &x[16..32]);
}

#[test]
fn grayscale_is_the_rounded_luma() {
    let dir = three_classes();
    let ds = ImageFolder::from_dir(dir.path())
        .image_size(3, 3)
        .color_mode(ColorMode::Grayscale)
        .shuffle(false)
        .build()
        .unwrap();
    assert_eq!(ds.sample_shape(), &[1, 3, 3]);
    let (x, _) = read(&ds, 0);
    // 0.299 × 200 + 0.587 × 30 + 0.114 × 40 = 81.97.
    assert_eq!(x, [82.0; 9]);
}

#[test]
fn crop_to_aspect_ratio_takes_the_center() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.png");
    // 6 × 2: two red columns, two green, two blue.
    let image =
        image::RgbImage::from_fn(6, 2, |x, _| image::Rgb([RED, GREEN, BLUE][x as usize / 2]));
    image.save(&path).unwrap();
    let build = |crop| {
        ImageFolder::from_files([(&path, 0)])
            .image_size(2, 2)
            .interpolation(Interpolation::Nearest)
            .crop_to_aspect_ratio(crop)
            .build()
            .unwrap()
    };
    let (x, _) = read(&build(true), 0);
    assert!(is_colour(&x, GREEN, 0.0), "{x:?}");
    // Stretched, nearest takes source columns 1 and 4.
    let (x, _) = read(&build(false), 0);
    assert_eq!(&x[..4], [200.0, 10.0, 200.0, 10.0]);
}

#[test]
fn validation_split_is_seeded_disjoint_and_complete() {
    let dir = three_classes();
    let split = |seed| {
        ImageFolder::from_dir(dir.path())
            .image_size(2, 2)
            .validation_split(0.2)
            .seed(seed)
            .build_split()
            .unwrap()
    };
    let (train, val) = split(7);
    assert_eq!((train.len(), val.len()), (12, 3));
    assert!(train.name().ends_with("(training)"), "{}", train.name());
    let mut files: Vec<PathBuf> = [train.file_paths(), val.file_paths()].concat();
    files.sort();
    files.dedup();
    assert_eq!(files.len(), 15, "the two sides overlap");
    // The same seed gives the same split, built at once or one side at a time.
    let (again, _) = split(7);
    assert_eq!(again.file_paths(), train.file_paths());
    let one_side = |subset| {
        ImageFolder::from_dir(dir.path())
            .validation_split(0.2)
            .seed(7)
            .subset(subset)
            .build()
            .unwrap()
    };
    assert_eq!(
        one_side(SplitSubset::Validation).file_paths(),
        val.file_paths()
    );
    assert_eq!(one_side(SplitSubset::Training).labels(), train.labels());
    // Another seed, another order.
    let (other, _) = split(8);
    assert_ne!(other.file_paths(), train.file_paths());
    // Labels still follow the files.
    for (path, &label) in train.file_paths().iter().zip(train.labels()) {
        let class = path.parent().unwrap().file_name().unwrap();
        assert_eq!(class.to_str().unwrap(), train.class_names()[label]);
    }
}

#[test]
fn bad_options_are_errors() {
    let dir = three_classes();
    let builder = || ImageFolder::from_dir(dir.path());
    let invalid = |r: kandle::Result<ImageFolder>| match r {
        Err(Error::InvalidInput(msg)) => msg,
        other => panic!("expected InvalidInput, got {other:?}"),
    };
    let msg = invalid(builder().validation_split(0.2).build());
    assert!(msg.contains("subset"), "{msg}");
    for bad in [0.0, 1.0, -0.5, f64::NAN] {
        invalid(
            builder()
                .validation_split(bad)
                .subset(SplitSubset::Training)
                .build(),
        );
    }
    // 1% of 15 images is no image.
    let msg = invalid(
        builder()
            .validation_split(0.01)
            .subset(SplitSubset::Validation)
            .build(),
    );
    assert!(msg.contains("0 for validation"), "{msg}");
    invalid(builder().image_size(0, 4).build());
    invalid(builder().subset(SplitSubset::Training).build());
    assert!(builder().build_split().is_err());
    // Explicit files: a label past the class names.
    let file = dir.path().join("a_red/0.png");
    let msg = invalid(
        ImageFolder::from_files([(&file, 2)])
            .class_names(["x", "y"])
            .build(),
    );
    assert!(msg.contains("0.png"), "{msg}");
    invalid(ImageFolder::from_files(Vec::<(PathBuf, usize)>::new()).build());
    let msg = invalid(ImageFolder::from_files([(&file, usize::MAX)]).build());
    assert!(msg.contains("class names"), "{msg}");
}

#[test]
fn class_names_pick_the_order_and_must_match_the_folders() {
    let dir = three_classes();
    let ds = ImageFolder::from_dir(dir.path())
        .class_names(["c_blue", "a_red", "b_green"])
        .shuffle(false)
        .image_size(1, 1)
        .one_hot()
        .build()
        .unwrap();
    assert_eq!(ds.targets(), Targets::Values(vec![3]));
    let (x, y) = read(&ds, 0);
    assert_eq!((x, y), (vec![10.0, 40.0, 220.0], vec![1.0, 0.0, 0.0]));
    let err = ImageFolder::from_dir(dir.path())
        .class_names(["a_red", "b_green", "d_none"])
        .build()
        .unwrap_err();
    assert_eq!(data_error_path(&err), dir.path());
    let msg = err.to_string();
    assert!(msg.contains("d_none") && msg.contains("c_blue"), "{msg}");
}

#[test]
fn the_cache_gives_the_same_values() {
    let dir = three_classes();
    let build = |cache, verify| {
        ImageFolder::from_dir(dir.path())
            .image_size(5, 3)
            .cache(cache)
            .verify(verify)
            .build()
            .unwrap()
    };
    let plain = all(&build(false, false));
    let cached = build(true, false);
    assert!(cached.is_cached());
    assert_eq!(all(&cached), plain);
    // The second pass comes from the cache, even with the files gone.
    std::fs::remove_dir_all(dir.path().join("a_red")).unwrap();
    assert_eq!(all(&cached), plain);
    drop(dir);
    let dir = three_classes();
    let verified = ImageFolder::from_dir(dir.path())
        .image_size(5, 3)
        .cache(true)
        .verify(true)
        .build()
        .unwrap();
    std::fs::remove_dir_all(dir.path().join("b_green")).unwrap();
    assert_eq!(all(&verified), plain);
}

#[test]
fn missing_and_misshapen_folders_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere");
    let err = ImageFolder::from_dir(&missing).build().unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_eq!(data_error_path(&err), missing);
    assert!(err.to_string().contains("nowhere"), "{err}");

    // A file, not a folder.
    let file = dir.path().join("one.png");
    solid(&file, 2, 2, RED);
    let err = ImageFolder::from_dir(&file).build().unwrap_err();
    assert_eq!(data_error_path(&err), file);
    assert!(err.to_string().contains("not a directory"), "{err}");

    // Images but no class subfolders.
    let err = ImageFolder::from_dir(dir.path()).build().unwrap_err();
    assert_eq!(data_error_path(&err), dir.path());
    assert!(err.to_string().contains("1 images directly"), "{err}");

    // An empty class folder.
    std::fs::create_dir_all(dir.path().join("cats")).unwrap();
    std::fs::create_dir_all(dir.path().join("dogs")).unwrap();
    solid(&dir.path().join("cats/1.png"), 2, 2, RED);
    std::fs::write(dir.path().join("dogs/readme.txt"), "no images here").unwrap();
    let err = ImageFolder::from_dir(dir.path()).build().unwrap_err();
    assert_eq!(data_error_path(&err), dir.path().join("dogs"));
    assert!(err.to_string().contains("holds no image"), "{err}");

    // One class is allowed, with a warning.
    std::fs::remove_dir_all(dir.path().join("dogs")).unwrap();
    let ds = ImageFolder::from_dir(dir.path()).build().unwrap();
    assert_eq!((ds.len(), ds.class_names().len()), (1, 1));
}

/// The bytes of a 5 × 7 PNG.
fn png_bytes() -> Vec<u8> {
    let mut bytes = std::io::Cursor::new(Vec::new());
    image::RgbImage::from_pixel(5, 7, image::Rgb(RED))
        .write_to(&mut bytes, image::ImageOutputFormat::Png)
        .unwrap();
    bytes.into_inner()
}

#[test]
fn bad_files_are_errors_naming_them_or_skipped() {
    let dir = three_classes();
    // Garbage with an image extension: found when building.
    let garbage = dir.path().join("b_green/garbage.jpg");
    std::fs::write(&garbage, b"this is not a JPEG at all").unwrap();
    let err = ImageFolder::from_dir(dir.path()).build().unwrap_err();
    assert_eq!(data_error_path(&err), garbage);
    assert!(err.to_string().contains("garbage.jpg"), "{err}");
    let ds = ImageFolder::from_dir(dir.path())
        .skip_bad_files(true)
        .build()
        .unwrap();
    assert_eq!(ds.len(), 15);
    std::fs::remove_file(&garbage).unwrap();

    // A truncated PNG: its header reads, its data does not.
    let truncated = dir.path().join("c_blue/truncated.png");
    std::fs::write(&truncated, &png_bytes()[..60]).unwrap();
    let ds = ImageFolder::from_dir(dir.path())
        .shuffle(false)
        .image_size(2, 2)
        .build()
        .unwrap();
    assert_eq!(ds.len(), 16);
    let at = ds
        .file_paths()
        .iter()
        .position(|p| *p == truncated)
        .unwrap();
    let (mut x, mut y) = (vec![0.0; 12], [0.0]);
    let err = ds.read(at, &mut x, &mut y).unwrap_err();
    assert_eq!(data_error_path(&err), truncated);
    assert!(err.to_string().contains("cannot decode"), "{err}");
    // `verify` finds it when building; with `skip_bad_files` it is dropped then.
    let err = ImageFolder::from_dir(dir.path())
        .verify(true)
        .build()
        .unwrap_err();
    assert_eq!(data_error_path(&err), truncated);
    let ds = ImageFolder::from_dir(dir.path())
        .verify(true)
        .skip_bad_files(true)
        .image_size(2, 2)
        .build()
        .unwrap();
    assert_eq!(ds.len(), 15);
    assert!(!ds.file_paths().contains(&truncated));

    // A header declaring more pixels than allowed.
    let err = ImageFolder::from_dir(dir.path())
        .max_pixels(20)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("max_pixels"), "{err}");

    // Every image of a class dropped: the class is named.
    for (i, ext) in FORMATS.iter().enumerate() {
        std::fs::write(dir.path().join(format!("a_red/{i}.{ext}")), b"junk").unwrap();
    }
    let err = ImageFolder::from_dir(dir.path())
        .skip_bad_files(true)
        .build()
        .unwrap_err();
    assert_eq!(data_error_path(&err), dir.path().join("a_red"));
}

#[cfg(unix)]
#[test]
fn links_to_folders_are_followed_only_when_asked() {
    let dir = three_classes();
    let elsewhere = tempfile::tempdir().unwrap();
    let extra = elsewhere.path().join("more");
    std::fs::create_dir(&extra).unwrap();
    solid(&extra.join("x.png"), 2, 2, RED);
    std::os::unix::fs::symlink(&extra, dir.path().join("a_red/linked")).unwrap();
    // A cycle: a link inside a class folder to the folder itself.
    std::os::unix::fs::symlink(dir.path().join("a_red"), dir.path().join("a_red/loop")).unwrap();
    let count = |follow| {
        ImageFolder::from_dir(dir.path())
            .follow_links(follow)
            .build()
            .unwrap()
            .len()
    };
    assert_eq!(count(false), 15);
    assert_eq!(count(true), 16);
}

/// Red, green and blue images with noise, `n` per class.
fn noisy_colours(n: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut state = 12345u64;
    let mut noise = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u8 % 90
    };
    for (class, main) in [("blue", 2), ("green", 1), ("red", 0)] {
        let folder = dir.path().join(class);
        std::fs::create_dir(&folder).unwrap();
        for i in 0..n {
            let image = image::RgbImage::from_fn(7, 5, |_, _| {
                let mut px = [noise(), noise(), noise()];
                px[main] = px[main].saturating_add(120);
                image::Rgb(px)
            });
            image.save(folder.join(format!("{i}.png"))).unwrap();
        }
    }
    dir
}

#[test]
fn a_small_model_learns_an_image_folder() -> anyhow::Result<()> {
    let dir = noisy_colours(30);
    let (train, val) = ImageFolder::from_dir(dir.path())
        .image_size(4, 4)
        .validation_split(0.2)
        .seed(3)
        .cache(true)
        .build_split()?;
    let mut model = Sequential::new()
        .add(Rescaling::new(1.0 / 255.0, 0.0))
        .add(Flatten)
        .add(Dense::new(3))
        .add(Activation::Softmax)
        .compile(
            Adam::new(0.05),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )?
        .with_seed(1)?;
    let history = model.fit(
        &train,
        FitOptions {
            epochs: 15,
            batch_size_per_replica: 8,
            validation: Some(&val),
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let losses = history.series("loss");
    assert!(losses[losses.len() - 1] < losses[0] / 2.0, "{losses:?}");
    let accuracy = model.evaluate(&val, 16)?.get("accuracy").unwrap_or(0.0);
    eprintln!(
        "image folder validation accuracy: {accuracy:.3} on {} images",
        val.len()
    );
    assert!(accuracy >= 0.9, "validation accuracy {accuracy}");
    Ok(())
}
