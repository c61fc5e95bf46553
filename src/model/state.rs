//! The model's weights and whole training state, in memory and on disk: `get_weights` /
//! `set_weights`, `save_weights` / `load_weights` (safetensors, see [`crate::checkpoint`]),
//! `load_weights_from` (a PyTorch state dict, see [`crate::pretrained`]), `training_state` /
//! `set_training_state` and `save` / `load` (weights, optimizer state and learning rate, see
//! [`crate::training_state`]). Under multi-worker training only the chief writes; a state that
//! does not fit leaves the model as it was.

use super::Model;
use crate::params::Weights;
use crate::pretrained::{ImportOptions, LoadReport};
use crate::training_state::TrainingState;
use crate::{Error, Result};

impl Model {
    /// The current weights by canonical name, on the CPU.
    pub fn get_weights(&self) -> Result<Weights> {
        self.built()?.replicas.weights()
    }

    /// Replaces every weight on every replica. Names and shapes must match exactly; otherwise
    /// nothing changes.
    pub fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.replicas()?.set_weights(weights)
    }

    /// Saves the weights as safetensors at `path`, atomically. Under multi-worker training only
    /// the chief writes.
    pub fn save_weights(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let weights = self.get_weights()?;
        if self.is_chief() {
            crate::checkpoint::save(&weights, path)?;
        }
        Ok(())
    }

    /// Loads weights saved by [`Model::save_weights`] under any strategy, onto this model's
    /// devices. A missing or corrupt file, or one whose names or shapes differ from the model,
    /// is an error naming the differences, and the model is left unchanged.
    pub fn load_weights(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        let weights = crate::checkpoint::load(path)?;
        self.set_weights(&weights).map_err(|e| match e {
            Error::InvalidInput(reason) => Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("does not match the model: {reason}"),
            },
            other => other,
        })
    }

    /// Loads weights trained elsewhere (a PyTorch state dict as safetensors or as a
    /// `torch.save` file), matched to the model's variables by name as `options` say: see
    /// [`crate::pretrained`]. Every name and shape is checked before anything changes: a
    /// missing or corrupt file, a shape that differs (the error names the variable and both
    /// shapes), or names missing or left over where `options` do not allow it are an error,
    /// and the model is left unchanged. Returns what was loaded, missing, unexpected and
    /// skipped. Fails if the model is not built.
    pub fn load_weights_from(
        &mut self,
        path: impl AsRef<std::path::Path>,
        options: &ImportOptions,
    ) -> Result<LoadReport> {
        let path = path.as_ref();
        let current = self.get_weights()?;
        let state_dict = crate::pretrained::read_state_dict(path, options)?;
        let (weights, report) =
            state_dict
                .fit_to(&current, options)
                .map_err(|reason| Error::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!("does not match the model: {reason}"),
                })?;
        self.set_weights(&weights)?;
        Ok(report)
    }

    /// The whole training state: every weight, the optimizer's state (by canonical variable
    /// name, the same under every strategy) and the learning rate, on the CPU. `extra` is
    /// empty. Fails if the model is not built.
    pub fn training_state(&mut self) -> Result<TrainingState> {
        let learning_rate = self.learning_rate;
        let replicas = self.replicas()?;
        // The optimizer state first: a model whose variables live elsewhere takes the weights
        // that go with it at the same time (see `DistributedModel::optimizer_state`).
        let optimizer = replicas.optimizer_state()?;
        Ok(TrainingState {
            weights: replicas.weights()?,
            optimizer,
            learning_rate,
            extra: serde_json::Map::new(),
        })
    }

    /// Restores a training state taken under any strategy: weights, optimizer state and
    /// learning rate, on every replica. Names and shapes must match the model and the optimizer
    /// must be of the same kind; otherwise the error says what differs and the model is left as
    /// it was. Fails if the model is not built.
    pub fn set_training_state(&mut self, state: &TrainingState) -> Result<()> {
        let lr = state.learning_rate;
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::invalid(format!(
                "learning rate must be finite and >= 0, got {lr}"
            )));
        }
        let replicas = self.replicas()?;
        let optimizer_before = replicas.optimizer_state()?;
        if optimizer_before.kind != state.optimizer.kind {
            return Err(Error::invalid(format!(
                "the state's optimizer is {}, but the model's is {}",
                crate::optimizers::describe_kind(&state.optimizer.kind),
                crate::optimizers::describe_kind(&optimizer_before.kind)
            )));
        }
        let weights_before = replicas.weights()?;
        // Each call checks before it changes anything; the weights are put back if the
        // optimizer state does not fit.
        replicas.set_weights(&state.weights)?;
        if let Err(e) = replicas.set_optimizer_state(&state.optimizer) {
            let restored = replicas
                .set_weights(&weights_before)
                .and_then(|()| replicas.set_optimizer_state(&optimizer_before));
            return Err(match restored {
                Ok(()) => e,
                Err(r) => Error::invalid(format!(
                    "{e}; putting the previous state back failed too, rebuild the model ({r})"
                )),
            });
        }
        self.learning_rate = lr;
        Ok(())
    }

    /// Saves the whole training state (weights, optimizer state, learning rate) to `path` as
    /// one versioned safetensors file, written atomically: see [`crate::training_state`]. Under
    /// multi-worker training every process calls it and only the chief writes (under parameter
    /// servers, the servers hand over their parts of the optimizer state). Fails if the model
    /// is not built.
    pub fn save(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let state = self.training_state()?;
        if self.is_chief() {
            state.save(path)?;
        }
        Ok(())
    }

    /// Loads a training state written by [`Model::save`] under any strategy: weights, optimizer
    /// state and learning rate, so that training continues as if it had not stopped. The model
    /// must be built (for the input shape the state was saved with). The whole file is checked
    /// before the model is touched: a missing, truncated, corrupt or foreign file, a newer
    /// format version, another optimizer, or names and shapes that differ from the model are an
    /// [`Error::Checkpoint`] naming the file and the problem, and the model is left unchanged.
    /// Under multi-worker training every worker reads the file.
    pub fn load(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        if !self.is_built() {
            return Err(Error::NotReady(format!(
                "Model::load(`{}`) needs a built model: build it first (Model::build with the \
                 input shape, Sequential::input_shape, or fit), then load the state",
                path.display()
            )));
        }
        let state = TrainingState::load(path)?;
        self.set_training_state(&state).map_err(|e| match e {
            Error::InvalidInput(reason) => Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("does not fit the model: {reason}"),
            },
            Error::Replica { replica, reason } => Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("does not fit the model ({replica}): {reason}"),
            },
            other => other,
        })
    }
}
