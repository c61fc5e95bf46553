//! `LearningRateScheduler` inside `fit`: the schedule's rate is set before every epoch and
//! recorded as `lr` in the history.

use kandle::callbacks::{Callback, LearningRateScheduler, Verbosity};
use kandle::data::{Dataset, Targets};
use kandle::layers::{Activation, Dense, Sequential};
use kandle::optimizers::Sgd;
use kandle::prelude::{Accuracy, SparseCategoricalCrossentropy};
use kandle::schedules::PolynomialDecay;
use kandle::Compile;
use kandle::{Error, FitOptions, Model, OneDeviceStrategy};

/// Eight points in the plane, class 1 when x + y > 0.
struct Points;

const POINTS: [[f32; 2]; 8] = [
    [1.0, 0.5],
    [-1.0, -0.5],
    [0.3, 0.9],
    [-0.2, -0.8],
    [0.7, -0.1],
    [-0.6, 0.2],
    [0.1, 0.4],
    [-0.9, 0.3],
];

impl Dataset for Points {
    fn len(&self) -> usize {
        POINTS.len()
    }
    fn sample_shape(&self) -> &[usize] {
        &[2]
    }
    fn targets(&self) -> Targets {
        Targets::Classes(2)
    }
    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> kandle::Result<()> {
        let p = POINTS[index];
        x.copy_from_slice(&p);
        y[0] = if p[0] + p[1] > 0.0 { 1.0 } else { 0.0 };
        Ok(())
    }
}

fn tiny_model() -> kandle::Result<Model> {
    Sequential::new()
        .add(Dense::new(4))
        .add(Activation::Relu)
        .add(Dense::new(2))
        .add(Activation::Softmax)
        .compile(
            Sgd::new(0.5).momentum(0.9),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &OneDeviceStrategy::cpu(),
        )
}

fn options(callbacks: Vec<Box<dyn Callback>>) -> FitOptions<'static> {
    FitOptions {
        epochs: 4,
        batch_size_per_replica: 4,
        callbacks,
        verbosity: Verbosity::Silent,
        ..Default::default()
    }
}

#[test]
fn polynomial_decay_sets_each_epochs_rate() -> anyhow::Result<()> {
    let mut model = tiny_model()?;
    let schedule = LearningRateScheduler::new(PolynomialDecay::new(0.1, 4, 1.0));
    let history = model.fit(&Points, options(vec![schedule.boxed()]))?;
    let lr = history.series("lr");
    let expected = [0.1, 0.075, 0.05, 0.025];
    assert_eq!(lr.len(), expected.len(), "lr series {lr:?}");
    for (got, want) in lr.iter().zip(expected) {
        assert!(
            (got - want).abs() <= 1e-12,
            "lr series {lr:?}, expected {expected:?}"
        );
    }
    assert!((model.learning_rate() - 0.025).abs() <= 1e-12);
    Ok(())
}

#[test]
fn closure_sees_the_current_rate() -> anyhow::Result<()> {
    let mut model = tiny_model()?;
    // Keras's signature: halve the current rate every epoch after the first.
    let halve = LearningRateScheduler::from_fn(|epoch, lr| if epoch == 0 { lr } else { lr / 2.0 });
    let history = model.fit(&Points, options(vec![halve.boxed()]))?;
    assert_eq!(history.series("lr"), vec![0.5, 0.25, 0.125, 0.0625]);
    Ok(())
}

#[test]
fn a_bad_rate_stops_fit_with_an_error() -> anyhow::Result<()> {
    for bad in [-0.1, f64::NAN, f64::INFINITY] {
        let mut model = tiny_model()?;
        let schedule =
            LearningRateScheduler::new(move |epoch: usize| if epoch < 2 { 0.1 } else { bad });
        match model.fit(&Points, options(vec![schedule.boxed()])) {
            Err(Error::InvalidInput(msg)) => {
                assert!(msg.contains("epoch 2"), "{msg}");
            }
            Err(other) => panic!("expected Error::InvalidInput for {bad}, got {other}"),
            Ok(history) => panic!(
                "expected an error for {bad}, got {:?}",
                history.series("lr")
            ),
        }
        // The last good rate stays in place.
        assert_eq!(model.learning_rate(), 0.1);
    }
    Ok(())
}
