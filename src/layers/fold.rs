//! Inference's folding of a per-channel affine map into the layer before it: a BatchNorm
//! with its running statistics (and the ReLU it absorbed) is `y = max(scale * x + shift, 0)`
//! per channel, which a convolution can apply to its own output as it writes it, so the two
//! layers cost one pass over memory instead of two. A [`SequentialNet`](super::SequentialNet)
//! in inference asks each layer's successor for its map ([`FastPath::inference_affine`]) and the
//! layer whether it can apply it ([`FastPath::forward_then_affine`]); training runs every layer
//! on its own, so its recorded backward pass is untouched, except where no gradient goes
//! through a stretch of frozen layers (a frozen base under a head that trains): there a frozen
//! BatchNorm, which normalises with its running statistics in training too, folds as in
//! inference ([`Pass::FrozenTraining`], [`FastPath::frozen_affine`]).

use candle_core::Tensor;

use super::{ChannelPart, ChannelSlot, FastPath};
use crate::Result;

/// A per-channel affine map and an optional ReLU after it: `max(scale[c] * x + shift[c], 0)`
/// on channel `c` (axis 1), `scale` and `shift` of shape `(channels,)`.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct ChannelAffine {
    /// What each channel is multiplied by.
    pub scale: Tensor,
    /// What is then added to each channel.
    pub shift: Tensor,
    /// Whether a ReLU follows.
    pub relu: bool,
}

/// How a stack of layers runs, and which maps of the layer after a layer it folds in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Training, every layer on its own (a backward pass may follow).
    Training,
    /// Training where no gradient is asked of the stack (a frozen stretch below every layer
    /// that trains): the maps frozen layers apply in training too are folded in
    /// ([`FastPath::frozen_affine`]).
    FrozenTraining,
    /// Inference: the maps of inference are folded in ([`FastPath::inference_affine`]).
    Inference,
}

impl Pass {
    /// The pass of `forward_t`'s `train`.
    pub(crate) fn of(train: bool) -> Self {
        if train {
            Pass::Training
        } else {
            Pass::Inference
        }
    }

    fn train(self) -> bool {
        self != Pass::Inference
    }
}

/// Runs `layers` in order on `x`; where `pass` folds (in inference, or frozen layers in a
/// training pass that no gradient goes through), a layer whose successor offers its affine map
/// and that can apply it runs both at once.
pub(crate) fn run_layers(layers: &[Named], x: &Tensor, pass: Pass) -> Result<Tensor> {
    let mut h = x.clone();
    let mut rest = layers;
    while let Some((step, after)) = next_step(rest, &h, pass)? {
        rest = after;
        h = step.run(&h, pass)?;
    }
    Ok(h)
}

/// Runs `layers` in inference on `x` with the output written into `slot` (its channels of a
/// concatenation's output on the CPU): by the last step itself where it can write there,
/// otherwise copied.
pub(crate) fn run_layers_into(
    layers: &[Named],
    x: &Tensor,
    slot: &mut ChannelSlot<'_>,
) -> Result<()> {
    run_layers_writing(
        layers,
        x,
        slot,
        |layer, h, affine, slot| Ok(layer.forward_into(h, affine, slot)?.then_some(())),
        |slot, h| Ok(slot.copy_from(h)?),
    )
}

/// Runs `layers` in inference on `x` with the output written into `part` (its channels of a
/// concatenation's output on a CUDA device) and returns the part's view: by the last step
/// itself where it can write there, otherwise copied.
pub(crate) fn run_layers_into_part(
    layers: &[Named],
    x: &Tensor,
    part: &ChannelPart<'_>,
) -> Result<Tensor> {
    run_layers_writing(
        layers,
        x,
        &mut &*part,
        |layer, h, affine, part| match affine {
            Some(_) => Ok(None),
            None => layer.forward_inference_into(h, part),
        },
        |part, h| part.write(h),
    )
}

/// Runs `layers` in inference on `x` into `target`: the last step (the layers after it hand
/// their input on) through `write(layer, h, affine, target)`, which writes the layer's output
/// with the map folded in and returns what it gives, or `None` having written nothing; then,
/// or when there is no step, `copy(target, output)`.
fn run_layers_writing<T: ?Sized, R>(
    layers: &[Named],
    x: &Tensor,
    target: &mut T,
    write: impl Fn(&dyn FastPath, &Tensor, Option<&ChannelAffine>, &mut T) -> Result<Option<R>>,
    copy: impl FnOnce(&mut T, &Tensor) -> Result<R>,
) -> Result<R> {
    let mut h = x.clone();
    let mut rest = layers;
    while let Some((step, after)) = next_step(rest, &h, Pass::Inference)? {
        rest = after;
        let last = after.iter().all(|(_, layer)| layer.passes_through());
        if last {
            if let Some(written) = write(step.layer, &h, step.affine(), target)? {
                return Ok(written);
            }
        }
        h = step.run(&h, Pass::Inference)?;
    }
    copy(target, &h)
}

/// A layer of a stack, with its name.
type Named = (String, Box<dyn FastPath>);

/// One step of a stack's forward pass: a layer, and in inference the layer after it when that
/// one offers an affine map to fold in, with the map.
struct Step<'a> {
    layer: &'a dyn FastPath,
    then: Option<(&'a dyn FastPath, ChannelAffine)>,
}

impl Step<'_> {
    /// The map to fold into the layer's output, if any.
    fn affine(&self) -> Option<&ChannelAffine> {
        self.then.as_ref().map(|(_, affine)| affine)
    }

    /// The step's output in `pass`: the layer's with the map folded in where the layer can,
    /// otherwise the two layers one after the other.
    fn run(&self, h: &Tensor, pass: Pass) -> Result<Tensor> {
        let forward = |layer: &dyn FastPath, h: &Tensor| match pass {
            Pass::FrozenTraining => layer.forward_frozen(h),
            _ => layer.forward_t(h, pass.train()),
        };
        let Some((next, affine)) = &self.then else {
            return forward(self.layer, h);
        };
        match self.layer.forward_then_affine(h, affine)? {
            Some(y) => Ok(y),
            None => forward(*next, &forward(self.layer, h)?),
        }
    }
}

/// The first step of `layers` on the input `h` in `pass`, and the layers after it; `None` when
/// there are none.
fn next_step<'a>(
    layers: &'a [Named],
    h: &Tensor,
    pass: Pass,
) -> Result<Option<(Step<'a>, &'a [Named])>> {
    let Some(((_, layer), after)) = layers.split_first() else {
        return Ok(None);
    };
    let layer = layer.as_ref();
    if let Some(((_, next), rest)) = after.split_first() {
        let affine = match pass {
            Pass::Training => None,
            Pass::FrozenTraining => next.frozen_affine(h)?,
            Pass::Inference => next.inference_affine(h)?,
        };
        if let Some(affine) = affine {
            let then = Some((next.as_ref(), affine));
            return Ok(Some((Step { layer, then }, rest)));
        }
    }
    Ok(Some((Step { layer, then: None }, after)))
}

/// Moves every variable of `store` away from its initial value (biases start at zero,
/// statistics at zero and one), then copies them all to `other`: for tests that compare
/// inference's fused paths with the layers run apart, which must carry each variable.
#[cfg(test)]
pub(crate) fn move_variables(
    store: &crate::params::ParamStore,
    other: &crate::params::ParamStore,
) -> Result<()> {
    for (i, p) in store.iter().enumerate() {
        let noise = kandle_testing::random::seeded_normal(p.var.dims(), 0.5, i as u64)?
            .to_device(p.var.device())?;
        let value = if p.name.ends_with("running_var") {
            (noise.abs()? + 0.5)?
        } else {
            (noise + (i % 3) as f64 * 0.1)?
        };
        p.var.set(&value)?;
    }
    other.assign(&store.weights()?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::layers::FastPath;
    use candle_core::{Device, Tensor};

    use crate::layers::{
        Activation, BatchNormalization, BuildContext, Conv2D, Layer, LayerSpecExt, Padding,
        Sequential, SequentialNet,
    };
    use crate::params::ParamStore;
    use crate::ComputePath;

    const INPUT: [usize; 3] = [16, 9, 9];

    /// Convolutions with biases before BatchNorms, with and without the ReLU after, in the
    /// shapes of the kernel's paths: Winograd's 3x3, a 1x1, a strided window.
    fn build(path: ComputePath) -> crate::Result<(SequentialNet, ParamStore)> {
        let net = Sequential::new()
            .add(Conv2D::new(20, 3).padding(Padding::Same))
            .add(BatchNormalization::new())
            .add(Activation::Relu)
            .add(Conv2D::new(24, 1))
            .add(BatchNormalization::new().scale(false))
            .add(Conv2D::new(8, 3).stride(2))
            .add(BatchNormalization::new().center(false))
            .add(Activation::Relu);
        let ctx = BuildContext::new(&Device::Cpu, 3).with_compute_path(path);
        let (net, store, _) = net.build_in(ctx, &INPUT)?;
        Ok((net, store))
    }

    #[test]
    fn folded_inference_matches_the_layers_run_apart() -> crate::Result<()> {
        let (folded, store) = build(ComputePath::Auto)?;
        let (apart, apart_store) = build(ComputePath::DeviceGeneric)?;
        super::move_variables(&store, &apart_store)?;
        let x = kandle_testing::random::seeded_normal(&[5, INPUT[0], INPUT[1], INPUT[2]], 1.0, 2)?;
        let got = folded.forward_t(&x, false)?;
        let want = apart.forward_t(&x, false)?;
        assert_eq!(got.dims(), want.dims());
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
        let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
        assert!(err < 1e-5, "relative error {err}");
        // The ReLU at the end was applied.
        assert_eq!(got.lt(0f32)?.sum_all()?.to_scalar::<u8>()?, 0);
        Ok(())
    }

    #[test]
    fn a_frozen_stack_folds_in_training_as_in_inference() -> crate::Result<()> {
        // The stack frozen (its BatchNorms normalise with their running statistics in training
        // too), inside an outer stack as a base under a head.
        let build_frozen = |path| -> crate::Result<(SequentialNet, ParamStore)> {
            let base = Sequential::new()
                .add(Conv2D::new(20, 3).padding(Padding::Same))
                .add(BatchNormalization::new())
                .add(Activation::Relu)
                .add(Conv2D::new(8, 3).stride(2))
                .add(BatchNormalization::new().center(false));
            let net = Sequential::new().add(base.trainable(false));
            let ctx = BuildContext::new(&Device::Cpu, 3).with_compute_path(path);
            let (net, store, _) = net.build_in(ctx, &INPUT)?;
            Ok((net, store))
        };
        let (net, store) = build_frozen(ComputePath::Auto)?;
        let (apart, apart_store) = build_frozen(ComputePath::DeviceGeneric)?;
        super::move_variables(&store, &apart_store)?;
        let x = kandle_testing::random::seeded_normal(&[4, INPUT[0], INPUT[1], INPUT[2]], 1.0, 3)?;
        let bits = |t: &Tensor| -> crate::Result<Vec<u32>> {
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(v.iter().map(|f| f.to_bits()).collect())
        };
        // No gradient goes through it: the BatchNorms fold into the convolutions before them,
        // bit for bit inference's folded pass.
        let frozen = net.forward_frozen(&x)?;
        assert_eq!(bits(&frozen)?, bits(&net.forward_t(&x, false)?)?);
        // The same values as the layers run apart in training, to float32's rounding.
        let want = apart.forward_t(&x, true)?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
        let err = (&frozen - &want)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
        assert!(err < 1e-5, "relative error {err}");
        // Training's own pass, which a backward pass may follow, keeps the layers apart (the
        // folded convolution keeps no gradient).
        let trained = net.forward_t(&x, true)?;
        assert_ne!(bits(&trained)?, bits(&frozen)?);
        Ok(())
    }

    #[test]
    fn only_a_kernel_convolution_folds() -> crate::Result<()> {
        let x = kandle_testing::random::seeded_normal(&[2, INPUT[0], INPUT[1], INPUT[2]], 1.0, 4)?;
        let conv = |path, activation| -> crate::Result<Box<dyn FastPath>> {
            let spec = Conv2D::new(4, 3).activation(activation);
            let ctx = BuildContext::new(&Device::Cpu, 0).with_compute_path(path);
            Ok(crate::layers::LayerSpec::build(&spec, &mut { ctx }, &INPUT)?.layer)
        };
        let affine = super::ChannelAffine {
            scale: Tensor::ones(4, candle_core::DType::F32, &Device::Cpu)?,
            shift: Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu)?,
            relu: false,
        };
        let takes = |layer: Box<dyn FastPath>| -> crate::Result<bool> {
            Ok(layer.forward_then_affine(&x, &affine)?.is_some())
        };
        assert!(takes(conv(ComputePath::Auto, Activation::Linear)?)?);
        // Its own activation comes before the map: it cannot fold one after it.
        assert!(!takes(conv(ComputePath::Auto, Activation::Relu)?)?);
        assert!(!takes(conv(
            ComputePath::DeviceGeneric,
            Activation::Linear
        )?)?);
        Ok(())
    }
}
