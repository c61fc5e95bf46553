//! Inference's folding of a per-channel affine map into the layer before it: a BatchNorm
//! with its running statistics (and the ReLU it absorbed) is `y = max(scale * x + shift, 0)`
//! per channel, which a convolution can apply to its own output as it writes it, so the two
//! layers cost one pass over memory instead of two. A [`SequentialNet`](super::SequentialNet)
//! in inference asks each layer's successor for its map ([`FastPath::inference_affine`]) and the
//! layer whether it can apply it ([`FastPath::forward_then_affine`]); training runs every layer
//! on its own, so its recorded backward pass is untouched.

use candle_core::Tensor;

use super::{ChannelSlot, FastPath};
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

/// Runs `layers` in order on `x`; in inference (`!train`), a layer whose successor offers its
/// affine map and that can apply it runs both at once.
pub(crate) fn run_layers(layers: &[Named], x: &Tensor, train: bool) -> Result<Tensor> {
    let mut h = x.clone();
    let mut rest = layers;
    while let Some((step, after)) = next_step(rest, &h, train)? {
        rest = after;
        h = step.run(&h, train)?;
    }
    Ok(h)
}

/// Runs `layers` in inference on `x` with the output written into `slot` (its channels of a
/// concatenation's output): by the last step itself where it can write there, otherwise
/// copied.
pub(crate) fn run_layers_into(
    layers: &[Named],
    x: &Tensor,
    slot: &mut ChannelSlot<'_>,
) -> Result<()> {
    let mut h = x.clone();
    let mut rest = layers;
    while let Some((step, after)) = next_step(rest, &h, false)? {
        rest = after;
        let last = after.iter().all(|(_, layer)| layer.passes_through());
        if last && step.layer.forward_into(&h, step.affine(), slot)? {
            return Ok(());
        }
        h = step.run(&h, false)?;
    }
    Ok(slot.copy_from(&h)?)
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

    /// The step's output: the layer's with the map folded in where the layer can, otherwise
    /// the two layers one after the other.
    fn run(&self, h: &Tensor, train: bool) -> Result<Tensor> {
        let Some((next, affine)) = &self.then else {
            return self.layer.forward_t(h, train);
        };
        match self.layer.forward_then_affine(h, affine)? {
            Some(y) => Ok(y),
            None => next.forward_t(&self.layer.forward_t(h, train)?, train),
        }
    }
}

/// The first step of `layers` on the input `h`, and the layers after it; `None` when there
/// are none.
fn next_step<'a>(
    layers: &'a [Named],
    h: &Tensor,
    train: bool,
) -> Result<Option<(Step<'a>, &'a [Named])>> {
    let Some(((_, layer), after)) = layers.split_first() else {
        return Ok(None);
    };
    let layer = layer.as_ref();
    if !train {
        if let Some(((_, next), rest)) = after.split_first() {
            if let Some(affine) = next.inference_affine(h)? {
                let then = Some((next.as_ref(), affine));
                return Ok(Some((Step { layer, then }, rest)));
            }
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
        let noise = Tensor::randn(0f32, 0.5, p.var.dims(), p.var.device())?;
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
        Activation, BatchNormalization, BuildContext, Conv2D, Layer, Padding, Sequential,
        SequentialNet,
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
        let x = Tensor::randn(0f32, 1., (5, INPUT[0], INPUT[1], INPUT[2]), &Device::Cpu)?;
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
    fn only_a_kernel_convolution_folds() -> crate::Result<()> {
        let x = Tensor::randn(0f32, 1., (2, INPUT[0], INPUT[1], INPUT[2]), &Device::Cpu)?;
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
