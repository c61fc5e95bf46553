//! A [`Message`] on the wire.
//!
//! A message is one MPI message, so that a push or a pull is one message per server: its
//! [`Kind`] is the MPI tag, and its contents one `f32` vector: the number of the call of
//! `fit`, `evaluate` or `predict` it belongs to, the kind's fields in order, then its payload.
//! Integers and floats travel as the bits of `f32` words: a `u32` in one word, a `u64` or an
//! `f64` in two (high, low); bytes travel four to a word (the last word zero-padded) after the
//! fields that count them. A message whose tag is unknown, or whose length or fields do not fit
//! its kind, is refused by [`Message::decode`] with an error naming its sender; the lengths a
//! kind leaves open (a push's buffer, the sums) are checked by the receiver against its model.

use kandle::{Error, Result};

use super::{EpochTotals, Kind, LoadPart, Message, Snapshot, Staleness, StepTotals};

/// A message as it goes on the wire: its MPI tag and its words.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Encoded {
    /// The MPI tag: the message's [`Kind`].
    pub(crate) tag: i32,
    /// The call number, the fields and the payload.
    pub(crate) words: Vec<f32>,
}

impl Message {
    /// The message on the wire, as part of call `call`.
    pub(crate) fn encode(&self, call: u32) -> Encoded {
        let mut w = Writer(vec![f32::from_bits(call)]);
        match self {
            Message::Hello {
                signature,
                buffer_len,
            } => {
                w.u64(*signature);
                w.u64(*buffer_len);
            }
            Message::Pull
            | Message::Fetch
            | Message::End
            | Message::Alive
            | Message::StateRequest
            | Message::Waiting => {}
            Message::Push {
                base,
                step,
                lr,
                buffer,
            } => {
                w.u64(*base);
                w.u32(*step);
                w.u64(lr.to_bits());
                w.0.extend_from_slice(buffer);
            }
            Message::Test { step, totals } => {
                w.u32(*step);
                w.step_totals(totals);
            }
            Message::TestTotals(totals) => w.step_totals(totals),
            Message::Epoch { epoch, totals } => {
                w.u32(*epoch);
                w.epoch_totals(totals);
            }
            Message::EpochTotals(totals) => w.epoch_totals(totals),
            Message::Load { part, state } => {
                w.u32(*part as u32);
                w.bytes(&[state]);
            }
            Message::State { version, state } => {
                w.u64(*version);
                w.bytes(&[state]);
            }
            Message::Gather { values } | Message::Gathered { values } => {
                for &v in values {
                    w.u64(v);
                }
            }
            Message::Weights(snapshot) | Message::Shard(snapshot) => w.snapshot(snapshot),
            Message::Abort { culprit, reason } => w.bytes(&[culprit.as_bytes(), reason.as_bytes()]),
        }
        Encoded {
            tag: self.kind().tag(),
            words: w.0,
        }
    }

    /// The call number and message of `words`, received with MPI tag `tag` from `sender` (its
    /// name in the error, e.g. `worker 1`). A message whose tag is unknown, or whose length or
    /// fields do not fit its kind, is an error naming the sender and what does not fit.
    pub(crate) fn decode(tag: i32, words: Vec<f32>, sender: &str) -> Result<(u32, Message)> {
        let malformed = |what: String| Error::Replica {
            replica: sender.to_string(),
            reason: format!("sent a malformed parameter-server message: {what}"),
        };
        let kind =
            Kind::of_tag(tag).ok_or_else(|| malformed(format!("unknown message tag {tag:#x}")))?;
        let mut reader = Reader::new(kind, words);
        reader
            .u32("call number")
            .and_then(|call| Ok((call, reader.message()?)))
            .map_err(|what| malformed(format!("a {kind:?} message {what}")))
    }
}

/// Builds a message's words.
struct Writer(Vec<f32>);

impl Writer {
    /// One word.
    fn u32(&mut self, value: u32) {
        self.0.push(f32::from_bits(value));
    }

    /// Two words, high then low.
    fn u64(&mut self, value: u64) {
        self.u32((value >> 32) as u32);
        self.u32(value as u32);
    }

    /// The length of each of `parts`, then all of them, four bytes to a word.
    fn bytes(&mut self, parts: &[&[u8]]) {
        for part in parts {
            self.u64(part.len() as u64);
        }
        let all: Vec<u8> = parts.concat();
        self.0.reserve(all.len().div_ceil(4));
        for chunk in all.chunks(4) {
            let mut word = [0u8; 4];
            word[..chunk.len()].copy_from_slice(chunk);
            self.u32(u32::from_le_bytes(word));
        }
    }

    /// Samples, then the sums.
    fn step_totals(&mut self, totals: &StepTotals) {
        self.u64(totals.samples);
        self.0.extend_from_slice(&totals.sums);
    }

    /// Staleness sum, count and max, samples, then the sums.
    fn epoch_totals(&mut self, totals: &EpochTotals) {
        let s = totals.staleness;
        for v in [s.sum, s.count, s.max, totals.samples] {
            self.u64(v);
        }
        self.0.extend_from_slice(&totals.sums);
    }

    /// Version, applied flag, staleness, samples, number of sums, then the sums and values.
    fn snapshot(&mut self, s: &Snapshot) {
        self.u64(s.version);
        self.u32(u32::from(s.staleness.is_some()));
        self.u64(s.staleness.unwrap_or(0));
        self.u64(s.samples);
        self.u64(s.sums.len() as u64);
        self.0.reserve(s.sums.len() + s.values.len());
        self.0.extend_from_slice(&s.sums);
        self.0.extend_from_slice(&s.values);
    }
}

/// Reads a message's words in order; each failure says what does not fit.
struct Reader {
    kind: Kind,
    words: Vec<f32>,
    at: usize,
}

/// A field read from a message, or what does not fit, to complete "a Push message ...".
type Fit<T> = std::result::Result<T, String>;

impl Reader {
    /// A reader of `words`, a message of `kind`, from its first word.
    fn new(kind: Kind, words: Vec<f32>) -> Self {
        Self { kind, words, at: 0 }
    }

    /// One word, `field`.
    fn u32(&mut self, field: &str) -> Fit<u32> {
        let word = self.words.get(self.at).ok_or_else(|| {
            format!(
                "of {} words ends before its {field} (word {})",
                self.words.len(),
                self.at
            )
        })?;
        self.at += 1;
        Ok(word.to_bits())
    }

    /// Two words, high then low, `field`.
    fn u64(&mut self, field: &str) -> Fit<u64> {
        let high = self.u32(field)?;
        let low = self.u32(field)?;
        Ok((u64::from(high) << 32) | u64::from(low))
    }

    /// A count of `field` that must fit in the words left, `per_word` to a word.
    fn count(&mut self, field: &str, per_word: usize) -> Fit<usize> {
        let n = self.u64(field)?;
        let left = (self.words.len() - self.at) as u64;
        if n.div_ceil(per_word as u64) > left {
            return Err(format!(
                "says it carries {n} {field} where {left} words are left"
            ));
        }
        Ok(n as usize)
    }

    /// The words left, which must be a whole number of `per` words each.
    fn rest(&mut self, field: &str, per: usize) -> Fit<Vec<f32>> {
        let left = self.words.len() - self.at;
        if !left.is_multiple_of(per) {
            return Err(format!(
                "has {left} words of {field}, not a whole number of {per}-word values"
            ));
        }
        let rest = self.words.split_off(self.at);
        self.at = self.words.len();
        Ok(rest)
    }

    /// The next `n` words, of `field`.
    fn take(&mut self, field: &str, n: usize) -> Fit<Vec<f32>> {
        let end = self.at.saturating_add(n);
        let taken = self.words.get(self.at..end).ok_or_else(|| {
            format!(
                "of {} words ends inside its {field} (words {} to {end})",
                self.words.len(),
                self.at
            )
        })?;
        let taken = taken.to_vec();
        self.at = end;
        Ok(taken)
    }

    /// Texts or byte strings counted by one field each, packed together after the counts.
    fn bytes<const N: usize>(&mut self, fields: [&str; N]) -> Fit<[Vec<u8>; N]> {
        let mut counts = [0usize; N];
        for (count, field) in counts.iter_mut().zip(fields) {
            *count = self.count(field, 4)?;
        }
        let total: usize = counts.iter().sum();
        let left = self.words.len() - self.at;
        if left != total.div_ceil(4) {
            return Err(format!(
                "of {total} bytes in all is {left} words long after its fields, not {}",
                total.div_ceil(4)
            ));
        }
        let mut all: Vec<u8> = self.words[self.at..]
            .iter()
            .flat_map(|w| w.to_bits().to_le_bytes())
            .collect();
        self.at = self.words.len();
        all.truncate(total);
        let mut parts: [Vec<u8>; N] = std::array::from_fn(|_| Vec::new());
        let mut start = 0;
        for (part, n) in parts.iter_mut().zip(counts) {
            let bytes = all
                .get(start..start + n)
                .ok_or_else(|| format!("ends inside its bytes ({start} to {})", start + n))?;
            *part = bytes.to_vec();
            start += n;
        }
        Ok(parts)
    }

    /// `bytes` as text, `field`.
    fn text(bytes: Vec<u8>, field: &str) -> Fit<String> {
        String::from_utf8(bytes).map_err(|_| format!("has a {field} that is not UTF-8"))
    }

    /// The words must be all read.
    fn end(&self) -> Fit<()> {
        let left = self.words.len() - self.at;
        if left > 0 {
            return Err(format!(
                "of {} words carries {left} after its {} words of fields, where none belong",
                self.words.len(),
                self.at
            ));
        }
        Ok(())
    }

    /// What [`Writer::step_totals`] wrote.
    fn step_totals(&mut self) -> Fit<StepTotals> {
        let samples = self.u64("sample count")?;
        Ok(StepTotals {
            samples,
            sums: self.rest("sums", 1)?,
        })
    }

    /// What [`Writer::epoch_totals`] wrote.
    fn epoch_totals(&mut self) -> Fit<EpochTotals> {
        let staleness = Staleness {
            sum: self.u64("staleness sum")?,
            count: self.u64("staleness count")?,
            max: self.u64("largest staleness")?,
        };
        let samples = self.u64("sample count")?;
        Ok(EpochTotals {
            staleness,
            samples,
            sums: self.rest("sums", 1)?,
        })
    }

    /// What [`Writer::snapshot`] wrote.
    fn snapshot(&mut self) -> Fit<Snapshot> {
        let version = self.u64("version")?;
        let applied = match self.u32("applied flag")? {
            0 => false,
            1 => true,
            other => return Err(format!("has applied flag {other}, neither 0 nor 1")),
        };
        let staleness = self.u64("staleness")?;
        let staleness = applied.then_some(staleness);
        let samples = self.u64("sample count")?;
        let sums = self.count("sums", 1)?;
        let sums = self.take("sums", sums)?;
        Ok(Snapshot {
            version,
            staleness,
            samples,
            sums,
            values: self.rest("values", 1)?,
        })
    }

    /// The words left, as 64-bit values.
    fn u64s(&mut self) -> Fit<Vec<u64>> {
        let words = self.rest("64-bit values", 2)?;
        Ok(words
            .chunks_exact(2)
            .map(|w| (u64::from(w[0].to_bits()) << 32) | u64::from(w[1].to_bits()))
            .collect())
    }

    /// The message of the kind being read, after its call number; all words must be read.
    fn message(&mut self) -> Fit<Message> {
        let message = match self.kind {
            Kind::Hello => Message::Hello {
                signature: self.u64("model signature")?,
                buffer_len: self.u64("step buffer length")?,
            },
            Kind::Pull => Message::Pull,
            Kind::Fetch => Message::Fetch,
            Kind::End => Message::End,
            Kind::Alive => Message::Alive,
            Kind::StateRequest => Message::StateRequest,
            Kind::Waiting => Message::Waiting,
            Kind::Push => {
                let base = self.u64("base version")?;
                let step = self.u32("step")?;
                let lr = f64::from_bits(self.u64("learning rate")?);
                Message::Push {
                    base,
                    step,
                    lr,
                    buffer: self.rest("step buffer", 1)?,
                }
            }
            Kind::Test => {
                let step = self.u32("evaluation step")?;
                Message::Test {
                    step,
                    totals: self.step_totals()?,
                }
            }
            Kind::TestTotals => Message::TestTotals(self.step_totals()?),
            Kind::Epoch => {
                let epoch = self.u32("epoch")?;
                Message::Epoch {
                    epoch,
                    totals: self.epoch_totals()?,
                }
            }
            Kind::EpochTotals => Message::EpochTotals(self.epoch_totals()?),
            Kind::Load => {
                let part = match self.u32("part to load")? {
                    0 => LoadPart::Weights,
                    1 => LoadPart::Optimizer,
                    other => return Err(format!("names part {other} to load, neither 0 nor 1")),
                };
                let [state] = self.bytes(["bytes of training state"])?;
                Message::Load { part, state }
            }
            Kind::State => {
                let version = self.u64("version")?;
                let [state] = self.bytes(["bytes of training state"])?;
                Message::State { version, state }
            }
            Kind::Gather => Message::Gather {
                values: self.u64s()?,
            },
            Kind::Gathered => Message::Gathered {
                values: self.u64s()?,
            },
            Kind::Weights => Message::Weights(self.snapshot()?),
            Kind::Shard => Message::Shard(self.snapshot()?),
            Kind::Abort => {
                let [culprit, reason] = self.bytes(["bytes of culprit", "bytes of reason"])?;
                Message::Abort {
                    culprit: Self::text(culprit, "culprit")?,
                    reason: Self::text(reason, "reason")?,
                }
            }
        };
        self.end()?;
        Ok(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_message() -> Vec<Message> {
        let snapshot = |staleness| Snapshot {
            version: (7 << 32) + 3,
            staleness,
            samples: 48,
            sums: vec![1.5, f32::NAN, -0.0],
            values: vec![0.25; 5],
        };
        let epoch = EpochTotals {
            staleness: Staleness {
                sum: 9,
                count: 4,
                max: u64::MAX,
            },
            samples: 320,
            sums: vec![2.0, 0.5],
        };
        vec![
            Message::Hello {
                signature: 0xdead_beef_0123_4567,
                buffer_len: 1027,
            },
            Message::Pull,
            Message::Push {
                base: u64::MAX - 1,
                step: 12,
                lr: 0.05,
                buffer: vec![1.0, f32::NAN, f32::INFINITY, 3.5],
            },
            Message::Push {
                base: 0,
                step: 1,
                lr: 1e-9,
                buffer: Vec::new(),
            },
            Message::Fetch,
            Message::Test {
                step: 3,
                totals: StepTotals {
                    samples: 16,
                    sums: vec![0.5, 12.0],
                },
            },
            Message::Epoch {
                epoch: 2,
                totals: epoch.clone(),
            },
            Message::End,
            Message::Alive,
            Message::StateRequest,
            Message::Load {
                part: LoadPart::Weights,
                state: (0..1027).map(|i| (i * 37 % 256) as u8).collect(),
            },
            Message::Load {
                part: LoadPart::Optimizer,
                state: Vec::new(),
            },
            Message::Gather {
                values: vec![0, 1, u64::MAX, 0x7fc0_0001_ffff_0000],
            },
            Message::Weights(snapshot(Some(2))),
            Message::Weights(snapshot(None)),
            Message::TestTotals(StepTotals {
                samples: 32,
                sums: vec![1.0],
            }),
            Message::EpochTotals(epoch),
            Message::Gathered { values: vec![5; 6] },
            Message::Waiting,
            Message::State {
                version: 41,
                state: vec![1, 2, 3],
            },
            Message::Shard(snapshot(None)),
            Message::Abort {
                culprit: "worker 1".into(),
                reason: "left call 2 with an error: ünïcode".into(),
            },
        ]
    }

    /// Compares two messages bit for bit (NaN sums included).
    fn same(a: &Message, b: &Message) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    #[test]
    fn every_message_round_trips() -> Result<()> {
        for (call, message) in every_message().into_iter().enumerate() {
            let call = call as u32 * 1000 + 1;
            let wire = message.encode(call);
            assert_eq!(wire.tag, message.kind().tag());
            assert_eq!(Kind::of_tag(wire.tag), Some(message.kind()));
            let (back_call, back) = Message::decode(wire.tag, wire.words, "worker 1")?;
            assert_eq!(back_call, call);
            assert!(same(&back, &message), "{back:?} != {message:?}");
        }
        Ok(())
    }

    #[test]
    fn every_kind_has_its_own_tag() {
        for (i, a) in Kind::ALL.iter().enumerate() {
            assert_eq!(Kind::of_tag(a.tag()), Some(*a));
            assert!(Kind::ALL[i + 1..].iter().all(|b| b.tag() != a.tag()));
        }
        let kinds: Vec<Kind> = every_message().iter().map(Message::kind).collect();
        assert!(Kind::ALL.iter().all(|k| kinds.contains(k)));
    }

    /// The error for `words` received with `tag` from `worker 2`, as text.
    fn refusal(tag: i32, words: Vec<f32>) -> String {
        match Message::decode(tag, words, "worker 2") {
            Ok(m) => panic!("decoded {m:?}"),
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.starts_with("worker 2: sent a malformed parameter-server message: "),
                    "{text}"
                );
                text
            }
        }
    }

    fn words(message: &Message) -> Vec<f32> {
        message.encode(4).words
    }

    #[test]
    fn malformed_messages_are_refused_naming_the_sender() {
        assert!(refusal(0x4b01, vec![0.0]).contains("unknown message tag 0x4b01"));
        assert!(refusal(Kind::Pull.tag(), Vec::new())
            .contains("a Pull message of 0 words ends before its call number"));
        let push = Message::Push {
            base: 3,
            step: 1,
            lr: 0.1,
            buffer: vec![1.0; 4],
        };
        let mut short = words(&push);
        short.truncate(4);
        assert!(refusal(Kind::Push.tag(), short)
            .contains("a Push message of 4 words ends before its learning rate"));
        let mut long = words(&Message::End);
        long.push(0.0);
        assert!(refusal(Kind::End.tag(), long).contains("carries 1 after its 1 words of fields"));
        let load = Message::Load {
            part: LoadPart::Weights,
            state: vec![1, 2, 3, 4, 5],
        };
        let mut cut = words(&load);
        cut.pop();
        assert!(refusal(Kind::Load.tag(), cut)
            .contains("says it carries 5 bytes of training state where 1 words are left"));
        let mut padded = words(&load);
        padded.push(0.0);
        assert!(refusal(Kind::Load.tag(), padded)
            .contains("of 5 bytes in all is 3 words long after its fields, not 2"));
        let mut bad_part = words(&load);
        bad_part[1] = f32::from_bits(7);
        assert!(refusal(Kind::Load.tag(), bad_part).contains("names part 7 to load"));
        let mut huge = words(&load);
        huge[3] = f32::from_bits(u32::MAX);
        assert!(refusal(Kind::Load.tag(), huge)
            .contains("says it carries 4294967295 bytes of training state where 2 words are left"));
        let mut odd = words(&Message::Gather { values: vec![1, 2] });
        odd.pop();
        assert!(refusal(Kind::Gather.tag(), odd).contains("not a whole number of 2-word values"));
        let snapshot = Message::Weights(Snapshot {
            version: 1,
            staleness: None,
            samples: 0,
            sums: vec![0.0; 2],
            values: vec![1.0; 3],
        });
        let mut flag = words(&snapshot);
        flag[3] = f32::from_bits(2);
        assert!(refusal(Kind::Weights.tag(), flag).contains("applied flag 2"));
        let mut sums = words(&snapshot);
        sums[9] = f32::from_bits(9);
        assert!(refusal(Kind::Weights.tag(), sums)
            .contains("says it carries 9 sums where 5 words are left"));
        let mut text = words(&Message::Abort {
            culprit: "w".into(),
            reason: "x".into(),
        });
        text[5] = f32::from_bits(0xffff);
        assert!(refusal(Kind::Abort.tag(), text).contains("has a culprit that is not UTF-8"));
    }
}
