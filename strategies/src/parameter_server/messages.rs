//! The messages between workers and parameter servers, over MPI point-to-point: their tags, the
//! header every message starts with, and the polled, deadline-bound sends and receives both
//! sides use.
//!
//! A message is one `f32` vector: an [`HEADER`]-word header (integers stored as the bits of
//! `f32` words) followed by the payload, so that a push or a pull is one message per server.
//! An abort notice is text (`u8`), `"<who>\x1f<why>"`.
//!
//! | tag | from | header after the call number | payload | answer |
//! |---|---|---|---|---|
//! | `HELLO` | worker | model signature (2 words), values in a step buffer | | `WEIGHTS`, or `ABORT` |
//! | `PULL` | worker | | | `WEIGHTS` |
//! | `PUSH` | worker | base version, step, learning rate (2 words) | the server's part of the step buffer | `WEIGHTS` once applied |
//! | `FETCH` | worker | | | `WEIGHTS` |
//! | `TEST` | worker, to server 0 | evaluation step | loss and metric sums, samples | `TOTALS` once every worker sent its own |
//! | `EPOCH` | worker | epoch | staleness sum, count, max; the epoch's samples and loss and metric sums | from server 0, `TOTALS` once every worker ended the epoch |
//! | `END` | worker | | | `WEIGHTS` (the final ones) once every worker ended the call |
//! | `STATE` | worker | | | `STATE` |
//! | `LOAD` | worker | what it loads (weights or optimizer state), bytes | a training state's bytes | `WEIGHTS` once every worker sent its own (the chief's is loaded) |
//! | `GATHER` | worker, to server 0 | | 64-bit values (2 words each) | `TOTALS` with every worker's, in rank order, once every worker sent its own |
//! | `WEIGHTS` | server | version, applied, staleness, samples | loss and metric sums, then the server's variables | |
//! | `TOTALS` | server 0 | | the sums | |
//! | `STATE` | server | version, bytes | its shard's training state (weights and optimizer state), as bytes | (between calls, a server sends it to every other rank unasked) |
//! | `ALIVE` | worker | | | (keeps the other servers from taking a worker that waits on one server for a stalled one) |
//! | `SHARD` | server, to the other servers | as `WEIGHTS` | as `WEIGHTS` | (at the end of a call: every server then holds every variable) |
//! | `WAITING` | server | | | (keeps a waiting worker's deadline from passing) |
//! | `ABORT` | any | | text | |

use std::time::{Duration, Instant};

use mpi::datatype::Equivalence;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use kandle::{Error, Result};

use crate::mpi::abort::abort_job;
use crate::mpi::poll::SendPace;

/// Worker to server: the model's signature when the model is built.
pub(crate) const HELLO: i32 = 0x5001;
/// Worker to server: send me your current weights, I train on them.
pub(crate) const PULL: i32 = 0x5002;
/// Worker to server: gradients of one step.
pub(crate) const PUSH: i32 = 0x5003;
/// Worker to server: send me your current weights, to evaluate or predict with.
pub(crate) const FETCH: i32 = 0x5004;
/// Worker to server 0: the sums of one evaluation step.
pub(crate) const TEST: i32 = 0x5005;
/// Worker to server: this worker ended an epoch.
pub(crate) const EPOCH: i32 = 0x5006;
/// Worker to server: this worker ended the current `fit`, `evaluate` or `predict`.
pub(crate) const END: i32 = 0x5007;
/// Worker to server: send me your shard's training state. Server to any rank: a shard's
/// training state.
pub(crate) const STATE: i32 = 0x5009;
/// Worker to server: load this training state's weights or optimizer state.
pub(crate) const LOAD: i32 = 0x500a;
/// A `LOAD` of the weights (header word 1).
pub(crate) const LOAD_WEIGHTS: u32 = 0;
/// A `LOAD` of the optimizer state (header word 1).
pub(crate) const LOAD_OPTIMIZER: u32 = 1;
/// Worker to server 0: values to gather from every worker.
pub(crate) const GATHER: i32 = 0x500b;
/// Server to worker: weights (and what the step did).
pub(crate) const WEIGHTS: i32 = 0x5011;
/// Server 0 to worker: sums over every worker.
pub(crate) const TOTALS: i32 = 0x5012;
/// Anyone to anyone: the job failed; text names the culprit.
pub(crate) const ABORT: i32 = 0x5013;
/// Server to server: its variables at the end of a call (laid out as `WEIGHTS`).
pub(crate) const SHARD: i32 = 0x5015;
/// Worker to server: still alive, waiting for another server; header only.
pub(crate) const ALIVE: i32 = 0x5008;
/// Server to a worker it makes wait (at an epoch's or a call's end): still alive, still
/// waiting for the others; header only.
pub(crate) const WAITING: i32 = 0x5014;

/// Words of the header at the start of every message; the first is the call number.
pub(crate) const HEADER: usize = 6;

/// What a `WEIGHTS` header says besides the call number.
pub(crate) const NOT_STALE: u32 = u32::MAX;

/// A header of `words` (the call number first), as the start of a message.
pub(crate) fn header(words: [u32; HEADER]) -> Vec<f32> {
    words.iter().map(|&w| f32::from_bits(w)).collect()
}

/// The header of a message, or an error saying it is too short.
pub(crate) fn read_header(message: &[f32]) -> Result<[u32; HEADER]> {
    let mut words = [0u32; HEADER];
    if message.len() < HEADER {
        return Err(Error::invalid(format!(
            "a parameter-server message of {} words, shorter than its header",
            message.len()
        )));
    }
    for (w, v) in words.iter_mut().zip(message) {
        *w = v.to_bits();
    }
    Ok(words)
}

/// A learning rate as two header words.
pub(crate) fn lr_words(lr: f64) -> [u32; 2] {
    let bits = lr.to_bits();
    [(bits >> 32) as u32, bits as u32]
}

/// A learning rate from two header words.
pub(crate) fn lr_from(words: [u32; 2]) -> f64 {
    f64::from_bits((u64::from(words[0]) << 32) | u64::from(words[1]))
}

/// `header` followed by `bytes`, four to a word (the last word zero-padded); the header's
/// word `at` must be left for the byte count, which this sets.
pub(crate) fn with_bytes(mut header: [u32; HEADER], at: usize, bytes: &[u8]) -> Vec<f32> {
    header[at] = bytes.len() as u32;
    let mut out = self::header(header);
    out.reserve(bytes.len().div_ceil(4));
    for chunk in bytes.chunks(4) {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        out.push(f32::from_bits(u32::from_le_bytes(word)));
    }
    out
}

/// The bytes a message made by [`with_bytes`] carries, their count in header word `at`.
pub(crate) fn bytes_of(message: &[f32], at: usize) -> Result<Vec<u8>> {
    let n = read_header(message)?[at] as usize;
    let words = &message[HEADER..];
    if words.len() != n.div_ceil(4) {
        return Err(Error::invalid(format!(
            "a parameter-server message of {} payload words says it carries {n} bytes",
            words.len()
        )));
    }
    let mut bytes: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect();
    bytes.truncate(n);
    Ok(bytes)
}

/// 64-bit values as two words each (high, low).
pub(crate) fn u64_words(values: &[u64]) -> Vec<f32> {
    values
        .iter()
        .flat_map(|&v| [(v >> 32) as u32, v as u32])
        .map(f32::from_bits)
        .collect()
}

/// The 64-bit values of words made by [`u64_words`].
pub(crate) fn u64s_from(words: &[f32]) -> Vec<u64> {
    words
        .chunks_exact(2)
        .map(|w| (u64::from(w[0].to_bits()) << 32) | u64::from(w[1].to_bits()))
        .collect()
}

/// A message taken from the queue.
pub(crate) struct Incoming {
    /// The sender's rank.
    pub(crate) source: usize,
    /// Its tag.
    pub(crate) tag: i32,
    /// Its words (empty for an abort notice).
    pub(crate) words: Vec<f32>,
    /// An abort notice's error.
    pub(crate) abort: Option<Error>,
}

/// Takes the next message from `source` (any rank when `None`), if one has arrived.
pub(crate) fn try_receive(comm: &SimpleCommunicator, source: Option<usize>) -> Option<Incoming> {
    let (message, status) = match source {
        Some(rank) => comm.process_at_rank(rank as i32).immediate_matched_probe(),
        None => comm.any_process().immediate_matched_probe(),
    }?;
    let from = status.source_rank() as usize;
    if status.tag() == ABORT {
        let n = status.count(u8::equivalent_datatype()).max(0) as usize;
        let mut text = vec![0u8; n];
        message.matched_receive_into(&mut text[..]);
        return Some(Incoming {
            source: from,
            tag: ABORT,
            words: Vec::new(),
            abort: Some(abort_error(&String::from_utf8_lossy(&text))),
        });
    }
    let n = status.count(f32::equivalent_datatype()).max(0) as usize;
    let mut words = vec![0f32; n];
    message.matched_receive_into(&mut words[..]);
    Some(Incoming {
        source: from,
        tag: status.tag(),
        words,
        abort: None,
    })
}

/// Sends an abort notice carrying `error` to every rank in `ranks`, without waiting (a buffered
/// send: the notice is small).
pub(crate) fn send_abort(
    comm: &SimpleCommunicator,
    ranks: impl Iterator<Item = usize>,
    error: &Error,
) {
    let text = match error {
        Error::Replica { replica, reason } => format!("{replica}\x1f{reason}"),
        other => format!("rank {}\x1f{other}", comm.rank()),
    };
    for rank in ranks {
        comm.process_at_rank(rank as i32)
            .buffered_send_with_tag(text.as_bytes(), ABORT);
    }
}

fn abort_error(text: &str) -> Error {
    match text.split_once('\x1f') {
        Some((who, why)) => Error::Replica {
            replica: who.to_string(),
            reason: why.to_string(),
        },
        None => Error::Replica {
            replica: "a parameter-server job".into(),
            reason: text.to_string(),
        },
    }
}

/// Sends each `(rank, tag, words)` with a non-blocking send and waits for all to complete
/// within `patience`. A send that cannot complete in time (its receiver died or stalls) cannot
/// be taken back, so the job is ended, naming `label(rank)` of the receivers still missing.
pub(crate) fn send_all(
    comm: &SimpleCommunicator,
    messages: &[(usize, i32, &[f32])],
    patience: Duration,
    label: impl Fn(usize) -> String,
) {
    // Nothing to receive: this cannot fail.
    let _ = send_all_while(comm, messages, patience, label, || Ok(true));
}

/// [`send_all`], calling `receive` between the tests of the sends until the sends are complete
/// and `receive` says it is done (`Ok(true)`). Ranks that send each other large messages at
/// once must receive while they send: a large send completes only once its receiver takes it.
/// An error of `receive` is returned once the sends are complete; while a send is still under
/// way it ends the job, naming the error.
pub(crate) fn send_all_while(
    comm: &SimpleCommunicator,
    messages: &[(usize, i32, &[f32])],
    patience: Duration,
    label: impl Fn(usize) -> String,
    mut receive: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + patience;
    mpi::request::scope(|scope| {
        let mut requests: Vec<_> = messages
            .iter()
            .map(|&(rank, tag, words)| {
                Some(
                    comm.process_at_rank(rank as i32)
                        .immediate_send_with_tag(scope, words, tag),
                )
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
                    .map(|(_, &(rank, _, _))| label(rank))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_learning_rates_round_trip() -> Result<()> {
        let words = [7, u32::MAX, 0, 0x7fc0_0001, 1, 2];
        assert_eq!(read_header(&header(words))?, words);
        for lr in [0.05, 1e-9, 3.0] {
            assert_eq!(lr_from(lr_words(lr)), lr);
        }
        assert!(read_header(&[0.0]).is_err());
        Ok(())
    }

    #[test]
    fn bytes_and_64_bit_values_round_trip() -> Result<()> {
        for n in [0usize, 1, 3, 4, 5, 1027] {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).collect();
            let message = with_bytes([9, 0, 0, 0, 0, 0], 2, &bytes);
            assert_eq!(message.len(), HEADER + n.div_ceil(4));
            assert_eq!(read_header(&message)?[0], 9);
            assert_eq!(bytes_of(&message, 2)?, bytes);
        }
        let mut short = with_bytes([1, 0, 0, 0, 0, 0], 1, &[1, 2, 3, 4, 5]);
        short.pop();
        assert!(bytes_of(&short, 1).is_err());
        let values = [0, 1, u64::MAX, 0x7fc0_0001_ffff_0000];
        assert_eq!(u64s_from(&u64_words(&values)), values);
        Ok(())
    }
}
