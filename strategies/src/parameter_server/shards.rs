//! `Sharding`: which variables each parameter server holds, and how a worker's step buffer and
//! a server's weights message are cut and laid out for each server.
//!
//! Every variable of the model but the dropout generators' positions (each worker keeps its
//! own masks going) lives whole on one server, placed by [`partition`](crate::partition::partition). A
//! server's part of a step is a step buffer of its own ([`StepLayout`]): the gradients of its
//! trainable variables, the step's loss and metric sums and sample count (every server gets
//! them, so all decide alike whether a step applies), and its moving statistics times the
//! sample count. Its weights message is its variables fused in store order.

use std::ops::Range;

use kandle::params::ParamStore;
use kandle::strategy::fused::FusedLayout;
use kandle::strategy::step::StepLayout;
use kandle::Result;

use crate::partition::partition;

/// The placement of a model's variables on the servers, computed alike on every rank.
#[derive(Debug, Clone)]
pub(crate) struct Sharding {
    /// For each server, the store indices of its variables, in store order.
    pub(crate) vars: Vec<Vec<usize>>,
    /// For each server, the ranges of a worker's whole step buffer that make its part, in
    /// order.
    pub(crate) push_ranges: Vec<Vec<Range<usize>>>,
    /// For each server, the layout of its part of a step.
    pub(crate) layouts: Vec<StepLayout>,
    /// For each server, the layout of its weights message.
    pub(crate) weights: Vec<FusedLayout>,
    /// A digest of the model's variables (names, shapes, roles) and step layout, equal on
    /// every rank that built the same model.
    pub(crate) signature: u64,
}

impl Sharding {
    /// The placement of `store`'s variables (a replica's, whose step buffers are laid out by
    /// `layout`) on `servers` servers.
    pub(crate) fn new(store: &ParamStore, layout: &StepLayout, servers: usize) -> Result<Self> {
        let params: Vec<_> = store.iter().collect();
        let sharded: Vec<usize> = (0..params.len())
            .filter(|&i| !params[i].generator)
            .collect();
        let sizes: Vec<usize> = sharded
            .iter()
            .map(|&i| params[i].var.elem_count())
            .collect();
        let placed = partition(&sizes, servers)?;
        let mut server_of = vec![None; params.len()];
        for (&i, &s) in sharded.iter().zip(&placed) {
            server_of[i] = Some(s);
        }
        let mut vars = vec![Vec::new(); servers];
        let mut grads: Vec<Vec<Range<usize>>> = vec![Vec::new(); servers];
        let mut stats: Vec<Vec<Range<usize>>> = vec![Vec::new(); servers];
        let mut grad_shapes = vec![Vec::new(); servers];
        let mut stat_shapes = vec![Vec::new(); servers];
        let mut weight_shapes = vec![Vec::new(); servers];
        let (mut grad_at, mut stat_at) = (0, layout.statistics_offset());
        let mut signature = Fnv::new();
        signature.add(&format!("{} sums", layout.num_stats));
        for (i, p) in params.iter().enumerate() {
            let n = p.var.elem_count();
            signature.add(&format!(
                "{} {:?} {} {} {}",
                p.name,
                p.var.dims(),
                p.trainable,
                p.statistic,
                p.generator
            ));
            let server = server_of[i];
            if p.trainable {
                if let Some(s) = server {
                    grads[s].push(grad_at..grad_at + n);
                    grad_shapes[s].push(p.var.shape().clone());
                }
                grad_at += n;
            }
            if p.statistic {
                if let Some(s) = server {
                    stats[s].push(stat_at..stat_at + n);
                    stat_shapes[s].push(p.var.shape().clone());
                }
                stat_at += n;
            }
            if let Some(s) = server {
                vars[s].push(i);
                weight_shapes[s].push(p.var.shape().clone());
            }
        }
        let sums = layout.stats_offset()..layout.statistics_offset();
        let push_ranges = (0..servers)
            .map(|s| {
                let mut r = grads[s].clone();
                r.push(sums.clone());
                r.extend(stats[s].iter().cloned());
                r
            })
            .collect();
        let layouts = (0..servers)
            .map(|s| StepLayout {
                grads: FusedLayout::from_shapes(grad_shapes[s].clone()),
                num_stats: layout.num_stats,
                statistics: FusedLayout::from_shapes(stat_shapes[s].clone()),
            })
            .collect();
        let weights = weight_shapes
            .into_iter()
            .map(FusedLayout::from_shapes)
            .collect();
        Ok(Self {
            vars,
            push_ranges,
            layouts,
            weights,
            signature: signature.0,
        })
    }

    /// Number of servers.
    pub(crate) fn servers(&self) -> usize {
        self.vars.len()
    }

    /// Server `server`'s part of a worker's whole step buffer `full`, appended to `out`.
    pub(crate) fn cut(&self, server: usize, full: &[f32], out: &mut Vec<f32>) {
        for r in &self.push_ranges[server] {
            out.extend_from_slice(&full[r.clone()]);
        }
    }
}

/// FNV-1a, 64 bits: a digest that is the same in every process (std's hasher is seeded).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn add(&mut self, text: &str) {
        for b in text.bytes().chain(std::iter::once(0)) {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kandle::prelude::*;
    use kandle::strategy::{ModelSpec, Replica};

    fn replica() -> Result<Replica> {
        let spec = ModelSpec {
            network: Sequential::new()
                .add(Dense::new(4))
                .add(BatchNormalization::new())
                .add(Dense::new(3))
                .into(),
            input_shapes: vec![vec![5]],
            optimizer: Box::new(Sgd::new(0.1)),
            loss: kandle::Objective::new(MeanSquaredError),
            metrics: Metrics::default(),
            seed: 0,
            compute_path: kandle::ComputePath::default(),
            dtype_policy: kandle::DTypePolicy::default(),
        };
        Replica::new(&spec, &candle_core::Device::Cpu)
    }

    /// Cutting a whole step buffer for each server gives buffers laid out as each server's
    /// layout says, and every value of the whole buffer's gradients and statistics lands on
    /// exactly one server.
    #[test]
    fn every_value_goes_to_one_server() -> Result<()> {
        let r = replica()?;
        let layout = r.layout();
        let full: Vec<f32> = (0..layout.len()).map(|i| i as f32).collect();
        for servers in 1..=3 {
            let sharding = Sharding::new(r.store(), layout, servers)?;
            let mut seen = Vec::new();
            for s in 0..servers {
                let mut part = Vec::new();
                sharding.cut(s, &full, &mut part);
                assert_eq!(part.len(), sharding.layouts[s].len());
                let l = &sharding.layouts[s];
                seen.extend_from_slice(&part[..l.grads.len()]);
                seen.extend_from_slice(&part[l.statistics_offset()..]);
                // The sums and sample count go to every server.
                assert_eq!(
                    part[l.stats_offset()..l.statistics_offset()],
                    full[layout.stats_offset()..layout.statistics_offset()]
                );
            }
            seen.sort_by(f32::total_cmp);
            let mut want: Vec<f32> = full[..layout.grads.len()].to_vec();
            want.extend_from_slice(&full[layout.statistics_offset()..]);
            assert_eq!(seen, want, "{servers} servers");
            let held: usize = sharding.weights.iter().map(FusedLayout::len).sum();
            let all: usize = r.store().iter().map(|p| p.var.elem_count()).sum();
            assert_eq!(held, all);
        }
        Ok(())
    }
}
