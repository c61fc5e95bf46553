//! Provisional loader; the `data` branch replaces this file wholesale (keep theirs on conflict).

use candle_core::{Device, Tensor};

use super::{Batch, Dataset, Targets};
use crate::{Error, Result};

/// Loader options.
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    /// Global batch size.
    pub batch_size: usize,
    /// Shuffle each epoch.
    pub shuffle: bool,
    /// Shuffle seed.
    pub seed: u64,
    /// Drop a short last batch.
    pub drop_remainder: bool,
    /// Batches prepared ahead.
    pub prefetch: usize,
    /// `(index, count)` of this worker.
    pub shard: Option<(usize, usize)>,
}

impl Default for LoaderOptions {
    fn default() -> Self {
        Self {
            batch_size: 32,
            shuffle: false,
            seed: 0,
            drop_remainder: false,
            prefetch: 2,
            shard: None,
        }
    }
}

/// Batches a dataset.
pub struct Loader<'d> {
    dataset: &'d dyn Dataset,
    options: LoaderOptions,
}

impl<'d> Loader<'d> {
    /// A loader.
    pub fn new(dataset: &'d dyn Dataset, options: LoaderOptions) -> Result<Self> {
        if options.batch_size == 0 {
            return Err(Error::invalid("batch size must be positive"));
        }
        if dataset.is_empty() {
            return Err(Error::EmptyDataset(dataset.name().to_string()));
        }
        Ok(Self { dataset, options })
    }

    /// Steps per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        let n = self.dataset.len();
        if self.options.drop_remainder {
            n / self.options.batch_size
        } else {
            n.div_ceil(self.options.batch_size)
        }
    }

    /// Samples per epoch.
    pub fn samples_per_epoch(&self) -> usize {
        if self.options.drop_remainder {
            self.steps_per_epoch() * self.options.batch_size
        } else {
            self.dataset.len()
        }
    }

    /// Batches of an epoch, in the background.
    pub fn spawn<'scope, 'env>(
        &'env self,
        _scope: &'scope std::thread::Scope<'scope, 'env>,
        epoch: usize,
    ) -> impl Iterator<Item = Result<Batch>> + 'env {
        self.iter(epoch)
    }

    /// Batches of an epoch.
    pub fn iter(&self, epoch: usize) -> impl Iterator<Item = Result<Batch>> + '_ {
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let mut order: Vec<usize> = (0..self.dataset.len()).collect();
        if self.options.shuffle {
            let mut rng = rand::rngs::StdRng::seed_from_u64(
                self.options.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            order.shuffle(&mut rng);
        }
        let bs = self.options.batch_size;
        let steps = self.steps_per_epoch();
        (0..steps).map(move |s| {
            let idx = &order[s * bs..((s + 1) * bs).min(order.len())];
            let idx: Vec<usize> = match self.options.shard {
                Some((i, w)) => {
                    let n = idx.len();
                    let start = i * (n / w) + i.min(n % w);
                    let len = n / w + usize::from(i < n % w);
                    idx[start..start + len].to_vec()
                }
                None => idx.to_vec(),
            };
            self.assemble(&idx)
        })
    }

    fn assemble(&self, idx: &[usize]) -> Result<Batch> {
        let shape = self.dataset.sample_shape().to_vec();
        let sx: usize = shape.iter().product();
        let targets = self.dataset.targets();
        let sy = targets.width();
        let mut x = vec![0f32; idx.len() * sx];
        let mut y = vec![0f32; idx.len() * sy];
        for (k, &i) in idx.iter().enumerate() {
            self.dataset.read(
                i,
                &mut x[k * sx..(k + 1) * sx],
                &mut y[k * sy..(k + 1) * sy],
            )?;
        }
        let mut dims = vec![idx.len()];
        dims.extend(shape);
        let x = Tensor::from_vec(x, dims, &Device::Cpu)?;
        let y = match targets {
            Targets::Classes(_) => Tensor::from_vec(
                y.iter().map(|v| *v as u32).collect::<Vec<_>>(),
                idx.len(),
                &Device::Cpu,
            )?,
            Targets::Values(s) => {
                let mut d = vec![idx.len()];
                d.extend(s);
                Tensor::from_vec(y, d, &Device::Cpu)?
            }
        };
        Ok(Batch { x, y })
    }
}

/// A contiguous range of another dataset.
pub struct RangeView<'a> {
    inner: &'a dyn Dataset,
    start: usize,
    len: usize,
}

impl Dataset for RangeView<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn sample_shape(&self) -> &[usize] {
        self.inner.sample_shape()
    }
    fn targets(&self) -> Targets {
        self.inner.targets()
    }
    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
        self.inner.read(self.start + index, x, y)
    }
}

/// Splits off the last `fraction` of `data`.
pub fn split_tail(data: &dyn Dataset, fraction: f64) -> Result<(RangeView<'_>, RangeView<'_>)> {
    let n = data.len();
    let tail = ((n as f64) * fraction).round() as usize;
    if !(0.0..1.0).contains(&fraction) || tail == 0 || tail >= n {
        return Err(Error::invalid("bad validation split"));
    }
    Ok((
        RangeView {
            inner: data,
            start: 0,
            len: n - tail,
        },
        RangeView {
            inner: data,
            start: n - tail,
            len: tail,
        },
    ))
}
