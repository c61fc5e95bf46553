//! Inference and single batches: `evaluate` (loss and metrics over a dataset, also `fit`'s
//! validation pass), `predict`, and Keras's one-batch forms `train_on_batch`, `test_on_batch`
//! and `predict_on_batch`, which take tensors, check them as `fit` checks a dataset, and run
//! one step. Each public method is one call of the strategy (`Model::strategy_call`): on a
//! process that serves the others it returns empty logs or no rows.

use candle_core::Tensor;

use super::totals::Totals;
use super::{EvaluateOptions, Model, PredictOptions};
use crate::callbacks::{Callback, CallbackList, Logs};
use crate::data::{weighting, Batch, Dataset, Loader, LoaderOptions};
use crate::functional::{pack, unpack};
use crate::{Error, Result};

impl Model {
    /// Loss and metrics over `data` in inference mode. `options` is a batch size per replica,
    /// or [`EvaluateOptions`] with callbacks and sample weights.
    pub fn evaluate<'a>(
        &mut self,
        data: &dyn Dataset,
        options: impl Into<EvaluateOptions<'a>>,
    ) -> Result<Logs> {
        let options = options.into();
        self.prepare_for(data)?;
        let logs = self.strategy_call(|model| {
            let loader = model.loader(
                data,
                options.batch_size_per_replica,
                LoaderOptions {
                    sample_weight: weighting::sample_weights(data, options.sample_weight)?,
                    ..LoaderOptions::default()
                },
            )?;
            let mut callbacks = CallbackList::new(options.callbacks, model.is_chief());
            model.run_evaluation(&loader, &mut callbacks)
        })?;
        Ok(logs.unwrap_or_else(Logs::new))
    }

    /// One pass of `loader` in inference mode, with the callbacks' `on_test_*` hooks: the loss
    /// and metrics over its data. `evaluate` and `fit`'s validation run it.
    pub(super) fn run_evaluation(
        &mut self,
        loader: &Loader<'_>,
        callbacks: &mut CallbackList,
    ) -> Result<Logs> {
        let mut totals = Totals::new(&self.metrics);
        callbacks.on_test_begin(self)?;
        std::thread::scope(|scope| -> Result<()> {
            for (step, batch) in loader.spawn(scope, 0).enumerate() {
                callbacks.on_test_batch_begin(step, self)?;
                totals.add(&self.replicas()?.test_step(&batch?)?);
                callbacks.on_test_batch_end(step, &totals.logs(), self)?;
            }
            Ok(())
        })?;
        let logs = totals.logs();
        callbacks.on_test_end(&logs, self)?;
        Ok(logs)
    }

    /// A functional model's outputs, one tensor `(n, output shape...)` per output in the
    /// model's order, for its inputs `inputs`, one tensor `(n, input shape...)` per input (see
    /// [`Model::predict`]).
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use kandle::functional::{concatenate, Functional, Input};
    /// use kandle::prelude::*;
    ///
    /// let a = Input::new(&[2]).tensor();
    /// let b = Input::new(&[3]).tensor();
    /// let joined = concatenate(&[&a, &b])?;
    /// let score = Dense::new(1).named("score").call(&joined)?;
    /// let class = Activation::Softmax.call(&Dense::new(4).named("class").call(&joined)?)?;
    /// let net = Functional::new([&a, &b], [&score, &class])?;
    /// let mut model = net.compile(Sgd::new(0.1), MeanSquaredError, (), &OneDeviceStrategy::cpu())?;
    /// let xa = Tensor::zeros((5, 2), candle_core::DType::F32, &Device::Cpu)?;
    /// let xb = Tensor::ones((5, 3), candle_core::DType::F32, &Device::Cpu)?;
    /// let outputs = model.predict_outputs(&[xa, xb], 2)?;
    /// assert_eq!(outputs[0].dims(), [5, 1]);
    /// assert_eq!(outputs[1].dims(), [5, 4]);
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn predict_outputs(
        &mut self,
        inputs: &[Tensor],
        options: impl Into<PredictOptions>,
    ) -> Result<Vec<Tensor>> {
        let parts = self.network.parts().cloned();
        match parts {
            Some(parts) if parts.packed() => {
                if inputs.len() != parts.input_shapes.len() {
                    return Err(Error::invalid(format!(
                        "the model takes {} inputs but was given {}",
                        parts.input_shapes.len(),
                        inputs.len()
                    )));
                }
                let flat = inputs
                    .iter()
                    .map(|x| {
                        Ok(x.to_device(&candle_core::Device::Cpu)?
                            .to_dtype(candle_core::DType::F32)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let y = self.predict(&pack(&flat)?, options)?;
                unpack(&y, &parts.output_shapes)
            }
            _ => match inputs {
                [x] => Ok(vec![self.predict(x, options)?]),
                _ => Err(Error::invalid(format!(
                    "the model takes one input but was given {}",
                    inputs.len()
                ))),
            },
        }
    }

    /// The model's outputs for `x` (`(n, input_shape...)`, any device) on the CPU, computed in
    /// global batches of `batch_size_per_replica * num_replicas_in_sync()` (each replica takes
    /// its part). `options` is that batch size, or [`PredictOptions`] with callbacks. Under
    /// multi-worker training each worker predicts all of `x` on its own replicas.
    pub fn predict(&mut self, x: &Tensor, options: impl Into<PredictOptions>) -> Result<Tensor> {
        let options = options.into();
        if options.batch_size_per_replica == 0 {
            return Err(Error::invalid("batch size must be positive, got 0"));
        }
        let n = self.prepare_inputs(x)?;
        let outputs = self.strategy_call(|model| {
            let x = x.to_dtype(candle_core::DType::F32)?;
            let batch = options.batch_size_per_replica * model.strategy.local_replicas();
            let mut callbacks = CallbackList::new(options.callbacks, model.is_chief());
            callbacks.on_predict_begin(model)?;
            let mut outputs = Vec::with_capacity(n.div_ceil(batch));
            for (step, start) in (0..n).step_by(batch).enumerate() {
                callbacks.on_predict_batch_begin(step, model)?;
                let part = x.narrow(0, start, batch.min(n - start))?;
                let out = model.replicas()?.predict_step(&part)?;
                callbacks.on_predict_batch_end(step, &out, model)?;
                outputs.push(out);
            }
            callbacks.on_predict_end(model)?;
            Ok(outputs)
        })?;
        match outputs {
            Some(outputs) => Ok(Tensor::cat(&outputs, 0)?),
            None => self.no_predictions(),
        }
    }

    /// Checks that `x` has a batch dimension and samples, builds for its sample shape if
    /// needed, and returns its sample count.
    fn prepare_inputs(&mut self, x: &Tensor) -> Result<usize> {
        let dims = x.dims();
        let Some((&n, sample)) = dims.split_first() else {
            return Err(Error::invalid("the inputs need a batch dimension"));
        };
        if n == 0 {
            return Err(Error::EmptyDataset("the inputs".into()));
        }
        self.build(sample)?;
        Ok(n)
    }

    /// One batch as `fit` would see it: checked against the loss, on the CPU, `f32` inputs.
    fn one_batch(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        sample_weight: Option<&Tensor>,
    ) -> Result<Batch> {
        let n = self.prepare_inputs(x)?;
        let data = crate::data::InMemoryDataset::new(x.clone(), y.clone())?.named("the batch");
        let output_shape = self.built()?.output_shape.clone();
        self.loss.check_targets(&data.targets(), &output_shape)?;
        let (x, y) = data.to_tensors()?;
        let batch = Batch::new(x, y);
        Ok(match sample_weight {
            Some(w) => batch.with_weights(weighting::batch_sample_weight(w, n)?),
            None => batch,
        })
    }

    /// One training step on this batch, as Keras's `train_on_batch`: the whole batch is the
    /// global batch (split across this process's replicas; under multi-worker training each
    /// worker passes its own part). Returns the batch's loss and metrics. An update whose loss
    /// or gradients are not finite is not applied, and the loss is then NaN. With
    /// [`gradient_accumulation_steps`](crate::optimizers::OptimizerConfig::gradient_accumulation_steps)
    /// `k`, every `k`-th call updates, with the gradients of its batch and the `k - 1` before
    /// it; the calls in between return their batch's loss and metrics (this process's share
    /// under multi-worker training) and change no weight. On a process that
    /// serves the others (a parameter server), it and the other `*_on_batch` methods serve that
    /// one batch and return nothing (empty logs, no rows), as `fit` does.
    pub fn train_on_batch(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        sample_weight: Option<&Tensor>,
    ) -> Result<Logs> {
        let batch = self.one_batch(x, y, sample_weight)?;
        let stats = self.strategy_call(|model| model.train_or_accumulate(&batch, false))?;
        // A step (not a kept micro-batch) that was not applied reports a NaN loss, unless its
        // loss was finite and the loss scale overflowed.
        let stepped = self.accumulated == 0;
        Ok(stats.map_or_else(Logs::new, |stats| {
            let training = stepped && !self.overflowed(&stats);
            Totals::of(&self.metrics, &stats, training).logs()
        }))
    }

    /// Loss and metrics of this batch in inference mode, as Keras's `test_on_batch`.
    pub fn test_on_batch(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        sample_weight: Option<&Tensor>,
    ) -> Result<Logs> {
        let batch = self.one_batch(x, y, sample_weight)?;
        let stats = self.strategy_call(|model| model.replicas()?.test_step(&batch))?;
        Ok(stats.map_or_else(Logs::new, |stats| {
            Totals::of(&self.metrics, &stats, false).logs()
        }))
    }

    /// The outputs for this batch in one step, as Keras's `predict_on_batch`.
    pub fn predict_on_batch(&mut self, x: &Tensor) -> Result<Tensor> {
        self.prepare_inputs(x)?;
        let out = self.strategy_call(|model| {
            let x = x.to_dtype(candle_core::DType::F32)?;
            model.replicas()?.predict_step(&x)
        })?;
        match out {
            Some(out) => Ok(out),
            None => self.no_predictions(),
        }
    }

    /// What `predict` returns on a process that serves the others: no rows.
    fn no_predictions(&self) -> Result<Tensor> {
        let mut empty = vec![0];
        empty.extend(&self.built()?.output_shape);
        Ok(Tensor::zeros(
            empty,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )?)
    }
}
