//! A functional model cut into consecutive stages for a pipeline: each stage a functional
//! model of its own, of one input and one output, holding a run of the graph's layers.
//!
//! The graph's layers are in the order they were first called; a stage holds the layers from
//! its first to the next stage's first, and all of their calls. A stage may start at a layer
//! only where one tensor flows past the cut: every value the later layers take from the
//! earlier ones (or from the model's input) is that one tensor, the previous stage's output.
//! Between the blocks of a ResNet or the modules of an Inception network one tensor flows; inside
//! a residual block two do (the block's input and its branch), so no stage starts there. The
//! stages keep the layers' names, and are built in the graph's layer order, so their variables
//! are those of the whole model.

use std::collections::{BTreeSet, HashMap};

use super::graph::{Functional, GraphCall, GraphInput, Source};
use crate::{Error, Result};

impl Functional {
    /// The values that flow from the layers before layer `cut` (and the model's inputs) into
    /// the layers from `cut` on and the outputs, in order.
    fn flowing_past(&self, cut: usize) -> BTreeSet<Source> {
        let before = |source: &Source| match *source {
            Source::Input(_) => true,
            Source::Call(call, _) => self.calls()[call].layer < cut,
        };
        let later_calls = self.calls().iter().filter(|c| c.layer >= cut);
        later_calls
            .flat_map(|c| c.inputs.iter())
            .chain(self.outputs())
            .filter(|s| before(s))
            .copied()
            .collect()
    }

    /// For each layer, whether a pipeline stage may start at it: the first layer, and those
    /// past which one tensor flows, given by a layer before them.
    pub(crate) fn stage_starts_allowed(&self) -> Vec<bool> {
        (0..self.layers().len())
            .map(|cut| {
                let flowing = self.flowing_past(cut);
                cut == 0
                    || (flowing.len() == 1 && matches!(flowing.first(), Some(Source::Call(..))))
            })
            .collect()
    }

    /// The graph cut into stages starting at the layers `starts` (rising, from 0): one
    /// functional model per stage, of one input and one output. Fails, naming the layer and
    /// the values, where a stage would start at a layer past which more than one value flows,
    /// and for a model of several inputs or outputs.
    pub(crate) fn split_at(&self, starts: &[usize]) -> Result<Vec<Functional>> {
        if self.inputs().len() != 1 || self.outputs().len() != 1 {
            return Err(Error::invalid(format!(
                "a pipeline cuts a model of one input and one output into stages; this one has \
                 {} inputs and {} outputs",
                self.inputs().len(),
                self.outputs().len()
            )));
        }
        let mut stage_inputs = vec![Source::Input(0)];
        for &cut in &starts[1..] {
            let flowing = self.flowing_past(cut);
            match (flowing.len(), flowing.first()) {
                (1, Some(&source @ Source::Call(..))) => stage_inputs.push(source),
                _ => {
                    let names: Vec<String> = flowing.iter().map(|s| self.describe(*s)).collect();
                    return Err(Error::invalid(format!(
                        "a pipeline stage cannot start at `{}`: {} values flow past it ({}); \
                         start stages where one tensor flows from one layer to the next",
                        self.layers()[cut].name,
                        flowing.len(),
                        names.join(", ")
                    )));
                }
            }
        }
        let mut stage_outputs = stage_inputs[1..].to_vec();
        stage_outputs.push(self.outputs()[0]);
        (0..starts.len())
            .map(|s| {
                let end = starts.get(s + 1).copied().unwrap_or(self.layers().len());
                self.stage(s, starts[s]..end, stage_inputs[s], stage_outputs[s])
            })
            .collect()
    }

    /// The stage of `layers`, taking `input` and giving `output`.
    fn stage(
        &self,
        s: usize,
        layers: std::ops::Range<usize>,
        input: Source,
        output: Source,
    ) -> Result<Functional> {
        let mut renumbered = HashMap::new();
        let mut calls = Vec::new();
        for (i, call) in self.calls().iter().enumerate() {
            if layers.contains(&call.layer) {
                renumbered.insert(i, calls.len());
                calls.push(call.clone());
            }
        }
        let outside = |source: Source| {
            Error::invalid(format!(
                "pipeline stage {s} takes {}, which no layer of it gives",
                self.describe(source)
            ))
        };
        let remap = |source: Source| -> Result<Source> {
            if source == input {
                return Ok(Source::Input(0));
            }
            match source {
                Source::Call(i, k) => match renumbered.get(&i) {
                    Some(&j) => Ok(Source::Call(j, k)),
                    None => Err(outside(source)),
                },
                Source::Input(_) => Err(outside(source)),
            }
        };
        let calls = calls
            .into_iter()
            .map(|call| {
                Ok(GraphCall {
                    layer: call.layer - layers.start,
                    inputs: call
                        .inputs
                        .iter()
                        .map(|&x| remap(x))
                        .collect::<Result<_>>()?,
                    ..call
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let stage_input = match input {
            Source::Input(i) => self.inputs()[i].clone(),
            other => GraphInput {
                name: format!("stage_{s}_input"),
                shape: self.shape_of(other).to_vec(),
            },
        };
        Functional::from_parts(
            vec![stage_input],
            self.layers()[layers].to_vec(),
            calls,
            vec![remap(output)?],
        )
    }

    /// A value of the graph as a message names it: the model's input, or the layer giving it.
    fn describe(&self, source: Source) -> String {
        match source {
            Source::Input(i) => format!("the input `{}`", self.inputs()[i].name),
            Source::Call(call, _) => {
                format!("`{}`", self.layers()[self.calls()[call].layer].name)
            }
        }
    }
}
