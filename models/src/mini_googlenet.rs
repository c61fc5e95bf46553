//! MiniGoogLeNet (Zhang et al., "Understanding deep learning requires rethinking
//! generalization"), exactly as the Keras multi-GPU CIFAR-10 tutorial defines it: as a
//! `Sequential` of `Concat` blocks, and as the tutorial writes it, a functional model whose
//! branches meet in `concatenate` (the same variables under the same names, the same outputs).

use kandle::functional::{concatenate, Functional, Input, LayerCall, SymbolicTensor};
use kandle::layers::{
    Activation, AveragePooling2D, BatchNormalization, Concat, Conv2D, Dense, Dropout, Flatten,
    LayerSpecExt, MaxPooling2D, Padding, Sequential,
};
use kandle::Result;

/// Conv2D (`filters`, `kx` x `ky`, `stride`, `padding`) → BatchNormalization → ReLU.
pub fn conv_module(
    filters: usize,
    kx: usize,
    ky: usize,
    stride: usize,
    padding: Padding,
) -> Sequential {
    Sequential::new()
        .add(
            Conv2D::new(filters, kx)
                .kernel(kx, ky)
                .stride(stride)
                .padding(padding)
                .named("conv"),
        )
        .add(BatchNormalization::new().named("bn"))
        .add(Activation::Relu.named("relu"))
}

/// Two branches joined on channels: a 1x1 conv module with `k1x1` filters and a 3x3 `same`
/// conv module with `k3x3` filters.
pub fn inception_module(k1x1: usize, k3x3: usize) -> Concat {
    Concat::new([
        conv_module(k1x1, 1, 1, 1, Padding::Same).named("branch_1x1"),
        conv_module(k3x3, 3, 3, 1, Padding::Same).named("branch_3x3"),
    ])
}

/// Halves the spatial size: a 3x3 stride-2 `valid` conv module with `filters` filters, joined
/// on channels with a 3x3 stride-2 max pool.
pub fn downsample_module(filters: usize) -> Concat {
    Concat::new([
        conv_module(filters, 3, 3, 2, Padding::Valid)
            .named("branch_conv")
            .boxed(),
        MaxPooling2D::new(3).stride(2).named("branch_pool").boxed(),
    ])
}

/// A stage: its inception modules' `(k1x1, k3x3)` filters, then an optional downsample's filters.
type Stage = (&'static [(usize, usize)], Option<usize>);

/// The tutorial's three stages.
const STAGES: [Stage; 3] = [
    (&[(32, 32), (32, 48)], Some(80)),
    (&[(112, 48), (96, 64), (80, 80), (48, 96)], Some(96)),
    (&[(176, 160), (176, 160)], None),
];

/// MiniGoogLeNet for 32x32 inputs with `classes` outputs (softmax): 1,656,250 parameters for
/// 10 classes, 1,652,826 of them trainable.
pub fn mini_googlenet(classes: usize) -> Sequential {
    let mut net = Sequential::new().add(conv_module(96, 3, 3, 1, Padding::Same).named("stem"));
    let (mut inceptions, mut downsamples) = (0, 0);
    for (modules, downsample) in STAGES {
        for &(k1, k3) in modules {
            inceptions += 1;
            net.push(inception_module(k1, k3).named(format!("inception_{inceptions}")));
        }
        if let Some(k) = downsample {
            downsamples += 1;
            net.push(downsample_module(k).named(format!("downsample_{downsamples}")));
        }
    }
    net.add(AveragePooling2D::new(7).named("avg_pool"))
        .add(Dropout::new(0.5).named("dropout"))
        .add(Flatten.named("flatten"))
        .add(Dense::new(classes).named("classifier"))
        .add(Activation::Softmax.named("softmax"))
}

/// [`conv_module`] called on `x`, its layers named `<prefix>.conv`, `<prefix>.bn` and
/// `<prefix>.relu` (the names the `Sequential`'s scopes give).
fn call_conv_module(
    x: &SymbolicTensor,
    prefix: &str,
    filters: usize,
    kernel: usize,
    stride: usize,
    padding: Padding,
) -> Result<SymbolicTensor> {
    let y = Conv2D::new(filters, kernel)
        .stride(stride)
        .padding(padding)
        .named(format!("{prefix}.conv"))
        .call(x)?;
    let y = BatchNormalization::new()
        .named(format!("{prefix}.bn"))
        .call(&y)?;
    Activation::Relu.named(format!("{prefix}.relu")).call(&y)
}

/// MiniGoogLeNet as a functional model, as the Keras tutorial writes it: each inception and
/// downsample module's branches joined by `concatenate`. Its variables have the names of
/// [`mini_googlenet`]'s and it gives the same outputs.
///
/// ```
/// let net = kandle_models::mini_googlenet_functional(10)?;
/// assert_eq!(net.summary()?.total(), 1_656_250);
/// # Ok::<(), kandle::Error>(())
/// ```
pub fn mini_googlenet_functional(classes: usize) -> Result<Functional> {
    let image = Input::new(&[3, 32, 32]).named("image").tensor();
    let mut x = call_conv_module(&image, "stem", 96, 3, 1, Padding::Same)?;
    let (mut inceptions, mut downsamples) = (0, 0);
    for (modules, downsample) in STAGES {
        for &(k1, k3) in modules {
            inceptions += 1;
            let name = format!("inception_{inceptions}");
            let a = call_conv_module(&x, &format!("{name}.branch_1x1"), k1, 1, 1, Padding::Same)?;
            let b = call_conv_module(&x, &format!("{name}.branch_3x3"), k3, 3, 1, Padding::Same)?;
            x = concatenate(&[&a, &b])?;
        }
        if let Some(k) = downsample {
            downsamples += 1;
            let name = format!("downsample_{downsamples}");
            let conv =
                call_conv_module(&x, &format!("{name}.branch_conv"), k, 3, 2, Padding::Valid)?;
            let pool = MaxPooling2D::new(3)
                .stride(2)
                .named(format!("{name}.branch_pool"))
                .call(&x)?;
            x = concatenate(&[&conv, &pool])?;
        }
    }
    let x = AveragePooling2D::new(7).named("avg_pool").call(&x)?;
    let x = Dropout::new(0.5).named("dropout").call(&x)?;
    let x = Flatten.named("flatten").call(&x)?;
    let x = Dense::new(classes).named("classifier").call(&x)?;
    let probabilities = Activation::Softmax.named("softmax").call(&x)?;
    Functional::new([&image], [&probabilities])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The functional form has the `Sequential`'s variables, names and initial values, and
    /// gives bit for bit its outputs, in inference and in a training forward.
    #[test]
    fn the_functional_form_gives_the_sequentials_outputs_bit_for_bit() -> kandle::Result<()> {
        use candle_core::{Device, Tensor};
        use kandle::layers::{BuildContext, Layer, LayerSpec};
        let build = |spec: &dyn LayerSpec| -> kandle::Result<_> {
            let mut ctx = BuildContext::new(&Device::Cpu, 3);
            let built = spec.build(&mut ctx, &[3, 32, 32])?;
            Ok((built.into_layer(), ctx.into_store()))
        };
        let (stack, stack_store) = build(&mini_googlenet(10))?;
        let (graph, graph_store) = build(&mini_googlenet_functional(10)?)?;
        let names = |store: &kandle::params::ParamStore| -> Vec<String> {
            store.iter().map(|p| p.name.clone()).collect()
        };
        assert_eq!(names(&stack_store), names(&graph_store));
        graph_store.assign(&stack_store.weights()?)?;
        let x = Tensor::randn(0f32, 1., (4, 3, 32, 32), &Device::Cpu)?;
        for train in [false, true] {
            let a = stack
                .forward_t(&x, train)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let b = graph
                .forward_t(&x, train)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "train {train}: the outputs differ");
        }
        Ok(())
    }

    /// A training step of the functional form, whose concatenations hand their BatchNorm
    /// branches views of the gradient as the `Sequential`'s do, updates the variables as the
    /// `Sequential`'s step does.
    #[test]
    fn the_functional_form_trains_as_the_sequential() -> kandle::Result<()> {
        use candle_core::{Device, Tensor};
        use kandle::prelude::*;
        let compile = |net: Model| net.with_seed(5);
        let optimizer = || Sgd::new(0.05).momentum(0.9);
        let strategy = OneDeviceStrategy::cpu();
        let loss = SparseCategoricalCrossentropy::new;
        let mut stack = compile(mini_googlenet(10).input_shape(&[3, 32, 32]).compile(
            optimizer(),
            loss(),
            [Accuracy],
            &strategy,
        )?)?;
        let mut graph = compile(mini_googlenet_functional(10)?.compile(
            optimizer(),
            loss(),
            [Accuracy],
            &strategy,
        )?)?;
        graph.set_weights(&stack.get_weights()?)?;
        let x = Tensor::randn(0f32, 1., (4, 3, 32, 32), &Device::Cpu)?;
        let y = Tensor::new(&[1u32, 7, 3, 3], &Device::Cpu)?;
        for _ in 0..2 {
            stack.train_on_batch(&x, &y, None)?;
            graph.train_on_batch(&x, &y, None)?;
        }
        let (a, b) = (stack.get_weights()?, graph.get_weights()?);
        assert_eq!(a.len(), b.len());
        for (name, want) in &a {
            let got = b.get(name).expect("the same variables");
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{name} differs by {diff}");
        }
        Ok(())
    }

    #[test]
    fn parameter_counts_match_keras() -> kandle::Result<()> {
        let summary = mini_googlenet(10).summary(&[3, 32, 32])?;
        assert_eq!(summary.total(), 1_656_250);
        assert_eq!(summary.trainable, 1_652_826);
        assert_eq!(summary.non_trainable, 3_424);
        let last = summary.rows.last().map(|r| r.output_shape.clone());
        assert_eq!(last, Some(vec![10]));
        let names: Vec<&str> = summary.rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            &names[..4],
            ["stem", "inception_1", "inception_2", "downsample_1"]
        );
        Ok(())
    }

    #[test]
    fn forward_shape_and_stable_names() -> kandle::Result<()> {
        let (net, store, _) =
            mini_googlenet(10).build_network(&candle_core::Device::Cpu, &[3, 32, 32], 0)?;
        let x = candle_core::Tensor::zeros(
            (2, 3, 32, 32),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )?;
        use kandle::layers::Layer;
        assert_eq!(net.forward_t(&x, false)?.dims(), &[2, 10]);
        assert!(store
            .get("inception_2.branch_3x3.bn.running_mean")
            .is_some());
        assert!(store.get("downsample_1.branch_conv.conv.weight").is_some());
        assert!(store.get("classifier.weight").is_some());
        Ok(())
    }
}
