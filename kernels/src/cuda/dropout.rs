//! Dropout's masks on CUDA devices (`dropout.cu`): [`crate::dropout::draw_mask`]'s draw and the
//! move of the generator's position, each one launch on candle's stream, reading the position
//! where it lives, so the host never waits for the device to draw a mask.

#![allow(unsafe_code)]

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Shape};

use super::operands::{address, address_mut, kernel, storage, uninit};
use super::program::{blocks_of, per_item, Arg, Program};
use crate::dropout::MaskDraw;

const OP: &str = "dropout_mask";

static PROGRAM: Program = Program::new(
    "kandle_dropout",
    concat!(include_str!("common.cuh"), include_str!("dropout.cu")),
);

/// An error unless `(s, l)` is a generator's position: two contiguous `f32` values.
fn check_position(s: &CudaStorage, l: &Layout) -> candle_core::Result<()> {
    if s.dtype() != DType::F32 || l.dims() != [2] || !l.is_contiguous() {
        candle_core::bail!(
            "{OP}: the generator's position must be two contiguous f32 values, got {:?} {:?}",
            s.dtype(),
            l.dims()
        );
    }
    Ok(())
}

/// The mask `draw` describes, for the generator at the position `(s, l)`, on its device.
pub(crate) fn draw(
    draw: &MaskDraw,
    s: &CudaStorage,
    l: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    check_position(s, l)?;
    let n = draw.len();
    if n > i32::MAX as usize {
        candle_core::bail!(
            "{OP}: a mask of {:?} has {n} values, more than the kernel's {}",
            draw.dims,
            i32::MAX
        );
    }
    let dev = &s.device;
    let stream = dev.cuda_stream();
    // SAFETY: the kernel writes every value of the mask.
    let mut mask = unsafe { uninit(dev, draw.dtype, n) }?;
    if n > 0 {
        let (position, read) = address(OP, s, l, &stream)?;
        let (out, write) = address_mut(&mut mask, &stream)?;
        let [key0, key1] = draw.key();
        let args = [
            Arg::Ptr(out),
            Arg::Ptr(position),
            Arg::U32(key0),
            Arg::U32(key1),
            Arg::U32(draw.threshold),
            Arg::F64(draw.scale),
            Arg::U32(n as u32),
        ];
        let name = kernel(OP, "dropout_mask", draw.dtype)?;
        // SAFETY: `position` holds two f32 values (checked above) and `mask` `n` values of the
        // kernel's dtype; the kernel reads the first and writes the second.
        unsafe { PROGRAM.launch(dev, &name, per_item(n.div_ceil(4)), &args) }?;
        drop((read, write));
    }
    Ok((storage(mask, dev), Shape::from(draw.dims.clone())))
}

/// Moves the generator's position `(s, l)` on by one draw, in place.
pub(crate) fn advance(s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
    check_position(s, l)?;
    let dev = s.device.clone();
    let stream = dev.cuda_stream();
    let (base, write) = address_mut(&mut s.slice, &stream)?;
    let position = base + (l.start_offset() * size_of::<f32>()) as u64;
    // SAFETY: `position` addresses the two f32 values of the position (checked above), which
    // the one thread reads and writes.
    unsafe {
        PROGRAM.launch(
            &dev,
            "dropout_advance",
            blocks_of((1, 1)),
            &[Arg::Ptr(position)],
        )
    }?;
    drop(write);
    Ok(())
}
