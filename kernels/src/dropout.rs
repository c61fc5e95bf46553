//! Dropout's masks, drawn on the device the generator's position lives on without reading
//! anything back: a GPU step never waits for the host to draw a mask, and a CUDA graph can
//! replay the draw.
//!
//! A layer's generator is a seed and a **position**, the count of masks drawn so far, kept as
//! two `f32` values `[count / 2^24, count % 2^24]` (each exact in `f32`) in a tensor on the
//! layer's device, saved with the weights. [`draw_mask`] reads the position where it lives,
//! fills the mask, and moves the position on in place. Value `i` of mask `count` is kept when
//! word `i % 4` of Philox4x32-10 at counter `[i / 4, count]` under the seed is below
//! `(1 - rate) * 2^32`: integers only, so the CPU and a CUDA device (`cuda/dropout.cu`) draw
//! the same masks bit for bit, and a run resumed at a saved position draws what an
//! uninterrupted one would.
//!
//! ```
//! # fn main() -> kandle_kernels::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! use kandle_kernels::dropout::draw_mask;
//!
//! let position = Tensor::zeros(2, DType::F32, &Device::Cpu)?;
//! let mask = draw_mask(&position, 42, 0.25, &[8, 100], DType::F32)?;
//! let values = mask.flatten_all()?.to_vec1::<f32>()?;
//! assert!(values.iter().all(|v| *v == 0.0 || *v == 1.0 / 0.75));
//! assert_eq!(position.to_vec1::<f32>()?, [0.0, 1.0]);
//! # Ok(()) }
//! ```

use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp1, Layout, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::philox::philox4x32_10;
use crate::{Error, Result};

const OP: &str = "dropout_mask";

/// `2^24`: the position's low part counts up to it.
const LOW_PART: u64 = 1 << 24;

/// Mask values per unit of parallel work on the CPU (a multiple of Philox's four words).
const CHUNK: usize = 1 << 14;

/// A fresh mask of `dims` in `dtype` (`f32`, `f64`, `f16` or `bf16`) for dropping values with
/// probability `rate`, in `[0, 1)`: `1 / (1 - rate)` where a value is kept (rounded to `f32`
/// first, then to `dtype`, unless `dtype` is `f64`), zero where it is dropped. The mask is
/// drawn on `position`'s device for the generator `seed` at `position` (two `f32` values; see
/// the module's documentation), which then moves on by one, in place.
///
/// A position read from a file that holds other values than the counts it stores (negative,
/// fractional, not a number) is read as Rust's and CUDA's conversions read it, the same on
/// every device. Errors ([`Error::InvalidInput`]) for a rate outside `[0, 1)`, a position that
/// is not two `f32` values, an integer `dtype`, or a device other than the CPU and CUDA.
pub fn draw_mask(
    position: &Tensor,
    seed: u64,
    rate: f64,
    dims: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    if !(0.0..1.0).contains(&rate) {
        return Err(Error::invalid(format!(
            "{OP}: the rate must be in [0, 1), got {rate}"
        )));
    }
    if position.dtype() != DType::F32 || position.dims() != [2] {
        return Err(Error::invalid(format!(
            "{OP}: the generator's position must be two f32 values, got {:?} {:?}",
            position.dtype(),
            position.dims()
        )));
    }
    if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Err(Error::invalid(format!(
            "{OP}: masks are f32, f64, f16 or bf16, not {dtype:?}"
        )));
    }
    if !(position.device().is_cpu() || position.device().is_cuda()) {
        return Err(Error::invalid(format!(
            "{OP}: masks are drawn on the CPU or a CUDA device, not {:?}",
            position.device()
        )));
    }
    let keep = 1.0 - rate;
    let draw = MaskDraw {
        seed,
        threshold: (keep * 4_294_967_296.0).floor().min(f64::from(u32::MAX)) as u32,
        scale: 1.0 / keep,
        dims: dims.to_vec(),
        dtype,
    };
    let mask = position.contiguous()?.apply_op1_no_bwd(&draw)?;
    position.inplace_op1(&AdvancePosition)?;
    Ok(mask)
}

/// The draw of one mask: what [`draw_mask`] computes from its arguments, for the CPU here and
/// for CUDA in `cuda::dropout`.
#[derive(Debug, Clone)]
pub(crate) struct MaskDraw {
    /// The generator's seed, Philox's key.
    pub(crate) seed: u64,
    /// A word below it keeps its value.
    pub(crate) threshold: u32,
    /// `1 / (1 - rate)`.
    pub(crate) scale: f64,
    /// The mask's shape.
    pub(crate) dims: Vec<usize>,
    /// The mask's dtype.
    pub(crate) dtype: DType,
}

impl MaskDraw {
    /// The number of values in the mask.
    pub(crate) fn len(&self) -> usize {
        self.dims.iter().product()
    }

    /// Philox's key for the seed.
    pub(crate) fn key(&self) -> [u32; 2] {
        [self.seed as u32, (self.seed >> 32) as u32]
    }

    /// The mask for the generator at `count`, `kept` where a value is kept and `zero` elsewhere.
    fn fill<T: Copy + Send + Sync>(&self, count: u64, kept: T, zero: T) -> Vec<T> {
        let mut out = vec![zero; self.len()];
        let key = self.key();
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (j, quad) in chunk.chunks_mut(4).enumerate() {
                    let block = ((c * CHUNK) / 4 + j) as u64;
                    let ctr = [
                        block as u32,
                        (block >> 32) as u32,
                        count as u32,
                        (count >> 32) as u32,
                    ];
                    let words = philox4x32_10(ctr, key);
                    for (v, w) in quad.iter_mut().zip(words) {
                        if w < self.threshold {
                            *v = kept;
                        }
                    }
                }
            });
        out
    }
}

/// The count a position holds, as the CUDA kernels read it: each part converted to an integer
/// as Rust's and PTX's conversions do (toward zero, clamped, NaN as zero), wrapping.
pub(crate) fn count_of(high: f32, low: f32) -> u64 {
    (high as u64)
        .wrapping_mul(LOW_PART)
        .wrapping_add(low as u64)
}

/// The position after `count`, as its two parts.
pub(crate) fn position_of(count: u64) -> [f32; 2] {
    [(count / LOW_PART) as f32, (count % LOW_PART) as f32]
}

/// The two parts of the position in `(storage, layout)`.
fn read_position(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(f32, f32)> {
    let (CpuStorage::F32(v), Some((start, end))) = (storage, layout.contiguous_offsets()) else {
        candle_core::bail!("{OP}: the generator's position must be two contiguous f32 values")
    };
    match v.get(start..end) {
        Some(&[high, low]) => Ok((high, low)),
        _ => candle_core::bail!("{OP}: the generator's position must be two f32 values"),
    }
}

impl CustomOp1 for MaskDraw {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (high, low) = read_position(storage, layout)?;
        let count = count_of(high, low);
        let narrow = self.scale as f32;
        let mask = match self.dtype {
            DType::F32 => CpuStorage::F32(self.fill(count, narrow, 0.0)),
            DType::F64 => CpuStorage::F64(self.fill(count, self.scale, 0.0)),
            DType::F16 => CpuStorage::F16(self.fill(count, f16::from_f32(narrow), f16::ZERO)),
            DType::BF16 => CpuStorage::BF16(self.fill(count, bf16::from_f32(narrow), bf16::ZERO)),
            other => candle_core::bail!("{OP}: masks are f32, f64, f16 or bf16, not {other:?}"),
        };
        Ok((mask, Shape::from(self.dims.clone())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::dropout::draw(self, storage, layout)
    }
}

/// Moves a generator's position on by one draw, in place.
pub(crate) struct AdvancePosition;

impl InplaceOp1 for AdvancePosition {
    fn name(&self) -> &'static str {
        "dropout_advance_position"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (high, low) = read_position(storage, layout)?;
        let next = position_of(count_of(high, low).wrapping_add(1));
        if let (CpuStorage::F32(v), Some((start, _))) = (storage, layout.contiguous_offsets()) {
            v[start..start + 2].copy_from_slice(&next);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        crate::cuda::dropout::advance(storage, layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn position(count: u64) -> Result<Tensor> {
        Ok(Tensor::new(&position_of(count), &Device::Cpu)?)
    }

    fn mask(count: u64, seed: u64, rate: f64, n: usize) -> Result<Vec<f32>> {
        Ok(draw_mask(&position(count)?, seed, rate, &[n], DType::F32)?.to_vec1::<f32>()?)
    }

    #[test]
    fn a_value_is_kept_when_its_philox_word_is_below_the_keep_fraction() -> Result<()> {
        let (seed, count, rate) = (0x0123_4567_89ab_cdef_u64, (3 << 24) + 17, 0.3);
        let got = mask(count, seed, rate, 4 * 5 + 3)?;
        let threshold = (0.7f64 * 4_294_967_296.0).floor() as u32;
        for (i, v) in got.iter().enumerate() {
            let b = (i / 4) as u32;
            let words = philox4x32_10(
                [b, 0, count as u32, (count >> 32) as u32],
                [seed as u32, (seed >> 32) as u32],
            );
            let want = if words[i % 4] < threshold {
                (1.0 / 0.7f64) as f32
            } else {
                0.0
            };
            assert_eq!(v.to_bits(), want.to_bits(), "value {i}");
        }
        Ok(())
    }

    #[test]
    fn masks_drop_about_the_rate_and_each_draw_moves_the_position() -> Result<()> {
        let p = position(0)?;
        let n = 100_003;
        let first = draw_mask(&p, 9, 0.5, &[n], DType::F32)?.to_vec1::<f32>()?;
        assert_eq!(p.to_vec1::<f32>()?, [0.0, 1.0]);
        let second = draw_mask(&p, 9, 0.5, &[n], DType::F32)?.to_vec1::<f32>()?;
        assert_eq!(p.to_vec1::<f32>()?, [0.0, 2.0]);
        assert_ne!(first, second);
        for m in [&first, &second] {
            let dropped = m.iter().filter(|v| **v == 0.0).count() as f64 / n as f64;
            // 5 standard deviations of a binomial proportion at n = 100,003.
            assert!(
                (dropped - 0.5).abs() < 5.0 * (0.25 / n as f64).sqrt(),
                "{dropped}"
            );
            assert!(m.iter().all(|v| *v == 0.0 || *v == 2.0));
        }
        // The second draw again from the first's position moved on by one.
        assert_eq!(mask(1, 9, 0.5, n)?, second);
        // Another seed, another mask.
        assert_ne!(mask(1, 10, 0.5, n)?, second);
        Ok(())
    }

    #[test]
    fn the_position_carries_into_its_high_part() -> Result<()> {
        let p = position(LOW_PART - 1)?;
        assert_eq!(p.to_vec1::<f32>()?, [0.0, 16_777_215.0]);
        draw_mask(&p, 1, 0.1, &[3], DType::F32)?;
        assert_eq!(p.to_vec1::<f32>()?, [1.0, 0.0]);
        draw_mask(&p, 1, 0.1, &[3], DType::F32)?;
        assert_eq!(p.to_vec1::<f32>()?, [1.0, 1.0]);
        // Values the position never holds read as the conversions read them.
        assert_eq!(count_of(-3.0, f32::NAN), 0);
        assert_eq!(count_of(2.7, 5.9), 2 * LOW_PART + 5);
        Ok(())
    }

    #[test]
    fn every_dtype_has_the_same_mask_rounded_from_f32() -> Result<()> {
        let rate = 1.0 / 3.0;
        let f32_mask = mask(4, 77, rate, 999)?;
        for dtype in [DType::F64, DType::F16, DType::BF16] {
            let got = draw_mask(&position(4)?, 77, rate, &[999], dtype)?;
            let want = Tensor::new(f32_mask.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            let same = match dtype {
                // f64 keeps 1.5 itself, where f32 rounds it: compare what is kept.
                DType::F64 => got.ne(0.0)?.to_vec1::<u8>()? == want.ne(0.0)?.to_vec1::<u8>()?,
                _ => {
                    got.to_dtype(DType::F32)?.to_vec1::<f32>()?
                        == want.to_dtype(DType::F32)?.to_vec1::<f32>()?
                }
            };
            assert!(same, "{dtype:?}");
        }
        let scale = draw_mask(&position(4)?, 77, rate, &[999], DType::F64)?.max(0)?;
        assert_eq!(scale.to_scalar::<f64>()?, 1.0 / (1.0 - rate));
        Ok(())
    }

    #[test]
    fn bad_arguments_are_errors_naming_the_op() -> Result<()> {
        let p = position(0)?;
        let err = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(draw_mask(&p, 0, 1.0, &[4], DType::F32)).contains("rate must be in [0, 1)"));
        assert!(err(draw_mask(&p, 0, -0.1, &[4], DType::F32)).contains("rate"));
        assert!(err(draw_mask(&p, 0, 0.5, &[4], DType::U8)).contains("not U8"));
        let three = Tensor::zeros(3, DType::F32, &Device::Cpu)?;
        assert!(err(draw_mask(&three, 0, 0.5, &[4], DType::F32)).contains("two f32 values"));
        assert_eq!(
            p.to_vec1::<f32>()?,
            [0.0, 0.0],
            "a refused draw moves nothing"
        );
        Ok(())
    }

    #[test]
    fn an_empty_mask_still_moves_the_position() -> Result<()> {
        let p = position(0)?;
        let m = draw_mask(&p, 0, 0.5, &[0, 7], DType::F32)?;
        assert_eq!(m.dims(), [0, 7]);
        assert_eq!(p.to_vec1::<f32>()?, [0.0, 1.0]);
        Ok(())
    }
}
