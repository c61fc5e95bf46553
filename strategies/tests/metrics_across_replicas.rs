//! Metrics are reduced from sums, so they do not depend on the replica count: balanced
//! accuracy (which is not a mean over samples and so cannot be averaged per replica) and the
//! accuracy of a trained model are the same under one device and under 2 and 3 CPU replicas
//! (with uneven splits and a short last batch), in `evaluate` and in `fit`'s epoch logs. The
//! batch size means samples per replica in `predict` too.

use std::sync::{Arc, Mutex};

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor, D};
use kandle::callbacks::{Callback, Logs};
use kandle::data::{digits, Dataset, InMemoryDataset};
use kandle::metrics::Metric;
use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy};

/// Balanced accuracy: the recall of each class, averaged over the classes present. Not a mean
/// over samples, so it cannot be averaged per batch or replica.
#[derive(Debug)]
struct BalancedAccuracy;

const CLASSES: usize = 10;

impl Metric for BalancedAccuracy {
    fn name(&self) -> &str {
        "balanced_accuracy"
    }
    /// `[hits per class..., samples per class...]`.
    fn state_size(&self) -> usize {
        2 * CLASSES
    }
    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> kandle::Result<Tensor> {
        let classes = y_true.to_dtype(DType::U32)?;
        let range = Tensor::arange(0u32, CLASSES as u32, y_pred.device())?.unsqueeze(0)?;
        let truth = classes
            .unsqueeze(1)?
            .broadcast_eq(&range)?
            .to_dtype(DType::F32)?;
        let hit = y_pred
            .argmax(D::Minus1)?
            .eq(&classes)?
            .to_dtype(DType::F32)?;
        let hits = truth.broadcast_mul(&hit.unsqueeze(1)?)?.sum(0)?;
        Ok(Tensor::cat(&[&hits, &truth.sum(0)?], 0)?)
    }
    fn result(&self, s: &[f64]) -> f64 {
        let present: Vec<f64> = (0..CLASSES)
            .filter(|&k| s[CLASSES + k] > 0.0)
            .map(|k| s[k] / s[CLASSES + k])
            .collect();
        present.iter().sum::<f64>() / present.len().max(1) as f64
    }
}

fn net() -> Sequential {
    Sequential::new()
        .add(Flatten)
        .add(Dense::new(24))
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

/// Records each epoch's logs.
struct EpochLogs(Arc<Mutex<Vec<Logs>>>);

impl Callback for EpochLogs {
    fn on_epoch_end(&mut self, _epoch: usize, logs: &Logs, _m: &mut Model) -> kandle::Result<()> {
        if let Ok(mut v) = self.0.lock() {
            v.push(logs.clone());
        }
        Ok(())
    }
}

/// Trains 2 epochs under `strategy` at global batch 48 and returns the epoch logs and the test
/// set's evaluation at a global batch of 30.
fn run<S: Strategy + Clone + 'static>(
    strategy: &S,
    train: &InMemoryDataset,
    test: &InMemoryDataset,
) -> Result<(Vec<Logs>, Logs)> {
    let replicas = strategy.num_replicas_in_sync();
    let mut model = net().compile(
        Sgd::new(0.1),
        SparseCategoricalCrossentropy::new(),
        (Accuracy, BalancedAccuracy),
        strategy,
    )?;
    let logs = Arc::new(Mutex::new(Vec::new()));
    model.fit(
        train,
        FitOptions {
            epochs: 2,
            batch_size_per_replica: 48 / replicas,
            shuffle: false,
            validation: Some(test),
            verbosity: Verbosity::Silent,
            callbacks: vec![Box::new(EpochLogs(Arc::clone(&logs)))],
            ..Default::default()
        },
    )?;
    let evaluated = model.evaluate(test, 30 / replicas)?;
    let logs = logs
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    Ok((logs, evaluated))
}

#[test]
fn metrics_do_not_depend_on_the_replica_count() -> Result<()> {
    let all = digits::load()?;
    // About 500 training samples: steps of 48 and a short last one; about 211 test samples,
    // split unevenly over 2 and 3 replicas.
    let (train, test) = all
        .subset(&(0..711).collect::<Vec<_>>())?
        .train_test_split(0.297, 5)?;
    ensure!(
        train.len() % 48 != 0 && test.len() % 30 != 0,
        "{} {}",
        train.len(),
        test.len()
    );
    let (one_logs, one_eval) = run(&OneDeviceStrategy::cpu(), &train, &test)?;
    let balanced = one_eval.get("balanced_accuracy").unwrap_or(0.0);
    ensure!(
        balanced > 0.1 && balanced < 1.0,
        "balanced accuracy {balanced}"
    );
    for (what, (logs, eval)) in [
        (
            "mirrored(2)",
            run(&MirroredStrategy::cpu(2)?, &train, &test)?,
        ),
        (
            "mirrored(3)",
            run(&MirroredStrategy::cpu(3)?, &train, &test)?,
        ),
        (
            "central_storage(2)",
            run(&CentralStorageStrategy::cpu(2)?, &train, &test)?,
        ),
    ] {
        for key in ["loss", "accuracy", "balanced_accuracy"] {
            let (want, got) = (
                one_eval.get(key).unwrap_or(f64::NAN),
                eval.get(key).unwrap_or(0.0),
            );
            ensure!(
                (want - got).abs() < 1e-4,
                "{what}: evaluate {key} {got} vs {want}"
            );
            for (epoch, (a, b)) in one_logs.iter().zip(&logs).enumerate() {
                for k in [key.to_string(), format!("val_{key}")] {
                    let (want, got) = (a.get(&k).unwrap_or(f64::NAN), b.get(&k).unwrap_or(0.0));
                    ensure!(
                        (want - got).abs() < 1e-4,
                        "{what}: epoch {epoch} {k} {got} vs {want}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn predict_batches_are_per_replica() -> Result<()> {
    let strategy = MirroredStrategy::cpu(2)?;
    let mut model = net().compile(
        Sgd::new(0.1),
        SparseCategoricalCrossentropy::new(),
        (),
        &strategy,
    )?;
    struct Rows(Arc<Mutex<Vec<usize>>>);
    impl Callback for Rows {
        fn on_predict_batch_end(
            &mut self,
            _b: usize,
            out: &Tensor,
            _m: &mut Model,
        ) -> kandle::Result<()> {
            let rows = out.dim(0)?;
            if let Ok(mut v) = self.0.lock() {
                v.push(rows);
            }
            Ok(())
        }
    }
    let rows = Arc::new(Mutex::new(Vec::new()));
    let (x, _) = digits::load()?.to_tensors()?;
    let x = x.narrow(0, 0, 50)?;
    let out = model.predict(
        &x,
        PredictOptions {
            batch_size_per_replica: 8,
            callbacks: vec![Box::new(Rows(Arc::clone(&rows)))],
        },
    )?;
    ensure!(out.dims() == [50, 10]);
    let rows = rows
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    ensure!(rows == [16, 16, 16, 2], "{rows:?}");
    Ok(())
}
