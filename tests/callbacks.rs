//! The callbacks inside real `fit` runs on the bundled digits data: checkpoints that load back,
//! early stopping with restored weights, termination on a NaN loss with the last good weights
//! kept, the CSV log, the learning-rate reduction and the plot.

use kandle::Compile;
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Context, Result};
use candle_core::Tensor;
use kandle::callbacks::{
    Callback, CsvLogger, EarlyStopping, Logs, ModelCheckpoint, PlotHistory, ReduceLROnPlateau,
    TerminateOnNaN, Verbosity,
};
use kandle::data::{digits, Dataset, InMemoryDataset};
use kandle::layers::{Activation, Dense, Flatten, Sequential};
use kandle::optimizers::{Adam, OptimizerConfig, Sgd};
use kandle::params::Weights;
use kandle::prelude::{Accuracy, SparseCategoricalCrossentropy};
use kandle::{FitOptions, Model, OneDeviceStrategy};

/// A small MLP for the 8×8 digits. Every call builds the same initial weights.
fn mlp(optimizer: impl OptimizerConfig) -> kandle::Result<Model> {
    Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Flatten)
        .add(Dense::new(16))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
        .compile(
            optimizer,
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )
}

/// Softmax regression: no ReLU, which would turn a NaN input into 0 (candle's `relu` is a
/// `max`), so a NaN sample makes the loss NaN.
fn linear(optimizer: impl OptimizerConfig) -> kandle::Result<Model> {
    Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Flatten)
        .add(Dense::new(10))
        .add(Activation::Softmax)
        .compile(
            optimizer,
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )
}

/// 640 training and 160 validation samples: enough to learn, quick to run.
fn digits_split() -> Result<(InMemoryDataset, InMemoryDataset)> {
    let all = digits::load()?;
    let (train, val) = all
        .subset(&(0..800).collect::<Vec<_>>())?
        .train_test_split(0.2, 7)?;
    Ok((train, val))
}

fn options<'a>(epochs: usize, callbacks: Vec<Box<dyn Callback>>) -> FitOptions<'a> {
    FitOptions {
        epochs,
        batch_size_per_replica: 32,
        callbacks,
        verbosity: Verbosity::Silent,
        ..Default::default()
    }
}

/// What a [`Recorder`] saw at the end of each epoch.
#[derive(Default)]
struct Recorded {
    predictions: Vec<Tensor>,
    weights: Vec<Weights>,
}

/// Records, after every epoch, the model's weights and its predictions on fixed inputs.
struct Recorder {
    x: Tensor,
    seen: Arc<Mutex<Recorded>>,
}

impl Callback for Recorder {
    fn on_epoch_end(
        &mut self,
        _epoch: usize,
        _logs: &Logs,
        model: &mut Model,
    ) -> kandle::Result<()> {
        let predictions = model.predict(&self.x, 64)?;
        let weights = model.get_weights()?;
        if let Ok(mut seen) = self.seen.lock() {
            seen.predictions.push(predictions);
            seen.weights.push(weights);
        }
        Ok(())
    }
}

fn recorder(x: &Tensor) -> (Recorder, Arc<Mutex<Recorded>>) {
    let seen = Arc::new(Mutex::new(Recorded::default()));
    (
        Recorder {
            x: x.clone(),
            seen: seen.clone(),
        },
        seen,
    )
}

fn flat(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

fn same_weights(a: &Weights, b: &Weights) -> Result<bool> {
    ensure!(
        a.keys().eq(b.keys()),
        "different names: {:?} vs {:?}",
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>()
    );
    for (name, t) in a {
        if flat(t)? != flat(&b[name])? {
            return Ok(false);
        }
    }
    Ok(true)
}

#[test]
fn model_checkpoint_best_only_loads_into_a_fresh_model() -> Result<()> {
    let (train, val) = digits_split()?;
    let (x_val, _) = val.to_tensors()?;
    let dir = tempfile::tempdir()?;
    let best = dir.path().join("best.safetensors");
    let every = dir.path().join("ckpt-{epoch}.safetensors");
    let (rec, seen) = recorder(&x_val);

    let mut model = mlp(Adam::new(1e-2))?;
    let history = model.fit(
        &train,
        FitOptions {
            validation: Some(&val),
            ..options(
                4,
                vec![
                    Box::new(rec),
                    Box::new(ModelCheckpoint::new(&best).save_best_only(true)),
                    Box::new(ModelCheckpoint::new(&every)),
                ],
            )
        },
    )?;
    assert_eq!(history.epochs, [0, 1, 2, 3]);
    for epoch in 1..=4 {
        let file = dir.path().join(format!("ckpt-{epoch:02}.safetensors"));
        ensure!(file.is_file(), "{} is missing", file.display());
    }

    // The best file holds the epoch with the lowest val_loss (the first, on ties).
    let val_loss = history.series("val_loss");
    let best_epoch = (0..val_loss.len())
        .min_by(|&a, &b| val_loss[a].total_cmp(&val_loss[b]))
        .context("no epochs")?;
    let mut fresh = mlp(Adam::new(1e-2))?;
    fresh.load_weights(&best)?;
    let seen = seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    assert_eq!(
        flat(&fresh.predict(&x_val, 64)?)?,
        flat(&seen.predictions[best_epoch])?,
        "best epoch {best_epoch} of val_loss {val_loss:?}"
    );

    // The last epoch's file reproduces the trained model.
    let mut last = mlp(Sgd::new(0.1))?;
    last.load_weights(dir.path().join("ckpt-04.safetensors"))?;
    assert_eq!(
        flat(&last.predict(&x_val, 64)?)?,
        flat(&model.predict(&x_val, 64)?)?
    );
    Ok(())
}

#[test]
fn early_stopping_stops_on_a_plateau_and_restores_the_best_weights() -> Result<()> {
    let (train, _) = digits_split()?;
    let (x, _) = train.to_tensors()?;
    let (rec, seen) = recorder(&x.narrow(0, 0, 8)?);
    let stop = EarlyStopping::new("loss")
        .min_delta(100.0) // no epoch can improve by this much: a plateau from epoch 0
        .patience(2)
        .restore_best_weights(true);

    let mut model = mlp(Adam::new(1e-2))?;
    let history = model.fit(&train, options(10, vec![Box::new(rec), Box::new(stop)]))?;

    // Epoch 0 sets the best; epochs 1 and 2 do not improve; patience 2 stops after epoch 2.
    assert_eq!(history.epochs, [0, 1, 2]);
    let seen = seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let now = model.get_weights()?;
    assert!(same_weights(&now, &seen.weights[0])?, "epoch 0's weights");
    assert!(
        !same_weights(&now, &seen.weights[2])?,
        "training moved the weights after epoch 0"
    );
    Ok(())
}

#[test]
fn early_stopping_without_restore_keeps_the_last_weights() -> Result<()> {
    let (train, _) = digits_split()?;
    let (x, _) = train.to_tensors()?;
    let (rec, seen) = recorder(&x.narrow(0, 0, 8)?);
    let stop = EarlyStopping::new("loss").min_delta(100.0).patience(1);
    let mut model = mlp(Adam::new(1e-2))?;
    let history = model.fit(&train, options(10, vec![Box::new(rec), Box::new(stop)]))?;
    assert_eq!(history.epochs, [0, 1]);
    let seen = seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    assert!(same_weights(&model.get_weights()?, &seen.weights[1])?);
    Ok(())
}

/// The first 320 digits, with sample `nan_at` made NaN.
fn digits_with_nan(nan_at: usize) -> Result<InMemoryDataset> {
    let ds = digits::load()?.subset(&(0..320).collect::<Vec<_>>())?;
    let mut x = ds.input_values().to_vec();
    let len: usize = ds.sample_shape().iter().product();
    x[nan_at * len..(nan_at + 1) * len].fill(f32::NAN);
    Ok(InMemoryDataset::from_vecs(
        x,
        ds.sample_shape(),
        ds.target_values().to_vec(),
        ds.targets(),
    )?)
}

fn assert_finite(weights: &Weights) -> Result<()> {
    for (name, t) in weights {
        ensure!(
            flat(t)?.iter().all(|v| v.is_finite()),
            "{name} has non-finite values"
        );
    }
    Ok(())
}

#[test]
fn terminate_on_nan_stops_on_a_nan_input_and_keeps_the_last_good_weights() -> Result<()> {
    // Batches of 32 in order: batch 3 (samples 96..128) holds the NaN.
    let data = digits_with_nan(100)?;
    let mut model = linear(Sgd::new(0.1))?;
    let history = model.fit(
        &data,
        FitOptions {
            shuffle: false,
            ..options(5, vec![Box::new(TerminateOnNaN)])
        },
    )?;
    assert_eq!(history.epochs, [0], "stopped during the first epoch");
    // The epoch's loss is that of the steps that trained; the skipped one is counted.
    assert!(history.last("loss").is_some_and(f64::is_finite));
    assert_eq!(history.last("skipped_steps"), Some(1.0));
    let weights = model.get_weights()?;
    assert_finite(&weights)?;

    // The weights are those after the three good batches before it.
    let mut reference = linear(Sgd::new(0.1))?;
    reference.fit(
        &data,
        FitOptions {
            shuffle: false,
            steps_per_epoch: Some(3),
            ..options(1, vec![])
        },
    )?;
    assert!(same_weights(&weights, &reference.get_weights()?)?);
    Ok(())
}

/// A two-output model (class and a score, the score's loss weighted 0.5) on the first 64
/// digits with samples 2, 30 and 50 made NaN, in batches of 8 in order: batches 0, 3 and 6
/// hold them. Their steps are skipped, counted, and left out of every loss alike.
#[test]
fn nan_samples_skip_their_steps_visibly_and_the_total_and_output_losses_agree() -> Result<()> {
    use kandle::functional::{Functional, Input, LayerCall, PerOutput};
    use kandle::layers::LayerSpecExt;
    use kandle::prelude::MeanSquaredError;

    let ds = digits::load()?.subset(&(0..64).collect::<Vec<_>>())?;
    let (x, labels) = ds.to_tensors()?;
    let mut values = x.flatten_all()?.to_vec1::<f32>()?;
    for sample in [2, 30, 50] {
        values[sample * 64..(sample + 1) * 64].fill(f32::NAN);
    }
    let x = Tensor::from_vec(values, x.dims(), x.device())?;
    let scores = (labels.to_dtype(candle_core::DType::F32)? * 0.1)?.reshape((64, 1))?;
    let data = InMemoryDataset::from_parts(&[x], &[labels, scores])?;
    let compile = || -> kandle::Result<Model> {
        let image = Input::new(&[1, 8, 8]).tensor();
        let h = Dense::new(16).call(&Flatten.call(&image)?)?;
        let class = Activation::Softmax
            .named("class")
            .call(&Dense::new(10).call(&h)?)?;
        let score = Dense::new(1).named("score").call(&h)?;
        let losses = PerOutput::new()
            .loss("class", SparseCategoricalCrossentropy::new())
            .loss("score", MeanSquaredError)
            .weight("score", 0.5);
        Functional::new([&image], [&class, &score])?.compile(
            Sgd::new(0.05),
            losses,
            (),
            &OneDeviceStrategy::cpu(),
        )
    };
    let fit = |callbacks: Vec<Box<dyn Callback>>| -> Result<(Model, kandle::callbacks::History)> {
        let mut model = compile()?;
        let history = model.fit(
            &data,
            FitOptions {
                epochs: 2,
                batch_size_per_replica: 8,
                shuffle: false,
                verbosity: Verbosity::Silent,
                callbacks,
                ..Default::default()
            },
        )?;
        Ok((model, history))
    };
    let (model, history) = fit(vec![])?;
    for logs in &history.logs {
        ensure!(logs.get("skipped_steps") == Some(3.0), "{logs:?}");
        let (loss, class, score) = (
            logs.get("loss").unwrap_or(f64::NAN),
            logs.get("class_loss").unwrap_or(f64::NAN),
            logs.get("score_loss").unwrap_or(f64::NAN),
        );
        ensure!(
            loss.is_finite() && class.is_finite() && score.is_finite(),
            "{logs:?}"
        );
        ensure!(
            (loss - (class + 0.5 * score)).abs() <= 1e-6 * loss,
            "{logs:?}"
        );
        ensure!(
            logs.to_line().contains("skipped_steps: 3"),
            "{}",
            logs.to_line()
        );
    }
    assert_finite(&model.get_weights()?)?;

    // TerminateOnNaN stops at the first skipped step, the first batch.
    let (_, history) = fit(vec![Box::new(TerminateOnNaN)])?;
    ensure!(history.epochs == [0], "{:?}", history.epochs);
    ensure!(
        history.last("skipped_steps") == Some(1.0),
        "{:?}",
        history.logs
    );
    Ok(())
}

#[test]
fn terminate_on_nan_stops_a_diverging_run() -> Result<()> {
    // SGD at 1e10 overflows the loss to infinity within the first epoch (at 1e6 it only
    // reaches about 1e27, which is finite).
    let (train, _) = digits_split()?;
    let mut model = mlp(Sgd::new(1e10))?;
    let history = model.fit(&train, options(20, vec![Box::new(TerminateOnNaN)]))?;
    assert_eq!(history.epochs, [0]);
    // Stopped at the first step whose loss was not finite, which was skipped and counted.
    assert_eq!(history.last("skipped_steps"), Some(1.0));
    assert_finite(&model.get_weights()?)
}

#[test]
fn csv_logger_writes_a_header_and_one_row_per_epoch() -> Result<()> {
    let (train, val) = digits_split()?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("log.csv");
    let mut model = mlp(Adam::new(1e-2))?;
    let history = model.fit(
        &train,
        FitOptions {
            validation: Some(&val),
            ..options(3, vec![Box::new(CsvLogger::new(&path))])
        },
    )?;
    let text = std::fs::read_to_string(&path)?;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0], "epoch,loss,accuracy,val_loss,val_accuracy,lr,skipped_steps",
        "{text}"
    );
    assert_eq!(lines.len(), 1 + 3);
    for (epoch, line) in lines[1..].iter().enumerate() {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells[0], epoch.to_string());
        let loss: f64 = cells[1].parse()?;
        assert_eq!(
            Some(loss),
            history.logs[epoch].get("loss"),
            "full precision"
        );
    }

    // Resuming with append adds rows under the same header.
    let mut resumed = mlp(Adam::new(1e-2))?;
    resumed.fit(
        &train,
        FitOptions {
            validation: Some(&val),
            initial_epoch: 3,
            ..options(5, vec![Box::new(CsvLogger::new(&path).append(true))])
        },
    )?;
    let text = std::fs::read_to_string(&path)?;
    let epochs: Vec<&str> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split(',').next())
        .collect();
    assert_eq!(epochs, ["0", "1", "2", "3", "4"]);
    Ok(())
}

#[test]
fn reduce_lr_on_plateau_lowers_lr_in_the_history() -> Result<()> {
    let (train, _) = digits_split()?;
    let reduce = ReduceLROnPlateau::new("loss")
        .min_delta(100.0) // every epoch after the first is a plateau
        .patience(1)
        .factor(0.5)
        .min_lr(0.0125)
        .verbose(false);
    let mut model = mlp(Sgd::new(0.1))?;
    let history = model.fit(&train, options(6, vec![Box::new(reduce)]))?;
    // Each epoch logs the rate it trained with; a reduction shows from the next epoch on.
    let lr = history.series("lr");
    assert_eq!(lr, [0.1, 0.1, 0.05, 0.025, 0.0125, 0.0125], "{lr:?}");
    assert_eq!(model.learning_rate(), 0.0125);
    Ok(())
}

#[test]
fn plot_history_draws_during_fit() -> Result<()> {
    let (train, val) = digits_split()?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("history.png");
    let mut model = mlp(Adam::new(1e-2))?;
    let history = model.fit(
        &train,
        FitOptions {
            validation: Some(&val),
            ..options(
                3,
                vec![Box::new(PlotHistory::new(&path).title("digits MLP"))],
            )
        },
    )?;
    let bytes = std::fs::read(&path)?;
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    // The plain function draws the returned history too.
    let again = dir.path().join("again.png");
    kandle::callbacks::plot_history(&history, &again, "digits MLP")?;
    assert!(again.is_file());
    Ok(())
}
