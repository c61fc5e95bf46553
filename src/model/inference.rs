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

    /// A model's outputs, one tensor `(n, output shape...)` per output in the model's order,
    /// for its inputs `inputs`, one tensor `(n, input shape...)` per input in the model's
    /// order, each in its own dtype (see [`Model::predict`]). Each is checked against the
    /// input it feeds: a missing, extra, swapped or reshaped input is an error naming it.
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
    /// let outputs = model.predict_outputs(&[xa.clone(), xb.clone()], 2)?;
    /// assert_eq!(outputs[0].dims(), [5, 1]);
    /// assert_eq!(outputs[1].dims(), [5, 4]);
    /// assert!(model.predict_outputs(&[xb, xa], 2).is_err()); // swapped
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn predict_outputs(
        &mut self,
        inputs: &[Tensor],
        options: impl Into<PredictOptions>,
    ) -> Result<Vec<Tensor>> {
        let options = options.into();
        if options.batch_size_per_replica == 0 {
            return Err(Error::invalid("batch size must be positive, got 0"));
        }
        let n = self.prepare_inputs(inputs)?;
        let outputs = self.strategy_call(|model| {
            let batch = options.batch_size_per_replica * model.strategy.local_replicas();
            let mut callbacks = CallbackList::new(options.callbacks, model.is_chief());
            callbacks.on_predict_begin(model)?;
            let mut outputs: Vec<Vec<Tensor>> = Vec::new();
            for (step, start) in (0..n).step_by(batch).enumerate() {
                callbacks.on_predict_batch_begin(step, model)?;
                let parts = inputs
                    .iter()
                    .map(|x| Ok(x.narrow(0, start, batch.min(n - start))?))
                    .collect::<Result<Vec<_>>>()?;
                let out = model.replicas()?.predict_step(&parts)?;
                if let Some(first) = out.first() {
                    callbacks.on_predict_batch_end(step, first, model)?;
                }
                outputs.resize_with(out.len(), Vec::new);
                for (all, part) in outputs.iter_mut().zip(out) {
                    all.push(part);
                }
            }
            callbacks.on_predict_end(model)?;
            outputs
                .iter()
                .map(|parts| Ok(Tensor::cat(parts, 0)?))
                .collect::<Result<Vec<_>>>()
        })?;
        match outputs {
            Some(outputs) => Ok(outputs),
            None => self.no_predictions(),
        }
    }

    /// The model's outputs for `x` (`(n, input_shape...)`, any device) on the CPU, computed in
    /// global batches of `batch_size_per_replica * num_replicas_in_sync()` (each replica takes
    /// its part). `options` is that batch size, or [`PredictOptions`] with callbacks. Under
    /// multi-worker training each worker predicts all of `x` on its own replicas. A model of
    /// several inputs or outputs takes [`Model::predict_outputs`].
    pub fn predict(&mut self, x: &Tensor, options: impl Into<PredictOptions>) -> Result<Tensor> {
        let outputs = self.predict_outputs(std::slice::from_ref(x), options)?;
        only_output(outputs)
    }

    /// Checks `inputs` against the model's inputs, in its order (the same sample count in each,
    /// each of its input's shape), builds for them if needed, and returns the sample count.
    fn prepare_inputs(&mut self, inputs: &[Tensor]) -> Result<usize> {
        let mut given = Vec::with_capacity(inputs.len());
        let mut count = None;
        for (i, x) in inputs.iter().enumerate() {
            let Some((&n, sample)) = x.dims().split_first() else {
                return Err(Error::invalid(format!(
                    "input {} needs a batch dimension, but it is a scalar",
                    i + 1
                )));
            };
            if *count.get_or_insert(n) != n {
                return Err(Error::invalid(format!(
                    "input {} holds {n} samples but input 1 holds {}",
                    i + 1,
                    count.unwrap_or_default()
                )));
            }
            given.push(crate::data::InputSpec::new(sample).with_dtype(x.dtype()));
        }
        let n = count.ok_or_else(|| Error::invalid("the model was given no input"))?;
        if n == 0 {
            return Err(Error::EmptyDataset("the inputs".into()));
        }
        super::inputs::match_inputs(&self.network.declared_inputs(), &given, "the inputs")?;
        let shapes: Vec<Vec<usize>> = given.into_iter().map(|g| g.shape).collect();
        self.build_inputs(&shapes)?;
        Ok(n)
    }

    /// One batch as `fit` would see it: checked against the loss, on the CPU, `f32` inputs.
    fn one_batch(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        sample_weight: Option<&Tensor>,
    ) -> Result<Batch> {
        let n = self.prepare_inputs(std::slice::from_ref(x))?;
        let data = crate::data::InMemoryDataset::new(x.clone(), y.clone())?.named("the batch");
        self.check_targets(&data.targets())?;
        let batch = data.to_batch()?;
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
            let overflowed = self.overflowed(&stats);
            Totals::of(&self.metrics, &stats, stepped, overflowed).logs()
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
            Totals::of(&self.metrics, &stats, false, false).logs()
        }))
    }

    /// The outputs for this batch in one step, as Keras's `predict_on_batch`.
    pub fn predict_on_batch(&mut self, x: &Tensor) -> Result<Tensor> {
        self.prepare_inputs(std::slice::from_ref(x))?;
        let out =
            self.strategy_call(|model| model.replicas()?.predict_step(std::slice::from_ref(x)))?;
        match out {
            Some(out) => only_output(out),
            None => only_output(self.no_predictions()?),
        }
    }

    /// What `predict` returns on a process that serves the others: no rows, per output.
    fn no_predictions(&self) -> Result<Vec<Tensor>> {
        self.built()?
            .output_shapes
            .iter()
            .map(|shape| {
                let mut empty = vec![0];
                empty.extend(shape);
                Ok(Tensor::zeros(
                    empty,
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )?)
            })
            .collect()
    }
}

/// The only output of a model of one output; an error for a model of several.
fn only_output(mut outputs: Vec<Tensor>) -> Result<Tensor> {
    match outputs.len() {
        1 => Ok(outputs.remove(0)),
        n => Err(Error::invalid(format!(
            "the model gives {n} outputs; predict_outputs returns them all"
        ))),
    }
}
