//! `Sequential`: a stack of layers, each feeding the next. It is the model recipe users build,
//! and also a layer, so stacks nest (an inception branch is a `Sequential` inside a `Concat`).
//!
//! When built, a layer followed by a ReLU may absorb it ([`FastPath::fuse_relu`]): BatchNorm then
//! Relu runs as one fused kernel. In inference, a convolution folds the BatchNorm (and ReLU)
//! after it into its own output (see [`super::fold`]). Names, variables and the summary are
//! those of the recipe.

use candle_core::{Device, Tensor};

use super::{
    build_child, check_input, child_names, missing_input_grad, run_layers, run_layers_into,
    run_layers_into_part, Backward, BuildContext, Built, ChannelAffine, ChannelPart, ChannelSlot,
    FastPath, Identity, Layer, LayerSpec, ParamGrads, Pass, RecordRequest, Recorded, Summary,
    SummaryRow,
};
use crate::params::ParamStore;
use crate::Result;

/// A stack of layer recipes.
#[derive(Debug, Clone, Default)]
pub struct Sequential {
    layers: Vec<Box<dyn LayerSpec>>,
    input_shape: Option<Vec<usize>>,
}

impl Sequential {
    /// An empty stack.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a layer (builder style), as Keras's `model.add`.
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl LayerSpec) -> Self {
        self.push(layer);
        self
    }

    /// Appends a layer.
    pub fn push(&mut self, layer: impl LayerSpec) {
        self.layers.push(Box::new(layer));
    }

    /// Declares the input shape (without the batch dimension), like `keras.Input(shape)`, so
    /// the model can be built before it sees data.
    pub fn input_shape(mut self, shape: &[usize]) -> Self {
        self.input_shape = Some(shape.to_vec());
        self
    }

    /// The declared input shape, if any.
    pub fn declared_input_shape(&self) -> Option<&[usize]> {
        self.input_shape.as_deref()
    }

    /// Number of layers in the stack (not counting nested ones).
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the stack is empty.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layer recipes, in order, with the names they get when built (a recipe's own, or
    /// its kind numbered: `conv2d_2`).
    pub(crate) fn named_specs(&self) -> impl Iterator<Item = (&dyn LayerSpec, String)> {
        self.layers
            .iter()
            .map(|l| l.as_ref())
            .zip(child_names(&self.layers))
    }

    /// Builds the stack as a whole network on `device`, with variables initialised from `seed`.
    pub fn build_network(
        &self,
        device: &Device,
        input_shape: &[usize],
        seed: u64,
    ) -> Result<(SequentialNet, ParamStore, Summary)> {
        self.build_in(BuildContext::new(device, seed), input_shape)
    }

    /// Builds the stack as a whole network in a prepared context (for example one that
    /// synchronises batch statistics across replicas).
    pub fn build_in(
        &self,
        mut ctx: BuildContext,
        input_shape: &[usize],
    ) -> Result<(SequentialNet, ParamStore, Summary)> {
        let built = self.build_layers(&mut ctx, input_shape)?;
        let store = ctx.into_store();
        let (trainable, non_trainable) = store.count("");
        let summary = Summary {
            inputs: vec![("input".into(), input_shape.to_vec())],
            rows: built.children,
            trainable,
            non_trainable,
            stages: Vec::new(),
        };
        Ok((built.net, store, summary))
    }

    /// The layer table for inputs of `input_shape`, built on the CPU.
    pub fn summary(&self, input_shape: &[usize]) -> Result<Summary> {
        Ok(self.build_network(&Device::Cpu, input_shape, 0)?.2)
    }

    fn build_layers(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<BuiltStack> {
        let path = if ctx.path().is_empty() {
            "model".to_string()
        } else {
            ctx.path()
        };
        if self.layers.is_empty() {
            return Err(crate::Error::invalid(format!("`{path}` has no layers")));
        }
        let mut shape = input_shape.to_vec();
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut trains = Vec::with_capacity(self.layers.len());
        let mut rows = Vec::with_capacity(self.layers.len());
        for (spec, name) in self.layers.iter().zip(child_names(&self.layers)) {
            let child = build_child(ctx, spec.as_ref(), &name, &shape)?;
            let full = if ctx.path().is_empty() {
                name
            } else {
                format!("{}.{name}", ctx.path())
            };
            rows.push(child.row);
            shape = child.output_shape;
            trains.push(child.trains);
            layers.push((full, child.layer));
        }
        absorb_relus(&mut layers);
        Ok(BuiltStack {
            net: SequentialNet {
                path,
                input_shape: input_shape.to_vec(),
                output_shape: shape,
                layers,
                trains,
            },
            children: rows,
        })
    }
}

/// Lets each layer absorb the ReLU that follows it, when it can compute both in one pass
/// (BatchNorm does). The ReLU keeps its place and name in the stack but passes its input on.
fn absorb_relus(layers: &mut [(String, Box<dyn FastPath>)]) {
    for i in 1..layers.len() {
        let (before, after) = layers.split_at_mut(i);
        if after[0].1.is_relu() && before[i - 1].1.fuse_relu() {
            after[0].1 = Box::new(Identity);
        }
    }
}

struct BuiltStack {
    net: SequentialNet,
    children: Vec<SummaryRow>,
}

impl LayerSpec for Sequential {
    fn kind(&self) -> &'static str {
        "sequential"
    }

    fn class_name(&self) -> &'static str {
        "Sequential"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let stack = self.build_layers(ctx, input_shape)?;
        Ok(Built {
            output_shape: stack.net.output_shape.clone(),
            layer: Box::new(stack.net),
            children: stack.children,
        })
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

/// A built [`Sequential`]: its layers, in order, with their full names.
pub struct SequentialNet {
    path: String,
    input_shape: Vec<usize>,
    output_shape: Vec<usize>,
    layers: Vec<(String, Box<dyn FastPath>)>,
    /// Whether each layer has a trainable variable.
    trains: Vec<bool>,
}

impl SequentialNet {
    /// Built layers run one after the other, under `path` (for errors), each letting the
    /// layer before it absorb it where it is a ReLU: a chain of a functional model. `trains`
    /// says which layers have a trainable variable.
    pub(crate) fn chain(
        path: String,
        input_shape: Vec<usize>,
        output_shape: Vec<usize>,
        mut layers: Vec<(String, Box<dyn FastPath>)>,
        trains: Vec<bool>,
    ) -> Self {
        absorb_relus(&mut layers);
        Self {
            path,
            input_shape,
            output_shape,
            layers,
            trains,
        }
    }

    /// The name errors give it.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The shape it was built for, without the batch dimension.
    pub fn input_shape(&self) -> &[usize] {
        &self.input_shape
    }

    /// The output shape, without the batch dimension.
    pub fn output_shape(&self) -> &[usize] {
        &self.output_shape
    }

    /// The full names of the layers, in order.
    #[cfg(test)]
    pub(crate) fn layer_names(&self) -> impl Iterator<Item = &str> {
        self.layers.iter().map(|(n, _)| n.as_str())
    }

    /// Which layers hand their input on unchanged in inference (a ReLU the layer before absorbed
    /// does), in order.
    #[cfg(test)]
    pub(crate) fn passing_through(&self) -> Vec<bool> {
        self.layers
            .iter()
            .map(|(_, l)| l.passes_through())
            .collect()
    }

    /// The recorded forward pass through every layer, as `request` asks (see
    /// [`FastPath::forward_recorded`]): with its logits, the last layer may give logits;
    /// without its input's gradient, the layers below the lowest that trains run unrecorded.
    /// `into` is a range of a concatenation's output for the stack's output: the last layer that
    /// can change its input writes there ([`FastPath::forward_recorded_into`]), and if a layer
    /// after it changes the output after all (a dropout in training), that output is copied
    /// there.
    fn record(
        &self,
        x: &Tensor,
        request: RecordRequest,
        into: Option<&ChannelPart<'_>>,
    ) -> Result<Recorded> {
        check_input(&self.path, x, &self.input_shape)?;
        let RecordRequest {
            logits: with_logits,
            input_grad,
        } = request;
        let last = self.layers.len().saturating_sub(1);
        let first = match input_grad {
            true => 0,
            false => {
                let lowest = self.trains.iter().position(|&t| t);
                // The last layer still gives its logits when nothing trains.
                lowest.unwrap_or(if with_logits { last } else { self.layers.len() })
            }
        };
        // No gradient goes through the layers below `first`: frozen ones fold as in inference.
        let mut h = run_layers(&self.layers[..first], x, Pass::FrozenTraining)?;
        let mut logits = None;
        let mut steps = Vec::with_capacity(self.layers.len() - first);
        let writer = into.and_then(|_| self.layers.iter().rposition(|(_, l)| !l.passes_through()));
        let mut written = None;
        for (i, (name, layer)) in self.layers.iter().enumerate().skip(first) {
            let request = RecordRequest {
                logits: with_logits && i == last,
                input_grad: input_grad || i != first,
            };
            let recorded = match into.filter(|_| writer == Some(i)) {
                Some(part) => {
                    let recorded = layer.forward_recorded_into(&h, part)?;
                    written = Some(recorded.output.id());
                    recorded
                }
                None => layer.forward_recorded(&h, request)?,
            };
            h = recorded.output;
            logits = recorded.logits;
            steps.push((name.clone(), recorded.backward));
        }
        if let Some(part) = into.filter(|_| written != Some(h.id())) {
            h = part.write(&h)?;
        }
        Ok(Recorded {
            output: h,
            logits,
            backward: Box::new(StackBackward {
                steps,
                input_grad: input_grad.then_some(()).ok_or_else(|| self.path.clone()),
            }),
        })
    }
}

/// A layer's full name and its recorded backward pass.
type Step = (String, Box<dyn Backward>);

/// The recorded backward pass of a stack: each layer's, last first.
struct StackBackward {
    steps: Vec<Step>,
    /// Whether it gives the input's gradient; recorded without, the stack's name.
    input_grad: std::result::Result<(), String>,
}

impl StackBackward {
    /// An error unless the stack was recorded to give its input's gradient.
    fn check_input_grad(&self) -> Result<()> {
        match &self.input_grad {
            Ok(()) => Ok(()),
            Err(path) => Err(crate::Error::invalid(format!(
                "`{path}` was recorded without its input's gradient, which its backward pass \
                 was then asked for"
            ))),
        }
    }
}

impl StackBackward {
    /// Every layer's backward pass but the first's, last first: the gradient of the first
    /// layer's output, with that layer's name and backward pass.
    fn down_to_first(
        mut self,
        dy: Tensor,
        grads: &mut ParamGrads,
    ) -> Result<Option<(Tensor, Step)>> {
        let mut grad = dy;
        while self.steps.len() > 1 {
            let Some((name, step)) = self.steps.pop() else {
                break;
            };
            grad = step
                .backward(grad, grads, true)?
                .ok_or_else(|| missing_input_grad(&name))?;
        }
        Ok(self.steps.pop().map(|first| (grad, first)))
    }
}

impl Backward for StackBackward {
    fn backward(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        if input_grad {
            self.check_input_grad()?;
        }
        let Some((grad, (name, first))) = self.down_to_first(dy.clone(), grads)? else {
            return Ok(input_grad.then_some(dy));
        };
        match first.backward(grad, grads, input_grad)? {
            None if input_grad => Err(missing_input_grad(&name)),
            dx => Ok(dx),
        }
    }

    fn backward_adding(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        add: Tensor,
    ) -> Result<Tensor> {
        self.check_input_grad()?;
        match self.down_to_first(dy.clone(), grads)? {
            Some((grad, (_, first))) => first.backward_adding(grad, grads, add),
            None => Ok(dy.add(&add)?),
        }
    }

    fn adds_in_place(&self) -> bool {
        self.steps
            .first()
            .is_some_and(|(_, first)| first.adds_in_place())
    }

    fn takes_channel_views(&self) -> bool {
        // The last layer that does not hand the gradient on unchanged reads the stack's.
        self.steps
            .iter()
            .rev()
            .find(|(_, step)| !step.passes_gradient_on())
            .is_some_and(|(_, step)| step.takes_channel_views())
    }
}

impl Layer for SequentialNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        check_input(&self.path, x, &self.input_shape)?;
        run_layers(&self.layers, x, Pass::of(train))
    }

    fn forward_with_logits(&self, x: &Tensor, train: bool) -> Result<(Tensor, Option<Tensor>)> {
        check_input(&self.path, x, &self.input_shape)?;
        let Some(((_, last), init)) = self.layers.split_last() else {
            return Ok((x.clone(), None));
        };
        last.forward_with_logits(&run_layers(init, x, Pass::of(train))?, train)
    }
}

impl FastPath for SequentialNet {
    fn forward_into(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
        slot: &mut ChannelSlot<'_>,
    ) -> Result<bool> {
        if affine.is_some() {
            return Ok(false);
        }
        check_input(&self.path, x, &self.input_shape)?;
        run_layers_into(&self.layers, x, slot)?;
        Ok(true)
    }

    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        self.record(x, request, None)
    }

    fn forward_recorded_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Recorded> {
        self.record(x, RecordRequest::output(), Some(part))
    }

    fn forward_inference_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Option<Tensor>> {
        check_input(&self.path, x, &self.input_shape)?;
        Ok(Some(run_layers_into_part(&self.layers, x, part)?))
    }

    fn forward_frozen(&self, x: &Tensor) -> Result<Tensor> {
        check_input(&self.path, x, &self.input_shape)?;
        run_layers(&self.layers, x, Pass::FrozenTraining)
    }
}
