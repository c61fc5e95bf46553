//! Sample and class weighting (Keras's `sample_weight` and `class_weight`) in one place: the
//! checks of what the caller gave against the data ([`sample_weights`], [`class_weights`],
//! [`batch_sample_weight`]), which `Model` runs before a call starts, and the weights of a
//! batch's samples ([`batch_weights`]), which the [`Loader`](super::Loader) computes as it
//! assembles each batch.
//!
//! A sample's weight is its sample weight times its class's weight (1 for what is not given);
//! a one-hot target's class is its argmax.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::{Dataset, Targets};
use crate::{Error, Result};

/// `sample_weight` checked against `data`: one finite, non-negative weight per sample.
pub(crate) fn sample_weights(
    data: &dyn Dataset,
    weights: Option<&[f32]>,
) -> Result<Option<Arc<[f32]>>> {
    let Some(weights) = weights else {
        return Ok(None);
    };
    if weights.len() != data.len() {
        return Err(Error::invalid(format!(
            "sample_weight has {} values but `{}` has {} samples",
            weights.len(),
            data.name(),
            data.len()
        )));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(Error::invalid(format!(
            "sample_weight[{i}] is {w}; weights must be finite and >= 0"
        )));
    }
    Ok(Some(weights.into()))
}

/// `class_weight` as one weight per class index (1 for classes not listed), checked against
/// `data`'s classes.
pub(crate) fn class_weights(
    data: &dyn Dataset,
    weights: Option<&HashMap<usize, f32>>,
) -> Result<Option<Arc<[f32]>>> {
    let Some(weights) = weights else {
        return Ok(None);
    };
    let classes = match data.targets() {
        Targets::Classes(k) => k,
        Targets::Values(shape) => shape.iter().product(),
        Targets::Parts(_) => {
            return Err(Error::invalid(format!(
                "class_weight needs one target per sample, but `{}` has one per output; weight \
                 samples with sample_weight instead",
                data.name()
            )))
        }
    };
    let mut dense = vec![1f32; classes];
    for (&class, &w) in weights {
        if !(w.is_finite() && w >= 0.0) {
            return Err(Error::invalid(format!(
                "class_weight for class {class} is {w}; weights must be finite and >= 0"
            )));
        }
        let slot = dense.get_mut(class).ok_or_else(|| {
            Error::invalid(format!(
                "class_weight names class {class}, but `{}` has {classes} classes",
                data.name()
            ))
        })?;
        *slot = w;
    }
    Ok(Some(dense.into()))
}

/// The `sample_weight` of one batch of `n` samples given as a tensor (`train_on_batch`,
/// `test_on_batch`), checked to be `(n,)` and returned as `f32` on the CPU.
pub(crate) fn batch_sample_weight(weights: &Tensor, n: usize) -> Result<Tensor> {
    if weights.dims() != [n] {
        return Err(Error::Shape {
            layer: "sample_weight".into(),
            expected: format!("({n},)"),
            got: format!("{:?}", weights.dims()),
        });
    }
    Ok(weights.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
}

/// The weights of the samples at `indices` of the dataset named `name`, whose targets are `y`
/// (as read, `width` floats each), as a `(batch,)` tensor on the CPU; `None` when neither
/// sample weights (by sample index) nor class weights (by class index) are set.
pub(crate) fn batch_weights(
    sample_weight: Option<&[f32]>,
    class_weight: Option<&[f32]>,
    name: &str,
    indices: &[usize],
    y: &[f32],
    width: usize,
) -> Result<Option<Tensor>> {
    if sample_weight.is_none() && class_weight.is_none() {
        return Ok(None);
    }
    let weights = indices
        .iter()
        .zip(y.chunks(width.max(1)))
        .map(|(&index, target)| {
            let by_sample = match sample_weight {
                Some(w) => *w.get(index).ok_or_else(|| {
                    Error::invalid(format!(
                        "sample_weight has {} values but `{name}` has sample {index}",
                        w.len()
                    ))
                })?,
                None => 1.0,
            };
            let by_class = match class_weight {
                Some(w) => w.get(class_of(target)).copied().unwrap_or(1.0),
                None => 1.0,
            };
            Ok(by_sample * by_class)
        })
        .collect::<Result<Vec<f32>>>()?;
    Ok(Some(Tensor::from_vec(
        weights,
        indices.len(),
        &Device::Cpu,
    )?))
}

/// A target's class: the index itself for a class-index target, the argmax of a one-hot row.
fn class_of(target: &[f32]) -> usize {
    match target {
        [index] => index.max(0.0) as usize,
        row => {
            row.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                    if v > best.1 {
                        (i, v)
                    } else {
                        best
                    }
                })
                .0
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::data::InMemoryDataset;

    /// Four samples of shape `[1]`, classes `0, 1, 2, 0` of 3.
    fn four() -> InMemoryDataset {
        InMemoryDataset::from_vecs(
            vec![0.0; 4],
            &[1],
            vec![0.0, 1.0, 2.0, 0.0],
            Targets::Classes(3),
        )
        .unwrap()
        .named("four")
    }

    #[test]
    fn sample_weights_need_one_finite_non_negative_value_per_sample() {
        let data = four();
        assert!(sample_weights(&data, None).unwrap().is_none());
        let ok = sample_weights(&data, Some(&[1.0, 0.0, 2.0, 0.5])).unwrap();
        assert_eq!(ok.as_deref(), Some(&[1.0, 0.0, 2.0, 0.5][..]));
        let short = sample_weights(&data, Some(&[1.0; 3])).unwrap_err();
        assert!(short.to_string().contains("3 values"), "{short}");
        for bad in [-1.0, f32::NAN, f32::INFINITY] {
            let e = sample_weights(&data, Some(&[1.0, bad, 1.0, 1.0])).unwrap_err();
            assert!(e.to_string().contains("sample_weight[1]"), "{e}");
        }
    }

    #[test]
    fn class_weights_are_dense_and_checked_against_the_classes() {
        let data = four();
        let weights = HashMap::from([(1, 3.0)]);
        let dense = class_weights(&data, Some(&weights)).unwrap();
        assert_eq!(dense.as_deref(), Some(&[1.0, 3.0, 1.0][..]));
        let unknown = class_weights(&data, Some(&HashMap::from([(3, 1.0)]))).unwrap_err();
        assert!(unknown.to_string().contains("3 classes"), "{unknown}");
        let negative = class_weights(&data, Some(&HashMap::from([(0, -1.0)]))).unwrap_err();
        assert!(negative.to_string().contains("class 0"), "{negative}");
    }

    #[test]
    fn a_batch_weighs_each_sample_by_its_weight_times_its_class_weight() {
        let sample = [1.0, 2.0, 3.0, 4.0];
        let class = [1.0, 10.0, 100.0];
        assert!(batch_weights(None, None, "four", &[0, 1], &[0.0, 1.0], 1)
            .unwrap()
            .is_none());
        // Class indices, samples 3, 1, 2.
        let w = batch_weights(
            Some(&sample),
            Some(&class),
            "four",
            &[3, 1, 2],
            &[0., 1., 2.],
            1,
        )
        .unwrap()
        .unwrap();
        assert_eq!(w.to_vec1::<f32>().unwrap(), [4.0, 20.0, 300.0]);
        // One-hot rows: the argmax is the class.
        let rows = [0.0, 0.0, 1.0, 0.0, 1.0, 0.0];
        let w = batch_weights(None, Some(&class), "four", &[0, 1], &rows, 3)
            .unwrap()
            .unwrap();
        assert_eq!(w.to_vec1::<f32>().unwrap(), [100.0, 10.0]);
        let e = batch_weights(Some(&sample), None, "four", &[4], &[0.0], 1).unwrap_err();
        assert!(e.to_string().contains("has sample 4"), "{e}");
    }

    #[test]
    fn a_batch_sample_weight_tensor_must_have_one_value_per_sample() {
        let w = Tensor::new(&[1f64, 2.0], &Device::Cpu).unwrap();
        let checked = batch_sample_weight(&w, 2).unwrap();
        assert_eq!(checked.dtype(), DType::F32);
        assert_eq!(checked.to_vec1::<f32>().unwrap(), [1.0, 2.0]);
        assert!(matches!(
            batch_sample_weight(&w, 3),
            Err(Error::Shape { .. })
        ));
    }
}
