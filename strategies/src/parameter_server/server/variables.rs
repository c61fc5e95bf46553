//! A server's part of the model: the variables placed on it, the optimizer state of its
//! trainable ones, and its version (the number of updates it applied). An update applies the
//! sum of one or more workers' step buffers by [`kandle::strategy::step::finish`], the final
//! phase every strategy shares.

use candle_core::{Device, Tensor, Var};

use kandle::optimizers::{NamedOptimizerState, Optimizer};
use kandle::params::{Param, Weights};
use kandle::strategy::step::{self, StepLayout, StepTotals};
use kandle::strategy::{ModelSpec, Replica};
use kandle::training_state::TrainingState;
use kandle::{Error, Result};

use crate::parameter_server::protocol::{LoadPart, Snapshot};
use crate::parameter_server::shards::Sharding;

/// One server's variables and optimizer.
pub(super) struct Variables {
    /// The whole model as this server built it (only its own variables are current during a
    /// call).
    replica: Replica,
    /// Its own variables, in store order.
    params: Vec<Param>,
    /// The optimizer over its trainable variables.
    optimizer: Box<dyn Optimizer>,
    /// How its part of a step buffer is laid out.
    layout: StepLayout,
    /// Where every variable lives, to take the other servers' at the end of a call.
    sharding: Sharding,
    /// Updates applied.
    version: u64,
}

impl Variables {
    /// Server `index`'s part of `replica` (built from `spec`), placed by `sharding`.
    pub(super) fn new(
        spec: &ModelSpec,
        replica: Replica,
        sharding: &Sharding,
        index: usize,
    ) -> Result<Self> {
        let all: Vec<Param> = replica.store().iter().cloned().collect();
        let params: Vec<Param> = sharding.vars[index]
            .iter()
            .map(|&i| all[i].clone())
            .collect();
        let trainable = params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.var.clone())
            .collect();
        Ok(Self {
            optimizer: spec.optimizer.build_on_path(trainable, spec.compute_path)?,
            layout: sharding.layouts[index].clone(),
            sharding: sharding.clone(),
            replica,
            params,
            version: 0,
        })
    }

    /// The whole model this server built; only this server's variables are current.
    pub(super) fn replica(&self) -> &Replica {
        &self.replica
    }

    /// Updates applied so far.
    pub(super) fn version(&self) -> u64 {
        self.version
    }

    /// Values in this server's part of a step buffer.
    pub(super) fn buffer_len(&self) -> usize {
        self.layout.len()
    }

    fn trainable(&self) -> (Vec<String>, Vec<Var>) {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| (p.name.clone(), p.var.clone()))
            .unzip()
    }

    /// Applies the sum of `buffers` (parts of step buffers) as one update at learning rate
    /// `lr`, and returns what the summed step says; the version moves when it applies.
    pub(super) fn apply(&mut self, buffers: Vec<Vec<f32>>, lr: f64) -> Result<StepTotals> {
        let mut buffers = buffers.into_iter();
        let mut sum = buffers.next().unwrap_or_default();
        for buffer in buffers {
            for (s, v) in sum.iter_mut().zip(&buffer) {
                *s += v;
            }
        }
        let len = sum.len();
        let total = Tensor::from_vec(sum, len, &Device::Cpu)?;
        let totals = self.layout.read(&total)?;
        let statistics: Vec<Var> = self
            .params
            .iter()
            .filter(|p| p.statistic)
            .map(|p| p.var.clone())
            .collect();
        step::finish(
            self.optimizer.as_mut(),
            &statistics,
            &self.layout,
            &total,
            &totals,
            &[],
            lr,
        )?;
        if totals.applies() {
            self.version += 1;
        }
        Ok(totals)
    }

    /// This server's variables, answering `step` (when it answers one) with `staleness` (when
    /// an update applied it).
    pub(super) fn snapshot(
        &self,
        staleness: Option<u64>,
        step: Option<&StepTotals>,
    ) -> Result<Snapshot> {
        let mut sums: Vec<f32> = step
            .map(|t| t.sums.iter().map(|&v| v as f32).collect())
            .unwrap_or_default();
        sums.resize(self.layout.num_stats, 0.0);
        let mut values = Vec::with_capacity(self.params.iter().map(|p| p.var.elem_count()).sum());
        for p in &self.params {
            append_values(p.var.as_tensor(), &mut values)?;
        }
        Ok(Snapshot {
            version: self.version,
            staleness,
            samples: step.map_or(0, |t| t.samples as u64),
            sums,
            values,
        })
    }

    /// Sets the variables of server `server` in this server's copy of the model from `values`
    /// (its [`Snapshot::values`]). `from` and `me` name both servers in the error when the
    /// count does not fit.
    pub(super) fn take_shard(
        &self,
        server: usize,
        values: &[f32],
        from: String,
        me: &str,
    ) -> Result<()> {
        let layout = &self.sharding.weights[server];
        if values.len() != layout.len() {
            return Err(Error::Replica {
                replica: from,
                reason: format!(
                    "sent {} values for its variables where {me} expects {}",
                    values.len(),
                    layout.len()
                ),
            });
        }
        let params: Vec<Param> = self.replica.store().iter().cloned().collect();
        let values = Tensor::from_slice(values, values.len(), &Device::Cpu)?;
        for (&i, value) in self.sharding.vars[server]
            .iter()
            .zip(layout.split(&values, 0)?)
        {
            params[i].var.set(&value)?;
        }
        Ok(())
    }

    /// This server's shard of the training state: its variables and its optimizer's state.
    pub(super) fn state(&self) -> Result<TrainingState> {
        let weights = self
            .params
            .iter()
            .map(|p| Ok((p.name.clone(), p.var.as_tensor().copy()?)))
            .collect::<Result<Weights>>()?;
        let (names, _) = self.trainable();
        Ok(TrainingState {
            weights,
            optimizer: self.optimizer.state()?.into_named(&names)?,
            ..TrainingState::default()
        })
    }

    /// Sets every variable of this server's copy of the model (its shard's, and the others it
    /// holds between calls) from `weights`, the whole model's. Fails without changing anything
    /// when the names or shapes do not match.
    pub(super) fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        let store = self.replica.store();
        store
            .check_compatible(weights)
            .map_err(|reason| Error::invalid(format!("cannot set weights: {reason}")))?;
        store.assign(weights)
    }

    /// Checks `state` (the whole model's) against the optimizer and loads this server's part
    /// of it. Fails without changing anything when the kind, names or shapes do not match.
    pub(super) fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        // The whole state is checked against the full optimizer of this server's copy of the
        // model, so that every rank refuses the same states alike.
        self.replica.load_optimizer_state(state)?;
        let (names, vars) = self.trainable();
        let part = state.restricted_to(&names).to_positional(&names, &vars)?;
        self.optimizer.load_state(&part)
    }

    /// Loads `part` of `state`.
    pub(super) fn load(&mut self, part: LoadPart, state: &TrainingState) -> Result<()> {
        match part {
            LoadPart::Weights => self.set_weights(&state.weights),
            LoadPart::Optimizer => self.set_optimizer_state(&state.optimizer),
        }
    }
}

/// Appends a CPU tensor's values, as `f32`, to `out`: straight from its storage when it is a
/// contiguous `f32` tensor.
fn append_values(t: &Tensor, out: &mut Vec<f32>) -> Result<()> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(values)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            out.extend_from_slice(&values[a..b]);
            return Ok(());
        }
    }
    out.extend(
        t.flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?,
    );
    Ok(())
}
