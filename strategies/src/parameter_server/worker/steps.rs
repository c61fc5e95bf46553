//! A worker's training steps: the push of its part of each step to every server, the pull of
//! the weights it trains on, and gradient accumulation.

use candle_core::{Device, Tensor};

use kandle::data::Batch;
use kandle::strategy::StepStats;
use kandle::{Error, Result};

use super::{weights_of, Worker};
use crate::parameter_server::protocol::{Kind, Message};
use crate::parameter_server::server::Mode;

impl Worker {
    /// One training step on this worker's part of the global batch.
    pub(crate) fn train(&mut self, batch: &Batch, lr: f64) -> Result<StepStats> {
        self.steps += 1;
        if !self.fresh {
            let _pull = kandle::timeline::span("pull");
            self.pull(Message::Pull, "a pull of the weights")?;
            self.fresh = true;
        }
        let buffer = self.replica.step_buffer(batch)?;
        let push = kandle::timeline::span("push and pull");
        copy_to_host(&buffer.fused, &mut self.host)?;
        let finite = self.host.iter().all(|v| v.is_finite());
        let messages: Vec<Message> = (0..self.sharding.servers())
            .map(|s| {
                let mut buffer = Vec::with_capacity(self.sharding.layouts[s].len());
                self.sharding.cut(s, &self.host, &mut buffer);
                if !finite {
                    // Every server then reads a non-finite step and leaves it out.
                    if let Some(loss) = buffer.get_mut(self.sharding.layouts[s].stats_offset()) {
                        *loss = f32::NAN;
                    }
                }
                Message::Push {
                    base: self.base[s],
                    step: self.steps,
                    lr,
                    buffer,
                }
            })
            .collect();
        let what = format!("the push of step {}", self.steps);
        let replies = self.exchange(&messages, Kind::Weights, weights_of, &what)?;
        self.load(&replies)?;
        drop(push);
        self.fetched = false;
        let Some(first) = replies.first() else {
            return Err(Error::invalid(
                "a parameter-server step without a server (internal error)",
            ));
        };
        let applied = first.staleness.is_some();
        if applied {
            let stale = replies.iter().filter_map(|r| r.staleness).max();
            self.staleness.record(stale.unwrap_or(0));
        }
        // Mixed precision's loss scale, which each worker keeps: synchronous workers all see
        // whether the step applied; an asynchronous push applies alone, and its own
        // finite-ness decides.
        let step_finite = match self.mode {
            Mode::Synchronous => applied,
            _ => finite,
        };
        self.replica
            .update_loss_scale(&kandle::strategy::step::StepTotals {
                sums: Vec::new(),
                samples: first.samples as usize,
                finite: step_finite,
            })?;
        Ok(StepStats {
            samples: first.samples as usize,
            sums: first.sums.iter().map(|&v| f64::from(v)).collect(),
            applied,
        })
    }

    /// Gradient accumulation: this worker's part of a micro-batch, computed on the weights of
    /// the step it belongs to and kept for the next push ([`Replica::accumulate`]); nothing is
    /// sent. Returns this worker's sample count and sums.
    pub(crate) fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        if !self.fresh {
            self.pull(Message::Pull, "a pull of the weights")?;
            self.fresh = true;
        }
        let (samples, sums) = self.replica.accumulate(batch)?;
        Ok(StepStats {
            samples,
            sums,
            applied: false,
        })
    }
}

/// Copies a 1-D `f32` CPU tensor into `out` (cleared first).
fn copy_to_host(t: &Tensor, out: &mut Vec<f32>) -> Result<()> {
    let t = t.to_device(&Device::Cpu)?.contiguous()?;
    out.clear();
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(values)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            out.extend_from_slice(&values[a..b]);
            return Ok(());
        }
    }
    out.extend(t.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}
