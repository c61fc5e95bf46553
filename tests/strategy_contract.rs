//! The `Strategy` trait is enough for data parallelism: a second implementation written here,
//! two CPU replicas with an in-process mean, trains through the unchanged `fit` to the same
//! weights as `OneDeviceStrategy` at the same global batch, short last batch included.

use candle_core::{DType, Device, Tensor};
use kandle::data::{Batch, InMemoryDataset};
use kandle::layers::Summary;
use kandle::params::Weights;
use kandle::prelude::*;
use kandle::strategy::{DistributedModel, ModelSpec, Replica, StepStats, WorkerHooks};

/// Two replicas on the CPU; each takes half of every batch (the first gets the extra sample
/// of an odd batch), the gradients are summed in process, and both apply the same update.
#[derive(Clone)]
struct TwoCpuReplicas;

struct TwoReplicaModel {
    replicas: Vec<Replica>,
}

impl Strategy for TwoCpuReplicas {
    fn name(&self) -> &str {
        "two_cpu_replicas"
    }

    fn num_replicas_in_sync(&self) -> usize {
        2
    }

    fn distribute(&self, spec: &ModelSpec) -> kandle::Result<Box<dyn DistributedModel>> {
        let replicas = vec![
            Replica::new(spec, &Device::Cpu)?,
            Replica::new(spec, &Device::Cpu)?,
        ];
        replicas[1]
            .store()
            .assign(&replicas[0].store().weights()?)?;
        Ok(Box::new(TwoReplicaModel { replicas }))
    }
}

fn halves(batch: &Batch) -> kandle::Result<[Batch; 2]> {
    let n = batch.len();
    let first = n.div_ceil(2);
    Ok([batch.narrow(0, first)?, batch.narrow(first, n - first)?])
}

impl WorkerHooks for TwoReplicaModel {}

impl DistributedModel for TwoReplicaModel {
    fn train_step(&mut self, batch: &Batch, lr: f64) -> kandle::Result<StepStats> {
        // Each replica's step buffer; summing them is all a strategy decides.
        let parts = halves(batch)?;
        let mut buffers = Vec::new();
        for (replica, part) in self.replicas.iter().zip(&parts) {
            buffers.push(replica.step_buffer(part)?);
        }
        let total = (&buffers[0].fused + &buffers[1].fused)?;
        let totals = self.replicas[0].layout().read(&total)?;
        for (replica, buffer) in self.replicas.iter_mut().zip(&buffers) {
            replica.finish_step(&total, &totals, &buffer.statistics_before, lr)?;
        }
        Ok(totals.into_stats())
    }

    fn test_step(&mut self, batch: &Batch) -> kandle::Result<StepStats> {
        let sums = self.replicas[0]
            .evaluate(batch)?
            .to_dtype(DType::F64)?
            .to_vec1()?;
        Ok(StepStats {
            samples: batch.len(),
            sums,
            applied: false,
        })
    }

    fn summary(&self) -> &Summary {
        self.replicas[0].summary()
    }

    fn predict_step(&mut self, inputs: &[Tensor]) -> kandle::Result<Vec<Tensor>> {
        self.replicas[0].predict(inputs)
    }

    fn weights(&self) -> kandle::Result<Weights> {
        self.replicas[0].store().weights()
    }

    fn set_weights(&mut self, weights: &Weights) -> kandle::Result<()> {
        for r in &self.replicas {
            r.store().assign(weights)?;
        }
        Ok(())
    }
}

fn train<S: Strategy + Clone + 'static>(
    strategy: &S,
    data: &InMemoryDataset,
) -> anyhow::Result<Weights> {
    let net = Sequential::new()
        .add(Conv2D::new(4, 3).padding(Padding::Same))
        .add(Activation::Relu)
        .add(Flatten)
        .add(Dense::new(10))
        .add(Activation::Softmax);
    let mut model = net
        .compile(
            Sgd::new(0.05).momentum(0.9),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            strategy,
        )?
        .with_seed(3)?;
    // Batch 25 per replica-pair step: 50 global, so 230 samples end with a short batch of 30.
    let history = model.fit(
        data,
        FitOptions {
            epochs: 2,
            batch_size_per_replica: 50 / strategy.num_replicas_in_sync(),
            seed: Some(11),
            verbosity: kandle::callbacks::Verbosity::Silent,
            ..Default::default()
        },
    )?;
    assert_eq!(history.epochs, vec![0, 1]);
    Ok(model.get_weights()?)
}

#[test]
fn second_strategy_matches_one_device() -> anyhow::Result<()> {
    let digits = kandle::data::digits::load()?;
    let data = digits.subset(&(0..230).collect::<Vec<_>>())?;
    let reference = train(&OneDeviceStrategy::cpu(), &data)?;
    let replicated = train(&TwoCpuReplicas, &data)?;
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        replicated.keys().collect::<Vec<_>>()
    );
    for (name, want) in &reference {
        let got = &replicated[name];
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-3);
        assert!(
            diff / scale < 1e-5,
            "{name}: relative difference {}",
            diff / scale
        );
    }
    Ok(())
}
