//! A layer written against the public `Layer` trait alone (`forward_t`, nothing else) trains
//! under every strategy as one device does, and through the recorded backward pass (which runs
//! it under candle's autograd) as through candle's autograd end to end.

use candle_core::{Tensor, Var};
use kandle::layers::{BuildContext, Built, Layer, LayerSpec};
use kandle::params::{Init, Weights};
use kandle::prelude::*;
use kandle::ComputePath;
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy};

use kandle_testing::strategies as support;
use support::equivalence_run::{train, train_on, Order, SAMPLES};
use support::Reference;

/// `y = x * scale + shift`, one scale and shift per feature: a user's layer with variables.
struct FeatureAffine {
    scale: Var,
    shift: Var,
}

impl Layer for FeatureAffine {
    fn forward_t(&self, x: &Tensor, _train: bool) -> kandle::Result<Tensor> {
        Ok(x.broadcast_mul(self.scale.as_tensor())?
            .broadcast_add(self.shift.as_tensor())?)
    }
}

/// The recipe of [`FeatureAffine`].
#[derive(Clone)]
struct FeatureAffineSpec;

impl LayerSpec for FeatureAffineSpec {
    fn kind(&self) -> &'static str {
        "feature_affine"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> kandle::Result<Built> {
        let scale = ctx.variable("scale", input_shape, Init::Constant(1.5))?;
        let shift = ctx.variable("shift", input_shape, Init::Constant(0.1))?;
        Ok(Built::leaf(
            FeatureAffine { scale, shift },
            input_shape.to_vec(),
        ))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

/// A CNN with the user's layer between two of kandle's, so gradients pass through it both ways.
fn net() -> Sequential {
    Sequential::new()
        .add(Conv2D::new(6, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(16))
        .add(FeatureAffineSpec)
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
}

fn weights<S: Strategy + Clone + 'static>(strategy: &S) -> anyhow::Result<Weights> {
    Ok(train(net(), strategy, SAMPLES)?.get_weights()?)
}

#[test]
fn a_user_layer_trains_under_every_strategy_as_on_one_device() -> anyhow::Result<()> {
    let one = OneDeviceStrategy::cpu();
    let run = |path, order| -> anyhow::Result<Weights> {
        Ok(train_on(net(), &one, SAMPLES, Some(path), order)?.get_weights()?)
    };
    let reference = Reference::new(
        run(ComputePath::Auto, Order::Fixed)?,
        &run(ComputePath::Auto, Order::ReversedInBatches)?,
    )?;
    // The user's variables were trained.
    let scale = reference.weights["feature_affine_1.scale"].flatten_all()?;
    let moved = (scale - 1.5)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(moved > 1e-3, "the user layer's scale moved by {moved} only");

    reference.assert_matches(&weights(&MirroredStrategy::cpu(2)?)?, "mirrored x2")?;
    reference.assert_matches(
        &weights(&CentralStorageStrategy::cpu(2)?)?,
        "central storage x2",
    )?;
    reference.assert_matches(
        &run(ComputePath::DeviceGeneric, Order::Fixed)?,
        "candle's autograd end to end",
    )?;
    Ok(())
}

#[test]
fn a_user_layer_learns_digits() -> anyhow::Result<()> {
    let (train_set, test_set) = kandle::data::digits::load()?.train_test_split(0.2, 7)?;
    let mut model = Sequential::new()
        .add(Flatten)
        .add(Dense::new(32))
        .add(FeatureAffineSpec)
        .add(Activation::Relu)
        .add(Dense::new(10))
        .add(Activation::Softmax)
        .compile(
            Adam::new(1e-2),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &MirroredStrategy::cpu(2)?,
        )?
        .with_seed(3)?;
    model.fit(
        &train_set,
        FitOptions {
            epochs: 10,
            batch_size_per_replica: 16,
            seed: Some(1),
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let accuracy = model
        .evaluate(&test_set, 64)?
        .get("accuracy")
        .unwrap_or(0.0);
    assert!(accuracy >= 0.93, "test accuracy {accuracy}");
    Ok(())
}
