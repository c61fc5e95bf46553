//! Trains a small CNN on the digits set with a loss and a metric defined here, not in kandle:
//! a focal loss (Lin et al., 2017) and the macro-averaged F1 score, logged as `macro_f1` in the
//! epoch lines, the CSV and the plot. The same program runs under any strategy.
//!
//! ```text
//! cargo run --release -p kandle-examples --bin custom_objective
//! cargo run --release -p kandle-examples --bin custom_objective -- --strategy mirrored --replicas 2
//! ```
//!
//! The F1 score is not a mean over samples, so it cannot be averaged over batches or replicas.
//! Its state is the true positives, false positives and false negatives of every class, which
//! do add up: kandle sums them over every step, replica and worker, and the score is computed
//! once from the totals, so it is the same whatever the split.

use anyhow::Result;
use candle_core::{DType, Tensor, D};
use clap::Parser;
use kandle::callbacks::{CsvLogger, PlotHistory};
use kandle::losses::Loss;
use kandle::metrics::Metric;
use kandle::prelude::*;
use kandle_examples::{build_strategy, StrategyKind};

/// Focal loss on class-index targets: `-(1 - p_t)^gamma * log(p_t)`, where `p_t` is the
/// probability of the true class. It down-weights samples the model already gets right.
#[derive(Debug, Clone, Copy)]
struct FocalLoss {
    gamma: f64,
}

impl Loss for FocalLoss {
    fn name(&self) -> &str {
        "focal_loss"
    }

    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> kandle::Result<Tensor> {
        let log_p = y_pred.clamp(1e-7, 1.0 - 1e-7)?.log()?;
        self.of_log_probabilities(y_true, &log_p)
    }

    /// With the logits of the model's final softmax, `log p` comes from `log_softmax`, stable
    /// even for saturated outputs.
    fn call_with_logits(
        &self,
        y_true: &Tensor,
        y_pred: &Tensor,
        logits: Option<&Tensor>,
    ) -> kandle::Result<Tensor> {
        match logits {
            Some(z) => {
                let shifted = z.broadcast_sub(&z.max_keepdim(D::Minus1)?)?;
                let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
                self.of_log_probabilities(y_true, &shifted.broadcast_sub(&log_sum)?)
            }
            None => self.call(y_true, y_pred),
        }
    }

    fn check_targets(&self, targets: &Targets, _output_shape: &[usize]) -> kandle::Result<()> {
        match targets {
            Targets::Classes(_) => Ok(()),
            _ => Err(kandle::Error::invalid(
                "focal_loss takes class-index labels",
            )),
        }
    }

    fn expected_targets(&self, output_shape: &[usize]) -> Targets {
        Targets::Classes(output_shape.first().copied().unwrap_or(1))
    }
}

impl FocalLoss {
    fn of_log_probabilities(&self, y_true: &Tensor, log_p: &Tensor) -> kandle::Result<Tensor> {
        let index = y_true.to_dtype(DType::U32)?.unsqueeze(1)?;
        let log_pt = log_p.gather(&index, 1)?.squeeze(1)?;
        let pt = log_pt.exp()?;
        let weight = (pt.ones_like()? - pt)?.powf(self.gamma)?;
        Ok((weight * log_pt)?.neg()?)
    }
}

/// The F1 score of each class, averaged over the classes (`average="macro"` in Keras and
/// scikit-learn). A class with no true and no predicted sample scores 0.
#[derive(Debug, Clone, Copy)]
struct MacroF1 {
    classes: usize,
}

impl Metric for MacroF1 {
    fn name(&self) -> &str {
        "macro_f1"
    }

    /// `[true positives..., false positives..., false negatives...]`, one of each per class.
    fn state_size(&self) -> usize {
        3 * self.classes
    }

    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> kandle::Result<Tensor> {
        let one_hot = |classes: &Tensor| -> kandle::Result<Tensor> {
            let range = Tensor::arange(0u32, self.classes as u32, classes.device())?;
            Ok(classes
                .unsqueeze(1)?
                .broadcast_eq(&range.unsqueeze(0)?)?
                .to_dtype(DType::F32)?)
        };
        let truth = one_hot(&y_true.to_dtype(DType::U32)?)?;
        let predicted = one_hot(&y_pred.argmax(D::Minus1)?)?;
        let tp = (&truth * &predicted)?.sum(0)?;
        let fp = (predicted.sum(0)? - &tp)?;
        let fn_ = (truth.sum(0)? - &tp)?;
        Ok(Tensor::cat(&[&tp, &fp, &fn_], 0)?)
    }

    fn result(&self, state: &[f64]) -> f64 {
        let c = self.classes;
        let per_class = (0..c).map(|k| {
            let (tp, fp, fn_) = (state[k], state[c + k], state[2 * c + k]);
            let denominator = 2.0 * tp + fp + fn_;
            if denominator > 0.0 {
                2.0 * tp / denominator
            } else {
                0.0
            }
        });
        per_class.sum::<f64>() / c.max(1) as f64
    }
}

#[derive(Parser, Debug)]
#[command(about = "Train on digits with a focal loss and a macro-F1 metric defined in the example")]
struct Args {
    /// Epochs to train.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// How training is distributed.
    #[arg(long, value_enum, default_value_t = StrategyKind::OneDevice)]
    strategy: StrategyKind,
    /// Replicas (per worker for multi-worker).
    #[arg(long, default_value_t = 1, value_parser = kandle_examples::at_least_one())]
    replicas: usize,
    /// Samples per replica per step.
    #[arg(long, default_value_t = 32, value_parser = kandle_examples::at_least_one())]
    batch_size_per_replica: usize,
    /// The focal loss's focusing parameter (0 gives cross-entropy).
    #[arg(long, default_value_t = 2.0)]
    gamma: f64,
    /// Where the PNG goes (the CSV beside it).
    #[arg(long, default_value = "plots/custom_objective.png")]
    plot: String,
    /// Seed for the split, the weights and the shuffling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    let (train, test) = kandle::data::digits::load()?.train_test_split(0.2, args.seed)?;
    let mut model = kandle_models::digits_cnn(10)
        .compile(
            Adam::new(2e-3),
            FocalLoss { gamma: args.gamma },
            (Accuracy, MacroF1 { classes: 10 }),
            &build_strategy(args.strategy, args.replicas)?,
        )?
        .with_seed(args.seed)?;
    let csv = std::path::Path::new(&args.plot).with_extension("csv");
    let history = model.fit(
        &train,
        FitOptions {
            epochs: args.epochs,
            batch_size_per_replica: args.batch_size_per_replica,
            validation: Some(&test),
            seed: Some(args.seed),
            callbacks: vec![
                CsvLogger::new(&csv).boxed(),
                PlotHistory::new(&args.plot)
                    .title("Focal loss and macro F1 on digits")
                    .metrics(["accuracy", "macro_f1"])
                    .boxed(),
            ],
            ..Default::default()
        },
    )?;
    let logs = model.evaluate(&test, 64)?;
    if model.is_chief() {
        println!(
            "test focal loss {:.4}, accuracy {:.4}, macro F1 {:.4} after {} epochs on {} replica(s)",
            logs.get("loss").unwrap_or(f64::NAN),
            logs.get("accuracy").unwrap_or(f64::NAN),
            logs.get("macro_f1").unwrap_or(f64::NAN),
            history.epochs.len(),
            model.num_replicas_in_sync(),
        );
        if history.epochs.is_empty() {
            println!(
                "trained no epoch, so wrote no plot or CSV ({}, {})",
                args.plot,
                csv.display()
            );
        } else {
            println!("wrote {} and {}", args.plot, csv.display());
        }
    }
    Ok(())
}
