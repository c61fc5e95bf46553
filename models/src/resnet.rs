//! ResNet-18 and ResNet-34 (He et al., "Deep Residual Learning for Image Recognition") as
//! torchvision defines them: a 7x7 stride-2 stem padded by 3, a 3x3 stride-2 max pool padded by
//! 1, four stages of basic blocks, global average pooling and a dense classifier. Each block is
//! an [`Add`] of its residual branch and its shortcut (an [`Identity`], or a strided 1x1
//! projection where the shape changes), then a ReLU the sum absorbs.

use kandle::layers::{
    Activation, Add, BatchNormalization, Conv2D, Dense, GlobalAveragePooling2D, Identity,
    LayerSpecExt, MaxPooling2D, Padding, Sequential,
};

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

/// A basic block: `relu(bn(conv3x3(relu(bn(conv3x3(x))))) + shortcut(x))` with `filters`
/// channels; the first convolution has `stride`, and `project` gives the shortcut a 1x1
/// convolution (with `stride`) and a batch norm instead of the identity.
pub fn basic_block(filters: usize, stride: usize, project: bool) -> Add {
    let residual = Sequential::new()
        .add(conv(filters, 3, stride).named("conv1"))
        .add(batch_norm().named("bn1"))
        .add(Activation::Relu.named("relu"))
        .add(conv(filters, 3, 1).named("conv2"))
        .add(batch_norm().named("bn2"))
        .named("residual");
    let shortcut = if project {
        Sequential::new()
            .add(conv(filters, 1, stride).named("conv"))
            .add(batch_norm().named("bn"))
            .named("shortcut")
            .boxed()
    } else {
        Identity.named("shortcut").boxed()
    };
    Add::new([residual.boxed(), shortcut])
}

/// A ResNet of basic blocks, `blocks[i]` of them in stage `i + 1`, with `classes` outputs
/// (softmax).
fn resnet(blocks: [usize; 4], classes: usize) -> Sequential {
    let mut net = Sequential::new()
        .add(conv(64, 7, 2).named("conv1"))
        .add(batch_norm().named("bn1"))
        .add(Activation::Relu.named("relu"))
        .add(
            MaxPooling2D::new(3)
                .stride(2)
                .padding(Padding::symmetric(1, 1))
                .named("maxpool"),
        );
    let mut channels = 64;
    for (stage, (&count, filters)) in blocks.iter().zip([64, 128, 256, 512]).enumerate() {
        let mut layer = Sequential::new();
        for block in 0..count {
            let stride = if block == 0 && stage > 0 { 2 } else { 1 };
            let project = stride != 1 || channels != filters;
            layer.push(basic_block(filters, stride, project).named(format!("block_{}", block + 1)));
            layer.push(Activation::Relu.named(format!("relu_{}", block + 1)));
            channels = filters;
        }
        net.push(layer.named(format!("layer{}", stage + 1)));
    }
    net.add(GlobalAveragePooling2D.named("avgpool"))
        .add(Dense::new(classes).named("fc"))
        .add(Activation::Softmax.named("softmax"))
}

/// ResNet-18 with `classes` outputs: 11,689,512 trainable parameters for 1,000 classes, as
/// torchvision's `resnet18` (its batch norms' running statistics are kandle's non-trainable
/// variables).
///
/// ```
/// let summary = kandle_models::resnet18(1000).summary(&[3, 224, 224])?;
/// assert_eq!(summary.trainable, 11_689_512);
/// # Ok::<(), kandle::Error>(())
/// ```
pub fn resnet18(classes: usize) -> Sequential {
    resnet([2, 2, 2, 2], classes)
}

/// ResNet-34 with `classes` outputs: 21,797,672 trainable parameters for 1,000 classes, as
/// torchvision's `resnet34`.
pub fn resnet34(classes: usize) -> Sequential {
    resnet([3, 4, 6, 3], classes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_torchvision() -> kandle::Result<()> {
        let summary = resnet18(1000).summary(&[3, 224, 224])?;
        assert_eq!(summary.trainable, 11_689_512);
        // Two running statistics per batch-norm channel: 4,800 channels in ResNet-18.
        assert_eq!(summary.non_trainable, 2 * 4_800);
        let shapes: Vec<Vec<usize>> = summary
            .rows
            .iter()
            .map(|r| r.output_shape.clone())
            .collect();
        assert_eq!(shapes[0], [64, 112, 112]);
        assert_eq!(shapes[3], [64, 56, 56]);
        assert_eq!(shapes[7], [512, 7, 7]);
        assert_eq!(shapes.last(), Some(&vec![1000]));
        assert_eq!(
            resnet34(1000).summary(&[3, 224, 224])?.trainable,
            21_797_672
        );
        Ok(())
    }

    #[test]
    fn forward_shape_and_names() -> kandle::Result<()> {
        use kandle::layers::Layer;
        let (net, store, _) =
            resnet18(10).build_network(&candle_core::Device::Cpu, &[3, 64, 64], 0)?;
        let x = candle_core::Tensor::randn(0f32, 1., (2, 3, 64, 64), &candle_core::Device::Cpu)?;
        let y = net.forward_t(&x, false)?;
        assert_eq!(y.dims(), &[2, 10]);
        let sums = y.sum(1)?.to_vec1::<f32>()?;
        assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5), "{sums:?}");
        assert!(store.get("layer2.block_1.shortcut.conv.weight").is_some());
        assert!(store
            .get("layer1.block_2.residual.bn2.running_var")
            .is_some());
        assert!(store.get("layer1.block_1.shortcut.conv.weight").is_none());
        assert!(store.get("fc.weight").is_some());
        Ok(())
    }
}
