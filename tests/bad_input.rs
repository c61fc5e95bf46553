//! Bad input gets a clear error and loses nothing: every case returns `Err` naming what is
//! wrong; none panics or hangs.

use candle_core::{DType, Device, Tensor};
use kandle::data::InMemoryDataset;
use kandle::prelude::*;

fn small_net() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(4, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

fn compile(net: Sequential) -> kandle::Result<Model> {
    net.compile(
        Sgd::new(0.1),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )
}

fn quiet() -> FitOptions<'static> {
    FitOptions {
        verbosity: Verbosity::Silent,
        ..Default::default()
    }
}

#[test]
fn a_layer_that_cannot_take_its_input_names_itself_and_both_shapes() -> anyhow::Result<()> {
    let net = Sequential::new().add(Conv2D::new(4, 3)).add(Dense::new(10));
    let err = net
        .summary(&[1, 8, 8])
        .expect_err("dense needs a flat input")
        .to_string();
    assert!(err.contains("`dense_1`"), "{err}");
    assert!(
        err.contains("(batch, features)") && err.contains("(batch, 4, 6, 6)"),
        "{err}"
    );

    let err = Sequential::new()
        .add(Conv2D::new(4, 5))
        .summary(&[1, 3, 3])
        .expect_err("too small");
    assert!(
        err.to_string().contains("`conv2d_1`") && err.to_string().contains("(batch, 1, 3, 3)"),
        "{err}"
    );

    let branches = Concat::new([
        Sequential::new().add(Conv2D::new(2, 3)),
        Sequential::new().add(Conv2D::new(2, 1)),
    ]);
    let err = Sequential::new()
        .add(branches)
        .summary(&[1, 8, 8])
        .expect_err("spatial sizes differ")
        .to_string();
    assert!(
        err.contains("concat_1")
            && err.contains("(batch, 2, 6, 6)")
            && err.contains("(batch, 2, 8, 8)"),
        "{err}"
    );
    Ok(())
}

#[test]
fn data_of_the_wrong_shape_names_the_model_and_both_shapes() -> anyhow::Result<()> {
    let mut model = compile(small_net().input_shape(&[1, 8, 8]))?;
    let x = Tensor::zeros((2, 1, 9, 9), DType::F32, &Device::Cpu)?;
    let err = model.predict(&x, 8).expect_err("built for 8x8").to_string();
    assert!(
        err.contains("(batch, 1, 8, 8)") && err.contains("(batch, 1, 9, 9)"),
        "{err}"
    );

    let data =
        InMemoryDataset::new(x, Tensor::new(&[0u32, 1], &Device::Cpu)?)?.named("nine by nine");
    let err = model
        .fit(&data, quiet())
        .expect_err("built for 8x8")
        .to_string();
    assert!(
        err.contains("nine by nine") && err.contains("(batch, 1, 9, 9)"),
        "{err}"
    );
    Ok(())
}

#[test]
fn labels_that_do_not_match_the_inputs_or_the_model() -> anyhow::Result<()> {
    let x = Tensor::zeros((3, 1, 8, 8), DType::F32, &Device::Cpu)?;
    let err = InMemoryDataset::new(x.clone(), Tensor::new(&[0u32, 1], &Device::Cpu)?)
        .expect_err("3 inputs, 2 labels");
    assert!(
        err.to_string().contains('3') && err.to_string().contains('2'),
        "{err}"
    );

    let twelve = InMemoryDataset::new(x, Tensor::new(&[0u32, 11, 5], &Device::Cpu)?)?;
    let mut model = compile(small_net())?;
    let err = model
        .fit(&twelve, quiet())
        .expect_err("12 classes, 10 outputs")
        .to_string();
    assert!(
        err.contains("12 classes") && err.contains("(batch, 10)"),
        "{err}"
    );

    let digits = kandle::data::digits::load()?.one_hot()?;
    let err = model
        .fit(&digits, quiet())
        .expect_err("sparse loss, one-hot targets")
        .to_string();
    assert!(err.contains("one-hot"), "{err}");
    Ok(())
}

#[test]
fn empty_data_and_zero_batches_are_errors() -> anyhow::Result<()> {
    let digits = kandle::data::digits::load()?;
    let empty = digits.subset(&[])?;
    let mut model = compile(small_net())?;
    let err = model.fit(&empty, quiet()).expect_err("empty");
    assert!(matches!(err, kandle::Error::EmptyDataset(_)), "{err}");
    let err = model
        .fit(
            &digits,
            FitOptions {
                batch_size_per_replica: 0,
                ..quiet()
            },
        )
        .expect_err("batch 0");
    assert!(err.to_string().contains("batch size"), "{err}");
    let err = model.evaluate(&digits, 0).expect_err("batch 0");
    assert!(err.to_string().contains("batch size"), "{err}");
    let x = Tensor::zeros((2, 1, 8, 8), DType::F32, &Device::Cpu)?;
    assert!(model.predict(&x, 0).is_err());
    Ok(())
}

#[test]
fn missing_corrupt_or_mismatched_checkpoints_leave_the_model_unchanged() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut model = compile(small_net().input_shape(&[1, 8, 8]))?;
    let before = model.get_weights()?;

    let err = model
        .load_weights(dir.path().join("missing.safetensors"))
        .expect_err("missing");
    assert!(err.to_string().contains("missing.safetensors"), "{err}");

    let corrupt = dir.path().join("corrupt.safetensors");
    std::fs::write(&corrupt, b"not a checkpoint")?;
    let err = model
        .load_weights(&corrupt)
        .expect_err("corrupt")
        .to_string();
    assert!(
        err.contains("corrupt.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );

    let other = compile(
        Sequential::new()
            .add(Conv2D::new(5, 3).padding(Padding::Same))
            .add(Flatten)
            .add(Dense::new(10))
            .input_shape(&[1, 8, 8]),
    )?;
    let other_path = dir.path().join("other.safetensors");
    other.save_weights(&other_path)?;
    let err = model
        .load_weights(&other_path)
        .expect_err("different model")
        .to_string();
    assert!(err.contains("does not match the model"), "{err}");
    assert!(
        err.contains("`conv2d_1.weight` is [5, 1, 3, 3] in the file but [4, 1, 3, 3] in the model"),
        "{err}"
    );

    let after = model.get_weights()?;
    for (name, value) in &before {
        assert_eq!(
            value.flatten_all()?.to_vec1::<f32>()?,
            after[name].flatten_all()?.to_vec1::<f32>()?,
            "{name}"
        );
    }
    Ok(())
}

#[test]
fn unbuilt_models_and_bad_rates_are_errors() -> anyhow::Result<()> {
    let mut model = compile(small_net())?;
    assert!(matches!(model.summary(), Err(kandle::Error::NotReady(_))));
    assert!(model.save_weights("never.safetensors").is_err());
    assert!(model.set_learning_rate(f64::NAN).is_err());
    assert!(model.set_learning_rate(-1.0).is_err());
    assert!(Sequential::new().summary(&[3]).is_err());
    assert!(Dropout::new(1.5)
        .boxed()
        .build(
            &mut kandle::layers::BuildContext::new(&Device::Cpu, 0),
            &[3]
        )
        .is_err());
    Ok(())
}

/// Six one-record CIFAR-10 files in `dir`.
fn tiny_cifar10(dir: &std::path::Path) -> anyhow::Result<()> {
    use kandle::data::cifar10::{self, Cifar10, Cifar10Dataset, IMAGE_LEN};
    let set = |n: usize| Cifar10Dataset::new(vec![7; n * IMAGE_LEN], vec![3; n]);
    cifar10::save(
        dir,
        &Cifar10 {
            train: set(5)?,
            test: set(1)?,
        },
    )?;
    Ok(())
}

#[test]
#[cfg(unix)]
fn a_cifar10_file_linked_to_dev_zero_is_named_not_missing_and_not_read() -> anyhow::Result<()> {
    use kandle::data::cifar10;
    let dir = tempfile::tempdir()?;
    tiny_cifar10(dir.path())?;
    let file = dir.path().join(cifar10::TEST_FILE);
    std::fs::remove_file(&file)?;
    std::os::unix::fs::symlink("/dev/zero", &file)?;
    // It would never end if read: the error comes from what the file is.
    let err = cifar10::load(dir.path()).expect_err("a device").to_string();
    assert!(
        err.contains(&file.display().to_string())
            && err.contains("not a regular file")
            && err.contains("/dev/zero")
            && !err.contains("not found"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_truncated_cifar10_file_gives_its_size() -> anyhow::Result<()> {
    use kandle::data::cifar10;
    let dir = tempfile::tempdir()?;
    tiny_cifar10(dir.path())?;
    let file = dir.path().join("data_batch_5.bin");
    std::fs::write(&file, vec![1u8; 1000])?;
    let err = cifar10::load_file(&file)
        .expect_err("truncated")
        .to_string();
    assert!(
        err.contains(&file.display().to_string())
            && err.contains("wrong size")
            && err.contains("got 1000 bytes"),
        "{err}"
    );
    Ok(())
}
