//! Gradient buckets: a replica's gradients cut into buckets that are summed across replicas
//! while its backward pass is still running, as PyTorch DDP's buckets and Horovod's fused
//! tensors overlap the all-reduce with the backward pass.
//!
//! A [`BucketPlan`] cuts the trainable variables, in their order, into contiguous runs of at
//! most a given size, numbered from the last variables to the first: the backward pass reaches
//! the last layers first, so bucket 0 fills first. A strategy gives every replica the same plan
//! and a shared [`BucketReducer`] ([`Replica::set_buckets`](super::Replica::set_buckets)).
//!
//! During the recorded backward pass, the replica counts the gradients each variable receives
//! (a variable used twice receives two); once every variable of a bucket has received as many
//! as in the first step, the bucket's gradients are fused and handed to the reducer, which sums
//! it over the replicas as soon as every replica has handed it in, while the backward passes
//! go on. Buckets not handed in by then (the first step's, those of a step through candle's
//! autograd, or after gradient accumulation) are handed in when the backward pass ends. Every
//! replica hands in every bucket every step, so the step buffer always holds the summed
//! gradients, the same values in the same order as a sum of whole step buffers.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::{Tensor, TensorId, Var};

use super::fused::fuse;
use crate::{Error, Result};

/// Sums buckets of gradients over the replicas of a step, each bucket as soon as every replica
/// has handed it in.
///
/// Within a step every replica calls [`Self::submit`] once per bucket of the plan (in any
/// order), then [`Self::total`] once per bucket; a replica whose step fails calls
/// [`Self::abort`] so that the others stop waiting.
pub trait BucketReducer: Send + Sync {
    /// Hands in replica `replica`'s gradients of bucket `bucket`, fused (an `f32` vector on its
    /// device); `during_backward` says whether the backward pass was still running.
    fn submit(
        &self,
        replica: usize,
        bucket: usize,
        values: Tensor,
        during_backward: bool,
    ) -> Result<()>;

    /// The sum of bucket `bucket` over the replicas, on replica `replica`'s device; waits until
    /// every replica has handed it in.
    fn total(&self, replica: usize, bucket: usize) -> Result<Tensor>;

    /// Replica `replica` failed this step with `reason`: every wait of the step ends with an
    /// error.
    fn abort(&self, replica: usize, reason: &str);
}

/// Which trainable variables each bucket holds: contiguous runs of the variables, bucket 0
/// holding the last ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    ranges: Vec<Range<usize>>,
}

impl BucketPlan {
    /// Buckets of variables with `sizes` elements (of 4 bytes, the step buffer's `f32`), in
    /// variable order: the first bucket (the last variables) holds at most `first_bytes`,
    /// the others at most `bytes`, and a variable larger than that has a bucket of its own.
    ///
    /// ```
    /// use kandle::strategy::buckets::BucketPlan;
    ///
    /// // Variables of 300, 100 and 50 floats in buckets of at most 1,000 bytes (250 floats).
    /// let plan = BucketPlan::new(&[300, 100, 50], 1000, 1000);
    /// assert_eq!(plan.len(), 2);
    /// assert_eq!(plan.range(0), 1..3); // the last variables, which the backward pass reaches first
    /// assert_eq!(plan.range(1), 0..1); // larger than a bucket: a bucket of its own
    /// ```
    pub fn new(sizes: &[usize], first_bytes: usize, bytes: usize) -> Self {
        let mut ranges = Vec::new();
        let mut end = sizes.len();
        let mut filled = 0usize;
        let mut cap = first_bytes;
        for i in (0..sizes.len()).rev() {
            let size = sizes[i] * 4;
            if i + 1 < end && filled + size > cap {
                ranges.push(i + 1..end);
                end = i + 1;
                filled = 0;
                cap = bytes;
            }
            filled += size;
        }
        if end > 0 {
            ranges.push(0..end);
        }
        Self { ranges }
    }

    /// Number of buckets.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether the plan has no bucket (a model without trainable variables).
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The trainable variables of bucket `bucket`, by index.
    pub fn range(&self, bucket: usize) -> Range<usize> {
        self.ranges[bucket].clone()
    }

    /// The bucket of each trainable variable, by variable index.
    fn bucket_of(&self) -> Vec<usize> {
        let count = self.ranges.first().map_or(0, |r| r.end);
        let mut of = vec![0; count];
        for (b, r) in self.ranges.iter().enumerate() {
            for i in r.clone() {
                of[i] = b;
            }
        }
        of
    }
}

/// What a replica's buckets and each of its watches share: the reducer, the replica's index,
/// the plan, and where each variable sits in it.
struct Placement {
    reducer: Arc<dyn BucketReducer>,
    index: usize,
    plan: Arc<BucketPlan>,
    /// The bucket of each trainable variable, by index.
    bucket_of: Vec<usize>,
    /// The index of each trainable variable, by tensor id.
    ids: HashMap<TensorId, usize>,
}

/// A replica's part in a strategy's gradient buckets: where its variables sit, and the number
/// of gradients each variable received in the first step.
pub(crate) struct ReplicaBuckets {
    placement: Arc<Placement>,
    /// Gradients per variable in one backward pass, learned in the first.
    expected: Mutex<Option<Vec<usize>>>,
}

impl ReplicaBuckets {
    /// Replica `index`'s buckets of `trainable` by `plan`, summed by `reducer`.
    pub(crate) fn new(
        reducer: Arc<dyn BucketReducer>,
        index: usize,
        plan: Arc<BucketPlan>,
        trainable: &[Var],
    ) -> Result<Self> {
        let covered = plan.ranges.first().map_or(0, |r| r.end);
        if covered != trainable.len() {
            return Err(Error::invalid(format!(
                "gradient buckets cover {covered} variables but the replica trains {}",
                trainable.len()
            )));
        }
        let placement = Placement {
            reducer,
            index,
            bucket_of: plan.bucket_of(),
            plan,
            ids: trainable
                .iter()
                .enumerate()
                .map(|(i, v)| (v.as_tensor().id(), i))
                .collect(),
        };
        Ok(Self {
            placement: Arc::new(placement),
            expected: Mutex::new(None),
        })
    }

    /// A watch for one backward pass over `vars` (the trainable variables), whose gradients
    /// are divided by `scale` (the loss scale) before they are fused.
    pub(crate) fn watch(&self, vars: &[Var], scale: Option<Tensor>) -> Result<BucketWatch> {
        let expected = self.expected_lock()?.clone();
        let place = &self.placement;
        let mut pending = vec![0; place.plan.len()];
        if let Some(expected) = &expected {
            for (i, &count) in expected.iter().enumerate() {
                if count > 0 {
                    pending[place.bucket_of[i]] += 1;
                }
            }
        }
        Ok(BucketWatch {
            placement: Arc::clone(place),
            vars: vars.to_vec(),
            scale,
            adds: vec![0; vars.len()],
            expected,
            pending,
            submitted: vec![false; place.plan.len()],
        })
    }

    /// Ends a step's backward pass: hands in every bucket `watch` did not (all of them without
    /// a watch) from `grads` (the final gradients, in trainable order, divided by the loss
    /// scale), learns the gradient counts from the first watch, and returns the sums of all
    /// buckets fused in trainable order, on this replica's device.
    pub(crate) fn finish(&self, watch: Option<BucketWatch>, grads: &[Tensor]) -> Result<Tensor> {
        let place = &self.placement;
        let submitted = match watch {
            Some(watch) => {
                let mut expected = self.expected_lock()?;
                if expected.is_none() {
                    *expected = Some(watch.adds.clone());
                }
                watch.submitted
            }
            None => vec![false; place.plan.len()],
        };
        for (bucket, done) in submitted.into_iter().enumerate() {
            if !done {
                let parts: Vec<&Tensor> = grads[place.plan.range(bucket)].iter().collect();
                place
                    .reducer
                    .submit(place.index, bucket, fuse(&parts)?, false)?;
            }
        }
        let mut totals = (0..place.plan.len())
            .map(|bucket| place.reducer.total(place.index, bucket))
            .collect::<Result<Vec<_>>>()?;
        // Bucket 0 holds the last variables: trainable order is the reverse.
        totals.reverse();
        Ok(Tensor::cat(&totals, 0)?)
    }

    /// Tells the other replicas that this one's step failed.
    pub(crate) fn abort(&self, error: &Error) {
        let place = &self.placement;
        place.reducer.abort(place.index, &error.to_string());
    }

    fn expected_lock(&self) -> Result<std::sync::MutexGuard<'_, Option<Vec<usize>>>> {
        self.expected
            .lock()
            .map_err(|_| Error::invalid("a replica's gradient buckets were poisoned by a panic"))
    }
}

/// Watches one backward pass's gradients arrive and hands in each bucket once all its
/// variables have received theirs ([`crate::layers::ParamGrads`] calls [`Self::added`]).
pub(crate) struct BucketWatch {
    placement: Arc<Placement>,
    vars: Vec<Var>,
    scale: Option<Tensor>,
    /// Gradients received per variable so far.
    adds: Vec<usize>,
    /// Gradients per variable in a whole pass; `None` in the first, which only counts.
    expected: Option<Vec<usize>>,
    /// Per bucket, the variables still waiting for a gradient.
    pending: Vec<usize>,
    submitted: Vec<bool>,
}

impl std::fmt::Debug for BucketWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketWatch")
            .field("index", &self.placement.index)
            .field("adds", &self.adds)
            .field("submitted", &self.submitted)
            .finish_non_exhaustive()
    }
}

impl BucketWatch {
    /// A gradient of the variable whose tensor id is `id` was added to `grads`.
    pub(crate) fn added(&mut self, id: TensorId, grads: &HashMap<TensorId, Tensor>) -> Result<()> {
        let Some(&i) = self.placement.ids.get(&id) else {
            return Ok(());
        };
        self.adds[i] += 1;
        let Some(expected) = &self.expected else {
            return Ok(());
        };
        let bucket = self.placement.bucket_of[i];
        if self.submitted[bucket] || self.adds[i] > expected[i] {
            return Err(Error::invalid(format!(
                "trainable variable {i} received gradient {} after its bucket was summed \
                 (the first step gave it {}): the network's backward pass changed between steps",
                self.adds[i], expected[i]
            )));
        }
        if self.adds[i] == expected[i] {
            self.pending[bucket] -= 1;
            if self.pending[bucket] == 0 {
                self.submit(bucket, grads)?;
            }
        }
        Ok(())
    }

    /// Fuses bucket `bucket`'s gradients from `grads` (zeros for a variable without one),
    /// divided by the loss scale, and hands them in.
    fn submit(&mut self, bucket: usize, grads: &HashMap<TensorId, Tensor>) -> Result<()> {
        let place = Arc::clone(&self.placement);
        let parts = place
            .plan
            .range(bucket)
            .map(|i| {
                let var = &self.vars[i];
                let grad = match grads.get(&var.as_tensor().id()) {
                    Some(g) => g.clone(),
                    None => var.as_tensor().zeros_like()?,
                };
                Ok(match &self.scale {
                    Some(scale) => grad.broadcast_div(scale)?,
                    None => grad,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let fused = fuse(&parts.iter().collect::<Vec<_>>())?;
        self.submitted[bucket] = true;
        place.reducer.submit(place.index, bucket, fused, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_cuts_the_variables_from_the_last_within_each_cap() {
        // 4 bytes per element: sizes in bytes 120, 400, 8, 8, 4000, 12.
        let plan = BucketPlan::new(&[30, 100, 2, 2, 1000, 3], 16, 500);
        assert_eq!(plan.ranges, vec![5..6, 4..5, 1..4, 0..1]);
        assert_eq!(plan.bucket_of(), vec![3, 2, 2, 2, 1, 0]);
        let one = BucketPlan::new(&[10, 100, 2], 1 << 20, 1 << 20);
        assert_eq!(one.ranges, vec![0..3]);
        assert!(BucketPlan::new(&[], 16, 16).is_empty());
    }
}
