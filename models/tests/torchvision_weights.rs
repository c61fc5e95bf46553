//! torchvision's weights load into kandle's ResNet as they are, and give PyTorch's outputs.
//!
//! The reference files come from `bench/torchvision_resnet_parity.py` (PyTorch's side):
//!
//! - `tiny_network_matches_pytorch` runs in CI on the committed fixture
//!   (`tests/reference/torchvision_tiny/`): a tiny network with torchvision's ResNet layout and
//!   names, built here from `kandle_models::basic_block`; names, shapes and eval-mode logits.
//! - `resnet18_matches_torchvision` is ignored: it needs torchvision's ResNet-18 files (about
//!   240 MB, not committed). Write them and run it with
//!
//!   ```text
//!   python3 bench/torchvision_resnet_parity.py --out target/torchvision-parity
//!   KANDLE_TORCHVISION_PARITY=target/torchvision-parity \
//!       cargo test --release -p kandle-models --test torchvision_weights -- --ignored --nocapture
//!   ```
//!
//!   It compares the eval-mode logits and the weights after one SGD step in train mode with
//!   PyTorch's, on `ComputePath::Auto`, `ComputePath::Autograd` and
//!   `ComputePath::DeviceGeneric` (each path measured before the test fails); with
//!   `KANDLE_PARITY_DEVICE=cuda:0` (and `--features kandle/cuda`) on that GPU, where every path
//!   is the device-generic one (`gpu/check.sh`'s `parity` step).
//!
//!   The step is judged against float64's with the same ReLU kinks taken (`support/
//!   step_reference.rs`): every batch has ReLU inputs that float64 puts nearer zero than
//!   float32's forward error there (on the script's batches, 4 to 9 inputs from 3.4e-7 to
//!   4.6e-5), and the side a float32 run lands one on decides whether its gradient passes, which
//!   moves every gradient below it by up to 1% of the update. PyTorch's own configurations
//!   differ so (channels-last and PyTorch's native convolutions take `layer4.0`'s -3.4e-7 input
//!   the other way on batch 2). What remains after the kinks must be within 10 times PyTorch
//!   float32's arithmetic spread. When a run takes several kinks together the test asks for
//!   float64's step with all of them (a command to run); `gpu/parity.sh` runs it and the test
//!   again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use kandle::functional::{Functional, Input};
use kandle::prelude::*;
use kandle::pretrained::{ImportOptions, SkipReason};
use kandle::ComputePath;
use kandle_models::{basic_block, Depth, Head, ResNet};

mod support;
use support::step_reference::{max_abs, values, StepReference, Values};

/// The fixture's network: torchvision's stem and names, a basic block of 8 channels and one of
/// 16 with stride 2 (and its `downsample`), and a 5-class `fc`, for 3x32x32 images.
fn tiny_resnet() -> Result<Functional> {
    let image = Input::new(&[3, 32, 32]).named("image").tensor();
    let x = Conv2D::new(8, 7)
        .stride(2)
        .padding(Padding::symmetric(3, 3))
        .use_bias(false)
        .named("conv1")
        .call(&image)?;
    let x = BatchNormalization::new()
        .epsilon(1e-5)
        .momentum(0.9)
        .named("bn1")
        .call(&x)?;
    let x = MaxPooling2D::new(3)
        .stride(2)
        .padding(Padding::symmetric(1, 1))
        .named("maxpool")
        .call(&Activation::Relu.call(&x)?)?;
    let x = basic_block(&x, "layer1.0.", 8, 1)?;
    let x = basic_block(&x, "layer2.0.", 16, 2)?;
    let x = GlobalAveragePooling2D.named("avgpool").call(&x)?;
    let logits = Dense::new(5).named("fc").call(&x)?;
    Functional::new([&image], [&logits])
}

fn compiled(net: Functional, path: ComputePath) -> Result<Model> {
    compiled_on(net, path, &Device::Cpu)
}

fn compiled_on(net: Functional, path: ComputePath, device: &Device) -> Result<Model> {
    net.compile(
        Sgd::new(0.1).momentum(0.9),
        SparseCategoricalCrossentropy::new().from_logits(true),
        (),
        &OneDeviceStrategy::new(device.clone()),
    )?
    .with_compute_path(path)
}

/// `KANDLE_PARITY_DEVICE=cuda:N` runs the ResNet-18 parity on that GPU (a build with
/// `--features kandle/cuda`), where every path is the device-generic one; the CPU otherwise.
fn parity_device() -> Result<Device> {
    match std::env::var("KANDLE_PARITY_DEVICE") {
        Err(_) => Ok(Device::Cpu),
        Ok(name) if name == "cpu" => Ok(Device::Cpu),
        Ok(name) => {
            let index = name
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "KANDLE_PARITY_DEVICE: `{name}` is not cpu or cuda:N"
                    ))
                })?;
            kandle::devices::cuda(index)
        }
    }
}

fn load(path: &Path) -> Result<HashMap<String, Tensor>> {
    Ok(candle_core::safetensors::load(path, &Device::Cpu)?)
}

fn tensor<'a>(file: &'a HashMap<String, Tensor>, name: &str) -> Result<&'a Tensor> {
    file.get(name)
        .ok_or_else(|| Error::invalid(format!("the reference file has no `{name}`")))
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// kandle's logits against PyTorch's float64 ones: the largest difference, which must be
/// within 1e-4 of the largest logit. Returns `(max |diff|, max |logit|)`.
fn check_logits(got: &Tensor, reference: &Tensor, what: &str) -> Result<(f64, f64)> {
    assert_eq!(got.dims(), reference.dims(), "{what}");
    let (got, reference) = (values(got)?, values(reference)?);
    let (diff, scale) = (max_abs_diff(&got, &reference), max_abs(&reference));
    assert!(
        diff <= 1e-4 * scale,
        "{what}: logits differ by {diff:e} (largest logit {scale})"
    );
    Ok((diff, scale))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/reference/torchvision_tiny")
        .join(name)
}

#[test]
fn tiny_network_matches_pytorch() -> Result<()> {
    let batch = load(&fixture("tiny_batch.safetensors"))?;
    let x = tensor(&batch, "x")?;
    let file = load(&fixture("tiny.safetensors"))?;
    for path in [ComputePath::Auto, ComputePath::DeviceGeneric] {
        let mut model = compiled(tiny_resnet()?, path)?;
        // Names: the model's variables are the state dict's float tensors, one for one.
        let mut model_names: Vec<String> = model.get_weights()?.into_keys().collect();
        let mut file_names: Vec<String> = file
            .keys()
            .filter(|k| !k.ends_with("num_batches_tracked"))
            .cloned()
            .collect();
        model_names.sort();
        file_names.sort();
        assert_eq!(model_names, file_names);

        let report = model.load_weights_from(fixture("tiny.safetensors"), &ImportOptions::new())?;
        assert!(report.is_complete(), "{report}");
        assert_eq!(report.loaded.len(), 32);
        assert_eq!(report.skipped.len(), 6);
        assert!(report
            .skipped
            .iter()
            .all(|s| s.reason == SkipReason::NotFloat("I64".into())));
        // Shapes: every tensor went in as it is.
        let weights = model.get_weights()?;
        for name in &report.loaded {
            assert_eq!(weights[name].dims(), tensor(&file, name)?.dims(), "{name}");
            assert_eq!(values(&weights[name])?, values(tensor(&file, name)?)?);
        }
        let logits = model.predict(x, 2)?;
        let (diff, scale) = check_logits(&logits, tensor(&batch, "logits_f64")?, "tiny")?;
        eprintln!("tiny network, {path:?}: logits max |kandle - float64| = {diff:.2e} (largest {scale:.3})");

        // The float64 `torch.save` checkpoint, state dict under a key, gives the same logits.
        let mut from_pth = compiled(tiny_resnet()?, path)?;
        from_pth.load_weights_from(fixture("tiny_checkpoint.pth"), &ImportOptions::new())?;
        assert_eq!(
            values(&from_pth.predict(x, 2)?)?,
            values(&logits)?,
            "the .pth and the safetensors file must load the same values"
        );
    }
    Ok(())
}

/// The side length of the feature maps a ResNet-18 batch norm sees for 64x64 images.
fn side_at(name: &str) -> usize {
    match name.get(..6) {
        Some("layer1") => 16,
        Some("layer2") => 8,
        Some("layer3") => 4,
        Some("layer4") => 2,
        _ => 32,
    }
}

#[test]
#[ignore = "needs torchvision's ResNet-18 files: see the module's documentation"]
fn resnet18_matches_torchvision() -> Result<()> {
    if !parity_device()?.is_cpu() {
        return resnet18_parity(&[ComputePath::DeviceGeneric]);
    }
    resnet18_parity(&[
        ComputePath::Auto,
        ComputePath::Autograd,
        ComputePath::DeviceGeneric,
    ])
}

/// Loads torchvision's ResNet-18 on each of `paths` and compares its eval-mode logits and its
/// weights after one SGD step with PyTorch's float64 run.
fn resnet18_parity(paths: &[ComputePath]) -> Result<()> {
    let dir = std::env::var_os("KANDLE_TORCHVISION_PARITY")
        .map(PathBuf::from)
        .ok_or_else(|| {
            Error::invalid(
                "set KANDLE_TORCHVISION_PARITY to the directory that \
                 `bench/torchvision_resnet_parity.py --out DIR` wrote",
            )
        })?;
    let batch = load(&dir.join("batch.safetensors"))?;
    let (x, y) = (
        tensor(&batch, "x")?,
        tensor(&batch, "y")?.to_dtype(DType::U32)?,
    );
    let initial = load(&dir.join("resnet18.safetensors"))?;
    let reference = StepReference::read(&dir)?;
    for run in &reference.float32 {
        eprintln!(
            "PyTorch float32 ({}): ReLU inputs on the other side of zero from float64: {}",
            run.config,
            reference.describe(&run.sides)
        );
    }
    let samples = x.dim(0)?;
    let resnet18 = || {
        ResNet::new(Depth::ResNet18)
            .input_shape(&[3, 64, 64])
            .head(Head::Logits(1000))
            .build()
    };
    let logits32 = tensor(&batch, "logits")?;
    let logits64 = tensor(&batch, "logits_f64")?;
    let torch_spread = max_abs_diff(&values(logits32)?, &values(logits64)?);
    eprintln!("ResNet-18 logits: PyTorch float32 against float64: {torch_spread:.2e}");
    let device = parity_device()?;
    let mut failed = Vec::new();
    let mut taken: Vec<Vec<usize>> = reference.float32.iter().map(|r| r.sides.clone()).collect();
    for &path in paths {
        let mut model = compiled_on(resnet18()?, path, &device)?;
        let report =
            model.load_weights_from(dir.join("resnet18.safetensors"), &ImportOptions::new())?;
        assert!(report.is_complete(), "{report}");
        assert_eq!((report.loaded.len(), report.skipped.len()), (102, 20));
        if path == ComputePath::Auto {
            let mut from_pth = compiled(resnet18()?, path)?;
            let pth_report =
                from_pth.load_weights_from(dir.join("resnet18.pth"), &ImportOptions::new())?;
            assert_eq!(pth_report, report);
            let (a, b) = (model.get_weights()?, from_pth.get_weights()?);
            for (name, t) in &a {
                assert_eq!(values(t)?, values(&b[name])?, "{name}");
            }
        }
        let logits = model.predict(x, samples)?;
        let (diff, scale) = check_logits(&logits, logits64, "ResNet-18")?;
        eprintln!(
            "ResNet-18 logits, {path:?} on {device:?}: max |kandle - float64| = {diff:.2e} \
             (largest logit {scale:.3}, PyTorch float32's {torch_spread:.2e})"
        );

        model.train_on_batch(x, &y, None)?;
        let after: Values = model
            .get_weights()?
            .iter()
            .map(|(name, t)| Ok((name.clone(), values(t)?)))
            .collect::<Result<_>>()?;
        let sides = reference.sides(&after)?;
        eprintln!(
            "ResNet-18 one SGD step, {path:?} on {device:?}: ReLU inputs on the other side of \
             zero from float64: {}",
            reference.describe(&sides)
        );
        taken.push(sides.clone());
        let mut worst_ratio: f64 = 0.0;
        let mut worst_var = (0.0f64, 0.0f64);
        let mut failures = Vec::new();
        for (name, got) in &after {
            let t64 = &reference.float64[name];
            let spread = reference.spread(name)?;
            if name.ends_with("running_var") {
                // PyTorch moves running_var towards the unbiased batch variance (n / (n - 1)
                // times the biased one); kandle, like Keras, towards the biased one.
                let side = side_at(name);
                let n = (samples * side * side) as f64;
                let before = values(tensor(&initial, name)?)?;
                let biased: Vec<f64> = t64
                    .iter()
                    .zip(&before)
                    .map(|(t, b)| 0.9 * b + (t - 0.9 * b) * (n - 1.0) / n)
                    .collect();
                let raw = max_abs_diff(got, t64);
                let corrected = max_abs_diff(got, &biased);
                worst_var = (worst_var.0.max(raw), worst_var.1.max(corrected));
                assert!(
                    corrected <= 10.0 * spread.max(1e-7 * max_abs(t64)),
                    "{name}: {corrected:e} from PyTorch's value with the biased variance, \
                     float32 spread {spread:e}"
                );
                continue;
            }
            // From float64's step with the same kinks taken as kandle's, against PyTorch
            // float32's arithmetic spread, or where its float32 runs land on the float64 value,
            // a tenth of a float32 rounding of the tensor's largest value.
            let err = reference.distance(&after, name, &sides)?;
            let allowed = 10.0 * spread.max(1e-7 * max_abs(t64));
            worst_ratio = worst_ratio.max(err / allowed * 10.0);
            if std::env::var_os("KANDLE_PARITY_VERBOSE").is_some() {
                let before = values(tensor(&initial, name)?)?;
                eprintln!(
                    "  {name}: |kandle - f64| {err:.2e}, |f32 - f64| {spread:.2e}, \
                     update {:.2e}",
                    max_abs_diff(t64, &before)
                );
            }
            if err > allowed {
                failures.push(format!(
                    "{name}: kandle differs from float64 (the same kinks taken) by {err:.2e}, \
                     PyTorch float32 by {spread:.2e}"
                ));
            }
        }
        eprintln!(
            "ResNet-18 one SGD step, {path:?} on {device:?}: worst max |kandle - float64| / \
             max(float32 spread, 1e-7 |w|) = {worst_ratio:.2}; running_var: max |kandle - PyTorch| = \
             {:.2e} (unbiased against biased variance), {:.2e} once PyTorch's is made biased",
            worst_var.0, worst_var.1
        );
        if !failures.is_empty() {
            failed.push(format!("{path:?}:\n{}", failures.join("\n")));
        }
    }
    // Sets of several kinks were judged by the sum of their single differences; the whole
    // step may differ from that sum, so the test asks for it.
    let missing = reference.missing_sets(&taken);
    assert!(
        missing.is_empty(),
        "several ReLU inputs were taken the other way together; write float64's step with \
         them and run the test again:\n  python3 bench/torchvision_resnet_parity.py {} \
         --kink-sets {}\n{}",
        reference.command,
        missing.join(","),
        failed.join("\n")
    );
    // Every path is measured before the test fails, so one run gives all their figures.
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    Ok(())
}

/// The README's weights recipe on images of any size: a ResNet-18 recipe made with
/// `ResNet::network` (built for 224x224), its weights loaded from a file, predicts on 64x64
/// and 224x224 images with the same variables (each prediction equal to the model's that
/// wrote the file), and trains on 64x64 images keeping its weights across sizes (the
/// optimizer state's part of that is tested on a small network in kandle's
/// `functional_models` tests).
#[test]
fn a_resnet_network_takes_any_image_size() -> Result<()> {
    let recipe = ResNet::new(Depth::ResNet18).head(Head::Logits(10));
    let compile = |seed: u64| -> Result<Model> {
        recipe
            .network()?
            .compile(
                Sgd::new(0.01).momentum(0.9),
                SparseCategoricalCrossentropy::new().from_logits(true),
                (),
                &OneDeviceStrategy::cpu(),
            )?
            .with_seed(seed)
    };
    let dir =
        tempfile::tempdir().map_err(|e| kandle::Error::io("cannot create", "a temp dir", e))?;
    let file = dir.path().join("resnet18.safetensors");
    let mut source = compile(1)?;
    source.save_weights(&file)?;
    let mut model = compile(2)?;
    model.load_weights_from(&file, &ImportOptions::new())?;
    for side in [64, 224] {
        let x = Tensor::randn(0f32, 1., (1, 3, side, side), &Device::Cpu)?;
        let (got, want) = (model.predict(&x, 1)?, source.predict(&x, 1)?);
        assert_eq!(got.dims(), [1, 10]);
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{side}x{side}");
    }
    let weights = model.get_weights()?;
    let x = Tensor::randn(0f32, 1., (2, 3, 64, 64), &Device::Cpu)?;
    let y = Tensor::new(&[0u32, 1], &Device::Cpu)?;
    model.train_on_batch(&x, &y, None)?;
    let moved = model.get_weights()?;
    assert_ne!(
        moved["fc.weight"].to_vec2::<f32>()?,
        weights["fc.weight"].to_vec2::<f32>()?
    );
    model.predict(&Tensor::zeros((1, 3, 96, 96), DType::F32, &Device::Cpu)?, 1)?;
    let kept = model.get_weights()?;
    for (name, value) in &moved {
        let same =
            value.flatten_all()?.to_vec1::<f32>()? == kept[name].flatten_all()?.to_vec1::<f32>()?;
        assert!(same, "{name} changed when the model was built for 96x96");
    }
    Ok(())
}
