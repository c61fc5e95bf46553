//! Evaluation and prediction on the servers' current weights, and what every worker sums or
//! gathers through server 0: an evaluation step's sums, an epoch's totals (the epoch barrier,
//! with the staleness of its updates), the gather.

use candle_core::{DType, Device, Tensor};

use kandle::data::Batch;
use kandle::strategy::StepStats;
use kandle::{Error, Result};

use super::Worker;
use crate::parameter_server::protocol::{Encoded, EpochTotals, Kind, Message, StepTotals};
use crate::parameter_server::server::Mode;

impl Worker {
    /// Fetches the servers' current weights once per evaluation or prediction.
    fn fetch(&mut self) -> Result<()> {
        if !self.fetched {
            self.pull(Message::Fetch, "a fetch of the weights")?;
            self.fetched = true;
            self.fresh = self.mode == Mode::Synchronous;
        }
        Ok(())
    }

    /// Loss and metric sums of this worker's part of an evaluation batch, summed over every
    /// worker by server 0.
    pub(crate) fn test(&mut self, batch: &Batch) -> Result<StepStats> {
        self.fetch()?;
        self.test_steps += 1;
        let sums = self
            .replica
            .evaluate(batch)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let m = Message::Test {
            step: self.test_steps,
            totals: StepTotals {
                samples: batch.len() as u64,
                sums: sums.iter().map(|&v| v as f32).collect(),
            },
        };
        let what = format!("evaluation step {}", self.test_steps);
        let replies = self.exchange(&[m], Kind::TestTotals, test_totals_of, &what)?;
        let total = replies
            .into_iter()
            .next()
            .ok_or_else(|| Error::invalid("an empty evaluation answer"))?;
        Ok(StepStats {
            samples: total.samples as usize,
            sums: total.sums.iter().map(|&v| f64::from(v)).collect(),
            applied: false,
        })
    }

    /// The model's outputs for `inputs`, on the servers' current weights.
    pub(crate) fn predict(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.fetch()?;
        self.replica
            .predict(inputs)?
            .into_iter()
            .map(|y| Ok(y.to_device(&Device::Cpu)?))
            .collect()
    }

    /// At an epoch's end (asynchronous mode): waits until every worker has ended the epoch,
    /// replaces `totals` (this worker's training steps) with the totals over every worker, and
    /// returns the staleness of the epoch's applied updates over every worker.
    pub(crate) fn end_epoch(&mut self, totals: &mut StepStats) -> Result<Vec<(String, f64)>> {
        if self.mode == Mode::Synchronous {
            return Ok(Vec::new());
        }
        self.epochs += 1;
        let sent = totals.sums.len();
        let m = Message::Epoch {
            epoch: self.epochs,
            totals: EpochTotals {
                staleness: std::mem::take(&mut self.staleness),
                samples: totals.samples as u64,
                sums: totals.sums.iter().map(|&v| v as f32).collect(),
            },
        }
        .encode(self.call);
        let what = format!("the end of epoch {}", self.epochs);
        let to: Vec<(usize, &Encoded)> = (0..self.sharding.servers()).map(|s| (s, &m)).collect();
        let replies = self.exchange_with(&to, &[0], Kind::EpochTotals, epoch_totals_of, &what)?;
        self.fresh = false;
        let Some(t) = replies.into_iter().next() else {
            return Err(Error::invalid("an empty answer to the end of an epoch"));
        };
        if t.sums.len() != sent {
            return Err(Error::Replica {
                replica: self.roles.server_label(0),
                reason: format!(
                    "answered the end of epoch {} with {} sums where {sent} were sent",
                    self.epochs,
                    t.sums.len(),
                ),
            });
        }
        totals.samples = t.samples as usize;
        totals.sums = t.sums.iter().map(|&v| f64::from(v)).collect();
        Ok(vec![
            ("staleness_mean".to_string(), t.staleness.mean()),
            ("staleness_max".to_string(), t.staleness.max as f64),
        ])
    }

    /// Every worker's `values`, in rank order, through server 0, during a call.
    pub(crate) fn all_gather(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        if !self.in_call {
            return Err(Error::invalid(
                "ParameterServerStrategy gathers values across workers only during fit, \
                 evaluate or predict",
            ));
        }
        let m = Message::Gather {
            values: values.to_vec(),
        }
        .encode(self.call);
        let what = "a gather across the workers";
        let replies = self.exchange_with(&[(0, &m)], &[0], Kind::Gathered, gathered_of, what)?;
        let all = replies.into_iter().next().unwrap_or_default();
        let roles = self.roles;
        if all.len() != values.len() * roles.workers {
            return Err(Error::Replica {
                replica: roles.server_label(0),
                reason: format!(
                    "gathered {} values from {} workers that sent {} each",
                    all.len(),
                    roles.workers,
                    values.len()
                ),
            });
        }
        Ok(all)
    }
}

/// The sums a `TestTotals` answer carries.
fn test_totals_of(message: Message) -> Option<StepTotals> {
    match message {
        Message::TestTotals(totals) => Some(totals),
        _ => None,
    }
}

/// The totals an `EpochTotals` answer carries.
fn epoch_totals_of(message: Message) -> Option<EpochTotals> {
    match message {
        Message::EpochTotals(totals) => Some(totals),
        _ => None,
    }
}

/// Every worker's values, which a `Gathered` answer carries.
fn gathered_of(message: Message) -> Option<Vec<u64>> {
    match message {
        Message::Gathered { values } => Some(values),
        _ => None,
    }
}
