//! A replica that stalls or panics ends the step with an error naming it, within the timeout;
//! it never hangs `fit`.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use kandle::layers::{BuildContext, Built, Layer, LayerSpec};
use kandle::prelude::*;
use kandle_strategies::{MirroredStrategy, ReplicaOptions};

/// What replica 1 does in its forward pass.
#[derive(Clone, Copy)]
enum Fault {
    Stall,
    Panic,
}

/// Identity, except on the thread of replica 1, where it stalls or panics.
#[derive(Clone)]
struct FaultyOnReplica1(Fault);

struct FaultyLayer(Fault);

impl LayerSpec for FaultyOnReplica1 {
    fn kind(&self) -> &'static str {
        "faulty"
    }
    fn build(&self, _ctx: &mut BuildContext, input_shape: &[usize]) -> kandle::Result<Built> {
        Ok(Built::leaf(FaultyLayer(self.0), input_shape.to_vec()))
    }
    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

impl Layer for FaultyLayer {
    fn forward_t(&self, x: &Tensor, _train: bool) -> kandle::Result<Tensor> {
        if std::thread::current().name() == Some("kandle-replica-1") {
            match self.0 {
                Fault::Stall => std::thread::sleep(Duration::from_secs(30)),
                Fault::Panic => panic!("simulated device failure"),
            }
        }
        Ok(x.clone())
    }
}

fn fit_with(fault: Fault) -> anyhow::Result<(kandle::Error, Duration)> {
    let data = kandle::data::digits::load()?.subset(&(0..64).collect::<Vec<_>>())?;
    let options = ReplicaOptions::default().timeout(Duration::from_secs(2));
    let strategy = MirroredStrategy::cpu(2)?.with_options(options);
    let net = Sequential::new()
        .add(Flatten)
        .add(FaultyOnReplica1(fault))
        .add(Dense::new(10))
        .add(Activation::Softmax);
    let mut model = net.compile(
        Sgd::new(0.1),
        SparseCategoricalCrossentropy::new(),
        (),
        &strategy,
    )?;
    let start = Instant::now();
    let err = model
        .fit(
            &data,
            FitOptions {
                batch_size_per_replica: 16,
                verbosity: Verbosity::Silent,
                ..Default::default()
            },
        )
        .expect_err("a failing replica must fail the step");
    Ok((err, start.elapsed()))
}

#[test]
fn a_stalled_replica_fails_the_step_within_the_timeout() -> anyhow::Result<()> {
    let (err, elapsed) = fit_with(Fault::Stall)?;
    let msg = err.to_string();
    assert!(
        msg.contains("replica 1 (cpu)") && msg.contains("did not answer within 2 s"),
        "{msg}"
    );
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    Ok(())
}

#[test]
fn a_panicking_replica_is_named() -> anyhow::Result<()> {
    let (err, _) = fit_with(Fault::Panic)?;
    let msg = err.to_string();
    assert!(
        msg.contains("replica 1 (cpu)") && msg.contains("simulated device failure"),
        "{msg}"
    );
    Ok(())
}
