//! `MirroredStrategy`: a copy of the model on every device of this process, one thread per
//! replica; each step the global batch is split across replicas, their step buffers are summed
//! as one fused buffer, and every replica runs the same final phase on the sum.

use candle_core::Device;
use kandle::strategy::{DistributedModel, ModelSpec, Strategy};
use kandle::Result;

use crate::cross_device_ops::CrossDeviceOps;
use crate::replica_set::{all_gpus, replica_devices, ReplicaModel, ReplicaOptions, ReplicaSet};

/// The strategy's name in messages.
const NAME: &str = "MirroredStrategy";

/// Synchronous data parallelism over the devices of one process.
///
/// ```
/// use kandle_strategies::{CrossDeviceOps, MirroredStrategy};
/// use kandle::Strategy;
///
/// let strategy = MirroredStrategy::cpu(2)?.cross_device_ops(CrossDeviceOps::HierarchicalCopy);
/// assert_eq!(strategy.num_replicas_in_sync(), 2);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MirroredStrategy {
    devices: Vec<Device>,
    options: ReplicaOptions,
    /// `None`: [`CrossDeviceOps::default_for`] the devices.
    ops: Option<CrossDeviceOps>,
}

impl MirroredStrategy {
    /// One replica per device. Fails on an empty list.
    pub fn new(devices: Vec<Device>) -> Result<Self> {
        Ok(Self {
            devices: replica_devices(devices, NAME)?,
            options: ReplicaOptions::default(),
            ops: None,
        })
    }

    /// One replica per visible GPU (`CUDA_VISIBLE_DEVICES` is honoured). Fails when there is
    /// none or kandle was built without `cuda`.
    pub fn all_gpus() -> Result<Self> {
        Self::new(all_gpus(NAME)?)
    }

    /// `replicas` replicas on the CPU.
    pub fn cpu(replicas: usize) -> Result<Self> {
        Self::new(vec![Device::Cpu; replicas])
    }

    /// How replicas sum their step buffers and their `SyncBatchNorm` statistics (default
    /// [`CrossDeviceOps::default_for`] the devices: NCCL between distinct GPUs when built with
    /// the `nccl` feature, as TensorFlow's `MirroredStrategy` does, otherwise
    /// [`CrossDeviceOps::ReductionToOneDevice`]).
    pub fn cross_device_ops(mut self, ops: CrossDeviceOps) -> Self {
        self.ops = Some(ops);
        self
    }

    /// How the replicas sum: the ops set with [`cross_device_ops`](Self::cross_device_ops), or
    /// the devices' default.
    pub fn ops(&self) -> CrossDeviceOps {
        self.ops
            .unwrap_or_else(|| CrossDeviceOps::default_for(&self.devices))
    }

    /// How the replicas run: SyncBatchNorm, the timeout, threads per replica (default
    /// [`ReplicaOptions::default`]).
    pub fn with_options(self, options: ReplicaOptions) -> Self {
        Self { options, ..self }
    }

    /// The replicas' options.
    pub fn options(&self) -> &ReplicaOptions {
        &self.options
    }

    /// The replicas' devices.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
}

impl Strategy for MirroredStrategy {
    fn name(&self) -> &str {
        "mirrored"
    }

    fn num_replicas_in_sync(&self) -> usize {
        self.devices.len()
    }

    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        let ops = self.ops();
        let mut set = ReplicaSet::build(spec, &self.devices, &self.options, ops)?;
        // Replicas whose steps are captured as CUDA graphs sum their step buffers after the
        // passes: a captured step cannot hand buckets in midway.
        let graphed = kandle::devices::cuda_graphs() && self.devices.iter().all(Device::is_cuda);
        if let Some(bytes) = self.options.gradient_buckets.filter(|_| !graphed) {
            set.use_buckets(ops, bytes, self.options.timeout, None)?;
        }
        Ok(Box::new(ReplicaModel { set, reduce: ops }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kandle::data::Batch;
    use kandle::layers::{Activation, BatchNormalization, Conv2D, Dense, Flatten, Sequential};
    use kandle::losses::SparseCategoricalCrossentropy;
    use kandle::metrics::Accuracy;
    use kandle::optimizers::Sgd;
    use kandle::Compile;

    type MirroredModel = ReplicaModel<CrossDeviceOps>;

    /// `spec` on three CPU replicas, as `MirroredStrategy::cpu(3)` distributes it.
    fn three_replicas(spec: &ModelSpec) -> Result<MirroredModel> {
        Ok(ReplicaModel {
            set: ReplicaSet::build(
                spec,
                &[Device::Cpu, Device::Cpu, Device::Cpu],
                &ReplicaOptions::default(),
                CrossDeviceOps::default(),
            )?,
            reduce: CrossDeviceOps::default(),
        })
    }

    fn statistics_of(model: &MirroredModel) -> Result<Vec<Vec<f32>>> {
        model
            .set
            .stores
            .iter()
            .map(|s| {
                let parts = s
                    .iter()
                    .filter(|p| p.statistic)
                    .map(|p| Ok(p.var.as_tensor().flatten_all()?.to_vec1::<f32>()?))
                    .collect::<Result<Vec<_>>>()?;
                Ok(parts.concat())
            })
            .collect()
    }

    /// A small CNN with batch norm for digits, SGD at 0.1, on `path` under `policy`.
    fn bn_spec(path: kandle::ComputePath, policy: kandle::DTypePolicy) -> ModelSpec {
        ModelSpec {
            network: Sequential::new()
                .add(Conv2D::new(4, 3))
                .add(BatchNormalization::new())
                .add(Activation::Relu)
                .add(Flatten)
                .add(Dense::new(10))
                .add(Activation::Softmax)
                .into(),
            input_shapes: vec![vec![1, 8, 8]],
            optimizer: Box::new(Sgd::new(0.1)),
            loss: kandle::Objective::new(SparseCategoricalCrossentropy::new()),
            metrics: [Accuracy].into(),
            seed: 1,
            compute_path: path,
            dtype_policy: policy,
        }
    }

    #[test]
    fn per_replica_batch_norm_keeps_moving_statistics_identical() -> Result<()> {
        let spec = bn_spec(kandle::ComputePath::Auto, kandle::DTypePolicy::default());
        let mut model = three_replicas(&spec)?;
        let data = kandle::data::digits::load()?;
        let (x, y) = data.to_tensors()?;
        for step in 0..3 {
            // 20 samples over 3 replicas: parts of 7, 7 and 6 with different statistics.
            let batch = Batch::new(x.narrow(0, step * 20, 20)?, y.narrow(0, step * 20, 20)?);
            model.train_step(&batch, 0.1)?;
            let stats = statistics_of(&model)?;
            assert!(stats[0].iter().any(|v| *v != 0.0 && *v != 1.0));
            assert_eq!(stats[0], stats[1], "step {step}");
            assert_eq!(stats[0], stats[2], "step {step}");
        }
        Ok(())
    }

    #[test]
    fn every_replica_gets_the_loaded_optimizer_state() -> Result<()> {
        let spec = ModelSpec {
            network: Sequential::new()
                .add(Flatten)
                .add(Dense::new(10))
                .add(Activation::Softmax)
                .into(),
            input_shapes: vec![vec![1, 8, 8]],
            optimizer: Box::new(Sgd::new(0.1).momentum(0.9)),
            loss: kandle::Objective::new(SparseCategoricalCrossentropy::new()),
            metrics: [Accuracy].into(),
            seed: 1,
            compute_path: kandle::ComputePath::Auto,
            dtype_policy: kandle::DTypePolicy::default(),
        };
        let build = |seed| -> Result<MirroredModel> {
            let spec = ModelSpec {
                seed,
                ..spec.clone()
            };
            three_replicas(&spec)
        };
        let data = kandle::data::digits::load()?;
        let (x, y) = data.to_tensors()?;
        let mut trained = build(1)?;
        for step in 0..2 {
            let batch = Batch::new(x.narrow(0, step * 12, 12)?, y.narrow(0, step * 12, 12)?);
            trained.train_step(&batch, 0.1)?;
        }
        let state = trained.optimizer_state()?;
        let mut fresh = build(2)?;
        fresh.set_optimizer_state(&state)?;
        let momenta = fresh.set.pool.run(vec![(); 3], |_, replica, ()| {
            let state = replica.optimizer_state()?;
            let mut values = Vec::new();
            for t in state.slots["momentum"].values() {
                values.extend(t.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(values)
        })?;
        let mut want = Vec::new();
        for t in state.slots["momentum"].values() {
            want.extend(t.flatten_all()?.to_vec1::<f32>()?);
        }
        assert!(want.iter().any(|v| *v != 0.0));
        for (i, got) in momenta.iter().enumerate() {
            assert_eq!(got, &want, "replica {i}");
        }
        Ok(())
    }

    /// Mixed precision's loss scale under three replicas: an overflow halves it on every one,
    /// and an applied step counts on every one, so they stay equal.
    #[test]
    fn every_replica_keeps_the_same_loss_scale() -> Result<()> {
        let policy =
            kandle::DTypePolicy::mixed_float16().with_loss_scale(Some(kandle::LossScale {
                initial: 2f64.powi(40),
                growth_steps: 2000,
            }));
        let spec = bn_spec(kandle::ComputePath::DeviceGeneric, policy);
        let mut model = three_replicas(&spec)?;
        let data = kandle::data::digits::load()?;
        let (x, y) = data.to_tensors()?;
        let scales = |model: &MirroredModel| -> Result<Vec<Vec<f32>>> {
            model
                .set
                .stores
                .iter()
                .map(|s| {
                    let p = s.get(kandle::mixed_precision::LOSS_SCALE);
                    let p = p.ok_or_else(|| kandle::Error::invalid("no loss scale"))?;
                    Ok(p.var.as_tensor().to_vec1::<f32>()?)
                })
                .collect()
        };
        let mut applied = 0;
        for step in 0..40 {
            let batch = Batch::new(x.narrow(0, step * 21, 21)?, y.narrow(0, step * 21, 21)?);
            applied += usize::from(model.train_step(&batch, 0.1)?.applied);
            let scales = scales(&model)?;
            assert!(
                scales.iter().all(|s| *s == scales[0]),
                "step {step}: {scales:?}"
            );
        }
        let [scale, good] = scales(&model)?[0][..] else {
            return Err(kandle::Error::invalid("the loss scale holds two values"));
        };
        assert!(scale < 2f32.powi(20), "{scale}");
        assert!(applied > 0 && good as usize == applied, "{good} {applied}");
        Ok(())
    }

    /// Two convolutions with batch norm and a dense layer: in buckets of 1 KiB, five buckets.
    fn deep_spec(policy: kandle::DTypePolicy) -> ModelSpec {
        ModelSpec {
            network: Sequential::new()
                .add(Conv2D::new(4, 3))
                .add(BatchNormalization::new())
                .add(Activation::Relu)
                .add(Conv2D::new(8, 3))
                .add(BatchNormalization::new())
                .add(Activation::Relu)
                .add(Flatten)
                .add(Dense::new(10))
                .add(Activation::Softmax)
                .into(),
            optimizer: Box::new(Sgd::new(0.1).momentum(0.9)),
            ..bn_spec(kandle::ComputePath::Auto, policy)
        }
    }

    /// Trains `spec` on three replicas, its gradients summed in buckets of `bucket_bytes`
    /// (whole buffers for `None`) with `ops`: steps of 20 samples (parts of 7, 7 and 6), one of
    /// 2 (a replica without samples), and one update over two accumulated micro-batches.
    /// Returns the weights and the buckets handed in during backward passes.
    fn train_in_buckets(
        spec: &ModelSpec,
        ops: CrossDeviceOps,
        bucket_bytes: Option<usize>,
    ) -> Result<(Vec<Vec<f32>>, usize)> {
        let options = ReplicaOptions::default().gradient_buckets(bucket_bytes);
        let mut set = ReplicaSet::build(
            spec,
            &[Device::Cpu, Device::Cpu, Device::Cpu],
            &options,
            ops,
        )?;
        if let Some(bytes) = bucket_bytes {
            set.use_buckets(ops, bytes, options.timeout, None)?;
        }
        let mut model = ReplicaModel { set, reduce: ops };
        let data = kandle::data::digits::load()?;
        let (x, y) = data.to_tensors()?;
        let batch = |start: usize, len: usize| -> Result<Batch> {
            Ok(Batch::new(
                x.narrow(0, start, len)?,
                y.narrow(0, start, len)?,
            ))
        };
        for step in 0..4 {
            assert!(model.train_step(&batch(step * 20, 20)?, 0.05)?.applied);
        }
        assert!(model.train_step(&batch(100, 2)?, 0.05)?.applied);
        model.accumulate(&batch(120, 10)?)?;
        assert!(model.train_step(&batch(130, 11)?, 0.05)?.applied);
        let weights = model.weights()?;
        let values = weights
            .values()
            .map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
            .collect::<Result<Vec<_>>>()?;
        Ok((values, model.set.buckets_during_backward()))
    }

    #[test]
    fn gradient_buckets_train_as_whole_buffers_bit_for_bit() -> Result<()> {
        let scaled =
            kandle::DTypePolicy::mixed_float16().with_loss_scale(Some(kandle::LossScale {
                initial: 2f64.powi(10),
                growth_steps: 2000,
            }));
        for policy in [kandle::DTypePolicy::default(), scaled] {
            let spec = deep_spec(policy);
            for ops in [
                CrossDeviceOps::ReductionToOneDevice,
                CrossDeviceOps::HierarchicalCopy,
            ] {
                let (whole, none) = train_in_buckets(&spec, ops, None)?;
                assert_eq!(none, 0);
                let (bucketed, early) = train_in_buckets(&spec, ops, Some(1024))?;
                assert_eq!(bucketed, whole, "{ops:?} under {policy:?}");
                // Five buckets on three replicas from the second step on, but for the replica
                // without samples and the update after an accumulated micro-batch.
                assert_eq!(early, 5 * (3 * 3 + 2), "{ops:?} under {policy:?}");
            }
        }
        Ok(())
    }

    /// Mirrored with one replica trains as one device does (through `Replica::train_alone`,
    /// nothing to sum): the same weights after two epochs of digits with batch normalisation,
    /// gradient accumulation and a momentum, and the same history.
    #[test]
    fn one_replica_trains_as_one_device() -> Result<()> {
        fn run<S: Strategy + Clone + 'static>(
            strategy: &S,
        ) -> Result<(kandle::params::Weights, Vec<f64>)> {
            let net = Sequential::new()
                .add(Flatten)
                .add(Dense::new(16))
                .add(BatchNormalization::new())
                .add(Activation::Relu)
                .add(Dense::new(10))
                .add(Activation::Softmax);
            let data = kandle::data::digits::load()?.subset(&(0..96).collect::<Vec<_>>())?;
            let sgd = Sgd::new(0.05).momentum(0.9).gradient_accumulation_steps(2);
            let mut model = net
                .compile(
                    sgd,
                    SparseCategoricalCrossentropy::new(),
                    [Accuracy],
                    strategy,
                )?
                .with_seed(3)?;
            let history = model.fit(
                &data,
                kandle::FitOptions {
                    epochs: 2,
                    batch_size_per_replica: 8,
                    verbosity: kandle::callbacks::Verbosity::Silent,
                    ..Default::default()
                },
            )?;
            Ok((model.get_weights()?, history.series("loss")))
        }
        let (one, one_loss) = run(&kandle::OneDeviceStrategy::cpu())?;
        let (mirrored, mirrored_loss) = run(&MirroredStrategy::cpu(1)?)?;
        assert_eq!(one_loss, mirrored_loss);
        let bits = |t: &candle_core::Tensor| -> Result<Vec<u32>> {
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(v.iter().map(|x| x.to_bits()).collect())
        };
        for (name, value) in &one {
            assert_eq!(bits(value)?, bits(&mirrored[name])?, "{name}");
        }
        Ok(())
    }

    /// A model without trainable variables has no gradient to put in buckets: its steps run.
    #[test]
    fn a_model_without_trainable_variables_trains_under_buckets() -> Result<()> {
        let spec = ModelSpec {
            network: Sequential::new()
                .add(Flatten)
                .add(Activation::Softmax)
                .into(),
            input_shapes: vec![vec![10]],
            ..bn_spec(kandle::ComputePath::Auto, kandle::DTypePolicy::default())
        };
        let mut model = MirroredStrategy::cpu(2)?.distribute(&spec)?;
        let x = kandle_testing::random::seeded_normal(&[6, 10], 1.0, 1)?;
        let y = candle_core::Tensor::new(&[0u32, 1, 2, 3, 4, 5], &Device::Cpu)?;
        let stats = model.train_step(&Batch::new(x, y), 0.1)?;
        assert_eq!(stats.samples, 6);
        assert!(stats.applied && stats.sums[0].is_finite());
        Ok(())
    }

    /// Counts the reductions of a [`ReplicaModel`]'s steps.
    struct CountingOps(
        CrossDeviceOps,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    );

    impl crate::replica_set::Reduce for CountingOps {
        fn reduce_step(
            &mut self,
            set: &mut ReplicaSet,
            batch: &Batch,
        ) -> Result<(Vec<candle_core::Tensor>, Vec<Vec<candle_core::Tensor>>)> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.0.reduce_step(set, batch)
        }
    }

    /// Two CPU replicas whose reductions are counted.
    #[derive(Clone)]
    struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Strategy for Counted {
        fn name(&self) -> &str {
            "counted"
        }

        fn num_replicas_in_sync(&self) -> usize {
            2
        }

        fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
            let devices = [Device::Cpu, Device::Cpu];
            Ok(Box::new(ReplicaModel {
                set: ReplicaSet::build(
                    spec,
                    &devices,
                    &ReplicaOptions::default(),
                    CrossDeviceOps::default(),
                )?,
                reduce: CountingOps(CrossDeviceOps::default(), std::sync::Arc::clone(&self.0)),
            }))
        }
    }

    /// Gradient accumulation over 3 batches: one all-reduce per update, in `fit` (10 batches
    /// an epoch: groups of 3, 3, 3 and the short last one) and in `train_on_batch`.
    #[test]
    fn accumulation_reduces_once_per_update() -> Result<()> {
        use std::sync::atomic::Ordering;
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let net = Sequential::new()
            .add(Flatten)
            .add(Dense::new(10))
            .add(Activation::Softmax);
        let sgd = Sgd::new(0.1).gradient_accumulation_steps(3);
        let strategy = Counted(std::sync::Arc::clone(&count));
        let mut model = net.compile(
            sgd,
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
            &strategy,
        )?;
        let data = kandle::data::digits::load()?.subset(&(0..80).collect::<Vec<_>>())?;
        let options = kandle::FitOptions {
            epochs: 2,
            batch_size_per_replica: 4,
            verbosity: kandle::callbacks::Verbosity::Silent,
            ..Default::default()
        };
        let history = model.fit(&data, options)?;
        assert_eq!(
            count.load(Ordering::SeqCst),
            8,
            "4 updates an epoch, 2 epochs"
        );
        assert!(history.last("loss").is_some_and(f64::is_finite));

        let (x, y) = data.to_tensors()?;
        let values = |model: &kandle::Model| -> Result<Vec<f32>> {
            let mut all = Vec::new();
            for t in model.get_weights()?.values() {
                all.extend(t.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(all)
        };
        let before = values(&model)?;
        for call in 0..3 {
            let batch = (x.narrow(0, call * 8, 8)?, y.narrow(0, call * 8, 8)?);
            let logs = model.train_on_batch(&batch.0, &batch.1, None)?;
            assert!(logs.get("loss").is_some_and(f64::is_finite));
            let changed = values(&model)? != before;
            assert_eq!(changed, call == 2, "call {call}");
        }
        assert_eq!(count.load(Ordering::SeqCst), 9);
        Ok(())
    }
}
