//! ResNet (He et al., "Deep Residual Learning for Image Recognition") as torchvision defines
//! it, written as functional models: a 7x7 stride-2 stem padded by 3, a 3x3 stride-2 max pool
//! padded by 1, four stages of residual blocks, global average pooling and a dense classifier.
//!
//! The variables have torchvision's names (`conv1.weight`, `bn1.running_var`,
//! `layer1.0.conv1.weight`, `layer2.0.downsample.0.weight`, `fc.bias`, ...), so a torchvision
//! state dict maps onto them name for name, and its conventions: the stride on a bottleneck's
//! 3x3 convolution (ResNet v1.5), bias-free convolutions, BatchNorm with epsilon 1e-5 and
//! PyTorch's momentum 0.1 (0.9 as Keras counts it). Each block adds its residual branch to its
//! shortcut (the input itself, or a strided 1x1 projection and a BatchNorm where the shape
//! changes), and the ReLU after the sum is absorbed into it.

use kandle::functional::{add, Functional, Input, LayerCall, SymbolicTensor};
use kandle::layers::{
    Activation, BatchNormalization, Conv2D, Dense, Flatten, GlobalAveragePooling2D, LayerSpecExt,
    MaxPooling2D, Padding,
};
use kandle::{Network, Result};

/// torchvision's BatchNorm: epsilon 1e-5, momentum 0.1 (0.9 as Keras counts it).
fn batch_norm() -> BatchNormalization {
    BatchNormalization::new().epsilon(1e-5).momentum(0.9)
}

/// A `kernel` x `kernel` convolution without bias, padded by `kernel / 2` on every side.
fn conv(filters: usize, kernel: usize, stride: usize) -> Conv2D {
    let pad = kernel / 2;
    Conv2D::new(filters, kernel)
        .stride(stride)
        .padding(Padding::symmetric(pad, pad))
        .use_bias(false)
}

/// `bn(conv(x))`, the convolution named `<prefix>conv<i>` and the norm `<prefix>bn<i>`.
fn conv_bn(
    x: &SymbolicTensor,
    prefix: &str,
    i: usize,
    filters: usize,
    kernel: usize,
    stride: usize,
) -> Result<SymbolicTensor> {
    let y = conv(filters, kernel, stride)
        .named(format!("{prefix}conv{i}"))
        .call(x)?;
    batch_norm().named(format!("{prefix}bn{i}")).call(&y)
}

/// The shortcut of a block that gives `channels` channels at `stride`: the input itself, or
/// torchvision's `downsample` (a 1x1 convolution with the stride, then a BatchNorm) where the
/// shape changes.
fn shortcut(
    x: &SymbolicTensor,
    prefix: &str,
    channels: usize,
    stride: usize,
) -> Result<SymbolicTensor> {
    if stride == 1 && x.shape().first() == Some(&channels) {
        return Ok(x.clone());
    }
    let y = conv(channels, 1, stride)
        .named(format!("{prefix}downsample.0"))
        .call(x)?;
    batch_norm().named(format!("{prefix}downsample.1")).call(&y)
}

/// A basic block (ResNet-18 and 34): `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`,
/// two 3x3 convolutions of `filters` channels, the first with `stride`. Its layers are named
/// `<prefix>conv1`, `<prefix>bn1`, ... as torchvision names them (`prefix` such as
/// `layer2.0.`).
///
/// ```
/// use kandle::functional::{Functional, Input};
///
/// let x = Input::new(&[64, 8, 8]).tensor();
/// let y = kandle_models::basic_block(&x, "block.", 128, 2)?;
/// assert_eq!(y.shape(), [128, 4, 4]);
/// let block = Functional::new([&x], [&y])?;
/// let summary = block.summary()?;
/// // Two 3x3 convolutions, the 1x1 projection and three batch norms.
/// assert_eq!(summary.trainable, 64 * 128 * 9 + 128 * 128 * 9 + 64 * 128 + 3 * 2 * 128);
/// # Ok::<(), kandle::Error>(())
/// ```
pub fn basic_block(
    x: &SymbolicTensor,
    prefix: &str,
    filters: usize,
    stride: usize,
) -> Result<SymbolicTensor> {
    let y = conv_bn(x, prefix, 1, filters, 3, stride)?;
    let y = Activation::Relu.call(&y)?;
    let y = conv_bn(&y, prefix, 2, filters, 3, 1)?;
    let short = shortcut(x, prefix, filters, stride)?;
    Activation::Relu.call(&add(&[&y, &short])?)
}

/// A bottleneck block (ResNet-50, 101 and 152): a 1x1 convolution to `width` channels, a 3x3
/// with `stride`, a 1x1 to `4 * width`, each followed by a BatchNorm (and the first two by a
/// ReLU), added to the shortcut, then a ReLU. Layers named as in [`basic_block`].
pub fn bottleneck_block(
    x: &SymbolicTensor,
    prefix: &str,
    width: usize,
    stride: usize,
) -> Result<SymbolicTensor> {
    let y = Activation::Relu.call(&conv_bn(x, prefix, 1, width, 1, 1)?)?;
    let y = Activation::Relu.call(&conv_bn(&y, prefix, 2, width, 3, stride)?)?;
    let y = conv_bn(&y, prefix, 3, 4 * width, 1, 1)?;
    let short = shortcut(x, prefix, 4 * width, stride)?;
    Activation::Relu.call(&add(&[&y, &short])?)
}

/// Which blocks a ResNet stacks, and how many per stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// Basic blocks, 2-2-2-2.
    ResNet18,
    /// Basic blocks, 3-4-6-3.
    ResNet34,
    /// Bottlenecks, 3-4-6-3.
    ResNet50,
    /// Bottlenecks, 3-4-23-3.
    ResNet101,
    /// Bottlenecks, 3-8-36-3.
    ResNet152,
}

impl Depth {
    /// Blocks in each of the four stages.
    ///
    /// ```
    /// use kandle_models::Depth;
    ///
    /// assert_eq!(Depth::ResNet50.blocks(), [3, 4, 6, 3]);
    /// assert!(Depth::ResNet50.bottleneck() && !Depth::ResNet34.bottleneck());
    /// ```
    pub fn blocks(self) -> [usize; 4] {
        match self {
            Depth::ResNet18 => [2, 2, 2, 2],
            Depth::ResNet34 | Depth::ResNet50 => [3, 4, 6, 3],
            Depth::ResNet101 => [3, 4, 23, 3],
            Depth::ResNet152 => [3, 8, 36, 3],
        }
    }

    /// Whether the blocks are bottlenecks (1x1, 3x3, 1x1) rather than basic blocks (two 3x3).
    pub fn bottleneck(self) -> bool {
        !matches!(self, Depth::ResNet18 | Depth::ResNet34)
    }
}

/// What a ResNet ends with after its last stage, as Keras's `include_top` and `pooling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// Global average pooling, a dense layer `fc` of this many classes and a softmax.
    Softmax(usize),
    /// Global average pooling and the dense layer `fc`, whose logits are the output (as
    /// torchvision's model gives).
    Logits(usize),
    /// Global average pooling: the features, for a head of one's own.
    AveragePooling,
    /// Global max pooling: the features.
    MaxPooling,
    /// The last stage's feature maps.
    None,
}

/// A ResNet recipe: its depth, its input, its stem and its head.
///
/// ```
/// use kandle_models::{Depth, Head, ResNet};
///
/// // The CIFAR variant: a 3x3 stem without max pooling, for 32x32 images.
/// let net = ResNet::new(Depth::ResNet18)
///     .input_shape(&[3, 32, 32])
///     .small_images()
///     .head(Head::Softmax(10))
///     .build()?;
/// assert_eq!(net.output_shapes(), [vec![10]]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ResNet {
    depth: Depth,
    input_shape: Vec<usize>,
    small_images: bool,
    head: Head,
}

impl ResNet {
    /// torchvision's network of `depth` for 3x224x224 images with 1,000 classes (softmax).
    pub fn new(depth: Depth) -> Self {
        Self {
            depth,
            input_shape: vec![3, 224, 224],
            small_images: false,
            head: Head::Softmax(1000),
        }
    }

    /// The input shape, `(channels, height, width)`.
    pub fn input_shape(mut self, shape: &[usize]) -> Self {
        self.input_shape = shape.to_vec();
        self
    }

    /// For 32x32 images (CIFAR): a 3x3 stride-1 stem and no max pooling, so the last stage
    /// still sees 4x4 maps.
    pub fn small_images(mut self) -> Self {
        self.small_images = true;
        self
    }

    /// What follows the last stage.
    pub fn head(mut self, head: Head) -> Self {
        self.head = head;
        self
    }

    /// The network as a model's recipe that takes images of any height and width, as
    /// torchvision's ResNets and Keras's with `input_shape=None` do: built for
    /// [`Self::input_shape`] (224x224 by default) and built again, with the same variables,
    /// for the size of the images a model is given.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use kandle::prelude::*;
    /// use kandle_models::{Depth, Head, ResNet};
    ///
    /// let net = ResNet::new(Depth::ResNet18).head(Head::Logits(10)).network()?;
    /// let mut model = net.compile(Sgd::new(0.1), MeanSquaredError, (), &OneDeviceStrategy::cpu())?;
    /// let small = Tensor::zeros((1, 3, 64, 64), DType::F32, &Device::Cpu)?;
    /// assert_eq!(model.predict(&small, 1)?.dims(), [1, 10]);
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn network(&self) -> Result<Network> {
        let recipe = self.clone();
        Network::any_size(&self.input_shape, move |shape| {
            recipe.clone().input_shape(shape).build()
        })
    }

    /// The functional model for [`Self::input_shape`]. An input too small for the network's
    /// strides is an error naming the layer.
    pub fn build(&self) -> Result<Functional> {
        let image = Input::new(&self.input_shape).named("image").tensor();
        let mut x = if self.small_images {
            conv_bn(&image, "", 1, 64, 3, 1)?
        } else {
            conv_bn(&image, "", 1, 64, 7, 2)?
        };
        x = Activation::Relu.call(&x)?;
        if !self.small_images {
            x = MaxPooling2D::new(3)
                .stride(2)
                .padding(Padding::symmetric(1, 1))
                .named("maxpool")
                .call(&x)?;
        }
        for (stage, (&count, width)) in self
            .depth
            .blocks()
            .iter()
            .zip([64, 128, 256, 512])
            .enumerate()
        {
            for block in 0..count {
                let stride = if block == 0 && stage > 0 { 2 } else { 1 };
                let prefix = format!("layer{}.{block}.", stage + 1);
                x = match self.depth.bottleneck() {
                    true => bottleneck_block(&x, &prefix, width, stride)?,
                    false => basic_block(&x, &prefix, width, stride)?,
                };
            }
        }
        let classifier = |x: &SymbolicTensor, classes: usize| -> Result<SymbolicTensor> {
            let pooled = GlobalAveragePooling2D.named("avgpool").call(x)?;
            Dense::new(classes).named("fc").call(&pooled)
        };
        let out = match self.head {
            Head::Softmax(classes) => Activation::Softmax.call(&classifier(&x, classes)?)?,
            Head::Logits(classes) => classifier(&x, classes)?,
            Head::AveragePooling => GlobalAveragePooling2D.named("avgpool").call(&x)?,
            Head::MaxPooling => {
                // One window over each whole feature map.
                let (h, w) = (x.shape()[1], x.shape()[2]);
                let pooled = MaxPooling2D::new(1)
                    .window(h, w)
                    .strides(h, w)
                    .named("global_maxpool")
                    .call(&x)?;
                Flatten.named("flatten").call(&pooled)?
            }
            Head::None => x,
        };
        Functional::new([&image], [&out])
    }
}

/// ResNet-18 for 3x224x224 images with `classes` outputs (softmax): 11,689,512 trainable
/// parameters for 1,000 classes, as torchvision's `resnet18` (its batch norms' running
/// statistics are kandle's non-trainable variables).
///
/// ```
/// let summary = kandle_models::resnet18(1000)?.summary()?;
/// assert_eq!(summary.trainable, 11_689_512);
/// # Ok::<(), kandle::Error>(())
/// ```
pub fn resnet18(classes: usize) -> Result<Functional> {
    ResNet::new(Depth::ResNet18)
        .head(Head::Softmax(classes))
        .build()
}

/// ResNet-34 for 3x224x224 images: 21,797,672 trainable parameters for 1,000 classes.
pub fn resnet34(classes: usize) -> Result<Functional> {
    ResNet::new(Depth::ResNet34)
        .head(Head::Softmax(classes))
        .build()
}

/// ResNet-50 for 3x224x224 images: 25,557,032 trainable parameters for 1,000 classes.
pub fn resnet50(classes: usize) -> Result<Functional> {
    ResNet::new(Depth::ResNet50)
        .head(Head::Softmax(classes))
        .build()
}

/// ResNet-101 for 3x224x224 images: 44,549,160 trainable parameters for 1,000 classes.
pub fn resnet101(classes: usize) -> Result<Functional> {
    ResNet::new(Depth::ResNet101)
        .head(Head::Softmax(classes))
        .build()
}

/// ResNet-152 for 3x224x224 images: 60,192,808 trainable parameters for 1,000 classes.
pub fn resnet152(classes: usize) -> Result<Functional> {
    ResNet::new(Depth::ResNet152)
        .head(Head::Softmax(classes))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torchvision's counts (`sum(p.numel() for p in model.parameters())`).
    #[test]
    fn parameter_counts_match_torchvision() -> Result<()> {
        let resnet = |depth| ResNet::new(depth).build()?.summary();
        let r18 = resnet(Depth::ResNet18)?;
        assert_eq!(r18.trainable, 11_689_512);
        // Two running statistics per batch-norm channel: 4,800 channels in ResNet-18.
        assert_eq!(r18.non_trainable, 2 * 4_800);
        assert_eq!(resnet(Depth::ResNet34)?.trainable, 21_797_672);
        assert_eq!(resnet(Depth::ResNet50)?.trainable, 25_557_032);
        assert_eq!(resnet(Depth::ResNet101)?.trainable, 44_549_160);
        assert_eq!(resnet(Depth::ResNet152)?.trainable, 60_192_808);
        Ok(())
    }

    #[test]
    fn shapes_and_torchvision_names() -> Result<()> {
        let net = ResNet::new(Depth::ResNet50).build()?;
        let summary = net.summary()?;
        let shape_of = |name: &str| {
            summary
                .rows
                .iter()
                .find(|r| r.name == name)
                .map(|r| r.output_shape.clone())
        };
        assert_eq!(shape_of("conv1"), Some(vec![64, 112, 112]));
        assert_eq!(shape_of("maxpool"), Some(vec![64, 56, 56]));
        assert_eq!(shape_of("layer1.0.conv3"), Some(vec![256, 56, 56]));
        assert_eq!(shape_of("layer2.0.conv2"), Some(vec![128, 28, 28]));
        assert_eq!(shape_of("layer4.2.bn3"), Some(vec![2048, 7, 7]));
        assert_eq!(net.output_shapes(), [vec![1000]]);
        let mut ctx = kandle::layers::BuildContext::new(&candle_core::Device::Cpu, 0);
        kandle::layers::LayerSpec::build(&resnet18(10)?, &mut ctx, &[3, 224, 224])?;
        let store = ctx.into_store();
        for name in [
            "conv1.weight",
            "bn1.running_mean",
            "layer1.1.conv2.weight",
            "layer2.0.downsample.0.weight",
            "layer2.0.downsample.1.running_var",
            "fc.weight",
            "fc.bias",
        ] {
            assert!(store.get(name).is_some(), "{name}");
        }
        assert!(store.get("layer1.0.downsample.0.weight").is_none());
        assert!(store.get("conv1.bias").is_none());
        Ok(())
    }

    #[test]
    fn the_small_image_variant_and_heads() -> Result<()> {
        let cifar = ResNet::new(Depth::ResNet18)
            .input_shape(&[3, 32, 32])
            .small_images();
        let features = cifar.clone().head(Head::None).build()?;
        assert_eq!(features.output_shapes(), [vec![512, 4, 4]]);
        let pooled = cifar.clone().head(Head::AveragePooling).build()?;
        assert_eq!(pooled.output_shapes(), [vec![512]]);
        let pooled = cifar.clone().head(Head::MaxPooling).build()?;
        assert_eq!(pooled.output_shapes(), [vec![512]]);
        let logits = cifar.head(Head::Logits(10)).build()?.summary()?;
        // The 3x3 stem instead of the 7x7 one, and a 10-class head.
        assert_eq!(
            logits.trainable,
            11_689_512 - 64 * 3 * (49 - 9) - 512 * 990 - 990
        );
        let err = ResNet::new(Depth::ResNet18)
            .input_shape(&[3, 32])
            .build()
            .expect_err("too small")
            .to_string();
        assert!(err.contains("layer"), "{err}");
        Ok(())
    }
}
