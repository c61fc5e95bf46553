//! What the servers send each other: at the end of a call, each its variables, so that every
//! rank holds the whole model's weights between calls; between calls, each its shard of the
//! training state, to every other rank, so that every rank can join the whole optimizer state.
//!
//! Servers send each other large messages at once, so each receives while it sends.

use std::sync::Arc;
use std::time::Instant;

use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::optimizers::NamedOptimizerState;
use kandle::{Error, Result};

use super::{read_shard_state, Server};
use crate::mpi::poll::Backoff;
use crate::mpi::seconds;
use crate::parameter_server::protocol::{Encoded, Message, Snapshot};
use crate::parameter_server::transport::{self, Incoming};

impl Server {
    /// At the end of a call, sends this server's final variables (`last`) to the other servers
    /// and loads theirs into its copy of the model, so that every rank holds the whole model's
    /// weights between calls.
    pub(super) fn share_shards(&mut self, comm: &SimpleCommunicator, last: Snapshot) -> Result<()> {
        if self.roles.servers < 2 {
            return Ok(());
        }
        let mine = Message::Shard(last).encode(self.call);
        let to: Vec<(usize, &Encoded)> = (0..self.roles.servers)
            .filter(|&s| s != self.index)
            .map(|s| (self.roles.server_rank(s), &mine))
            .collect();
        let early = std::mem::replace(&mut self.early_shards, vec![None; self.roles.servers]);
        let what = format!("its variables at the end of call {}", self.call);
        let received = self.swap_with_servers(comm, &to, self.call, early, &what, shard_of)?;
        for (s, snapshot) in received.iter().enumerate() {
            if let Some(snapshot) = snapshot {
                let from = self.roles.server_label(s);
                self.variables
                    .take_shard(s, &snapshot.values, from, &self.label())?;
            }
        }
        Ok(())
    }

    /// Keeps another server's end-of-call variables (`m`, a `Shard` message) until this server
    /// ends the call too.
    pub(super) fn keep_shard(&mut self, m: Incoming) -> Result<()> {
        let s = self.roles.server_index(m.source).ok_or_else(|| {
            Error::invalid("a parameter server's variables from a worker (internal error)")
        })?;
        let snapshot = self.take_from_server(m, self.call, "the servers' variables", shard_of)?;
        self.early_shards[s] = Some(snapshot);
        Ok(())
    }

    /// Keeps another server's optimizer state (`m`, a `State` message) that came before this
    /// server reached the exchange ([`Self::optimizer_state`]).
    pub(super) fn keep_state(&mut self, m: Incoming) -> Result<()> {
        let s = self.roles.server_index(m.source).ok_or_else(|| {
            Error::invalid("a parameter server's optimizer state from a worker (internal error)")
        })?;
        let state = self.take_from_server(m, self.call + 1, "its optimizer state", state_of)?;
        self.early_states[s] = Some(state);
        Ok(())
    }

    /// The whole optimizer state, between calls: every rank runs this together (the same
    /// program, at the same point). This server sends its shard's state to every other rank
    /// and joins the other servers' shards to its own (those that came early included).
    pub(crate) fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        let call = self.call + 1;
        let early = std::mem::replace(&mut self.early_states, vec![None; self.roles.servers]);
        let mine = Message::State {
            version: self.variables.version(),
            state: self.variables.state()?.to_bytes()?,
        }
        .encode(call);
        let world = Arc::clone(&self.world);
        let received = world.point_to_point(|comm| {
            let me = comm.rank() as usize;
            let to: Vec<(usize, &Encoded)> = (0..comm.size() as usize)
                .filter(|&r| r != me)
                .map(|r| (r, &mine))
                .collect();
            self.swap_with_servers(comm, &to, call, early, "its optimizer state", state_of)
        })?;
        let mut parts = Vec::with_capacity(self.roles.servers);
        for (s, state) in received.into_iter().enumerate() {
            parts.push(match state {
                Some(bytes) => read_shard_state(&bytes, &self.roles.server_label(s))?.optimizer,
                None => self.variables.state()?.optimizer,
            });
        }
        NamedOptimizerState::join(parts)
    }

    /// Sends `to` (messages for other ranks) while it waits for one message of call `call`
    /// from every other server that `take` takes the contents of, within twice the timeout,
    /// starting from those already `received`; returns them by server index (`None` at this
    /// server's own). The error names a server that sends none in time.
    fn swap_with_servers<T>(
        &self,
        comm: &SimpleCommunicator,
        to: &[(usize, &Encoded)],
        call: u32,
        mut received: Vec<Option<T>>,
        what: &str,
        take: impl Fn(Message) -> Option<T>,
    ) -> Result<Vec<Option<T>>> {
        let patience = self.timeout * 2;
        let deadline = Instant::now() + patience;
        let me = self.index;
        let roles = self.roles;
        let mut backoff = Backoff::default();
        transport::send_all_while(comm, &roles, to, patience, || {
            let mut progressed = false;
            for s in (0..roles.servers).filter(|&s| s != me) {
                if received[s].is_some() {
                    continue;
                }
                if let Some(m) = transport::try_receive(comm, &roles, Some(roles.server_rank(s)))? {
                    received[s] = Some(self.take_from_server(m, call, what, &take)?);
                    progressed = true;
                }
            }
            let Some(late) = (0..roles.servers).find(|&s| s != me && received[s].is_none()) else {
                return Ok(true);
            };
            if !progressed {
                if Instant::now() >= deadline {
                    return Err(Error::Replica {
                        replica: roles.server_label(late),
                        reason: format!(
                            "did not send {what} to {} within {}",
                            self.label(),
                            seconds(patience)
                        ),
                    });
                }
                backoff.wait();
            }
            Ok(false)
        })?;
        Ok(received)
    }

    /// What `m`, a message from another server, carries when it belongs to call `call` and
    /// `take` takes it; the error of an abort notice, or of another message.
    fn take_from_server<T>(
        &self,
        m: Incoming,
        call: u32,
        what: &str,
        take: impl FnOnce(Message) -> Option<T>,
    ) -> Result<T> {
        if let Some(error) = m.abort_error() {
            return Err(error);
        }
        let (source, kind) = (m.source, m.message.kind());
        let during = format!("the exchange of {what}");
        if m.call != call {
            return Err(self.unexpected(source, kind, &during));
        }
        take(m.message).ok_or_else(|| self.unexpected(source, kind, &during))
    }
}

/// The training state a `State` message carries.
fn state_of(message: Message) -> Option<Vec<u8>> {
    match message {
        Message::State { state, .. } => Some(state),
        _ => None,
    }
}

/// The variables a `Shard` message carries.
fn shard_of(message: Message) -> Option<Snapshot> {
    match message {
        Message::Shard(snapshot) => Some(snapshot),
        _ => None,
    }
}
