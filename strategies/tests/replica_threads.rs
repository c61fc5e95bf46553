//! Replicas sharing the CPU each run in a rayon pool of their thread budget, so they do not
//! oversubscribe the cores: the pool size a layer sees inside a replica is the configured one.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use kandle::prelude::*;
use kandle_strategies::{CentralStorageStrategy, MirroredStrategy, ReplicaOptions, ReplicaThreads};

/// The rayon pool sizes seen by the layers of every replica during one epoch of training.
fn pool_sizes_during_fit<S: Strategy + Clone + 'static>(
    strategy: &S,
) -> kandle::Result<Vec<usize>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let probe = CandleLayer::new(move |_vb| {
        let record = Arc::clone(&record);
        Ok(move |x: &Tensor| {
            // Building the layer runs it once on a single sample, outside the replicas.
            if x.dim(0)? > 1 {
                if let Ok(mut seen) = record.lock() {
                    seen.push(rayon::current_num_threads());
                }
            }
            Ok(x.clone())
        })
    });
    let net = Sequential::new()
        .add(Flatten)
        .add(probe)
        .add(Dense::new(10))
        .add(Activation::Softmax);
    let mut model = net.compile(
        Sgd::new(0.1),
        SparseCategoricalCrossentropy::new(),
        [Accuracy],
        strategy,
    )?;
    let (train, _) = kandle::data::digits::load()?.train_test_split(0.9, 0)?;
    model.fit(
        &train,
        FitOptions {
            batch_size_per_replica: 16,
            steps_per_epoch: Some(3),
            verbosity: Verbosity::Silent,
            ..Default::default()
        },
    )?;
    let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(seen.len(), 3 * strategy.num_replicas_in_sync(), "{seen:?}");
    Ok(seen)
}

#[test]
fn configured_budget_is_the_pool_each_replica_runs_in() -> kandle::Result<()> {
    let three = ReplicaOptions::default().threads_per_replica(3);
    let sizes = pool_sizes_during_fit(&MirroredStrategy::cpu(2)?.with_options(three))?;
    assert!(sizes.iter().all(|&n| n == 3), "{sizes:?}");
    let one = ReplicaOptions::default().threads_per_replica(1);
    let sizes = pool_sizes_during_fit(&CentralStorageStrategy::cpu(2)?.with_options(one))?;
    assert!(sizes.iter().all(|&n| n == 1), "{sizes:?}");
    Ok(())
}

#[test]
fn default_budget_divides_the_cores_among_cpu_replicas() -> kandle::Result<()> {
    let cores = rayon::current_num_threads();
    let sizes = pool_sizes_during_fit(&MirroredStrategy::cpu(2)?)?;
    let each = (cores / 2).max(1);
    assert!(sizes.iter().all(|&n| n == each), "{cores} cores: {sizes:?}");
    let shared = ReplicaOptions::default().threads_per_replica(ReplicaThreads::Shared);
    let sizes = pool_sizes_during_fit(&MirroredStrategy::cpu(2)?.with_options(shared))?;
    assert!(
        sizes.iter().all(|&n| n == cores),
        "{cores} cores: {sizes:?}"
    );
    Ok(())
}

#[test]
fn a_zero_budget_is_refused() -> kandle::Result<()> {
    let net = Sequential::new().add(Flatten).add(Dense::new(2));
    let err = net
        .input_shape(&[4])
        .compile(
            Sgd::new(0.1),
            MeanSquaredError,
            (),
            &MirroredStrategy::cpu(2)?
                .with_options(ReplicaOptions::default().threads_per_replica(0)),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("threads_per_replica must be at least 1"),
        "{err}"
    );
    Ok(())
}
