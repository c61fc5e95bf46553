//! The batching [`Loader`]: epoch order (shuffled or not), global batches, sharding across
//! workers, parallel batch assembly, and a background prefetch thread.
//!
//! One epoch is a sequence of *global* batches of `batch_size` consecutive indices taken from
//! the epoch's order. With [`LoaderOptions::shard`] set, each global batch is split across the
//! workers and a loader yields only its own part, so every worker reads only its own samples
//! and all workers take the same number of steps. Batches are assembled on the CPU by filling
//! one buffer for the inputs and one for the targets, sample by sample in parallel (rayon).
//! [`Loader::spawn`] runs that work on a producer thread inside a [`std::thread::scope`] and
//! hands the batches over through a bounded channel, so the next batches are ready while the
//! training step runs. An optional [`Augment`] transforms each sample right after it is read,
//! inside the same parallel assembly, with a random generator seeded from the seed, the epoch
//! and the sample's position in the epoch, so augmented batches repeat exactly.
//!
//! ```
//! use kandle::data::{Dataset, InMemoryDataset, Loader, LoaderOptions, Targets};
//!
//! let ds = InMemoryDataset::from_vecs(vec![0.0; 10], &[1], vec![0.0; 10], Targets::Classes(1))?;
//! let loader = Loader::new(&ds, LoaderOptions { batch_size: 4, shuffle: true, ..Default::default() })?;
//! assert_eq!(loader.steps_per_epoch(), 3);
//! std::thread::scope(|s| -> kandle::Result<()> {
//!     for batch in loader.spawn(s, 0) {
//!         let batch = batch?;
//!         assert!(batch.len() == 4 || batch.len() == 2);
//!     }
//!     Ok(())
//! })?;
//! # Ok::<(), kandle::Error>(())
//! ```

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;

use super::{weighting, Augment, Batch, Dataset, InputSpec, PartBuffer, PartMut, Targets};
use crate::devices::batch_upload::BatchUpload;
use crate::{Error, Result};

/// How a [`Loader`] cuts an epoch into batches.
///
/// ```
/// use kandle::data::LoaderOptions;
///
/// let options = LoaderOptions { batch_size: 64, shuffle: true, seed: 42, ..Default::default() };
/// assert_eq!(options.prefetch, 2);
/// ```
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    /// Samples per global batch (all shards together). Default 32, as in Keras.
    pub batch_size: usize,
    /// Whether each epoch visits the samples in a new random order. Default `false`.
    pub shuffle: bool,
    /// Seed of the shuffle; mixed with the epoch number, so each epoch has its own order and a
    /// run is repeatable. Sharded workers must all use the same seed. Default 0.
    pub seed: u64,
    /// Whether to drop the last global batch when it is short. Default `false`: it is yielded
    /// with fewer samples.
    pub drop_remainder: bool,
    /// How many finished batches may wait for the consumer in [`Loader::spawn`]. Default 2.
    /// With 0, the producer still assembles the next batch while the consumer works, then
    /// waits for it to be taken.
    pub prefetch: usize,
    /// `Some((index, count))`: this loader is worker `index` of `count` and yields only its
    /// part of each global batch. Default `None`.
    pub shard: Option<(usize, usize)>,
    /// A random transform applied to each input sample after it is read, for training only
    /// (e.g. [`RandomShiftFlip`](super::RandomShiftFlip)). Sample `p` of epoch `e` (its
    /// position `p` in the epoch's order) gets a [`StdRng`](rand::rngs::StdRng) seeded from
    /// (`seed`, `e`, `p`), so results do not depend on the threads, and a sharded worker
    /// transforms its samples exactly as a single loader would. Default `None`.
    pub augment: Option<Arc<dyn Augment>>,
    /// One weight per sample of the dataset, by index (Keras's `sample_weight`): batches then
    /// carry each sample's weight in [`Batch::weights`]. Default `None`.
    pub sample_weight: Option<Arc<[f32]>>,
    /// One weight per class, by class index (Keras's `class_weight`): a sample's weight is
    /// multiplied by its class's (the argmax of a one-hot target). Default `None`.
    pub class_weight: Option<Arc<[f32]>>,
    /// `Some(order)`: a batch's input `i` is the dataset's input `order[i]` (a model takes a
    /// dataset's named inputs in its own order). Default `None`: the dataset's order.
    pub input_order: Option<Arc<[usize]>>,
    /// `Some(device)`: each batch is copied to `device` once assembled, by the prefetch thread
    /// under [`Loader::spawn`], so that on a CUDA device the copy runs while the step before it
    /// does (from pinned host memory, on a copy stream of the device's own). `fit` and
    /// `evaluate` set it where their strategy trains on one CUDA device. Default `None`:
    /// batches stay in host memory.
    pub device: Option<Device>,
}

/// Equal when every field is equal and both `augment`s are absent or the same object.
impl PartialEq for LoaderOptions {
    fn eq(&self, other: &Self) -> bool {
        let same_augment = match (&self.augment, &other.augment) {
            (None, None) => true,
            (Some(a), Some(b)) => std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b)),
            _ => false,
        };
        self.batch_size == other.batch_size
            && self.shuffle == other.shuffle
            && self.seed == other.seed
            && self.drop_remainder == other.drop_remainder
            && self.prefetch == other.prefetch
            && self.shard == other.shard
            && self.sample_weight == other.sample_weight
            && self.class_weight == other.class_weight
            && self.input_order == other.input_order
            && same_augment
            && match (&self.device, &other.device) {
                (None, None) => true,
                (Some(a), Some(b)) => a.same_device(b),
                _ => false,
            }
    }
}

impl Eq for LoaderOptions {}

impl Default for LoaderOptions {
    fn default() -> Self {
        Self {
            batch_size: 32,
            shuffle: false,
            seed: 0,
            drop_remainder: false,
            prefetch: 2,
            shard: None,
            augment: None,
            sample_weight: None,
            class_weight: None,
            input_order: None,
            device: None,
        }
    }
}

/// Cuts a dataset into batches, epoch after epoch.
///
/// An epoch's order is `0..len` or, with [`shuffle`](LoaderOptions::shuffle), a permutation
/// drawn from a [`StdRng`](rand::rngs::StdRng) seeded with the seed mixed with the epoch
/// number. Global batch `s` holds positions `s * batch_size..(s + 1) * batch_size` of that
/// order; the last one is short unless [`drop_remainder`](LoaderOptions::drop_remainder).
///
/// With [`shard`](LoaderOptions::shard) `Some((i, w))`, each global batch of `m` samples is
/// split into `w` consecutive parts whose sizes differ by at most one, the first `m % w` parts
/// taking one extra sample, and this loader yields part `i`. Every worker takes
/// [`steps_per_epoch`](Self::steps_per_epoch) steps, since distributed workers step in
/// lockstep. The one case where a part is empty is a short last batch with fewer samples than
/// workers: the workers past its end then get a batch with 0 rows, which a strategy must weight
/// by its sample count (zero). Set `drop_remainder` to avoid it.
///
/// Each input is batched in its dtype as `(batch, input shape...)` (see [`Dataset::inputs`]);
/// class targets as `u32` `(batch,)`, dense targets as `f32` `(batch, shape...)`, one tensor
/// per output, all on the CPU.
#[derive(Debug, Clone)]
pub struct Loader<'d> {
    dataset: &'d dyn Dataset,
    options: LoaderOptions,
    len: usize,
    sample_shape: Vec<usize>,
    sample_len: usize,
    /// The dataset's inputs; a lone `f32` input is read through [`Dataset::read`].
    inputs: Vec<InputSpec>,
    targets: Targets,
    width: usize,
    /// The copies of batches to [`LoaderOptions::device`].
    upload: BatchUpload,
}

impl<'d> Loader<'d> {
    /// A loader over `dataset`.
    ///
    /// Errors for a `batch_size` of 0, an empty dataset ([`Error::EmptyDataset`], naming it), a
    /// sample or target shape with no element, a shard index not below a non-zero count, or an
    /// [`augment`](LoaderOptions::augment) that rejects the sample shape.
    pub fn new(dataset: &'d dyn Dataset, options: LoaderOptions) -> Result<Self> {
        if options.batch_size == 0 {
            return Err(Error::invalid(format!(
                "batch_size must be at least 1 (loading `{}`)",
                dataset.name()
            )));
        }
        if let Some((index, count)) = options.shard {
            if count == 0 || index >= count {
                return Err(Error::invalid(format!(
                    "shard ({index}, {count}) is not a worker index below a non-zero worker count"
                )));
            }
        }
        let len = dataset.len();
        if len == 0 {
            return Err(Error::EmptyDataset(dataset.name().to_string()));
        }
        let inputs = dataset.inputs();
        let Some(first) = inputs.first() else {
            return Err(Error::invalid(format!(
                "`{}` declares no input",
                dataset.name()
            )));
        };
        let sample_shape = first.shape.clone();
        let sample_len: usize = sample_shape.iter().product();
        let targets = dataset.targets();
        let width = targets.width();
        if inputs.iter().any(|i| i.sample_len() == 0) || width == 0 {
            return Err(Error::invalid(format!(
                "`{}` has samples of shape {sample_shape:?} and targets {targets:?}; both need \
                 at least one element",
                dataset.name()
            )));
        }
        if let Some(augment) = &options.augment {
            if first.dtype != candle_core::DType::F32 {
                return Err(Error::invalid(format!(
                    "`{}`: augmentation transforms the first input, {first}, which must be f32",
                    dataset.name()
                )));
            }
            augment.check_shape(&sample_shape)?;
        }
        Ok(Self {
            dataset,
            options,
            len,
            sample_shape,
            sample_len,
            inputs,
            targets,
            width,
            upload: BatchUpload::default(),
        })
    }

    /// The dataset this loader reads.
    pub fn dataset(&self) -> &'d dyn Dataset {
        self.dataset
    }

    /// The options this loader was built with.
    pub fn options(&self) -> &LoaderOptions {
        &self.options
    }

    /// Batches per epoch; the same for every shard.
    pub fn steps_per_epoch(&self) -> usize {
        let bs = self.options.batch_size;
        if self.options.drop_remainder {
            self.len / bs
        } else {
            self.len.div_ceil(bs)
        }
    }

    /// Samples this loader yields per epoch: all of them (less a dropped remainder) without
    /// sharding, this worker's part with it.
    pub fn samples_per_epoch(&self) -> usize {
        (0..self.steps_per_epoch())
            .map(|step| {
                let range = self.global_range(step);
                self.shard_range(range.len()).len()
            })
            .sum()
    }

    /// The order in which epoch `epoch` visits the samples (before batching and sharding).
    pub fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.options.shuffle {
            let seed = mix_seed(self.options.seed, epoch as u64);
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        }
        order
    }

    /// The batches of epoch `epoch`, assembled on the calling thread when asked for. The
    /// iterator ends after the first error.
    pub fn iter(&self, epoch: usize) -> EpochIter<'_, 'd> {
        self.iter_from(epoch, 0)
    }

    /// [`Self::iter`] from global batch `first_step` on: the batches before it are not
    /// assembled (a run resumed mid-epoch skips what it already trained on).
    pub fn iter_from(&self, epoch: usize, first_step: usize) -> EpochIter<'_, 'd> {
        let steps = self.steps_per_epoch();
        EpochIter {
            loader: self,
            epoch,
            order: self.epoch_order(epoch),
            step: first_step.min(steps),
            steps,
        }
    }

    /// The batches of epoch `epoch`, assembled ahead of time by a producer thread spawned in
    /// `scope` and handed over through a channel holding up to
    /// [`prefetch`](LoaderOptions::prefetch) batches.
    ///
    /// A dataset error comes through as an `Err` item and ends the epoch. Dropping the
    /// iterator early stops the producer: its next hand-over fails and it returns, and the
    /// drop waits for that (at most the assembly of one batch). A panic in the producer (in
    /// the dataset's `read`) comes through as an [`Error::Data`] naming the dataset.
    pub fn spawn<'scope, 'env>(
        &'env self,
        scope: &'scope Scope<'scope, 'env>,
        epoch: usize,
    ) -> Batches<'scope> {
        self.spawn_from(scope, epoch, 0)
    }

    /// [`Self::spawn`] from global batch `first_step` on (see [`Self::iter_from`]).
    pub fn spawn_from<'scope, 'env>(
        &'env self,
        scope: &'scope Scope<'scope, 'env>,
        epoch: usize,
        first_step: usize,
    ) -> Batches<'scope> {
        let first_step = first_step.min(self.steps_per_epoch());
        let (tx, rx) = sync_channel(self.options.prefetch);
        let name = self.dataset.name().to_string();
        let spawned = std::thread::Builder::new()
            .name("kandle-loader".to_string())
            .spawn_scoped(scope, move || {
                for item in self.iter_from(epoch, first_step) {
                    if tx.send(item).is_err() {
                        // The consumer is gone: stop.
                        return;
                    }
                }
            });
        match spawned {
            Ok(handle) => Batches {
                rx: Some(rx),
                producer: Some(handle),
                remaining: self.steps_per_epoch() - first_step,
                pending: None,
                name,
            },
            Err(e) => Batches {
                rx: None,
                producer: None,
                remaining: 0,
                pending: Some(Error::Data {
                    path: name.clone().into(),
                    reason: format!("cannot start the prefetch thread: {e}"),
                }),
                name,
            },
        }
    }

    /// Positions in the epoch order of global batch `step`.
    fn global_range(&self, step: usize) -> std::ops::Range<usize> {
        let start = step * self.options.batch_size;
        start..(start + self.options.batch_size).min(self.len)
    }

    /// This worker's positions within a global batch of `m` samples.
    fn shard_range(&self, m: usize) -> std::ops::Range<usize> {
        match self.options.shard {
            None => 0..m,
            Some((index, count)) => shard_range(m, index, count),
        }
    }

    /// Batch `step` of epoch `epoch`, whose order is `order`.
    fn batch(&self, epoch: usize, order: &[usize], step: usize) -> Result<Batch> {
        let global = self.global_range(step);
        let shard = self.shard_range(global.len());
        let first = global.start + shard.start;
        let batch = self.assemble(epoch, first, &order[first..global.start + shard.end])?;
        match &self.options.device {
            Some(device) if !device.is_cpu() => {
                // Queued beside the training thread's steps, never into a capture.
                let _beside = crate::devices::stream_capture::beside_the_steps();
                batch.map_parts(|part| self.upload.upload(part, device))
            }
            _ => Ok(batch),
        }
    }

    /// Reads the samples at `indices`, which sit at positions `first..` of epoch `epoch`'s
    /// order, into one batch, augmenting each sample's first input if asked.
    fn assemble(&self, epoch: usize, first: usize, indices: &[usize]) -> Result<Batch> {
        let m = indices.len();
        let mut y = vec![0f32; m * self.width];
        let inputs = match self.single_f32() {
            true => vec![self.read_f32(epoch, first, indices, &mut y)?],
            false => self.read_parts(epoch, first, indices, &mut y)?,
        };
        let weights = weighting::batch_weights(
            self.options.sample_weight.as_deref(),
            self.options.class_weight.as_deref(),
            self.dataset.name(),
            indices,
            &y,
            self.width,
        )?;
        let targets = self
            .targets
            .batch_tensors(y, indices, self.dataset.name())?;
        let inputs = match &self.options.input_order {
            Some(order) => order
                .iter()
                .map(|&i| {
                    inputs.get(i).cloned().ok_or_else(|| {
                        Error::invalid(format!(
                            "input order {order:?} names input {i}, but `{}` has {}",
                            self.dataset.name(),
                            inputs.len()
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            None => inputs,
        };
        Ok(Batch {
            inputs,
            targets,
            weights,
        })
    }

    /// Whether the dataset has one `f32` input, read through [`Dataset::read`].
    fn single_f32(&self) -> bool {
        matches!(&self.inputs[..], [one] if one.dtype == candle_core::DType::F32)
    }

    /// The augmentation's generator for the sample at position `position` of the epoch whose
    /// augmentation seed is `augment_seed`.
    fn augment(&self, augment_seed: u64, position: usize, x: &mut [f32]) {
        if let Some(augment) = &self.options.augment {
            let mut rng =
                rand::rngs::StdRng::seed_from_u64(mix_seed(augment_seed, position as u64));
            augment.apply(x, &self.sample_shape, &mut rng);
        }
    }

    /// The one `f32` input of the samples at `indices` (targets into `y`), read in parallel.
    fn read_f32(
        &self,
        epoch: usize,
        first: usize,
        indices: &[usize],
        y: &mut [f32],
    ) -> Result<Tensor> {
        let m = indices.len();
        let mut x = vec![0f32; m * self.sample_len];
        // Give each rayon task at least ~16 KiB of input to copy.
        let min_len = (4096 / self.sample_len).max(1);
        let augment_seed = mix_seed(self.options.seed ^ AUGMENT_STREAM, epoch as u64);
        x.par_chunks_mut(self.sample_len)
            .zip(y.par_chunks_mut(self.width))
            .zip(indices.par_iter())
            .enumerate()
            .with_min_len(min_len)
            .try_for_each(|(k, ((xs, ys), &i))| {
                self.dataset.read(i, xs, ys)?;
                self.augment(augment_seed, first + k, xs);
                Ok::<(), Error>(())
            })?;
        let mut x_shape = Vec::with_capacity(self.sample_shape.len() + 1);
        x_shape.push(m);
        x_shape.extend_from_slice(&self.sample_shape);
        Ok(Tensor::from_vec(x, x_shape, &Device::Cpu)?)
    }

    /// Every input of the samples at `indices`, each in its dtype (targets into `y`), read in
    /// parallel.
    fn read_parts(
        &self,
        epoch: usize,
        first: usize,
        indices: &[usize],
        y: &mut [f32],
    ) -> Result<Vec<Tensor>> {
        let m = indices.len();
        let mut buffers = self
            .inputs
            .iter()
            .map(|spec| PartBuffer::zeros(spec.dtype, m * spec.sample_len()))
            .collect::<Result<Vec<_>>>()?;
        let augment_seed = mix_seed(self.options.seed ^ AUGMENT_STREAM, epoch as u64);
        let mut columns: Vec<std::vec::IntoIter<PartMut<'_>>> = buffers
            .iter_mut()
            .zip(&self.inputs)
            .map(|(buffer, spec)| buffer.chunks_mut(spec.sample_len()).into_iter())
            .collect();
        let samples: Vec<Vec<PartMut<'_>>> = (0..m)
            .map(|_| columns.iter_mut().filter_map(Iterator::next).collect())
            .collect();
        samples
            .into_par_iter()
            .zip(y.par_chunks_mut(self.width))
            .zip(indices.par_iter())
            .enumerate()
            .try_for_each(|(k, ((mut parts, ys), &i))| {
                self.dataset.read_inputs(i, &mut parts, ys)?;
                if let Some(PartMut::F32(x)) = parts.first_mut() {
                    self.augment(augment_seed, first + k, x);
                }
                Ok::<(), Error>(())
            })?;
        drop(columns);
        buffers
            .into_iter()
            .zip(&self.inputs)
            .map(|(buffer, spec)| {
                let mut dims = Vec::with_capacity(spec.shape.len() + 1);
                dims.push(m);
                dims.extend_from_slice(&spec.shape);
                buffer.into_tensor(dims)
            })
            .collect()
    }
}

/// Set apart the augmentation's random stream from the shuffle's, which uses the same seed.
const AUGMENT_STREAM: u64 = 0x6175_676D_656E_7421;

/// Mixes the user's seed with the epoch number (SplitMix64 finaliser), so that nearby seeds
/// and epochs give unrelated orders.
fn mix_seed(seed: u64, epoch: u64) -> u64 {
    fn splitmix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    splitmix(seed ^ splitmix(epoch))
}

/// The batches of one epoch, assembled on the calling thread: [`Loader::iter`].
#[derive(Debug)]
pub struct EpochIter<'l, 'd> {
    loader: &'l Loader<'d>,
    epoch: usize,
    order: Vec<usize>,
    step: usize,
    steps: usize,
}

impl Iterator for EpochIter<'_, '_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.step >= self.steps {
            return None;
        }
        let batch = self.loader.batch(self.epoch, &self.order, self.step);
        // An error ends the epoch.
        self.step = if batch.is_ok() {
            self.step + 1
        } else {
            self.steps
        };
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.steps - self.step;
        (left, Some(left))
    }
}

/// The batches of one epoch, prefetched by a background thread: [`Loader::spawn`].
///
/// Dropping it early stops the producer thread and waits for it to finish.
#[derive(Debug)]
pub struct Batches<'scope> {
    rx: Option<Receiver<Result<Batch>>>,
    producer: Option<ScopedJoinHandle<'scope, ()>>,
    remaining: usize,
    pending: Option<Error>,
    name: String,
}

impl Batches<'_> {
    /// Closes the channel, so that a blocked producer returns, then waits for it. A panic in
    /// the producer that was not reported through [`Iterator::next`] is dropped here (the panic
    /// hook has already printed it).
    fn stop(&mut self) {
        self.rx = None;
        if let Some(handle) = self.producer.take() {
            let _ = handle.join();
        }
    }
}

impl Iterator for Batches<'_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if let Some(err) = self.pending.take() {
            self.remaining = 0;
            return Some(Err(err));
        }
        if self.remaining == 0 {
            self.stop();
            return None;
        }
        let received = self.rx.as_ref()?.recv();
        match received {
            Ok(Ok(batch)) => {
                self.remaining -= 1;
                Some(Ok(batch))
            }
            Ok(Err(err)) => {
                self.remaining = 0;
                self.stop();
                Some(Err(err))
            }
            Err(_) => {
                // The producer hung up before the end of the epoch: it panicked.
                self.remaining = 0;
                self.rx = None;
                let reason = match self.producer.take().map(|h| h.join()) {
                    Some(Err(payload)) => crate::error::panic_message(payload.as_ref()),
                    _ => "it stopped early".to_string(),
                };
                Some(Err(Error::Data {
                    path: self.name.clone().into(),
                    reason: format!("the prefetch thread panicked: {reason}"),
                }))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.remaining + usize::from(self.pending.is_some());
        (left.min(1), Some(left))
    }
}

impl Drop for Batches<'_> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Part `index` of `count` near-equal consecutive parts of `0..m`: sizes differ by at most one
/// and the first `m % count` parts get the extra sample. Used to shard a global batch across
/// workers and across replicas.
pub fn shard_range(m: usize, index: usize, count: usize) -> std::ops::Range<usize> {
    let count = count.max(1);
    let (base, extra) = (m / count, m % count);
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::data::InMemoryDataset;
    use std::collections::BTreeSet;
    use std::time::{Duration, Instant};

    /// `n` samples of shape `[2]` holding `[i, -i]`, class `i % 3`.
    fn counting(n: usize) -> InMemoryDataset {
        let x: Vec<f32> = (0..n).flat_map(|i| [i as f32, -(i as f32)]).collect();
        let y: Vec<f32> = (0..n).map(|i| (i % 3) as f32).collect();
        InMemoryDataset::from_vecs(x, &[2], y, Targets::Classes(3))
            .unwrap()
            .named("count")
    }

    /// The sample indices in a batch of [`counting`].
    fn ids(batch: &Batch) -> Vec<usize> {
        let x = batch.inputs[0].to_vec2::<f32>().unwrap();
        let y = batch.targets[0].to_vec1::<u32>().unwrap();
        x.iter()
            .zip(&y)
            .map(|(row, &label)| {
                let i = row[0] as usize;
                assert_eq!(row[1], -row[0]);
                assert_eq!(label as usize, i % 3);
                i
            })
            .collect()
    }

    fn epoch(loader: &Loader, epoch: usize) -> Vec<Vec<usize>> {
        loader.iter(epoch).map(|b| ids(&b.unwrap())).collect()
    }

    fn options(batch_size: usize, shuffle: bool) -> LoaderOptions {
        LoaderOptions {
            batch_size,
            shuffle,
            seed: 7,
            ..Default::default()
        }
    }

    #[test]
    fn every_sample_once_with_short_last_batch() {
        let ds = counting(10);
        for shuffle in [false, true] {
            let loader = Loader::new(&ds, options(4, shuffle)).unwrap();
            assert_eq!(loader.steps_per_epoch(), 3);
            assert_eq!(loader.samples_per_epoch(), 10);
            let batches = epoch(&loader, 0);
            let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
            assert_eq!(sizes, vec![4, 4, 2]);
            let mut all: Vec<usize> = batches.concat();
            if !shuffle {
                assert_eq!(all, (0..10).collect::<Vec<_>>());
            }
            all.sort_unstable();
            assert_eq!(all, (0..10).collect::<Vec<_>>());
        }
    }

    #[test]
    fn batch_shapes_and_dtypes() {
        let ds = counting(5);
        let loader = Loader::new(&ds, options(3, false)).unwrap();
        let b = loader.iter(0).next().unwrap().unwrap();
        assert_eq!(b.inputs[0].dims(), &[3, 2]);
        assert_eq!(b.targets[0].dims(), &[3]);
        assert_eq!(b.targets[0].dtype(), candle_core::DType::U32);
        let hot = counting(5).one_hot().unwrap();
        let loader = Loader::new(&hot, options(3, false)).unwrap();
        let b = loader.iter(0).next().unwrap().unwrap();
        assert_eq!(b.targets[0].dims(), &[3, 3]);
        assert_eq!(b.targets[0].dtype(), candle_core::DType::F32);
        assert_eq!(
            b.targets[0].to_vec2::<f32>().unwrap()[1],
            vec![0.0, 1.0, 0.0]
        );
    }

    #[test]
    fn seeded_orders_repeat_and_epochs_differ() {
        let ds = counting(50);
        let a = Loader::new(&ds, options(8, true)).unwrap();
        let b = Loader::new(&ds, options(8, true)).unwrap();
        assert_eq!(epoch(&a, 0), epoch(&b, 0));
        assert_eq!(epoch(&a, 3), epoch(&b, 3));
        assert_ne!(epoch(&a, 0), epoch(&a, 1));
        let other_seed = Loader::new(
            &ds,
            LoaderOptions {
                seed: 8,
                ..options(8, true)
            },
        )
        .unwrap();
        assert_ne!(epoch(&a, 0), epoch(&other_seed, 0));
        let plain = Loader::new(&ds, options(8, false)).unwrap();
        assert_eq!(epoch(&plain, 0), epoch(&plain, 1));
    }

    #[test]
    fn drop_remainder_drops_the_short_batch() {
        let ds = counting(10);
        let loader = Loader::new(
            &ds,
            LoaderOptions {
                drop_remainder: true,
                ..options(4, false)
            },
        )
        .unwrap();
        assert_eq!(loader.steps_per_epoch(), 2);
        assert_eq!(loader.samples_per_epoch(), 8);
        assert_eq!(epoch(&loader, 0), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    }

    #[test]
    fn shards_split_each_global_batch() {
        let ds = counting(10);
        for drop_remainder in [false, true] {
            let base = LoaderOptions {
                drop_remainder,
                ..options(4, true)
            };
            let whole = epoch(&Loader::new(&ds, base.clone()).unwrap(), 2);
            let workers = 3;
            let shards: Vec<Loader> = (0..workers)
                .map(|i| {
                    Loader::new(
                        &ds,
                        LoaderOptions {
                            shard: Some((i, workers)),
                            ..base.clone()
                        },
                    )
                    .unwrap()
                })
                .collect();
            let parts: Vec<Vec<Vec<usize>>> = shards.iter().map(|l| epoch(l, 2)).collect();
            let total: usize = shards.iter().map(Loader::samples_per_epoch).sum();
            assert_eq!(total, whole.iter().map(Vec::len).sum::<usize>());
            for (shard, p) in shards.iter().zip(&parts) {
                assert_eq!(p.len(), whole.len());
                assert_eq!(shard.steps_per_epoch(), whole.len());
            }
            for (step, global) in whole.iter().enumerate() {
                let sizes: Vec<usize> = parts.iter().map(|p| p[step].len()).collect();
                // 4 samples over 3 workers: 2, 1, 1; the short last batch of 2: 1, 1, 0.
                let expected = if global.len() == 4 {
                    vec![2, 1, 1]
                } else {
                    vec![1, 1, 0]
                };
                assert_eq!(sizes, expected);
                let joined: Vec<usize> = parts.iter().flat_map(|p| p[step].clone()).collect();
                assert_eq!(
                    &joined, global,
                    "shards in order, disjoint, covering the batch"
                );
            }
        }
    }

    #[test]
    fn empty_shard_batch_has_zero_rows() {
        let ds = counting(5);
        let loader = Loader::new(
            &ds,
            LoaderOptions {
                shard: Some((2, 3)),
                ..options(4, false)
            },
        )
        .unwrap();
        let batches: Vec<Batch> = loader.iter(0).map(Result::unwrap).collect();
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[1].inputs[0].dims(), &[0, 2]);
        assert_eq!(batches[1].targets[0].dims(), &[0]);
        assert!(batches[1].is_empty());
    }

    #[test]
    fn spawn_yields_the_same_batches() {
        let ds = counting(23);
        let loader = Loader::new(&ds, options(5, true)).unwrap();
        let direct = epoch(&loader, 4);
        for prefetch in [0, 1, 2, 8] {
            let loader = Loader::new(
                &ds,
                LoaderOptions {
                    prefetch,
                    ..options(5, true)
                },
            )
            .unwrap();
            let prefetched: Vec<Vec<usize>> = std::thread::scope(|s| {
                let it = loader.spawn(s, 4);
                assert_eq!(it.size_hint().1, Some(5));
                it.map(|b| ids(&b.unwrap())).collect()
            });
            assert_eq!(prefetched, direct);
        }
    }

    /// With a CUDA device in the options, the prefetch thread hands over batches on it, the
    /// same as those in host memory.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn batches_copied_to_a_gpu_are_the_host_batches() -> Result<()> {
        let gpu = crate::devices::cuda(0)?;
        let ds = counting(23);
        let direct = epoch(&Loader::new(&ds, options(5, true))?, 1);
        let loader = Loader::new(
            &ds,
            LoaderOptions {
                device: Some(gpu),
                ..options(5, true)
            },
        )?;
        let copied = std::thread::scope(|s| -> Result<Vec<Vec<usize>>> {
            let mut seen = Vec::new();
            for batch in loader.spawn(s, 1) {
                let batch = batch?;
                assert!(batch.inputs[0].device().is_cuda() && batch.targets[0].device().is_cuda());
                seen.push(ids(&batch.to_device(&Device::Cpu)?));
            }
            Ok(seen)
        })?;
        assert_eq!(copied, direct);
        Ok(())
    }

    #[test]
    fn starting_mid_epoch_yields_the_rest_of_the_same_batches() {
        let ds = counting(23);
        let loader = Loader::new(&ds, options(5, true)).unwrap();
        let direct = epoch(&loader, 2);
        let rest: Vec<Vec<usize>> = loader.iter_from(2, 3).map(|b| ids(&b.unwrap())).collect();
        assert_eq!(rest, direct[3..]);
        let spawned: Vec<Vec<usize>> = std::thread::scope(|s| {
            let it = loader.spawn_from(s, 2, 3);
            assert_eq!(it.size_hint().1, Some(2));
            it.map(|b| ids(&b.unwrap())).collect()
        });
        assert_eq!(spawned, direct[3..]);
        assert_eq!(loader.iter_from(2, 99).count(), 0);
    }

    /// Sleeps a little on every read, so a producer is mid-epoch when the consumer leaves.
    struct Slow(InMemoryDataset);

    impl Dataset for Slow {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn sample_shape(&self) -> &[usize] {
            self.0.sample_shape()
        }
        fn targets(&self) -> Targets {
            self.0.targets()
        }
        fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
            std::thread::sleep(Duration::from_millis(1));
            self.0.read(index, x, y)
        }
    }

    #[test]
    fn dropping_early_stops_the_producer() {
        let ds = Slow(counting(10_000));
        let loader = Loader::new(
            &ds,
            LoaderOptions {
                prefetch: 1,
                ..options(1, true)
            },
        )
        .unwrap();
        let start = Instant::now();
        std::thread::scope(|s| {
            let mut it = loader.spawn(s, 0);
            assert!(it.next().unwrap().is_ok());
            assert!(it.next().unwrap().is_ok());
            drop(it);
            // Also leave one without taking anything.
            let _unused = loader.spawn(s, 1);
        });
        // The whole epoch would take 10+ s; stopping takes about one read.
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }

    /// Fails (or panics) when reading sample `bad`.
    struct Failing {
        inner: InMemoryDataset,
        bad: usize,
        panic: bool,
    }

    impl Dataset for Failing {
        fn len(&self) -> usize {
            self.inner.len()
        }
        fn sample_shape(&self) -> &[usize] {
            self.inner.sample_shape()
        }
        fn targets(&self) -> Targets {
            self.inner.targets()
        }
        fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
            if index == self.bad {
                if self.panic {
                    panic!("sample {index} exploded");
                }
                return Err(Error::invalid(format!("cannot read sample {index}")));
            }
            self.inner.read(index, x, y)
        }
        fn name(&self) -> &str {
            "failing"
        }
    }

    #[test]
    fn dataset_errors_come_through_and_end_the_epoch() {
        let ds = Failing {
            inner: counting(10),
            bad: 5,
            panic: false,
        };
        let loader = Loader::new(&ds, options(2, false)).unwrap();
        let check = |items: Vec<Result<Batch>>| {
            assert_eq!(items.len(), 3);
            assert!(items[0].is_ok() && items[1].is_ok());
            let err = items[2].as_ref().unwrap_err().to_string();
            assert!(err.contains("cannot read sample 5"), "{err}");
        };
        check(loader.iter(0).collect());
        check(std::thread::scope(|s| loader.spawn(s, 0).collect()));
    }

    #[test]
    fn a_panicking_read_becomes_an_error() {
        let ds = Failing {
            inner: counting(10),
            bad: 5,
            panic: true,
        };
        let loader = Loader::new(&ds, options(2, false)).unwrap();
        let items: Vec<Result<Batch>> = std::thread::scope(|s| loader.spawn(s, 0).collect());
        assert_eq!(items.len(), 3);
        let err = items[2].as_ref().unwrap_err().to_string();
        assert!(err.contains("failing") && err.contains("exploded"), "{err}");
    }

    /// Claims three classes but stores a label of 5.
    struct BadLabel;

    impl Dataset for BadLabel {
        fn len(&self) -> usize {
            2
        }
        fn sample_shape(&self) -> &[usize] {
            &[1]
        }
        fn targets(&self) -> Targets {
            Targets::Classes(3)
        }
        fn read(&self, index: usize, _x: &mut [f32], y: &mut [f32]) -> Result<()> {
            y[0] = if index == 1 { 5.0 } else { 0.0 };
            Ok(())
        }
    }

    #[test]
    fn a_label_outside_the_classes_is_an_error() {
        let loader = Loader::new(&BadLabel, options(2, false)).unwrap();
        let err = loader.iter(0).next().unwrap().unwrap_err().to_string();
        assert!(err.contains("sample 1") && err.contains("0..3"), "{err}");
    }

    /// `n` images `[1, 4, 4]`, image `i` holding `i * 16..(i + 1) * 16`, class `i % 3`.
    fn images(n: usize) -> InMemoryDataset {
        let x: Vec<f32> = (0..n * 16).map(|v| v as f32).collect();
        let y: Vec<f32> = (0..n).map(|i| (i % 3) as f32).collect();
        InMemoryDataset::from_vecs(x, &[1, 4, 4], y, Targets::Classes(3)).unwrap()
    }

    fn augmented(batch_size: usize, seed: u64) -> LoaderOptions {
        LoaderOptions {
            batch_size,
            shuffle: true,
            seed,
            augment: Some(Arc::new(crate::data::RandomShiftFlip {
                width_shift_range: 0.5,
                height_shift_range: 0.5,
                horizontal_flip: true,
            })),
            ..Default::default()
        }
    }

    fn xs(loader: &Loader, epoch: usize) -> Vec<Vec<f32>> {
        loader
            .iter(epoch)
            .map(|b| {
                b.unwrap().inputs[0]
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn augmented_batches_repeat_with_the_seed_and_differ_across_epochs() {
        let ds = images(40);
        let a = Loader::new(&ds, augmented(8, 3)).unwrap();
        let b = Loader::new(&ds, augmented(8, 3)).unwrap();
        assert_eq!(xs(&a, 0), xs(&b, 0));
        assert_eq!(xs(&a, 5), xs(&b, 5));
        let prefetched: Vec<Vec<f32>> = std::thread::scope(|s| {
            a.spawn(s, 5)
                .map(|b| {
                    b.unwrap().inputs[0]
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                })
                .collect()
        });
        assert_eq!(prefetched, xs(&a, 5));
        assert_ne!(xs(&a, 0), xs(&a, 1));
        let other = Loader::new(&ds, augmented(8, 4)).unwrap();
        assert_ne!(xs(&a, 0), xs(&other, 0));
        // The same epoch order without augmentation: augmentation changed the inputs, but
        // each augmented image is a transform of the image the plain loader puts there.
        let plain = Loader::new(
            &ds,
            LoaderOptions {
                augment: None,
                ..augmented(8, 3)
            },
        )
        .unwrap();
        let (aug, orig) = (xs(&a, 0).concat(), xs(&plain, 0).concat());
        assert_ne!(aug, orig);
        for (img_a, img_o) in aug.chunks(16).zip(orig.chunks(16)) {
            let base = img_o[0];
            assert!(img_a.iter().all(|&v| v >= base && v < base + 16.0));
        }
        // The batch size does not change which transform a sample gets.
        let big = Loader::new(&ds, augmented(40, 3)).unwrap();
        assert_eq!(xs(&big, 2).concat(), xs(&a, 2).concat());
    }

    #[test]
    fn sharded_workers_augment_as_one_loader() {
        let ds = images(30);
        let whole = Loader::new(&ds, augmented(8, 9)).unwrap();
        let parts: Vec<Vec<Vec<f32>>> = (0..3)
            .map(|i| {
                let options = LoaderOptions {
                    shard: Some((i, 3)),
                    ..augmented(8, 9)
                };
                xs(&Loader::new(&ds, options).unwrap(), 1)
            })
            .collect();
        for (step, global) in xs(&whole, 1).into_iter().enumerate() {
            let joined: Vec<f32> = parts.iter().flat_map(|p| p[step].clone()).collect();
            assert_eq!(joined, global);
        }
    }

    /// Counts its calls and the threads they ran on, sleeping a little in each.
    #[derive(Default)]
    struct Recorder {
        calls: std::sync::atomic::AtomicUsize,
        threads: std::sync::Mutex<BTreeSet<String>>,
    }

    impl Augment for Recorder {
        fn apply(&self, _: &mut [f32], _: &[usize], _: &mut rand::rngs::StdRng) {
            std::thread::sleep(Duration::from_millis(2));
            let id = format!("{:?}", std::thread::current().id());
            self.threads.lock().unwrap().insert(id);
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn augmentation_runs_in_parallel_ahead_of_the_consumer() {
        // Images of 32×32, so that a batch is split across threads.
        let ds = InMemoryDataset::from_vecs(
            vec![0.0; 64 * 1024],
            &[1, 32, 32],
            vec![0.0; 64],
            Targets::Classes(1),
        )
        .unwrap();
        let recorder = Arc::new(Recorder::default());
        let loader = Loader::new(
            &ds,
            LoaderOptions {
                batch_size: 16,
                prefetch: 2,
                augment: Some(recorder.clone()),
                ..Default::default()
            },
        )
        .unwrap();
        let consumer = format!("{:?}", std::thread::current().id());
        std::thread::scope(|s| {
            let mut it = loader.spawn(s, 0);
            assert!(it.next().unwrap().is_ok());
            // While the consumer "trains", the producer augments the next batches.
            let deadline = Instant::now() + Duration::from_secs(10);
            while recorder.calls.load(std::sync::atomic::Ordering::SeqCst) < 48
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert!(recorder.calls.load(std::sync::atomic::Ordering::SeqCst) >= 48);
            assert_eq!(it.count(), 3);
        });
        let threads = recorder.threads.lock().unwrap();
        assert!(
            !threads.contains(&consumer),
            "augmented on the consumer thread"
        );
        let expected = rayon::current_num_threads().min(2);
        assert!(threads.len() >= expected, "{} threads", threads.len());
    }

    #[test]
    fn an_augment_that_rejects_the_shape_is_an_error() {
        let ds = counting(4);
        let err = Loader::new(&ds, augmented(2, 0)).unwrap_err().to_string();
        assert!(err.contains("height, width"), "{err}");
    }

    #[test]
    fn bad_options_are_errors() {
        let ds = counting(4);
        assert!(matches!(
            Loader::new(&ds, options(0, false)),
            Err(Error::InvalidInput(_))
        ));
        for shard in [(3, 3), (0, 0), (5, 2)] {
            let opts = LoaderOptions {
                shard: Some(shard),
                ..options(2, false)
            };
            assert!(Loader::new(&ds, opts).is_err(), "{shard:?}");
        }
        let empty = InMemoryDataset::from_vecs(vec![], &[2], vec![], Targets::Classes(3))
            .unwrap()
            .named("nothing");
        match Loader::new(&empty, options(2, false)) {
            Err(Error::EmptyDataset(name)) => assert_eq!(name, "nothing"),
            other => panic!("expected EmptyDataset, got {other:?}"),
        }
        let seen: BTreeSet<usize> = epoch(&Loader::new(&ds, options(100, true)).unwrap(), 0)
            .concat()
            .into_iter()
            .collect();
        assert_eq!(seen.len(), 4);
    }
}
