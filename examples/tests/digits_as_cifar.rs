//! `digits_as_cifar` writes the bundled digits as CIFAR-10 files that `cifar10::load` reads:
//! the quickstart's split, every record's label and pixels checked against the digit it came
//! from, the same bytes for the same seed.

use std::path::Path;
use std::process::Command;

use kandle::data::{cifar10, digits, Dataset};

/// Runs the converter into `dir` with `extra` arguments; returns its standard output.
fn convert(dir: &Path, extra: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_digits_as_cifar"))
        .args(["--out-dir", &dir.to_string_lossy()])
        .args(extra)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(text)
}

/// The bytes of every file, in `load`'s order.
fn files(dir: &Path) -> anyhow::Result<Vec<Vec<u8>>> {
    cifar10::TRAIN_FILES
        .iter()
        .chain([&cifar10::TEST_FILE])
        .map(|f| Ok(std::fs::read(dir.join(f))?))
        .collect()
}

#[test]
fn every_record_is_its_digit_upsampled_in_grey() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let text = convert(dir.path(), &[])?;
    assert!(text.contains("1437 training and 360 test"), "{text}");
    let records: Vec<usize> = files(dir.path())?
        .iter()
        .map(|b| b.len() / cifar10::RECORD_LEN)
        .collect();
    assert_eq!(records, [288, 288, 287, 287, 287, 360]);

    let data = cifar10::load(dir.path())?;
    let (train, test) = digits::load()?.train_test_split(0.2, 42)?;
    for (cifar, digits) in [(&data.train, &train), (&data.test, &test)] {
        assert_eq!(cifar.len(), digits.len());
        let (mut x, mut y) = (vec![0f32; 64], [0f32; 1]);
        for i in 0..digits.len() {
            digits.read(i, &mut x, &mut y)?;
            assert_eq!(f32::from(cifar.labels()[i]), y[0], "label of image {i}");
            let image = cifar.image(i).expect("in range");
            for c in 0..3 {
                for r in 0..32 {
                    for col in 0..32 {
                        // Raw digit values are 0..16; the loader gives them divided by 16.
                        let raw = (x[(r / 4) * 8 + col / 4] * 16.0).round();
                        let expected = (raw * 255.0 / 16.0).round() as u8;
                        assert_eq!(
                            image[c * 1024 + r * 32 + col],
                            expected,
                            "image {i} of {}, pixel ({c}, {r}, {col})",
                            cifar.name()
                        );
                    }
                }
            }
        }
    }
    // Real digits, every class, and full-range pixels.
    let mut counts = [0usize; 10];
    for &l in data.train.labels() {
        counts[usize::from(l)] += 1;
    }
    assert!(counts.iter().all(|&c| c > 120), "{counts:?}");
    assert_eq!(data.train.pixels().iter().max(), Some(&255));
    Ok(())
}

#[test]
fn the_seed_and_fraction_choose_the_split() -> anyhow::Result<()> {
    let (a, b, c) = (
        tempfile::tempdir()?,
        tempfile::tempdir()?,
        tempfile::tempdir()?,
    );
    convert(a.path(), &["--seed", "7"])?;
    convert(b.path(), &["--seed", "7"])?;
    assert_eq!(files(a.path())?, files(b.path())?);
    convert(c.path(), &["--seed", "8", "--test-fraction", "0.5"])?;
    let (seven, eight) = (cifar10::load(a.path())?, cifar10::load(c.path())?);
    assert_eq!((seven.train.len(), seven.test.len()), (1437, 360));
    assert_eq!((eight.train.len(), eight.test.len()), (898, 899));
    assert_ne!(seven.test.labels(), &eight.test.labels()[..360]);
    Ok(())
}

#[test]
fn a_bad_fraction_is_an_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = Command::new(env!("CARGO_BIN_EXE_digits_as_cifar"))
        .args(["--out-dir", &dir.path().to_string_lossy()])
        .args(["--test-fraction", "1.5"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("test_fraction"), "{err}");
    assert!(!dir.path().join(cifar10::TEST_FILE).exists());
    Ok(())
}
