//! Merge layers: several tensors of a functional model made into one, as Keras's `Add`,
//! `Subtract`, `Multiply`, `Average` and `Concatenate` layers: how each merges and what shapes
//! it takes, and the built merges a graph runs. Calling one on symbolic tensors (and the
//! functional forms `add`, `subtract`, ...) is `symbolic`'s; this module takes nothing from the
//! rest of the functional API.
//!
//! Their backward passes hand each input its share of the output gradient without copying
//! where the share is the gradient itself (a sum hands every input the same tensor, so an
//! identity shortcut passes it on as it is); a ReLU after a sum or an average is absorbed into
//! it, with one gradient mask for both. Concatenation joins and cuts two `f32` CPU parts with
//! kandle's channel kernels, as [`Concat`](crate::layers::Concat) does.

use candle_core::Tensor;

use crate::error::shape_with_batch;
use crate::layers::{channel_part, join_channels, relu, ReluRecord};
use crate::{Error, Result};

/// How a merge combines its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeKind {
    /// The sum of the inputs, which share one shape.
    Add,
    /// The first input minus the second (exactly two, of one shape).
    Subtract,
    /// The element-wise product of the inputs, which share one shape.
    Multiply,
    /// The mean of the inputs, which share one shape.
    Average,
    /// The inputs joined along channels (the first axis after the batch's); every other axis
    /// must agree.
    Concatenate,
}

/// A merge layer: a [`MergeKind`] with an optional name, called on several symbolic tensors.
///
/// ```
/// use kandle::functional::{Input, Merge, MergeKind, LayerCall};
///
/// let a = Input::new(&[4, 8, 8]).tensor();
/// let b = Input::new(&[6, 8, 8]).tensor();
/// let joined = Merge::new(MergeKind::Concatenate).named("joined").call(&[&a, &b])?;
/// assert_eq!(joined.shape(), [10, 8, 8]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Merge {
    kind: MergeKind,
    name: Option<String>,
}

impl Merge {
    /// A merge of `kind`.
    pub fn new(kind: MergeKind) -> Self {
        Self { kind, name: None }
    }

    /// Names the layer (the default is the kind numbered in the model: `add_1`, ...).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How it merges.
    pub fn kind_of_merge(&self) -> MergeKind {
        self.kind
    }

    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The kind that automatic names are made of.
    pub(crate) fn kind(&self) -> &'static str {
        match self.kind {
            MergeKind::Add => "add",
            MergeKind::Subtract => "subtract",
            MergeKind::Multiply => "multiply",
            MergeKind::Average => "average",
            MergeKind::Concatenate => "concatenate",
        }
    }

    /// The class name the summary prints.
    pub(crate) fn class_name(&self) -> &'static str {
        match self.kind {
            MergeKind::Add => "Add",
            MergeKind::Subtract => "Subtract",
            MergeKind::Multiply => "Multiply",
            MergeKind::Average => "Average",
            MergeKind::Concatenate => "Concatenate",
        }
    }

    /// The output shape for inputs `parts` (each described for errors, with its shape), or
    /// an error naming `layer` and the two shapes that do not merge.
    pub(crate) fn output_shape(
        &self,
        layer: &str,
        parts: &[(String, &[usize])],
    ) -> Result<Vec<usize>> {
        let Some((first_name, first)) = parts.first() else {
            return Err(Error::invalid(format!(
                "merge layer `{layer}` has no inputs"
            )));
        };
        if self.kind == MergeKind::Subtract && parts.len() != 2 {
            return Err(Error::invalid(format!(
                "layer `{layer}` (Subtract) takes exactly two inputs, not {}",
                parts.len()
            )));
        }
        let mut output = first.to_vec();
        for (name, shape) in &parts[1..] {
            let merges = match self.kind {
                MergeKind::Concatenate => {
                    !shape.is_empty() && shape.len() == first.len() && shape[1..] == first[1..]
                }
                _ => shape == first,
            };
            if !merges {
                let rule = match self.kind {
                    MergeKind::Concatenate => "agree on every axis but channels",
                    _ => "have one shape",
                };
                return Err(Error::invalid(format!(
                    "layer `{layer}` ({}): input {first_name} gives {} and input {name} gives \
                     {}, which do not merge (its inputs must {rule})",
                    self.class_name(),
                    shape_with_batch(first),
                    shape_with_batch(shape),
                )));
            }
            if self.kind == MergeKind::Concatenate {
                output[0] += shape[0];
            }
        }
        Ok(output)
    }
}

/// A built merge: what the graph runs.
pub(crate) struct MergeLayer {
    kind: MergeKind,
    /// Whether the ReLU after it is applied here (sums and averages absorb one).
    relu: bool,
    /// Each input's channels (for concatenation).
    channels: Vec<usize>,
    /// Whether kandle's channel kernels may join and cut `f32` CPU parts.
    kernels: bool,
}

/// A recorded merge's backward pass: each input's gradient from the output's.
pub(crate) struct MergeBackward {
    kind: MergeKind,
    /// The ReLU's mask, when one was absorbed.
    relu: Option<ReluRecord>,
    /// The inputs (for a product's gradient).
    inputs: Vec<Tensor>,
    channels: Vec<usize>,
    kernels: bool,
}

impl MergeLayer {
    pub(crate) fn new(merge: &Merge, input_shapes: &[Vec<usize>], kernels: bool) -> Self {
        Self {
            kind: merge.kind,
            relu: false,
            channels: input_shapes
                .iter()
                .map(|s| s.first().copied().unwrap_or(1))
                .collect(),
            kernels,
        }
    }

    /// For a concatenation whose inputs' producers may write straight into its output (in
    /// inference, on the CPU): where input `i`'s channels start, and how many it has.
    pub(crate) fn channel_slot(&self, i: usize) -> Option<(usize, usize)> {
        if self.kind != MergeKind::Concatenate || !self.kernels {
            return None;
        }
        let offset = self.channels[..i].iter().sum();
        Some((offset, self.channels[i]))
    }

    /// Applies `max(y, 0)` to the output from now on, where the merge can (a sum or an
    /// average); returns whether it will.
    pub(crate) fn fuse_relu(&mut self) -> bool {
        self.relu = matches!(self.kind, MergeKind::Add | MergeKind::Average);
        self.relu
    }

    /// The merge of `xs`, before an absorbed ReLU.
    fn combine(&self, xs: &[Tensor]) -> Result<Tensor> {
        let (first, rest) = xs
            .split_first()
            .ok_or_else(|| Error::invalid("a merge of no tensors"))?;
        Ok(match self.kind {
            MergeKind::Add => rest.iter().try_fold(first.clone(), |acc, x| acc.add(x))?,
            MergeKind::Subtract => first.sub(&rest[0])?,
            MergeKind::Multiply => rest.iter().try_fold(first.clone(), |acc, x| acc.mul(x))?,
            MergeKind::Average => {
                let sum = rest.iter().try_fold(first.clone(), |acc, x| acc.add(x))?;
                (sum / xs.len() as f64)?
            }
            MergeKind::Concatenate => join_channels(xs, self.kernels)?,
        })
    }

    /// The output for `xs`.
    pub(crate) fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        let y = self.combine(xs)?;
        Ok(if self.relu {
            relu(&y, self.kernels)?
        } else {
            y
        })
    }

    /// The output for `xs` and its backward pass.
    pub(crate) fn record(&self, xs: &[Tensor]) -> Result<(Tensor, MergeBackward)> {
        let y = self.combine(xs)?;
        let (y, relu) = match self.relu {
            true => ReluRecord::relu(&y, self.kernels).map(|(y, r)| (y, Some(r)))?,
            false => (y, None),
        };
        let inputs = match self.kind {
            MergeKind::Multiply => xs.to_vec(),
            _ => Vec::new(),
        };
        let backward = MergeBackward {
            kind: self.kind,
            relu,
            inputs,
            channels: self.channels.clone(),
            kernels: self.kernels,
        };
        Ok((y, backward))
    }
}

impl MergeBackward {
    /// Each input's gradient, from the output's `dy`: for a concatenation, input `i`'s channels
    /// of it, a view when `views(i)` (its producer reads such a range in place), a copy
    /// otherwise.
    pub(crate) fn backward(self, dy: Tensor, views: impl Fn(usize) -> bool) -> Result<Vec<Tensor>> {
        let dy = match &self.relu {
            Some(relu) => relu.backward(&dy)?,
            None => dy,
        };
        let n = self.channels.len();
        Ok(match self.kind {
            MergeKind::Add => vec![dy; n],
            MergeKind::Subtract => vec![dy.clone(), dy.neg()?],
            MergeKind::Average => vec![(dy / n as f64)?; n],
            MergeKind::Multiply => (0..n)
                .map(|i| {
                    self.inputs
                        .iter()
                        .enumerate()
                        .filter(|&(j, _)| j != i)
                        .try_fold(dy.clone(), |acc, (_, x)| acc.mul(x))
                })
                .collect::<candle_core::Result<_>>()?,
            MergeKind::Concatenate => {
                let mut offset = 0;
                let mut parts = Vec::with_capacity(n);
                for (i, &channels) in self.channels.iter().enumerate() {
                    parts.push(match views(i) {
                        true => dy.narrow(1, offset, channels)?,
                        false => channel_part(&dy, offset, channels, self.kernels)?,
                    });
                    offset += channels;
                }
                parts
            }
        })
    }
}
