//! The ReLU every layer applies outside the kernels' fused ones (an activation, the ReLU a
//! merge or, off the kernels, a BatchNorm absorbed): `x < 0 ? 0 : x`, which keeps a NaN as
//! PyTorch's `relu` does (candle's `relu` is `max(x, 0)`, which makes a NaN zero). On kandle's
//! CPU kernel where the compute path allows it, composed of candle's device-generic ops
//! elsewhere, with the same values. Its gradient passes where `x < 0` is false: where
//! `x >= 0`, as candle's ReLU passes it, and at a NaN, as PyTorch's `threshold_backward` does;
//! where it stops, it gives zero whatever the output gradient holds. The kernels' fused ReLUs
//! (convolution epilogues, BatchNorm) compute the same.

use candle_core::Tensor;

use crate::kernels::relu as kernel;
use crate::kernels::replay::Replay1;
use crate::Result;

/// `x < 0 ? 0 : x` element by element: zero for negative values and `-inf`, `x` itself for the
/// rest (NaN, `+inf`, both zeros); on the CPU kernel when `kernels` and it takes `x`.
/// Differentiable by candle's autograd, with the gradient of [`ReluRecord`].
pub(crate) fn relu(x: &Tensor, kernels: bool) -> Result<Tensor> {
    match kernels && kernel::supported(x) {
        true => Ok(kernel::relu(x)?),
        false => stops_where_negative(x)?.pass(x),
    }
}

/// Where a ReLU stops the gradient, kept by a recorded forward pass for its backward.
pub(crate) struct ReluRecord(Record);

enum Record {
    /// The kernel's op, which computes the gradient from its input.
    Kernel(Replay1),
    /// A mask, 1 where the gradient stops.
    Stops(Stops),
}

impl ReluRecord {
    /// The ReLU of `x` (see [`relu`]) and its record: the gradient stops where `x < 0`.
    pub(crate) fn relu(x: &Tensor, kernels: bool) -> Result<(Tensor, Self)> {
        if kernels && kernel::supported(x) {
            let replay = kernel::relu_replay(x)?;
            return Ok((replay.output().clone(), Self(Record::Kernel(replay))));
        }
        let stops = stops_where_negative(x)?;
        Ok((stops.pass(x)?, Self(Record::Stops(stops))))
    }

    /// The record of a ReLU known by its output `y`: the gradient stops where `y <= 0` (a
    /// zero of the ReLU, from an input that was not above zero) and passes where `y > 0` or
    /// NaN.
    pub(crate) fn of_output(y: &Tensor) -> Result<Self> {
        Ok(Self(Record::Stops(Stops(y.le(0.0)?))))
    }

    /// The input's gradient for the output's `dy`: `dy` where the gradient passes, zero where
    /// it stops.
    pub(crate) fn backward(&self, dy: &Tensor) -> Result<Tensor> {
        match &self.0 {
            Record::Kernel(replay) => replay
                .backward(dy)?
                .ok_or_else(|| crate::Error::invalid("relu: no input gradient")),
            Record::Stops(stops) => stops.pass(dy),
        }
    }
}

/// A `u8` mask, 1 where a ReLU's gradient stops (and its output is zero).
struct Stops(Tensor);

/// The mask of the ReLU of `x`.
fn stops_where_negative(x: &Tensor) -> Result<Stops> {
    Ok(Stops(x.lt(0.0)?))
}

impl Stops {
    /// `t` where the mask is 0, zero where it is 1: the ReLU's output for its input, its
    /// input's gradient for its output's.
    fn pass(&self, t: &Tensor) -> Result<Tensor> {
        let zero = Tensor::zeros((), t.dtype(), t.device())?.broadcast_as(t.shape())?;
        Ok(self.0.where_cond(&zero, t)?)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::kernels::test_support::SPECIAL_VALUES;

    fn bits(t: &Tensor) -> Result<Vec<u32>> {
        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    }

    /// On the kernel and composed of candle's ops, the values are `x < 0 ? 0 : x` bit for bit:
    /// a NaN and `+inf` stay, `-inf` and negative numbers become zero; candle's ReLU agrees on
    /// every value but the NaN and the sign of a negative zero.
    #[test]
    fn keeps_nans_and_infinities() -> Result<()> {
        let x = Tensor::new(&SPECIAL_VALUES, &Device::Cpu)?;
        let want: Vec<u32> = SPECIAL_VALUES
            .iter()
            .map(|&v| if v < 0.0 { 0f32 } else { v }.to_bits())
            .collect();
        for kernels in [true, false] {
            assert_eq!(bits(&relu(&x, kernels)?)?, want, "kernels {kernels}");
            let (y, _) = ReluRecord::relu(&x, kernels)?;
            assert_eq!(bits(&y)?, want, "kernels {kernels}");
        }
        // Candle's ReLU differs at the NaN (zero) and at -0.0 (+0.0) only.
        let candle = x.relu()?.to_vec1::<f32>()?;
        let ours = relu(&x, false)?.to_vec1::<f32>()?;
        for (i, (got, v)) in ours.iter().zip(&candle).enumerate() {
            assert!(got == v || i == 0, "{got} vs candle's {v}");
        }
        Ok(())
    }

    /// Candle's autograd through [`relu`] and the recorded backward pass give the same
    /// gradient, on the kernel and off it: `dy` where `x >= 0` (zero included, as candle's
    /// ReLU) or NaN (as PyTorch's), zero elsewhere even where `dy` is NaN (as PyTorch's). A
    /// record made from the output stops at zero too.
    #[test]
    fn the_gradient_passes_where_the_input_is_not_negative() -> Result<()> {
        let x = Var::new(&SPECIAL_VALUES, &Device::Cpu)?;
        let dy = Tensor::new(
            &[1f32, f32::NAN, 3., 4., 5., f32::NAN, 7., 8.],
            &Device::Cpu,
        )?;
        let want = [1f32, 0., 3., 4., 5., 0., 7., 0.];
        for kernels in [true, false] {
            let grads = relu(&x, kernels)?.mul(&dy)?.sum_all()?.backward()?;
            let got = grads.get(&x).map(|g| g.to_vec1::<f32>()).transpose()?;
            assert_eq!(got.as_deref(), Some(&want[..]), "kernels {kernels}");
            let (y, record) = ReluRecord::relu(x.as_tensor(), kernels)?;
            assert_eq!(record.backward(&dy)?.to_vec1::<f32>()?, want);
            let from_output = ReluRecord::of_output(&y)?.backward(&dy)?;
            assert_eq!(
                from_output.to_vec1::<f32>()?,
                [1f32, 0., 3., 0., 0., 0., 7., 0.]
            );
        }
        Ok(())
    }
}
