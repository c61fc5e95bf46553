//! The training state to and from the servers: the whole optimizer state joined from their
//! shards, and weights or optimizer state loaded on them during a call.

use kandle::optimizers::NamedOptimizerState;
use kandle::params::Weights;
use kandle::training_state::TrainingState;
use kandle::{Error, Result};

use super::{weights_of, Worker};
use crate::parameter_server::protocol::{Kind, LoadPart, Message};
use crate::parameter_server::server::{read_shard_state, Mode};

impl Worker {
    /// The whole optimizer state, joined from every server's shard. During a call it asks the
    /// servers, and takes their current weights with it (so that [`Worker::weights`] then
    /// gives the weights this state goes with); between calls the servers send it unasked, as
    /// every rank runs the same program.
    pub(crate) fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        let servers = self.sharding.servers();
        let replies = if self.in_call {
            self.ask_all(
                &Message::StateRequest,
                Kind::State,
                state_of,
                "a request for the training state",
            )?
        } else {
            let awaited: Vec<usize> = (0..servers).collect();
            self.exchange_with(&[], &awaited, Kind::State, state_of, "the optimizer state")?
        };
        let mut parts = Vec::with_capacity(servers);
        for (s, (version, bytes)) in replies.into_iter().enumerate() {
            let shard = read_shard_state(&bytes, &self.roles.server_label(s))?;
            if self.in_call {
                for p in self.replica.store().iter() {
                    if let Some(value) = shard.weights.get(&p.name) {
                        p.var.set(&value.to_dtype(p.var.dtype())?)?;
                    }
                }
                self.base[s] = version;
            }
            parts.push(shard.optimizer);
        }
        NamedOptimizerState::join(parts)
    }

    /// Replaces the weights: on this worker, and during a call on the servers too, once every
    /// worker has asked the same (the chief's are loaded). Fails without changing anything when
    /// the names or shapes do not match.
    pub(crate) fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        let store = self.replica.store();
        store
            .check_compatible(weights)
            .map_err(|reason| Error::invalid(format!("cannot set weights: {reason}")))?;
        store.assign(weights)?;
        let state = TrainingState {
            weights: weights.clone(),
            ..TrainingState::default()
        };
        self.load_on_servers(LoadPart::Weights, &state, "a load of the weights")
    }

    /// Checks `state` against the model's optimizer and, during a call, loads it on the
    /// servers once every worker has asked the same (between calls each server loads it
    /// itself). Fails without changing anything when the kind, names or shapes do not match.
    pub(crate) fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        self.replica.load_optimizer_state(state)?;
        let state = TrainingState {
            optimizer: state.clone(),
            ..TrainingState::default()
        };
        self.load_on_servers(LoadPart::Optimizer, &state, "a load of the optimizer state")
    }

    /// During a call, sends `state` to every server to load its `part`, and takes the weights
    /// they answer with; between calls, nothing.
    fn load_on_servers(&mut self, part: LoadPart, state: &TrainingState, what: &str) -> Result<()> {
        if !self.in_call {
            return Ok(());
        }
        let message = Message::Load {
            part,
            state: state.to_bytes()?,
        };
        let replies = self.ask_all(&message, Kind::Weights, weights_of, what)?;
        self.load(&replies)?;
        self.fresh = self.mode == Mode::Synchronous;
        self.fetched = true;
        Ok(())
    }
}

/// The version and training state bytes a `State` message carries.
fn state_of(message: Message) -> Option<(u64, Vec<u8>)> {
    match message {
        Message::State { version, state } => Some((version, state)),
        _ => None,
    }
}
