//! Dropout's masks drawn on a GPU (`kandle_kernels::dropout::draw_mask` with the generator's
//! position on a CUDA device, `cuda/dropout.cu`) against the same draws on the CPU, bit for bit:
//! every dtype, sizes around Philox's four words and the kernel's blocks, positions across the
//! carry into the position's high part and values a position never holds (NaN, negative), seeds
//! at the extremes, and the position moved on alike on both devices.
//!
//! Built with `cuda` and `test-support`. The tests are `#[ignore]`d (`gpu/check.sh` runs them
//! with `--include-ignored`).

#[allow(dead_code)]
mod cuda_support;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};
use cuda_support::gpu;
use kandle_kernels::dropout::draw_mask;

/// The values' bits, whatever the dtype (half precision widened to `f32` exactly).
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    let t = t.to_device(&Device::Cpu)?.flatten_all()?;
    Ok(match t.dtype() {
        DType::F64 => t.to_vec1::<f64>()?.iter().map(|v| v.to_bits()).collect(),
        _ => t
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| u64::from(v.to_bits()))
            .collect(),
    })
}

#[test]
#[ignore = "needs a CUDA GPU; gpu/check.sh runs it"]
fn masks_drawn_on_the_gpu_are_the_cpus_bit_for_bit() -> Result<()> {
    let dev = gpu()?;
    let positions: [[f32; 2]; 6] = [
        [0.0, 0.0],
        [0.0, 1.0],
        [0.0, 16_777_215.0],
        [5.0, 7.0],
        [f32::NAN, 3.0],
        [-2.0, 9.5],
    ];
    let sizes: [&[usize]; 7] = [&[0], &[1], &[3], &[5], &[4, 257], &[64, 10], &[1_000_003]];
    let mut draws = 0;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (p, position) in positions.iter().enumerate() {
            for dims in sizes {
                for (seed, rate) in [(0u64, 0.5), (u64::MAX, 0.1), (0x0123_4567_89ab_cdef, 0.9)] {
                    let on_cpu = Tensor::new(position, &Device::Cpu)?;
                    let on_gpu = Tensor::new(position, &dev)?;
                    let want = draw_mask(&on_cpu, seed, rate, dims, dtype)?;
                    let got = draw_mask(&on_gpu, seed, rate, dims, dtype)?;
                    let what =
                        format!("{dtype:?} {dims:?} at {position:?}, seed {seed}, rate {rate}");
                    ensure!(
                        got.device().is_cuda() && got.dims() == dims,
                        "{what}: {got:?}"
                    );
                    ensure!(bits(&got)? == bits(&want)?, "{what}: the masks differ");
                    ensure!(
                        bits(&on_gpu)? == bits(&on_cpu)?,
                        "{what}: the position moved to {:?} on the GPU and {:?} on the CPU",
                        on_gpu.to_vec1::<f32>()?,
                        on_cpu.to_vec1::<f32>()?
                    );
                    if p == 0 {
                        ensure!(on_gpu.to_vec1::<f32>()? == [0.0, 1.0], "{what}");
                    }
                    draws += 1;
                }
            }
        }
    }
    println!("{draws} masks drawn on the GPU, each the CPU's bit for bit");
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU; gpu/check.sh runs it"]
fn a_variables_position_moves_in_place_draw_after_draw() -> Result<()> {
    let dev = gpu()?;
    let position = Var::from_tensor(&Tensor::zeros(2, DType::F32, &dev)?)?;
    let cpu = Tensor::zeros(2, DType::F32, &Device::Cpu)?;
    let mut masks = Vec::new();
    for _ in 0..5 {
        let got = draw_mask(position.as_tensor(), 3, 0.5, &[4096], DType::F32)?;
        let want = draw_mask(&cpu, 3, 0.5, &[4096], DType::F32)?;
        ensure!(bits(&got)? == bits(&want)?, "draw {}", masks.len());
        masks.push(bits(&got)?);
    }
    ensure!(position.as_tensor().to_vec1::<f32>()? == [0.0, 5.0]);
    masks.dedup();
    ensure!(masks.len() == 5, "each draw is a new mask");
    Ok(())
}
