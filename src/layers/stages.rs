//! A [`Sequential`] cut into consecutive stages, each built on a device of its own: the parts
//! of a pipeline (model parallelism).
//!
//! The stages are built from the one recipe in one pass, drawing initial values from the one
//! seeded generator and naming every layer as the whole stack does, so their variables are,
//! name for name and value for value, those of the stack built on one device. Each stage is a
//! chain of its layers ([`SequentialNet::chain`]): a ReLU still merges into the layer before
//! it inside a stage, not across a cut, which changes no value.

use candle_core::Device;

use super::{build_child, BuildContext, Sequential, SequentialNet, SummaryRow};
use crate::params::ParamStore;
use crate::{Error, Result};

/// Where a stage begins and the device it lives on.
#[derive(Debug, Clone)]
pub struct StagePlacement {
    /// The index of the stage's first top-level layer.
    pub first_layer: usize,
    /// The device holding the stage's variables and running its layers.
    pub device: Device,
}

/// One built stage of a [`Sequential`].
pub(crate) struct BuiltStage {
    /// The stage's layers as a chain.
    pub(crate) net: SequentialNet,
    /// The stage's variables, with the names they have in the whole stack.
    pub(crate) store: ParamStore,
    /// The summary rows of the stage's layers.
    pub(crate) rows: Vec<SummaryRow>,
}

impl Sequential {
    /// Builds the stack in `ctx` (at the top level) for inputs of `input_shape`, cut before
    /// each placement's first layer, each stage on its placement's device. The first
    /// placement must start at layer 0 and the starts must rise.
    pub(crate) fn build_stages(
        &self,
        mut ctx: BuildContext,
        input_shape: &[usize],
        placements: &[StagePlacement],
    ) -> Result<Vec<BuiltStage>> {
        check_starts(placements, self.len())?;
        let mut stages = Vec::with_capacity(placements.len());
        let mut shape = input_shape.to_vec();
        for (s, placement) in placements.iter().enumerate() {
            let end = placements.get(s + 1).map_or(self.len(), |p| p.first_layer);
            ctx.move_to(&placement.device);
            let stage_input = shape.clone();
            let (mut layers, mut trains, mut rows) = (Vec::new(), Vec::new(), Vec::new());
            for (spec, name) in self
                .named_specs()
                .skip(placement.first_layer)
                .take(end - placement.first_layer)
            {
                let child = build_child(&mut ctx, spec, &name, &shape)?;
                shape = child.output_shape;
                rows.push(child.row);
                trains.push(child.trains);
                layers.push((name, child.layer));
            }
            let path = format!("model (stage {s})");
            stages.push(BuiltStage {
                net: SequentialNet::chain(path, stage_input, shape.clone(), layers, trains),
                store: ctx.take_store(),
                rows,
            });
        }
        Ok(stages)
    }
}

/// Checks that the stages cut a model of `layers` top-level layers into non-empty consecutive
/// runs.
pub(crate) fn check_starts(placements: &[StagePlacement], layers: usize) -> Result<()> {
    let starts: Vec<usize> = placements.iter().map(|p| p.first_layer).collect();
    if placements.len() > layers {
        return Err(Error::invalid(format!(
            "a pipeline of {} stages needs at least as many layers, and the model has {layers}",
            placements.len()
        )));
    }
    let rising = starts.windows(2).all(|w| w[0] < w[1]);
    if starts.first() != Some(&0) || !rising || starts.last().is_some_and(|&l| l >= layers) {
        return Err(Error::invalid(format!(
            "stages must start at layer 0 and at rising layer indices below {layers}; got \
             {starts:?}"
        )));
    }
    Ok(())
}
