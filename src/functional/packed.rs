//! A functional model of several inputs or outputs as the network of a [`Model`](crate::Model).
//!
//! Everything that carries samples (datasets, the loader, the strategies' splitting of a batch
//! over replicas and workers, sample weights) carries one input tensor and one target tensor per
//! batch. A model of several inputs therefore takes each sample's inputs laid out one after the
//! other, `(batch, total)`, and takes them apart into its inputs' shapes; it gives its outputs
//! flattened and laid out the same way, and takes their gradient apart the same way in the
//! backward pass. [`InMemoryDataset::from_parts`](crate::data::InMemoryDataset::from_parts)
//! lays out datasets so, and [`Model::predict_outputs`](crate::Model::predict_outputs) hands
//! back one tensor per output.

use candle_core::Tensor;

use super::graph::Functional;
use super::net::GraphNet;
use crate::error::shape_with_batch;
use crate::layers::{
    missing_input_grad, BuildContext, Built, FastPath, Layer, LayerSpec, ParamGrads, Recorded,
};
use crate::{Error, Result};

/// Values per sample of each shape, and their sum.
pub(crate) fn sizes(shapes: &[Vec<usize>]) -> (Vec<usize>, usize) {
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let total = sizes.iter().sum();
    (sizes, total)
}

/// Values per sample of tensors of `shapes` laid out one after the other.
pub(crate) fn packed_size(shapes: &[Vec<usize>]) -> usize {
    sizes(shapes).1
}

/// `(batch, total)` taken apart into `(batch, shape...)` tensors, one per shape.
pub(crate) fn unpack(x: &Tensor, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    let batch = x.dim(0)?;
    let mut offset = 0;
    let mut parts = Vec::with_capacity(shapes.len());
    for shape in shapes {
        let size: usize = shape.iter().product();
        let mut dims = vec![batch];
        dims.extend(shape);
        parts.push(x.narrow(1, offset, size)?.contiguous()?.reshape(dims)?);
        offset += size;
    }
    Ok(parts)
}

/// Tensors `(batch, ...)` flattened and laid out one after the other: `(batch, total)`.
pub(crate) fn pack(parts: &[Tensor]) -> Result<Tensor> {
    let flat = parts
        .iter()
        .map(|p| p.flatten_from(1))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&flat, 1)?)
}

/// The recipe: a functional model taking its inputs laid out in one tensor and giving its
/// outputs laid out in one tensor.
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    graph: Functional,
}

impl Packed {
    pub(crate) fn new(graph: Functional) -> Self {
        Self { graph }
    }

    /// Values per sample of the inputs laid out.
    pub(crate) fn input_size(&self) -> usize {
        sizes(&self.graph.input_shapes()).1
    }
}

impl LayerSpec for Packed {
    fn kind(&self) -> &'static str {
        "functional"
    }

    fn class_name(&self) -> &'static str {
        "Functional"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let inputs = self.graph.input_shapes();
        let outputs = self.graph.output_shapes();
        let (_, total) = sizes(&inputs);
        if input_shape != [total] {
            let each: Vec<String> = self
                .graph
                .input_names()
                .iter()
                .zip(&inputs)
                .map(|(name, shape)| format!("`{name}` {}", shape_with_batch(shape)))
                .collect();
            return Err(Error::Shape {
                layer: "model".into(),
                expected: format!(
                    "{} (the inputs {} laid out one after the other)",
                    shape_with_batch(&[total]),
                    each.join(", ")
                ),
                got: shape_with_batch(input_shape),
            });
        }
        let (net, rows) = self.graph.build_graph(ctx, &inputs)?;
        let output_size = sizes(&outputs).1;
        let layer = PackedNet {
            net,
            inputs,
            outputs,
        };
        Ok(Built::fast(layer, vec![output_size], rows))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }

    fn name(&self) -> Option<&str> {
        self.graph.name()
    }
}

/// The built model, taking and giving laid-out tensors.
struct PackedNet {
    net: GraphNet,
    inputs: Vec<Vec<usize>>,
    outputs: Vec<Vec<usize>>,
}

impl Layer for PackedNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let (outputs, _) = self.net.run(&unpack(x, &self.inputs)?, train, false)?;
        pack(&outputs)
    }
}

impl FastPath for PackedNet {
    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
        let (outputs, _, backward) = self.net.record(&unpack(x, &self.inputs)?, false, true)?;
        let shapes = self.outputs.clone();
        Ok(Recorded::new(
            pack(&outputs)?,
            move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                let dxs = backward.backward(unpack(&dy, &shapes)?, grads, input_grad)?;
                if !input_grad {
                    return Ok(None);
                }
                let dxs = dxs
                    .into_iter()
                    .map(|d| d.ok_or_else(|| missing_input_grad("model")))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Some(pack(&dxs)?))
            },
        ))
    }

    fn forward_recorded_with_logits(&self, x: &Tensor) -> Result<Recorded> {
        self.forward_recorded(x)
    }
}
