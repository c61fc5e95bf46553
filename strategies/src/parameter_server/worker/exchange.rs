//! Sending messages to the servers and waiting for their answers: each server gets twice the
//! timeout to answer, the worker tells every server it is alive while it waits, and a server
//! that does not take its message or does not answer is named in the error.

use std::time::{Duration, Instant};

use mpi::point_to_point::Destination;
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::{Error, Result};

use super::Worker;
use crate::mpi::abort::abort_job;
use crate::mpi::poll::{Backoff, SendPace};
use crate::mpi::seconds;
use crate::parameter_server::protocol::{Encoded, Kind, Message};
use crate::parameter_server::transport;
use crate::parameter_server::Roles;

impl Worker {
    /// Sends `messages[s]` to server `s`, for each message, and waits for each of those
    /// servers' answer of kind `answer`, whose contents `take` takes (see [`exchange`]).
    pub(super) fn exchange<T>(
        &self,
        messages: &[Message],
        answer: Kind,
        take: fn(Message) -> Option<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        let encoded: Vec<Encoded> = messages.iter().map(|m| m.encode(self.call)).collect();
        let to: Vec<(usize, &Encoded)> = encoded.iter().enumerate().collect();
        let awaited: Vec<usize> = (0..messages.len()).collect();
        self.exchange_with(&to, &awaited, answer, take, what)
    }

    /// Sends `message` to every server and waits for each one's answer of kind `answer`, whose
    /// contents `take` takes (see [`exchange`]).
    pub(super) fn ask_all<T>(
        &self,
        message: &Message,
        answer: Kind,
        take: fn(Message) -> Option<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        let encoded = message.encode(self.call);
        let servers: Vec<usize> = (0..self.sharding.servers()).collect();
        let to: Vec<(usize, &Encoded)> = servers.iter().map(|&s| (s, &encoded)).collect();
        self.exchange_with(&to, &servers, answer, take, what)
    }

    /// Sends each `(server, message)` of `to` and waits for one answer of kind `answer` from
    /// each server of `awaited`, whose contents `take` takes (see [`exchange`]).
    pub(super) fn exchange_with<T>(
        &self,
        to: &[(usize, &Encoded)],
        awaited: &[usize],
        answer: Kind,
        take: fn(Message) -> Option<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        let expected = Expected {
            answer,
            take,
            call: self.call,
            what,
        };
        let (roles, timeout) = (self.roles, self.timeout);
        self.world
            .point_to_point(|comm| exchange(comm, roles, to, awaited, &expected, timeout))
    }
}

/// The answer an exchange waits for from each server.
struct Expected<'a, T> {
    /// Its kind.
    answer: Kind,
    /// Takes its contents out of a message of that kind.
    take: fn(Message) -> Option<T>,
    /// The call it belongs to.
    call: u32,
    /// What it answers, for errors: `the push of step 3`.
    what: &'a str,
}

/// Sends each `(server, message)` of `to` and waits for one answer as `expected` says from
/// each server of `awaited`, in one loop that also takes the answers of the servers that
/// already have their message while a send to another is still under way.
///
/// Each server gets twice the timeout (it may itself wait one timeout for another worker; a
/// `Waiting` note from it starts its wait again). Meanwhile the worker tells every server, a
/// few times per timeout, that it is alive, so that a server does not take a worker that waits
/// on another, stalled server for a stalled worker. An abort notice fails the exchange with the
/// error it carries. A server that does not take its message in time cannot be answered by
/// cancelling the send, so the job is ended naming it; one that takes it but does not answer is
/// named in the error.
fn exchange<T>(
    comm: &SimpleCommunicator,
    roles: Roles,
    to: &[(usize, &Encoded)],
    awaited: &[usize],
    expected: &Expected<'_, T>,
    timeout: Duration,
) -> Result<Vec<T>> {
    let what = expected.what;
    let patience = timeout * 2;
    let start = Instant::now();
    let mut answers: Vec<Option<T>> = awaited.iter().map(|_| None).collect();
    let mut deadlines = vec![start + patience; awaited.len()];
    let mut alive_sent = start;
    let alive = Message::Alive.encode(expected.call);
    mpi::request::scope(|scope| {
        let mut sends: Vec<_> = to
            .iter()
            .map(|&(s, message)| {
                Some(
                    comm.process_at_rank(roles.server_rank(s) as i32)
                        .immediate_send_with_tag(scope, &message.words[..], message.tag),
                )
            })
            .collect();
        let mut backoff = Backoff::default();
        let mut pace = SendPace::default();
        let outcome = loop {
            let mut progressed = false;
            for slot in sends.iter_mut() {
                if let Some(request) = slot.take() {
                    match request.test() {
                        Ok(_) => progressed = true,
                        Err(pending) => *slot = Some(pending),
                    }
                }
            }
            match receive_answers(comm, roles, awaited, expected, &mut answers) {
                Ok(Some(waiting)) => {
                    for i in waiting {
                        deadlines[i] = Instant::now() + patience;
                    }
                    progressed = true;
                }
                Ok(None) => {}
                Err(e) => break Err(e),
            }
            let sent = sends.iter().all(Option::is_none);
            if sent && answers.iter().all(Option::is_some) {
                break Ok(());
            }
            if progressed {
                backoff = Backoff::default();
                continue;
            }
            let now = Instant::now();
            if now.duration_since(alive_sent) > timeout / 4 {
                alive_sent = now;
                for s in 0..roles.servers {
                    comm.process_at_rank(roles.server_rank(s) as i32)
                        .buffered_send_with_tag(&alive.words[..], alive.tag);
                }
            }
            let unsent = to
                .iter()
                .zip(&sends)
                .find(|(_, r)| r.is_some())
                .map(|(&(s, _), _)| s);
            if let Some(s) = unsent.filter(|_| now >= start + patience) {
                break Err(Error::Replica {
                    replica: roles.server_label(s),
                    reason: format!("did not take {what} within {}", seconds(patience)),
                });
            }
            if let Some(i) =
                (0..awaited.len()).find(|&i| answers[i].is_none() && now >= deadlines[i])
            {
                break Err(Error::Replica {
                    replica: roles.server_label(awaited[i]),
                    reason: format!(
                        "did not answer {what} within {} (twice the timeout, as a server may \
                         wait one timeout for another worker)",
                        seconds(patience)
                    ),
                });
            }
            if sent {
                backoff.wait();
            } else {
                pace.wait();
            }
        };
        if let Err(e) = &outcome {
            if sends.iter().any(Option::is_some) {
                // MPI still owns the buffers of the unfinished sends: end the job, naming why.
                std::mem::forget(sends);
                abort_job(comm, &e.to_string())
            }
        }
        outcome
    })?;
    Ok(answers.into_iter().flatten().collect())
}

/// Takes the answers that have arrived from the servers of `awaited` into `answers`; returns
/// which of them sent a `Waiting` note (or `None` when nothing arrived), or the error of an
/// abort notice or a stray message.
fn receive_answers<T>(
    comm: &SimpleCommunicator,
    roles: Roles,
    awaited: &[usize],
    expected: &Expected<'_, T>,
    answers: &mut [Option<T>],
) -> Result<Option<Vec<usize>>> {
    let mut arrived = None;
    for (i, &s) in awaited.iter().enumerate() {
        if answers[i].is_some() {
            continue;
        }
        let Some(m) = transport::try_receive(comm, &roles, Some(roles.server_rank(s)))? else {
            continue;
        };
        let waiting: &mut Vec<usize> = arrived.get_or_insert_with(Vec::new);
        if let Some(error) = m.abort_error() {
            return Err(match error {
                Error::Replica { replica, reason } => Error::Replica {
                    replica,
                    reason: format!("{reason} (reported by {})", roles.server_label(s)),
                },
                other => other,
            });
        }
        if m.message == Message::Waiting {
            waiting.push(i);
            continue;
        }
        let (kind, call) = (m.message.kind(), m.call);
        let taken = (call == expected.call)
            .then(|| (expected.take)(m.message))
            .flatten();
        let Some(answer) = taken else {
            return Err(Error::Replica {
                replica: roles.server_label(s),
                reason: format!(
                    "answered {} with message tag {:#x} of call {call} (expected tag {:#x} of \
                     call {})",
                    expected.what,
                    kind.tag(),
                    expected.answer.tag(),
                    expected.call
                ),
            });
        };
        answers[i] = Some(answer);
    }
    Ok(arrived)
}
