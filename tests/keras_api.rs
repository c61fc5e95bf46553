//! The Keras conveniences on real digits data: one-batch training, testing and prediction;
//! sample and class weights; `validation_freq`; the evaluation and prediction hooks; a loss of
//! the user's own that turns NaN mid-epoch (`batch_loss` and `TerminateOnNaN`); binary
//! cross-entropy and Huber training.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use kandle::callbacks::{Callback, Logs, TerminateOnNaN};
use kandle::data::{digits, Dataset, InMemoryDataset};
use kandle::losses::Loss;
use kandle::params::Weights;
use kandle::prelude::*;

fn mlp() -> Sequential {
    Sequential::new()
        .input_shape(&[1, 8, 8])
        .add(Flatten)
        .add(Dense::new(16))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

fn compiled(optimizer: Sgd) -> kandle::Result<Model> {
    mlp().compile(
        optimizer,
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )
}

fn digits_split() -> Result<(InMemoryDataset, InMemoryDataset)> {
    let all = digits::load()?;
    Ok(all
        .subset(&(0..600).collect::<Vec<_>>())?
        .train_test_split(0.25, 3)?)
}

fn quiet<'a>(epochs: usize) -> FitOptions<'a> {
    FitOptions {
        epochs,
        batch_size_per_replica: 32,
        verbosity: Verbosity::Silent,
        ..Default::default()
    }
}

fn max_difference(a: &Weights, b: &Weights) -> Result<f32> {
    let mut worst = 0f32;
    for (name, x) in a {
        let y = b.get(name).ok_or_else(|| anyhow::anyhow!("no {name}"))?;
        worst = worst.max((x - y)?.abs()?.max_all()?.to_scalar::<f32>()?);
    }
    Ok(worst)
}

#[test]
fn one_batch_methods_train_test_and_predict() -> Result<()> {
    let (train, _) = digits_split()?;
    let (x, y) = train.to_tensors()?;
    let (x, y) = (x.narrow(0, 0, 64)?, y.narrow(0, 0, 64)?);
    let mut model = compiled(Sgd::new(0.1).momentum(0.9))?;
    let first = model.train_on_batch(&x, &y, None)?;
    for _ in 0..60 {
        model.train_on_batch(&x, &y, None)?;
    }
    let tested = model.test_on_batch(&x, &y, None)?;
    let first_loss = first.get("loss").unwrap_or(f64::NAN);
    let loss = tested.get("loss").unwrap_or(f64::NAN);
    ensure!(loss < 0.3 * first_loss, "loss {first_loss} -> {loss}");
    // test_on_batch is evaluate on that batch; predict_on_batch is predict.
    let data = InMemoryDataset::new(x.clone(), y.clone())?;
    let evaluated = model.evaluate(&data, 64)?;
    ensure!((evaluated.get("loss").unwrap_or(0.0) - loss).abs() < 1e-6);
    let once = model.predict_on_batch(&x)?;
    let batched = model.predict(&x, 16)?;
    ensure!(once.dims() == [64, 10]);
    ensure!((once - batched)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
    // A wrong sample_weight shape names both shapes.
    let w = Tensor::ones(3, DType::F32, &Device::Cpu)?;
    let err = model
        .train_on_batch(&x, &y, Some(&w))
        .err()
        .map(|e| e.to_string());
    ensure!(
        err.as_deref()
            .is_some_and(|e| e.contains("(64,)") && e.contains("[3]")),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn sample_weights_scale_the_loss_and_zero_weights_change_nothing() -> Result<()> {
    let (train, test) = digits_split()?;
    let mut model = compiled(Sgd::new(0.1))?;
    let plain = model.evaluate(&test, 32)?.get("loss").unwrap_or(f64::NAN);
    let twos = vec![2.0; test.len()];
    let weighted = model.evaluate(
        &test,
        EvaluateOptions {
            batch_size_per_replica: 32,
            sample_weight: Some(&twos),
            ..Default::default()
        },
    )?;
    let doubled = weighted.get("loss").unwrap_or(f64::NAN);
    ensure!(
        (doubled - 2.0 * plain).abs() < 1e-5 * plain,
        "{plain} {doubled}"
    );
    // Accuracy is not weighted.
    ensure!(weighted.get("accuracy") == model.evaluate(&test, 32)?.get("accuracy"));

    // Plain SGD with every weight 0 leaves the model as it was.
    let before = model.get_weights()?;
    let zeros = vec![0.0; train.len()];
    model.fit(
        &train,
        FitOptions {
            sample_weight: Some(&zeros),
            ..quiet(2)
        },
    )?;
    ensure!(max_difference(&before, &model.get_weights()?)? == 0.0);
    let no_class = (0..10).map(|c| (c, 0.0)).collect::<HashMap<_, _>>();
    model.fit(
        &train,
        FitOptions {
            class_weight: Some(no_class),
            ..quiet(1)
        },
    )?;
    ensure!(max_difference(&before, &model.get_weights()?)? == 0.0);

    let wrong = vec![1.0; 3];
    let err = model.fit(
        &train,
        FitOptions {
            sample_weight: Some(&wrong),
            ..quiet(1)
        },
    );
    ensure!(err.is_err_and(|e| e.to_string().contains("sample_weight has 3 values")));
    let bad = HashMap::from([(12, 1.0)]);
    let err = model.fit(
        &train,
        FitOptions {
            class_weight: Some(bad),
            ..quiet(1)
        },
    );
    ensure!(err.is_err_and(|e| e.to_string().contains("class 12")));
    Ok(())
}

#[test]
fn class_weights_equal_the_same_sample_weights() -> Result<()> {
    let (train, _) = digits_split()?;
    let class_weight: HashMap<usize, f32> = (0..10).map(|c| (c, 0.5 + c as f32 / 4.0)).collect();
    let (_, y) = train.to_tensors()?;
    let per_sample: Vec<f32> = y
        .to_vec1::<u32>()?
        .iter()
        .map(|&c| class_weight[&(c as usize)])
        .collect();
    let mut by_class = compiled(Sgd::new(0.1).momentum(0.9))?;
    by_class.fit(
        &train,
        FitOptions {
            class_weight: Some(class_weight),
            ..quiet(2)
        },
    )?;
    let mut by_sample = compiled(Sgd::new(0.1).momentum(0.9))?;
    by_sample.fit(
        &train,
        FitOptions {
            sample_weight: Some(&per_sample),
            ..quiet(2)
        },
    )?;
    let mut unweighted = compiled(Sgd::new(0.1).momentum(0.9))?;
    unweighted.fit(&train, quiet(2))?;
    let same = max_difference(&by_class.get_weights()?, &by_sample.get_weights()?)?;
    ensure!(same == 0.0, "class and sample weights differ by {same}");
    let moved = max_difference(&by_class.get_weights()?, &unweighted.get_weights()?)?;
    ensure!(moved > 1e-3, "the weights changed nothing ({moved})");
    Ok(())
}

/// Counts every hook it sees.
#[derive(Default)]
struct Counts {
    test_begin: usize,
    test_batches: usize,
    test_end: usize,
    predict_begin: usize,
    predict_batches: Vec<usize>,
    predict_end: usize,
}

struct Counting(Arc<Mutex<Counts>>);

impl Callback for Counting {
    fn on_test_begin(&mut self, _model: &mut Model) -> kandle::Result<()> {
        if let Ok(mut c) = self.0.lock() {
            c.test_begin += 1;
        }
        Ok(())
    }
    fn on_test_batch_end(&mut self, _b: usize, logs: &Logs, _m: &mut Model) -> kandle::Result<()> {
        assert!(logs.get("loss").is_some());
        if let Ok(mut c) = self.0.lock() {
            c.test_batches += 1;
        }
        Ok(())
    }
    fn on_test_end(&mut self, logs: &Logs, _model: &mut Model) -> kandle::Result<()> {
        assert!(logs.get("accuracy").is_some());
        if let Ok(mut c) = self.0.lock() {
            c.test_end += 1;
        }
        Ok(())
    }
    fn on_predict_begin(&mut self, _model: &mut Model) -> kandle::Result<()> {
        if let Ok(mut c) = self.0.lock() {
            c.predict_begin += 1;
        }
        Ok(())
    }
    fn on_predict_batch_end(
        &mut self,
        _batch: usize,
        outputs: &Tensor,
        _model: &mut Model,
    ) -> kandle::Result<()> {
        let rows = outputs.dim(0)?;
        if let Ok(mut c) = self.0.lock() {
            c.predict_batches.push(rows);
        }
        Ok(())
    }
    fn on_predict_end(&mut self, _model: &mut Model) -> kandle::Result<()> {
        if let Ok(mut c) = self.0.lock() {
            c.predict_end += 1;
        }
        Ok(())
    }
}

#[test]
fn validation_freq_and_the_test_and_predict_hooks() -> Result<()> {
    let (train, test) = digits_split()?;
    let counts = Arc::new(Mutex::new(Counts::default()));
    let mut model = compiled(Sgd::new(0.1))?;
    let history = model.fit(
        &train,
        FitOptions {
            validation: Some(&test),
            validation_freq: 2,
            callbacks: vec![Box::new(Counting(Arc::clone(&counts)))],
            ..quiet(4)
        },
    )?;
    let val: Vec<bool> = history
        .logs
        .iter()
        .map(|l| l.get("val_loss").is_some())
        .collect();
    ensure!(val == [false, true, false, true], "{val:?}");
    {
        let c = counts.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        // 150 validation samples in batches of 32: 5 steps, twice.
        ensure!((c.test_begin, c.test_batches, c.test_end) == (2, 10, 2));
    }
    model.evaluate(
        &test,
        EvaluateOptions {
            batch_size_per_replica: 64,
            callbacks: vec![Box::new(Counting(Arc::clone(&counts)))],
            ..Default::default()
        },
    )?;
    let (x, _) = test.to_tensors()?;
    let out = model.predict(
        &x,
        PredictOptions {
            batch_size_per_replica: 64,
            callbacks: vec![Box::new(Counting(Arc::clone(&counts)))],
        },
    )?;
    ensure!(out.dims() == [150, 10]);
    let c = counts.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    ensure!((c.test_begin, c.test_batches, c.test_end) == (3, 13, 3));
    ensure!(c.predict_batches == [64, 64, 22] && (c.predict_begin, c.predict_end) == (1, 1));
    let zero = model.fit(
        &train,
        FitOptions {
            validation_freq: 0,
            ..quiet(1)
        },
    );
    ensure!(zero.is_err_and(|e| e.to_string().contains("validation_freq")));
    Ok(())
}

/// Sparse cross-entropy that turns NaN from its `after`-th call on.
#[derive(Debug)]
struct TurnsNan {
    calls: Mutex<usize>,
    after: usize,
}

impl Loss for TurnsNan {
    fn name(&self) -> &str {
        "turns_nan"
    }
    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> kandle::Result<Tensor> {
        let loss = SparseCategoricalCrossentropy::new().call(y_true, y_pred)?;
        let mut calls = self
            .calls
            .lock()
            .map_err(|_| kandle::Error::invalid("poisoned"))?;
        *calls += 1;
        if *calls > self.after {
            return Ok((loss * f64::NAN)?);
        }
        Ok(loss)
    }
}

/// Records each batch's `batch_loss`.
struct BatchLosses(Arc<Mutex<Vec<f64>>>);

impl Callback for BatchLosses {
    fn on_train_batch_end(&mut self, _b: usize, logs: &Logs, _m: &mut Model) -> kandle::Result<()> {
        let loss = logs.get("batch_loss").unwrap_or(-1.0);
        if let Ok(mut v) = self.0.lock() {
            v.push(loss);
        }
        Ok(())
    }
}

#[test]
fn a_loss_turning_nan_mid_epoch_stops_training_at_that_batch() -> Result<()> {
    let (train, _) = digits_split()?;
    let mut model = mlp().compile(
        Sgd::new(0.1),
        TurnsNan {
            calls: Mutex::new(0),
            after: 5,
        },
        [Accuracy],
        &OneDeviceStrategy::cpu(),
    )?;
    let losses = Arc::new(Mutex::new(Vec::new()));
    let weights = Arc::new(Mutex::new(None));
    struct Keep(Arc<Mutex<Option<Weights>>>);
    impl Callback for Keep {
        fn on_train_batch_end(&mut self, b: usize, _l: &Logs, m: &mut Model) -> kandle::Result<()> {
            if b == 4 {
                let w = m.get_weights()?;
                if let Ok(mut k) = self.0.lock() {
                    *k = Some(w);
                }
            }
            Ok(())
        }
    }
    model.fit(
        &train,
        FitOptions {
            callbacks: vec![
                Box::new(Keep(Arc::clone(&weights))),
                Box::new(BatchLosses(Arc::clone(&losses))),
                Box::new(TerminateOnNaN),
            ],
            ..quiet(3)
        },
    )?;
    let losses = losses
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    // 450 samples in batches of 32: 15 steps an epoch; the sixth is the first NaN.
    ensure!(losses.len() == 6, "{losses:?}");
    ensure!(
        losses[..5].iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );
    ensure!(losses[5].is_nan());
    let kept = weights
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let kept = kept.ok_or_else(|| anyhow::anyhow!("no weights after batch 5"))?;
    ensure!(
        max_difference(&kept, &model.get_weights()?)? == 0.0,
        "the NaN step was applied"
    );
    Ok(())
}

#[test]
fn binary_crossentropy_and_huber_train() -> Result<()> {
    // Digits 0 against 1, one sigmoid output, from probabilities and from logits.
    let all = digits::load()?;
    let (x, y) = all.to_tensors()?;
    let labels = y.to_vec1::<u32>()?;
    let keep: Vec<usize> = (0..labels.len()).filter(|&i| labels[i] < 2).collect();
    let binary = all.subset(&keep)?.with_num_classes(2)?;
    let (train, test) = binary.train_test_split(0.3, 1)?;
    for from_logits in [false, true] {
        let net = Sequential::new()
            .add(Flatten)
            .add(Dense::new(1))
            .add(if from_logits {
                Activation::Linear
            } else {
                Activation::Sigmoid
            });
        let mut model = net.compile(
            Sgd::new(0.05),
            BinaryCrossentropy::new().from_logits(from_logits),
            [BinaryAccuracy::new().threshold(if from_logits { 0.0 } else { 0.5 })],
            &OneDeviceStrategy::cpu(),
        )?;
        model.fit(&train, quiet(5))?;
        let acc = model
            .evaluate(&test, 32)?
            .get("binary_accuracy")
            .unwrap_or(0.0);
        ensure!(
            acc > 0.97,
            "binary accuracy {acc} (from_logits {from_logits})"
        );
    }
    // Regress the digit's mean pixel with Huber.
    let n = x.dim(0)?;
    let target = x.flatten_from(1)?.mean_keepdim(1)?;
    let data = InMemoryDataset::new(x.clone(), target.reshape((n, 1))?)?;
    let mut model = Sequential::new().add(Flatten).add(Dense::new(1)).compile(
        Sgd::new(0.02),
        Huber::new(),
        [kandle::metrics::MeanAbsoluteError],
        &OneDeviceStrategy::cpu(),
    )?;
    let before = model
        .evaluate(&data, 64)?
        .get("mean_absolute_error")
        .unwrap_or(0.0);
    model.fit(&data, quiet(10))?;
    let after = model
        .evaluate(&data, 64)?
        .get("mean_absolute_error")
        .unwrap_or(f64::NAN);
    ensure!(
        after < 0.2 * before,
        "mean absolute error {before} -> {after}"
    );
    Ok(())
}

#[test]
fn clashing_metric_names_are_refused() -> Result<()> {
    let err = mlp()
        .compile(
            Sgd::new(0.1),
            SparseCategoricalCrossentropy::new(),
            (Accuracy, Accuracy),
            &OneDeviceStrategy::cpu(),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(err.contains("`accuracy` is taken"), "{err}");
    Ok(())
}
