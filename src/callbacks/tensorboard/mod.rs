//! `TensorBoard`: the run's scalars (and optionally weight histograms) as TensorBoard event
//! files, in Keras's layout and with Keras's names, so `tensorboard --logdir DIR` shows a
//! kandle run as it shows a Keras one.

mod events;

use std::path::{Path, PathBuf};

use super::{Callback, FitInfo, Logs};
use crate::{Model, Result};
use events::{histogram, scalar, EventWriter, HistogramProto};

/// How often [`TensorBoard`] writes the training scalars.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpdateFreq {
    /// Once per epoch (`epoch_loss`, ...), Keras's default.
    #[default]
    Epoch,
    /// Also every this many batches (`batch_loss`, ... at the global batch count), as Keras's
    /// integer `update_freq`.
    Batches(usize),
}

/// Writes TensorBoard logs as Keras's `keras.callbacks.TensorBoard` does: `log_dir/train` and
/// `log_dir/validation` event files; each epoch the scalars `epoch_loss`, `epoch_<metric>`
/// (every metric, per output for functional models: `epoch_class_accuracy`, ...),
/// `epoch_learning_rate` and kandle's `epoch_skipped_steps` in `train`, and the validation
/// logs under the same names in `validation`; with [`UpdateFreq::Batches`] also `batch_<name>`
/// every so many batches; with [`Self::histogram_freq`] each variable's histogram
/// (`<name>/histogram`). The files are flushed at the end of every epoch, so a run can be
/// watched while it trains. Under multi-worker training only the chief writes.
///
/// ```no_run
/// use kandle::callbacks::{TensorBoard, UpdateFreq};
/// use kandle::FitOptions;
///
/// let options = FitOptions {
///     callbacks: vec![Box::new(
///         TensorBoard::new("logs/run-1").update_freq(UpdateFreq::Batches(50)).histogram_freq(1),
///     )],
///     ..Default::default()
/// };
/// // then: tensorboard --logdir logs
/// ```
pub struct TensorBoard {
    log_dir: PathBuf,
    update_freq: UpdateFreq,
    histogram_freq: usize,
    steps_per_epoch: usize,
    epoch: usize,
    train: Option<EventWriter>,
    validation: Option<EventWriter>,
}

impl TensorBoard {
    /// Logs into `log_dir` (created when training starts), epoch scalars only.
    pub fn new(log_dir: impl AsRef<Path>) -> Self {
        Self {
            log_dir: log_dir.as_ref().to_path_buf(),
            update_freq: UpdateFreq::Epoch,
            histogram_freq: 0,
            steps_per_epoch: 0,
            epoch: 0,
            train: None,
            validation: None,
        }
    }

    /// How often the training scalars are written.
    pub fn update_freq(mut self, freq: UpdateFreq) -> Self {
        self.update_freq = freq;
        self
    }

    /// Writes every variable's histogram every `epochs` epochs (0, the default: never).
    pub fn histogram_freq(mut self, epochs: usize) -> Self {
        self.histogram_freq = epochs;
        self
    }

    /// The event files written so far (the training one, then the validation one).
    pub fn files(&self) -> Vec<PathBuf> {
        [&self.train, &self.validation]
            .into_iter()
            .flatten()
            .map(|w| w.path().to_path_buf())
            .collect()
    }

    fn train(&mut self) -> Result<&mut EventWriter> {
        let writer = match self.train.take() {
            Some(writer) => writer,
            None => EventWriter::create(&self.log_dir.join("train"))?,
        };
        Ok(self.train.insert(writer))
    }

    fn validation(&mut self) -> Result<&mut EventWriter> {
        let writer = match self.validation.take() {
            Some(writer) => writer,
            None => EventWriter::create(&self.log_dir.join("validation"))?,
        };
        Ok(self.validation.insert(writer))
    }

    fn write_histograms(&mut self, epoch: usize, model: &Model) -> Result<()> {
        let weights = model.get_weights()?;
        let values = weights
            .iter()
            .map(|(name, t)| {
                let flat = t
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1::<f32>()?;
                Ok(histogram(
                    format!("{name}/histogram"),
                    HistogramProto::of(&flat, 30),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        self.train()?.summary(epoch as i64, values)
    }
}

/// Keras's scalar name for a log key: the learning rate is `learning_rate`.
fn scalar_name(key: &str) -> &str {
    match key {
        "lr" => "learning_rate",
        key => key,
    }
}

impl Callback for TensorBoard {
    fn on_train_begin(&mut self, info: &FitInfo, _model: &mut Model) -> Result<()> {
        self.steps_per_epoch = info.steps_per_epoch;
        self.train()?;
        if info.has_validation {
            self.validation()?;
        }
        Ok(())
    }

    fn on_epoch_begin(&mut self, epoch: usize, _model: &mut Model) -> Result<()> {
        self.epoch = epoch;
        Ok(())
    }

    fn on_train_batch_end(&mut self, batch: usize, logs: &Logs, _model: &mut Model) -> Result<()> {
        let UpdateFreq::Batches(every) = self.update_freq else {
            return Ok(());
        };
        // The global batch count, the same when a run resumes.
        let step = self.epoch * self.steps_per_epoch + batch + 1;
        if every == 0 || !step.is_multiple_of(every) {
            return Ok(());
        }
        let values = logs
            .iter()
            .filter(|(key, _)| *key != "batch_loss")
            .map(|(key, value)| scalar(format!("batch_{}", scalar_name(key)), value))
            .collect();
        self.train()?.summary(step as i64, values)
    }

    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        let (mut train, mut validation) = (Vec::new(), Vec::new());
        for (key, value) in logs {
            match key.strip_prefix("val_") {
                Some(key) => validation.push(scalar(format!("epoch_{}", scalar_name(key)), value)),
                None => train.push(scalar(format!("epoch_{}", scalar_name(key)), value)),
            }
        }
        let step = epoch as i64;
        self.train()?.summary(step, train)?;
        if !validation.is_empty() {
            self.validation()?.summary(step, validation)?;
        }
        if self.histogram_freq > 0 && epoch.is_multiple_of(self.histogram_freq) {
            self.write_histograms(epoch, model)?;
        }
        for writer in [&mut self.train, &mut self.validation]
            .into_iter()
            .flatten()
        {
            writer.flush()?;
        }
        Ok(())
    }

    fn on_train_end(&mut self, _logs: &Logs, _model: &mut Model) -> Result<()> {
        for writer in [&mut self.train, &mut self.validation]
            .into_iter()
            .flatten()
        {
            writer.flush()?;
        }
        Ok(())
    }

    fn chief_only(&self) -> bool {
        true
    }
}
