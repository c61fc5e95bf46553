//! NCCL all-reduce between CUDA replicas of one process (the `nccl` feature).
//!
//! One thread drives every GPU at a time: one NCCL communicator per device, created together
//! with `ncclCommInitAll` the first time a set of devices reduces, and kept for the next steps
//! by the process, whichever thread calls next (the step's, the bucket exchange's, or the last
//! replica at a `SyncBatchNorm` round), so one set of devices has one set of communicators. The
//! per-device `all_reduce` calls sit between `ncclGroupStart` and `ncclGroupEnd`, as NCCL
//! requires when one thread drives several ranks, and run on each device's candle stream, so they
//! follow the replica's backward pass and precede whatever reads the result. Each replica gets
//! the sum in a fresh tensor on its device; the input buffers are left untouched.

use candle_core::{Device, Tensor};
use kandle::{Error, Result};

/// Sums `buffers` with NCCL and returns the total on each device.
#[cfg(not(feature = "nccl"))]
pub fn all_reduce(_buffers: Vec<Tensor>, _devices: &[Device]) -> Result<Vec<Tensor>> {
    Err(Error::Device(
        "CrossDeviceOps::NcclAllReduce needs kandle-strategies built with the `nccl` feature"
            .into(),
    ))
}

/// Sums `buffers` (contiguous `f32`, one per replica, on distinct GPUs) with NCCL and returns
/// the total on each device.
#[cfg(feature = "nccl")]
pub fn all_reduce(buffers: Vec<Tensor>, devices: &[Device]) -> Result<Vec<Tensor>> {
    imp::all_reduce(buffers, devices)
}

// For NCCL across workers (`multi_worker::nccl`).
#[cfg(all(feature = "nccl", feature = "mpi"))]
pub(crate) use imp::{check_buffers, cuda_devices, nccl_error, sum_into_new};

#[cfg(feature = "nccl")]
mod imp {
    use std::sync::Mutex;

    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
    use candle_core::cuda_backend::cudarc::nccl::safe::{group_end, group_start, Comm, ReduceOp};
    use candle_core::cuda_backend::cudarc::nccl::sys::ncclResult_t;
    use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId};
    use candle_core::op::BackpropOp;
    use candle_core::{DType, Storage};

    use super::*;

    /// The communicators of one set of devices, rank `i` on `devices[i]`.
    struct Communicators {
        devices: Vec<DeviceId>,
        comms: Vec<Comm>,
    }

    // SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
    // overlap. `Communicators` live only in `CACHE`, whose lock is held for every call on them
    // (one thread then drives every rank of the clique, between a group's start and end), so
    // calls never overlap, and moving them to another thread is sound.
    #[allow(unsafe_code)]
    unsafe impl Send for Communicators {}

    /// The communicators of the last set of devices that reduced: a new set (another strategy,
    /// or fresh devices) replaces them. Locked for the whole of each all-reduce.
    static CACHE: Mutex<Option<Communicators>> = Mutex::new(None);

    /// An NCCL failure as a kandle error.
    pub(crate) fn nccl_error(what: &str, e: ncclResult_t) -> Error {
        Error::Device(format!("NCCL {what} failed: {e:?}"))
    }

    impl Communicators {
        fn new(devices: &[CudaDevice]) -> Result<Self> {
            let streams = devices.iter().map(|d| d.cuda_stream()).collect();
            let comms = Comm::from_devices(streams).map_err(|e| nccl_error("init", e.0))?;
            Ok(Self {
                devices: devices.iter().map(|d| d.id()).collect(),
                comms,
            })
        }
    }

    pub fn all_reduce(buffers: Vec<Tensor>, devices: &[Device]) -> Result<Vec<Tensor>> {
        if buffers.len() != devices.len() {
            return Err(Error::invalid(format!(
                "NCCL all-reduce got {} buffers for {} devices",
                buffers.len(),
                devices.len()
            )));
        }
        if buffers.is_empty() {
            return Ok(Vec::new());
        }
        let cuda = cuda_devices(devices)?;
        check_buffers(&buffers, devices)?;
        let ids: Vec<DeviceId> = cuda.iter().map(|d| d.id()).collect();
        let mut cache = CACHE
            .lock()
            .map_err(|_| Error::Device("the NCCL communicators were poisoned by a panic".into()))?;
        let comms = match cache.take() {
            Some(cached) if cached.devices == ids => cached,
            stale => {
                drop(stale); // release the old communicators before creating new ones
                Communicators::new(&cuda)?
            }
        };
        let reduced = reduce(&buffers, &cuda, &comms.comms)?;
        // Only communicators that just succeeded go back to the cache: after an NCCL error
        // they are dropped, and the next call creates new ones.
        *cache = Some(comms);
        Ok(reduced)
    }

    /// The CUDA devices behind `devices`, which must be distinct GPUs: NCCL cannot put two
    /// ranks of one communicator on the same GPU.
    pub(crate) fn cuda_devices(devices: &[Device]) -> Result<Vec<CudaDevice>> {
        let mut cuda = Vec::with_capacity(devices.len());
        for (i, d) in devices.iter().enumerate() {
            let Device::Cuda(c) = d else {
                return Err(Error::Device(format!(
                    "NCCL all-reduce needs CUDA replicas, got {}",
                    kandle::devices::label(d)
                )));
            };
            if devices[..i].iter().any(|e| e.location() == d.location()) {
                return Err(Error::Device(format!(
                    "NCCL all-reduce needs one replica per GPU, but {} holds several; use \
                     CrossDeviceOps::ReductionToOneDevice or HierarchicalCopy for logical replicas",
                    kandle::devices::label(d)
                )));
            }
            cuda.push(c.clone());
        }
        Ok(cuda)
    }

    /// Every buffer is an `f32` tensor on its replica's device, all of the same length (NCCL
    /// would hang or read out of bounds otherwise).
    pub(crate) fn check_buffers(buffers: &[Tensor], devices: &[Device]) -> Result<()> {
        let len = buffers[0].elem_count();
        for (i, (b, d)) in buffers.iter().zip(devices).enumerate() {
            if b.dtype() != DType::F32 {
                return Err(Error::invalid(format!(
                    "NCCL all-reduce sums f32 buffers, replica {i} sent {:?}",
                    b.dtype()
                )));
            }
            if b.elem_count() != len {
                return Err(Error::invalid(format!(
                    "NCCL all-reduce needs buffers of one length: replica 0 sent {len} values, \
                     replica {i} sent {}",
                    b.elem_count()
                )));
            }
            if !b.device().same_device(d) {
                return Err(Error::Device(format!(
                    "NCCL all-reduce: replica {i}'s buffer is on {}, not on its replica's device",
                    kandle::devices::label(b.device())
                )));
            }
        }
        Ok(())
    }

    /// One grouped all-reduce: rank `i` sums `buffers[i]` into a fresh slice on `devices[i]`.
    fn reduce(buffers: &[Tensor], devices: &[CudaDevice], comms: &[Comm]) -> Result<Vec<Tensor>> {
        sum_into_new(buffers, devices, |inputs, outputs| {
            // Each communicator runs on its device's only candle stream, so stream order puts the
            // kernels that `group_end` launches after the backward pass, before any reader of the
            // outputs, and before the stream-ordered frees of the inputs dropped on return.
            group_start().map_err(|e| nccl_error("group start", e.0))?;
            // Every rank must be enqueued before the group ends, so a failing call is reported
            // only after `group_end`, which NCCL needs to leave its group state.
            let mut enqueued = Ok(());
            for ((comm, input), output) in comms.iter().zip(inputs).zip(outputs.iter_mut()) {
                if let Err(e) = comm.all_reduce(input, output, &ReduceOp::Sum) {
                    enqueued = Err(nccl_error("all-reduce", e.0));
                    break;
                }
            }
            let ended = group_end().map_err(|e| nccl_error("group end", e.0));
            enqueued?;
            ended?;
            Ok(())
        })
    }

    /// Gives `enqueue` a view of each contiguous `f32` buffer and a fresh slice of the same
    /// length on its device, for a collective to sum into, and returns those slices as tensors
    /// shaped as the buffers. `enqueue` only launches work on the devices' candle streams, so
    /// whatever reads the results is ordered after it.
    pub(crate) fn sum_into_new(
        buffers: &[Tensor],
        devices: &[CudaDevice],
        enqueue: impl FnOnce(&[CudaView<'_, f32>], &mut [CudaSlice<f32>]) -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        let contiguous: Vec<Tensor> = buffers
            .iter()
            .map(|b| Ok(b.contiguous()?))
            .collect::<Result<_>>()?;
        let mut outputs = devices
            .iter()
            .zip(&contiguous)
            .map(|(d, b)| Ok(d.alloc_zeros::<f32>(b.elem_count())?))
            .collect::<Result<Vec<_>>>()?;
        {
            let guards: Vec<_> = contiguous.iter().map(|b| b.storage_and_layout()).collect();
            let mut inputs = Vec::with_capacity(guards.len());
            for (storage, layout) in &guards {
                let Storage::Cuda(storage) = &**storage else {
                    return Err(Error::Device("NCCL all-reduce needs CUDA tensors".into()));
                };
                let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
                    Error::Device("NCCL all-reduce needs contiguous buffers".into())
                })?;
                inputs.push(storage.as_cuda_slice::<f32>()?.slice(start..end));
            }
            enqueue(&inputs, &mut outputs)?;
        }
        Ok(outputs
            .into_iter()
            .zip(devices)
            .zip(buffers)
            .map(|((sum, device), b)| {
                let storage = CudaStorage::wrap_cuda_slice(sum, device.clone());
                Tensor::from_storage(
                    Storage::Cuda(storage),
                    b.shape().clone(),
                    BackpropOp::none(),
                    false,
                )
            })
            .collect())
    }
}
