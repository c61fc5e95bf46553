//! How the parameter servers' messages travel over MPI point-to-point: polled receives that
//! decode a [`Message`] (an abort notice included), and non-blocking sends bound by a deadline,
//! which end the job if a receiver never takes its message and can receive while they send.
//!
//! What each message says, and its encoding, is the [`protocol`](super::protocol)'s.

use std::time::{Duration, Instant};

use mpi::datatype::Equivalence;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::{Error, Result};

use super::protocol::{Encoded, Message};
use super::Roles;
use crate::mpi::abort::abort_job;
use crate::mpi::poll::SendPace;

/// A message taken from the queue.
pub(crate) struct Incoming {
    /// The sender's rank.
    pub(crate) source: usize,
    /// The call of `fit`, `evaluate` or `predict` it belongs to.
    pub(crate) call: u32,
    /// What it says.
    pub(crate) message: Message,
}

impl Incoming {
    /// The failure an abort notice reports, if this is one.
    pub(crate) fn abort_error(&self) -> Option<Error> {
        match &self.message {
            Message::Abort { culprit, reason } => Some(Error::Replica {
                replica: culprit.clone(),
                reason: reason.clone(),
            }),
            _ => None,
        }
    }
}

/// Takes the next message from `source` (any rank when `None`), if one has arrived. A message
/// that cannot be decoded is an error naming its sender (by `roles`).
pub(crate) fn try_receive(
    comm: &SimpleCommunicator,
    roles: &Roles,
    source: Option<usize>,
) -> Result<Option<Incoming>> {
    let Some((message, status)) = (match source {
        Some(rank) => comm.process_at_rank(rank as i32).immediate_matched_probe(),
        None => comm.any_process().immediate_matched_probe(),
    }) else {
        return Ok(None);
    };
    let from = status.source_rank() as usize;
    let n = status.count(f32::equivalent_datatype()).max(0) as usize;
    let mut words = vec![0f32; n];
    message.matched_receive_into(&mut words[..]);
    let (call, message) = Message::decode(status.tag(), words, &roles.label(from))?;
    Ok(Some(Incoming {
        source: from,
        call,
        message,
    }))
}

/// Sends an abort notice carrying `error` to every rank in `ranks`, without waiting (a buffered
/// send: the notice is small).
pub(crate) fn send_abort(
    comm: &SimpleCommunicator,
    ranks: impl Iterator<Item = usize>,
    error: &Error,
) {
    let (culprit, reason) = match error {
        Error::Replica { replica, reason } => (replica.clone(), reason.clone()),
        other => (format!("rank {}", comm.rank()), other.to_string()),
    };
    let notice = Message::Abort { culprit, reason }.encode(0);
    for rank in ranks {
        comm.process_at_rank(rank as i32)
            .buffered_send_with_tag(&notice.words[..], notice.tag);
    }
}

/// Sends each `(rank, message)` with a non-blocking send and waits for all to complete within
/// `patience`. A send that cannot complete in time (its receiver died or stalls) cannot be
/// taken back, so the job is ended, naming (by `roles`) the receivers still missing.
pub(crate) fn send_all(
    comm: &SimpleCommunicator,
    roles: &Roles,
    messages: &[(usize, &Encoded)],
    patience: Duration,
) {
    // Nothing to receive: this cannot fail.
    let _ = send_all_while(comm, roles, messages, patience, || Ok(true));
}

/// [`send_all`], calling `receive` between the tests of the sends until the sends are complete
/// and `receive` says it is done (`Ok(true)`). Ranks that send each other large messages at
/// once must receive while they send: a large send completes only once its receiver takes it.
/// An error of `receive` is returned once the sends are complete; while a send is still under
/// way it ends the job, naming the error.
pub(crate) fn send_all_while(
    comm: &SimpleCommunicator,
    roles: &Roles,
    messages: &[(usize, &Encoded)],
    patience: Duration,
    mut receive: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + patience;
    mpi::request::scope(|scope| {
        let mut requests: Vec<_> = messages
            .iter()
            .map(|&(rank, message)| {
                Some(comm.process_at_rank(rank as i32).immediate_send_with_tag(
                    scope,
                    &message.words[..],
                    message.tag,
                ))
            })
            .collect();
        let mut pace = SendPace::default();
        let mut received = false;
        loop {
            for slot in requests.iter_mut() {
                if let Some(request) = slot.take() {
                    if let Err(pending) = request.test() {
                        *slot = Some(pending);
                    }
                }
            }
            let sent = requests.iter().all(Option::is_none);
            if !received {
                match receive() {
                    Ok(done) => received = done,
                    Err(e) if sent => return Err(e),
                    Err(e) => {
                        std::mem::forget(requests);
                        abort_job(comm, &e.to_string())
                    }
                }
            }
            if sent && received {
                return Ok(());
            }
            if !sent && Instant::now() >= deadline {
                let missing: Vec<String> = requests
                    .iter()
                    .zip(messages)
                    .filter(|(r, _)| r.is_some())
                    .map(|(_, &(rank, _))| roles.label(rank))
                    .collect();
                let why = format!(
                    "{} did not take a parameter-server message within {:.0} s",
                    missing.join(", "),
                    patience.as_secs_f64()
                );
                // MPI still owns the buffers of the unfinished sends: abort without dropping.
                std::mem::forget(requests);
                abort_job(comm, &why)
            }
            pace.wait();
        }
    })
}
