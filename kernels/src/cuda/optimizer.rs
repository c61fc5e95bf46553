//! Optimizers' updates of `f32` variables on a CUDA device with kandle's own kernels
//! (`optimizer.cu`), in place and in one launch for all of them: SGD's ([`sgd_step`]) and
//! Adam's and AdamW's ([`adam_step`]), with the semantics and the arithmetic of the CPU kernels
//! of [`crate::optimizer`] (each operation rounded on its own, in their order).
//!
//! The variables, their gradients and their state are listed in a table of device addresses
//! and lengths, copied to the device with the launch (a few words per variable); the kernel cuts
//! every variable into chunks of 4,096 values, and a block updates a chunk at a time, reading
//! each of its operands once and writing the variable and its state where they lie. The
//! learning rate and the step's scalars are the kernel's arguments, so a schedule costs nothing.
//! A network of a hundred variables takes one launch per step where candle's ops take a
//! thousand.
//!
//! The gated forms ([`sgd_step_live`], [`adam_step_live`]) read the scalars that change from
//! step to step from device memory ([`LiveRates`]) and apply only when the step's finite-ness
//! probe says so, deciding nothing on the host: the update a CUDA graph of a whole training step
//! replays, with each step's learning rate written into the rates before the launch. Their
//! table of addresses goes through candle's upload cache, so a capture that lists the tensors
//! its warm-up listed uploads nothing.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Layout, Storage, Tensor};

use super::operands::address;
use super::program::{blocks_of, Arg, Program};
use crate::optimizer::adam::{AdamStep, FirstMoment, SecondMoment, WeightDecay};
use crate::optimizer::sgd::Descent;
use crate::{Error, Result};

const SGD_OP: &str = "cuda_sgd_step";
const ADAM_OP: &str = "cuda_adam_step";

static PROGRAM: Program = Program::new(
    "kandle_optimizer",
    concat!(include_str!("common.cuh"), include_str!("optimizer.cu")),
);

/// Values of a variable that a block updates at a time (`optimizer.cu`'s `OPT_CHUNK`).
const CHUNK: usize = 4096;

/// Blocks of a launch at most (they loop over the rest of the chunks).
const MAX_BLOCKS: usize = 1 << 16;

/// SGD's momentum buffers, one per variable, for [`sgd_step`].
#[derive(Debug, Clone, Copy)]
pub enum MomentumBuffers<'a> {
    /// No momentum: no buffer.
    None,
    /// The first step with momentum: each buffer takes its variable's gradient (plus the
    /// weight decay), as torch's `clone`; what it held is not read.
    Start(&'a [&'a Tensor]),
    /// Later steps: `buf = mu * buf + g` ([`crate::optimizer::sgd::Momentum`]).
    Update(&'a [&'a Tensor]),
}

/// The scalars of a gated update ([`sgd_step_live`], [`adam_step_live`]) that it reads from
/// device memory when it runs, and whether it applies.
#[derive(Debug, Clone, Copy)]
pub struct LiveRates<'a> {
    /// `f64` values on the update's device: SGD's `[learning_rate, started]` (`started` not 0
    /// once the momentum buffers have taken a step), Adam's `[step_size, inv_sqrt_bc2,
    /// decay_factor]` (the last 1 for Adam).
    pub rates: &'a Tensor,
    /// One `f32` value on the device: the update applies when it is 0 and changes nothing
    /// otherwise (a step's finite-ness probe, NaN when something in the step was not finite).
    pub gate: &'a Tensor,
}

/// SGD's update of the `f32` variables `params` on one CUDA device with their gradients
/// `grads` and, with momentum, their buffers, all in place and in one launch: what
/// [`crate::optimizer::sgd::Momentum`] and then [`Descent`] compute on the CPU for each (PyTorch's
/// `torch.optim.SGD` without dampening), bit for bit. The learning rate is `step`'s.
///
/// Every tensor is contiguous and holds as many values as its variable; a gradient may be a
/// view into a larger buffer. A variable and its state are distinct tensors. Errors
/// ([`Error::InvalidInput`]) for lists of other lengths, tensors on another device, of another
/// dtype or length, buffers missing with a momentum or given without one.
///
/// ```no_run
/// # fn main() -> kandle_kernels::Result<()> {
/// use candle_core::{DType, Device, Tensor};
/// use kandle_kernels::cuda::{self, MomentumBuffers};
/// use kandle_kernels::optimizer::sgd::Descent;
///
/// let dev = Device::new_cuda(0)?;
/// let w = Tensor::ones((3, 4), DType::F32, &dev)?;
/// let b = Tensor::zeros(3, DType::F32, &dev)?;
/// let (gw, gb) = (w.ones_like()?, b.ones_like()?);
/// // The buffers' first step writes them whole.
/// let (bw, bb) = (w.zeros_like()?, b.zeros_like()?);
/// let step = Descent { learning_rate: 0.1, momentum: 0.9, nesterov: false, weight_decay: 0.0 };
/// cuda::sgd_step(&[&w, &b], &[&gw, &gb], MomentumBuffers::Start(&[&bw, &bb]), &step)?;
/// assert_eq!(b.to_vec1::<f32>()?, [-0.1; 3]);
/// # Ok(()) }
/// ```
pub fn sgd_step(
    params: &[&Tensor],
    grads: &[&Tensor],
    buffers: MomentumBuffers<'_>,
    step: &Descent,
) -> Result<()> {
    let (buffers, mode) = match (buffers, step.momentum != 0.0) {
        (MomentumBuffers::None, false) => (None, 0),
        (MomentumBuffers::Start(b), true) => (Some(b), 1),
        (MomentumBuffers::Update(b), true) => (Some(b), 2),
        (MomentumBuffers::None, true) => {
            return Err(Error::invalid(format!(
                "{SGD_OP}: a momentum of {} needs the momentum buffers",
                step.momentum
            )))
        }
        (_, false) => {
            return Err(Error::invalid(format!(
                "{SGD_OP}: momentum buffers given to an update without momentum"
            )))
        }
    };
    sgd_launch(params, grads, buffers, mode, step, None)
}

/// [`sgd_step`] gated and reading its learning rate from `live` ([`LiveRates`]): with a
/// momentum the buffers are [`MomentumBuffers::Update`]'s, and `live`'s `started` says whether
/// they take the first step's copy of the gradient or the running update. `step`'s learning
/// rate is not read. Errors as [`sgd_step`]'s, and for rates or a gate of another kind.
pub fn sgd_step_live(
    params: &[&Tensor],
    grads: &[&Tensor],
    buffers: MomentumBuffers<'_>,
    step: &Descent,
    live: &LiveRates<'_>,
) -> Result<()> {
    let (buffers, mode) = match (buffers, step.momentum != 0.0) {
        (MomentumBuffers::None, false) => (None, 0),
        (MomentumBuffers::Update(b), true) => (Some(b), 2),
        _ => {
            return Err(Error::invalid(format!(
                "{SGD_OP}: a gated update takes momentum buffers (as updates) exactly when it has \
                 a momentum, here {}",
                step.momentum
            )))
        }
    };
    sgd_launch(params, grads, buffers, mode, step, Some((live, 2)))
}

/// Launches SGD's kernel in `mode` (its `buffers` argument), gated by `live` (with the number
/// of rates it reads) when given.
fn sgd_launch(
    params: &[&Tensor],
    grads: &[&Tensor],
    buffers: Option<&[&Tensor]>,
    mode: i32,
    step: &Descent,
    live: Option<(&LiveRates<'_>, usize)>,
) -> Result<()> {
    let mut operands = vec![params, grads];
    operands.extend(buffers);
    let scalars = [
        Arg::F64(step.learning_rate),
        Arg::F64(step.momentum),
        Arg::F64(step.weight_decay),
        Arg::I32(step.nesterov.into()),
        Arg::I32(mode),
    ];
    // The kernel's table has a row for the buffers even without them (it never reads it).
    update(SGD_OP, "sgd_step_f32", &operands, 3, &scalars, live)
}

/// Adam's or AdamW's update of the `f32` variables `params` on one CUDA device with their
/// gradients `grads` and moments `(m, v)`, all in place and in one launch: what `first`,
/// `second` ([`FirstMoment`], [`SecondMoment`]) and then `step` ([`AdamStep`]) compute on the
/// CPU for each, bit for bit. The learning rate and the bias corrections are `step`'s.
///
/// The tensors and errors are as [`sgd_step`]'s (the moments are required).
pub fn adam_step(
    params: &[&Tensor],
    grads: &[&Tensor],
    (m, v): (&[&Tensor], &[&Tensor]),
    (first, second): (&FirstMoment, &SecondMoment),
    step: &AdamStep,
) -> Result<()> {
    adam_launch(params, grads, (m, v), (first, second), step, None)
}

/// [`adam_step`] gated and reading its step size, bias correction and decay factor from `live`
/// ([`LiveRates`]); `step`'s are not read, its epsilon and whether it decays the variables
/// are. Errors as [`adam_step`]'s, and for rates or a gate of another kind.
pub fn adam_step_live(
    params: &[&Tensor],
    grads: &[&Tensor],
    (m, v): (&[&Tensor], &[&Tensor]),
    (first, second): (&FirstMoment, &SecondMoment),
    step: &AdamStep,
    live: &LiveRates<'_>,
) -> Result<()> {
    adam_launch(
        params,
        grads,
        (m, v),
        (first, second),
        step,
        Some((live, 3)),
    )
}

/// Launches Adam's kernel, gated by `live` (with the number of rates it reads) when given.
fn adam_launch(
    params: &[&Tensor],
    grads: &[&Tensor],
    (m, v): (&[&Tensor], &[&Tensor]),
    (first, second): (&FirstMoment, &SecondMoment),
    step: &AdamStep,
    live: Option<(&LiveRates<'_>, usize)>,
) -> Result<()> {
    let l2 = |decay: WeightDecay| match decay {
        WeightDecay::None => (0.0, 0),
        WeightDecay::L2(wd) => (wd, 1),
    };
    let ((wd_1, l2_1), (wd_2, l2_2)) = (l2(first.decay), l2(second.decay));
    let scalars = [
        Arg::F64(first.beta),
        Arg::F64(1.0 - first.beta),
        Arg::F64(wd_1),
        Arg::I32(l2_1),
        Arg::F64(second.beta),
        Arg::F64(1.0 - second.beta),
        Arg::F64(wd_2),
        Arg::I32(l2_2),
        Arg::F64(step.step_size),
        Arg::F64(step.inv_sqrt_bc2),
        Arg::F64(step.epsilon),
        Arg::I32(step.decay_factor.is_some().into()),
        Arg::F64(step.decay_factor.unwrap_or(1.0)),
    ];
    update(
        ADAM_OP,
        "adam_step_f32",
        &[params, grads, m, v],
        4,
        &scalars,
        live,
    )
}

/// Launches `kernel` over the variables `operands[0]` with their other operands (one list
/// each, in the kernel's order), its table holding `rows` rows of addresses (unused rows null),
/// then `scalars`, then the addresses of `live`'s rates and gate (null when not gated; the
/// kernel reads the given number of rates).
fn update(
    op: &str,
    kernel: &str,
    operands: &[&[&Tensor]],
    rows: usize,
    scalars: &[Arg],
    live: Option<(&LiveRates<'_>, usize)>,
) -> Result<()> {
    let Some(dev) = check(op, operands)? else {
        return Ok(());
    };
    if let Some((live, rates)) = live {
        check_live(op, live, rates, &dev)?;
    }
    let live_locked =
        live.map(|(l, _)| (l.rates.storage_and_layout(), l.gate.storage_and_layout()));
    // The read locks of every operand, held until the kernel is queued: no candle op replaces
    // their storage meanwhile.
    let locked: Vec<Vec<_>> = operands
        .iter()
        .map(|list| list.iter().map(|t| t.storage_and_layout()).collect())
        .collect();
    let stream = dev.cuda_stream();
    let lengths: Vec<usize> = operands[0].iter().map(|t| t.elem_count()).collect();
    // Empty variables are left out of the table.
    let kept: Vec<usize> = (0..lengths.len()).filter(|&i| lengths[i] > 0).collect();
    if kept.is_empty() {
        return Ok(());
    }
    let tensors = kept.len();
    let mut table = vec![0u64; rows * tensors];
    let mut guards = Vec::with_capacity(operands.len() * tensors);
    for (k, list) in locked.iter().enumerate() {
        for (row, &i) in kept.iter().enumerate() {
            let (storage, layout): &(_, &Layout) = &list[i];
            let Storage::Cuda(s) = &**storage else {
                return Err(Error::invalid(format!(
                    "{op}: an operand left the CUDA device"
                )));
            };
            let (ptr, guard) = address(op, s, layout, &stream)?;
            table[k * tensors + row] = ptr;
            guards.push(guard);
        }
    }
    let mut chunks = 0u64;
    let firsts: Vec<u64> = kept
        .iter()
        .map(|&i| {
            let first = chunks;
            chunks += lengths[i].div_ceil(CHUNK) as u64;
            first
        })
        .collect();
    let Ok(chunks32) = u32::try_from(chunks) else {
        return Err(Error::invalid(format!(
            "{op}: {chunks} chunks of {CHUNK} values are more than one launch takes"
        )));
    };
    table.extend(kept.iter().map(|&i| lengths[i] as u64));
    table.extend(firsts);
    table.push(chunks);
    let table = dev.clone_htod(&table)?;
    let (ptable, read_table) = table.device_ptr(&stream);
    let mut args = vec![
        Arg::Ptr(ptable),
        Arg::U32(tensors as u32),
        Arg::U32(chunks32),
    ];
    args.extend_from_slice(scalars);
    let mut live_guards = Vec::with_capacity(2);
    match &live_locked {
        Some(((rates, rates_layout), (gate, gate_layout))) => {
            for (storage, layout) in [(rates, rates_layout), (gate, gate_layout)] {
                let Storage::Cuda(s) = &**storage else {
                    return Err(Error::invalid(format!(
                        "{op}: the gated update's rates or gate left the CUDA device"
                    )));
                };
                let (ptr, guard) = address(op, s, layout, &stream)?;
                args.push(Arg::Ptr(ptr));
                live_guards.push(guard);
            }
        }
        None => args.extend([Arg::Ptr(0), Arg::Ptr(0)]),
    }
    let blocks = (chunks32 as usize).min(MAX_BLOCKS) as u32;
    // SAFETY: the table holds, for each of `tensors` variables, the addresses of its contiguous
    // `f32` operands on `dev` (checked by `check`, each of the variable's length, or null in a
    // row the kernel does not read under these scalars), then the lengths and the chunks the
    // kernel walks; the locks and guards keep the operands alive until the launch is queued,
    // and stream order keeps them alive until it has run. The kernel writes through the
    // addresses of the variables and their state: candle's ops on them are queued on the same
    // stream, before or after it.
    unsafe { PROGRAM.launch(&dev, kernel, blocks_of((blocks, 1)), &args) }?;
    drop((read_table, guards, live_guards));
    Ok(())
}

/// Checks that `live` holds at least `rates` contiguous `f64` rates and one `f32` gate on
/// `dev`.
fn check_live(op: &str, live: &LiveRates<'_>, rates: usize, dev: &CudaDevice) -> Result<()> {
    let device = Device::Cuda(dev.clone());
    let fits = |t: &Tensor, dtype: DType, len: usize| {
        t.device().same_device(&device)
            && t.dtype() == dtype
            && t.is_contiguous()
            && t.elem_count() >= len
    };
    if !fits(live.rates, DType::F64, rates) || !fits(live.gate, DType::F32, 1) {
        return Err(Error::invalid(format!(
            "{op}: a gated update reads {rates} contiguous f64 rates and one f32 gate on the \
             variables' device, given {:?} {:?} and {:?} {:?}",
            live.rates.dtype(),
            live.rates.dims(),
            live.gate.dtype(),
            live.gate.dims()
        )));
    }
    Ok(())
}

/// The CUDA device of the operands, after checking each list has one tensor per variable and
/// each tensor is contiguous `f32` of its variable's length on that device; `None` without
/// variables.
fn check(op: &str, operands: &[&[&Tensor]]) -> Result<Option<CudaDevice>> {
    let params = operands[0];
    let Some(first) = params.first() else {
        return Ok(None);
    };
    let Device::Cuda(dev) = first.device() else {
        return Err(Error::invalid(format!(
            "{op}: kandle's CUDA kernels update variables on a CUDA device, but the first is on \
             {:?} (on the CPU, kandle_kernels::optimizer's ops update them)",
            first.device()
        )));
    };
    let what = ["variable", "gradient", "state", "state"];
    for (k, list) in operands.iter().enumerate() {
        if list.len() != params.len() {
            return Err(Error::invalid(format!(
                "{op}: {} {}s for {} variables",
                list.len(),
                what[k.min(3)],
                params.len()
            )));
        }
        for (i, (t, p)) in list.iter().zip(params).enumerate() {
            let fits = t.device().same_device(first.device())
                && t.dtype() == DType::F32
                && t.is_contiguous()
                && t.elem_count() == p.elem_count();
            if !fits {
                return Err(Error::invalid(format!(
                    "{op}: the {} of variable {i} is {:?} {:?} on {:?}{}, where the kernel takes \
                     contiguous f32 tensors of {} values on {:?}",
                    what[k.min(3)],
                    t.dtype(),
                    t.dims(),
                    t.device(),
                    if t.is_contiguous() {
                        ""
                    } else {
                        " with strides"
                    },
                    p.elem_count(),
                    first.device()
                )));
            }
        }
    }
    Ok(Some(dev.clone()))
}
