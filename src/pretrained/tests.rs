//! Every option and every error of a PyTorch import, on a small model with torchvision-style
//! names (`conv1`, `bn1`, `fc`) and state dicts written here, or the committed `.pth` fixture
//! of `bench/torchvision_resnet_parity.py`.

use crate::Compile;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::layers::{BatchNormalization, Conv2D, Dense, Flatten, LayerSpecExt, Sequential};
use crate::losses::MeanSquaredError;
use crate::optimizers::Sgd;
use crate::{Model, OneDeviceStrategy};

/// `conv1` (2 filters, 3x3, no bias) -> `bn1` -> flatten -> `fc` (3 units), for 3x2x2 inputs.
fn model() -> Result<Model> {
    Sequential::new()
        .input_shape(&[3, 2, 2])
        .add(Conv2D::new(2, 1).use_bias(false).named("conv1"))
        .add(BatchNormalization::new().named("bn1"))
        .add(Flatten)
        .add(Dense::new(3).named("fc"))
        .compile(
            Sgd::new(0.1),
            MeanSquaredError,
            (),
            &OneDeviceStrategy::cpu(),
        )
}

/// `0.5, 1.5, 2.5, ...` in `shape` and `dtype`, distinct from any initial value.
fn counting(shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?)
}

/// The model's state dict as PyTorch writes it: in float64, float16 and bfloat16 (values
/// exact in each), with BatchNorm's int64 counter.
fn torch_state_dict() -> Result<Vec<(String, Tensor)>> {
    Ok(vec![
        ("conv1.weight".into(), counting(&[2, 3, 1, 1], DType::F64)?),
        ("bn1.weight".into(), counting(&[2], DType::F16)?),
        ("bn1.bias".into(), counting(&[2], DType::BF16)?),
        ("bn1.running_mean".into(), counting(&[2], DType::F32)?),
        ("bn1.running_var".into(), counting(&[2], DType::F32)?),
        (
            "bn1.num_batches_tracked".into(),
            Tensor::new(7i64, &Device::Cpu)?,
        ),
        ("fc.weight".into(), counting(&[3, 8], DType::F32)?),
        ("fc.bias".into(), counting(&[3], DType::F64)?),
    ])
}

fn write(dir: &Path, name: &str, tensors: &[(String, Tensor)]) -> Result<PathBuf> {
    let path = dir.join(name);
    let map: std::collections::HashMap<&str, Tensor> = tensors
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    candle_core::safetensors::save(&map, &path)?;
    Ok(path)
}

fn temp_dir() -> Result<tempfile::TempDir> {
    tempfile::tempdir().map_err(|e| Error::io("cannot create", std::env::temp_dir(), e))
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// Asserts that two sets of weights hold the same names and values, bit for bit.
fn assert_same(a: &Weights, b: &Weights) -> Result<()> {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, t) in a {
        assert_eq!(values(t)?, values(&b[name])?, "{name}");
    }
    Ok(())
}

/// Loads `path` with `options`, expects an error, checks that the model did not change and
/// returns the message.
fn refused(model: &mut Model, path: &Path, options: &ImportOptions) -> Result<String> {
    let before = model.get_weights()?;
    let err = model
        .load_weights_from(path, options)
        .expect_err("the load must fail");
    assert_same(&before, &model.get_weights()?)?;
    Ok(err.to_string())
}

#[test]
fn a_torch_state_dict_loads_converted_with_its_counter_skipped() -> Result<()> {
    let dir = temp_dir()?;
    let sd = torch_state_dict()?;
    let path = write(dir.path(), "resnet.safetensors", &sd)?;
    let mut model = model()?;
    let report = model.load_weights_from(&path, &ImportOptions::new())?;
    assert_eq!(
        report.loaded,
        [
            "bn1.bias",
            "bn1.running_mean",
            "bn1.running_var",
            "bn1.weight",
            "conv1.weight",
            "fc.bias",
            "fc.weight"
        ]
    );
    assert!(report.is_complete());
    assert_eq!(
        report.skipped,
        [Skipped {
            name: "bn1.num_batches_tracked".into(),
            reason: SkipReason::NotFloat("I64".into()),
        }]
    );
    let weights = model.get_weights()?;
    for (name, t) in &sd {
        if let Some(loaded) = weights.get(name) {
            assert_eq!(loaded.dtype(), DType::F32);
            assert_eq!(values(loaded)?, values(t)?, "{name}");
        }
    }
    let printed = report.to_string();
    assert_eq!(
        printed,
        "loaded: 7 of 7 variables\nmissing: none\nunexpected: none\n\
         skipped: 1 (bn1.num_batches_tracked (I64, not a float))"
    );
    Ok(())
}

#[test]
fn missing_variables_are_refused_unless_allowed() -> Result<()> {
    let dir = temp_dir()?;
    let sd: Vec<_> = torch_state_dict()?
        .into_iter()
        .filter(|(k, _)| !k.starts_with("fc."))
        .collect();
    let path = write(dir.path(), "body.safetensors", &sd)?;
    let mut model = model()?;
    let err = refused(&mut model, &path, &ImportOptions::new())?;
    assert!(err.contains("body.safetensors"), "{err}");
    assert!(
        err.contains("the file lacks 2 of the model's variables")
            && err.contains("fc.bias, fc.weight"),
        "{err}"
    );
    let fc_before = model.get_weights()?["fc.weight"].clone();
    let report = model.load_weights_from(&path, &ImportOptions::new().allow_missing(true))?;
    assert_eq!(report.missing, ["fc.bias", "fc.weight"]);
    assert_eq!(report.loaded.len(), 5);
    assert!(!report.is_complete());
    assert!(report
        .to_string()
        .contains("missing: 2 (fc.bias, fc.weight)"));
    let weights = model.get_weights()?;
    assert_eq!(values(&weights["fc.weight"])?, values(&fc_before)?);
    assert_eq!(values(&weights["bn1.weight"])?, [0.5, 1.5]);
    Ok(())
}

#[test]
fn unexpected_tensors_are_refused_unless_allowed() -> Result<()> {
    let dir = temp_dir()?;
    let mut sd = torch_state_dict()?;
    sd.push(("head.weight".into(), counting(&[2, 2], DType::F32)?));
    let path = write(dir.path(), "more.safetensors", &sd)?;
    let mut model = model()?;
    let err = refused(&mut model, &path, &ImportOptions::new())?;
    assert!(
        err.contains("no variable for 1 of the file's tensors") && err.contains("head.weight"),
        "{err}"
    );
    let report = model.load_weights_from(&path, &ImportOptions::new().allow_unexpected(true))?;
    assert_eq!(report.unexpected, ["head.weight"]);
    assert_eq!(report.loaded.len(), 7);
    Ok(())
}

#[test]
fn non_float_tensors_count_as_unexpected_when_not_skipped() -> Result<()> {
    let dir = temp_dir()?;
    let path = write(dir.path(), "sd.safetensors", &torch_state_dict()?)?;
    let mut model = model()?;
    let keep = ImportOptions::new().skip_non_float(false);
    let err = refused(&mut model, &path, &keep)?;
    assert!(err.contains("bn1.num_batches_tracked"), "{err}");
    let report = model.load_weights_from(&path, &keep.allow_unexpected(true))?;
    assert_eq!(report.unexpected, ["bn1.num_batches_tracked"]);
    assert!(report.skipped.is_empty());

    // An integer tensor under a variable's name cannot go into it.
    let mut sd = torch_state_dict()?;
    sd[6].1 = Tensor::zeros((3, 8), DType::I64, &Device::Cpu)?;
    let path = write(dir.path(), "int.safetensors", &sd)?;
    let lenient = ImportOptions::new()
        .skip_non_float(false)
        .allow_unexpected(true)
        .allow_missing(true);
    let err = refused(&mut model, &path, &lenient)?;
    assert!(
        err.contains("`fc.weight` is I64 in the file but F32 in the model"),
        "{err}"
    );
    Ok(())
}

#[test]
fn renames_by_prefix_and_function() -> Result<()> {
    let dir = temp_dir()?;
    // timm-like names under DataParallel's prefix: `stem.conv`, `stem.bn`, `head.fc`.
    let timm = |name: &str| {
        name.replace("conv1.", "stem.conv.")
            .replace("bn1.", "stem.bn.")
            .replace("fc.", "head.fc.")
    };
    let sd: Vec<_> = torch_state_dict()?
        .into_iter()
        .map(|(k, v)| (format!("module.{}", timm(&k)), v))
        .collect();
    let path = write(dir.path(), "timm.safetensors", &sd)?;
    let mut model = model()?;
    let err = refused(&mut model, &path, &ImportOptions::new())?;
    assert!(
        err.contains("module.head.fc.bias, module.head.fc.weight"),
        "{err}"
    );

    let options = ImportOptions::new()
        .rename_prefix("module.", "")
        .rename_prefix("stem.conv.", "conv1.")
        .rename_prefix("stem.bn.", "bn1.")
        .rename(|name| Some(name.replace("head.fc.", "fc.")));
    let report = model.load_weights_from(&path, &options)?;
    assert!(report.is_complete(), "{report}");
    assert_eq!(report.loaded.len(), 7);
    assert_eq!(report.skipped[0].name, "module.stem.bn.num_batches_tracked");
    assert_eq!(values(&model.get_weights()?["fc.bias"])?, [0.5, 1.5, 2.5]);

    // A function that drops the head: the model keeps its own (a new classifier).
    let mut fresh = self::model()?;
    let fc_before = fresh.get_weights()?["fc.bias"].clone();
    let body_only = options
        .clone()
        .rename(|name| (!name.starts_with("fc.")).then(|| name.to_string()))
        .allow_missing(true);
    let report = fresh.load_weights_from(&path, &body_only)?;
    assert_eq!(report.missing, ["fc.bias", "fc.weight"]);
    let dropped: Vec<&str> = report
        .skipped
        .iter()
        .filter(|s| s.reason == SkipReason::Dropped)
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(dropped, ["module.head.fc.bias", "module.head.fc.weight"]);
    assert_eq!(
        values(&fresh.get_weights()?["fc.bias"])?,
        values(&fc_before)?
    );

    // Two tensors renamed alike.
    let clash = ImportOptions::new().rename(|_| Some("fc.bias".to_string()));
    let err = refused(&mut fresh, &path, &clash)?;
    assert!(err.contains("are both renamed `fc.bias`"), "{err}");
    Ok(())
}

#[test]
fn a_shape_mismatch_names_the_variable_and_both_shapes() -> Result<()> {
    let dir = temp_dir()?;
    let mut sd = torch_state_dict()?;
    // A classifier for 5 classes where the model has 3.
    sd[6].1 = counting(&[5, 8], DType::F32)?;
    let path = write(dir.path(), "five.safetensors", &sd)?;
    let mut model = model()?;
    let lenient = ImportOptions::new()
        .allow_missing(true)
        .allow_unexpected(true);
    let err = refused(&mut model, &path, &lenient)?;
    assert!(
        err.contains("`fc.weight` is [5, 8] in the file but [3, 8] in the model"),
        "{err}"
    );
    assert!(
        !err.contains("lacks"),
        "a misshaped tensor is not also missing: {err}"
    );
    Ok(())
}

#[test]
fn nothing_in_common_is_an_error_even_when_lenient() -> Result<()> {
    let dir = temp_dir()?;
    let sd = vec![("encoder.weight".to_string(), counting(&[2], DType::F32)?)];
    let path = write(dir.path(), "other.safetensors", &sd)?;
    let mut model = model()?;
    let lenient = ImportOptions::new()
        .allow_missing(true)
        .allow_unexpected(true);
    let err = refused(&mut model, &path, &lenient)?;
    assert!(err.contains("no tensor of the file matches"), "{err}");
    assert!(err.contains("encoder.weight"), "{err}");
    Ok(())
}

#[test]
fn missing_corrupt_and_foreign_files_are_errors_naming_them() -> Result<()> {
    let dir = temp_dir()?;
    let mut model = model()?;
    let options = ImportOptions::new();
    let err = refused(&mut model, &dir.path().join("nope.pth"), &options)?;
    assert!(
        err.contains("cannot read checkpoint") && err.contains("nope.pth"),
        "{err}"
    );

    let good = write(dir.path(), "good.safetensors", &torch_state_dict()?)?;
    let bytes = std::fs::read(&good).map_err(|e| Error::io("read", &good, e))?;
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 9]).map_err(|e| Error::io("write", &cut, e))?;
    let err = refused(&mut model, &cut, &options)?;
    assert!(err.contains("not a valid safetensors file"), "{err}");

    let pth = fixture("tiny_checkpoint.pth");
    let bytes = std::fs::read(&pth).map_err(|e| Error::io("read", &pth, e))?;
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "cut.pth",
            bytes[..bytes.len() / 2].to_vec(),
            "cannot be read as a PyTorch checkpoint",
        ),
        (
            "junk.pth",
            b"PK\x03\x04 then nothing a zip reader wants".to_vec(),
            "cannot be read as a PyTorch checkpoint",
        ),
        (
            "legacy.pth",
            b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.".to_vec(),
            "legacy format",
        ),
        ("empty.bin", Vec::new(), "not a valid safetensors file"),
    ];
    for (name, contents, expected) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, contents).map_err(|e| Error::io("write", &path, e))?;
        let err = refused(&mut model, &path, &options)?;
        assert!(
            err.contains(expected) && err.contains(name),
            "{name}: {err}"
        );
    }
    Ok(())
}

#[test]
fn an_unbuilt_model_is_refused_before_the_file_is_read() -> Result<()> {
    let mut model = Sequential::new().add(Dense::new(3).named("fc")).compile(
        Sgd::new(0.1),
        MeanSquaredError,
        (),
        &OneDeviceStrategy::cpu(),
    )?;
    let err = model
        .load_weights_from("/nonexistent/w.pth", &ImportOptions::new())
        .expect_err("not built");
    assert!(matches!(err, Error::NotReady(_)), "{err}");
    Ok(())
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference/torchvision_tiny")
        .join(name)
}

/// `torch.save({"epoch": 3, "state_dict": ...})` of the float64 state dict reads as the float32
/// safetensors file of the same network: the state dict found under its key, the float64
/// values (widened from float32) exact, the int64 counters skipped.
#[test]
fn a_pth_checkpoint_reads_as_its_safetensors_twin() -> Result<()> {
    let options = ImportOptions::new();
    let from_pth = read_state_dict(fixture("tiny_checkpoint.pth"), &options)?;
    let from_safetensors = read_state_dict(fixture("tiny.safetensors"), &options)?;
    assert_eq!(from_pth.weights.len(), 32);
    assert_same(&from_pth.weights, &from_safetensors.weights)?;
    assert_eq!(from_pth.skipped, from_safetensors.skipped);
    assert_eq!(from_pth.skipped.len(), 6);
    assert!(from_pth
        .skipped
        .iter()
        .all(|s| s.name.ends_with(".num_batches_tracked")
            && s.reason == SkipReason::NotFloat("I64".into())));

    let keyed = read_state_dict(
        fixture("tiny_checkpoint.pth"),
        &ImportOptions::new().key("state_dict"),
    )?;
    assert_same(&keyed.weights, &from_safetensors.weights)?;
    let err = read_state_dict(
        fixture("tiny_checkpoint.pth"),
        &ImportOptions::new().key("optimizer"),
    )
    .expect_err("no such key")
    .to_string();
    assert!(err.contains("optimizer"), "{err}");
    Ok(())
}
