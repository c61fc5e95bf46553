//! Batches copied to a CUDA device ahead of their steps: from page-locked (pinned) host memory,
//! on a stream of their own, so that a batch's copy runs while the step before it computes, as
//! PyTorch's `DataLoader(pin_memory=True)` with `non_blocking=True` copies do.
//!
//! Candle copies a host tensor to a device from pageable memory on the device's one stream: the
//! driver stages the bytes through a buffer of its own, and the copy waits in line behind the
//! step's kernels. A [`BatchUpload`] keeps, per dtype and length, two pinned staging buffers
//! (one filled while the other's copy runs) and a second stream of the device for the copies.
//! The device buffers it makes are ordered with the steps by cudarc's per-buffer events (on in
//! every device kandle opens): a step's first use of a batch waits for the copy's event on the
//! device, not on the host, and a batch's memory goes back to the pool only after the step's
//! last use of it. While a step is captured as a CUDA graph that tracking is paused, so the
//! copies run under [`super::stream_capture::beside_the_steps`], never during a capture.
//!
//! On the CPU, without the `cuda` feature, or on a device whose event tracking was turned off,
//! a batch moves with candle's [`Tensor::to_device`].

use std::sync::Mutex;

use candle_core::{Device, Tensor};

use crate::Result;

/// Copies host tensors to a device, keeping its staging buffers and copy stream from one batch
/// to the next. A clone starts with none of its own.
#[derive(Default)]
pub(crate) struct BatchUpload {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::PinnedCopies>,
}

impl BatchUpload {
    /// `tensor`, on the CPU, copied to `device`.
    pub(crate) fn upload(&self, tensor: &Tensor, device: &Device) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = device {
            if gpu.is_event_tracking() && tensor.device().is_cpu() {
                // The state is a cache of buffers: a panic while it was held leaves nothing
                // that a later copy could misread.
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let copies = match &mut state.cuda {
                    Some(copies) if copies.serves(gpu) => copies,
                    slot => slot.insert(cuda::PinnedCopies::new(gpu)?),
                };
                return copies.upload(tensor);
            }
        }
        Ok(tensor.to_device(device)?)
    }
}

impl Clone for BatchUpload {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for BatchUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BatchUpload")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::any::Any;
    use std::collections::HashMap;
    use std::sync::Arc;

    use candle_core::backend::BackendDevice;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{DType, Device, Storage, Tensor, WithDType};

    use crate::{Error, Result};

    /// Pinned staging buffers per dtype and length, used in turn.
    const STAGING_BUFFERS: usize = 2;

    /// A device's copy stream and the staging buffers of the batches copied on it.
    pub(super) struct PinnedCopies {
        device: CudaDevice,
        stream: Arc<CudaStream>,
        /// For each (dtype, element count): its staging buffers.
        staging: HashMap<(DType, usize), Staging>,
    }

    /// The pinned buffers (`PinnedHostSlice<T>`, boxed) of one dtype and length, and the one to
    /// use next.
    #[derive(Default)]
    struct Staging {
        buffers: Vec<Box<dyn Any + Send>>,
        next: usize,
    }

    impl PinnedCopies {
        pub(super) fn new(device: &CudaDevice) -> Result<Self> {
            let stream = device
                .cuda_stream()
                .context()
                .new_stream()
                .map_err(|e| Error::Device(format!("cannot create a copy stream: {e}")))?;
            Ok(Self {
                device: device.clone(),
                stream,
                staging: HashMap::new(),
            })
        }

        /// Whether these copies go to `device`.
        pub(super) fn serves(&self, device: &CudaDevice) -> bool {
            self.device.same_device(device)
        }

        pub(super) fn upload(&mut self, tensor: &Tensor) -> Result<Tensor> {
            if tensor.elem_count() == 0 {
                // A worker's empty share of a short last batch: nothing to stage.
                return Ok(tensor.to_device(&Device::Cuda(self.device.clone()))?);
            }
            match tensor.dtype() {
                DType::F32 => self.upload_as::<f32>(tensor),
                DType::F16 => self.upload_as::<half::f16>(tensor),
                DType::BF16 => self.upload_as::<half::bf16>(tensor),
                DType::F64 => self.upload_as::<f64>(tensor),
                DType::U32 => self.upload_as::<u32>(tensor),
                DType::U8 => self.upload_as::<u8>(tensor),
                DType::I64 => self.upload_as::<i64>(tensor),
                _ => Ok(tensor.to_device(&Device::Cuda(self.device.clone()))?),
            }
        }

        fn upload_as<T>(&mut self, tensor: &Tensor) -> Result<Tensor>
        where
            T: WithDType + CudaDType + DeviceRepr + ValidAsZeroBits,
        {
            let host = tensor.contiguous()?;
            let n = host.elem_count();
            let (storage, layout) = host.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                return Err(Error::Device(
                    "a batch to copy is not in host memory".into(),
                ));
            };
            // The host values, read in place: the staging buffer is their only copy.
            let start = layout.start_offset();
            let values = &cpu.as_slice::<T>()?[start..start + n];
            let failed =
                |what: &str, e: &dyn std::fmt::Display| Error::Device(format!("{what}: {e}"));
            let stream = Arc::clone(&self.stream);
            let staging = self.staging_for::<T>(n)?;
            // Waits until this buffer's last copy has read it.
            staging
                .as_mut_slice()
                .map_err(|e| failed("waiting for a staging buffer", &e))?
                .copy_from_slice(values);
            let slice = stream
                .clone_htod(&*staging)
                .map_err(|e| failed("copying a batch to the GPU", &e))?;
            let storage = CudaStorage::wrap_cuda_slice(slice, self.device.clone());
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                tensor.shape().clone(),
                BackpropOp::none(),
                false,
            ))
        }

        /// The next pinned buffer of `n` values of `T`, allocated on first use.
        fn staging_for<T>(&mut self, n: usize) -> Result<&mut PinnedHostSlice<T>>
        where
            T: WithDType + DeviceRepr + ValidAsZeroBits,
        {
            let context = self.stream.context().clone();
            let Staging { buffers, next } = self.staging.entry((T::DTYPE, n)).or_default();
            if buffers.len() < STAGING_BUFFERS {
                // SAFETY: the buffer's values are written (`as_mut_slice`) before any copy
                // reads them.
                #[allow(unsafe_code)]
                let fresh = unsafe { context.alloc_pinned::<T>(n) }.map_err(|e| {
                    Error::Device(format!(
                        "cannot allocate {} bytes of pinned host memory for a batch: {e}",
                        n * T::DTYPE.size_in_bytes()
                    ))
                })?;
                buffers.push(Box::new(fresh));
            }
            let at = *next % buffers.len();
            *next = (at + 1) % STAGING_BUFFERS;
            buffers[at]
                .downcast_mut::<PinnedHostSlice<T>>()
                .ok_or_else(|| Error::Device("a staging buffer of another dtype".into()))
        }
    }

    #[cfg(test)]
    mod tests {
        use candle_core::{DType, Device, Tensor};

        use super::super::BatchUpload;
        use crate::Result;

        /// Every dtype a batch holds arrives as it left, through both staging buffers of a
        /// length, a second length (a short last batch) and no rows (a worker's share past the
        /// end), and a strided tensor arrives as its contiguous values.
        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn batches_arrive_on_the_gpu_as_they_left() -> Result<()> {
            let gpu = crate::devices::cuda(0)?;
            let upload = BatchUpload::default();
            for n in [6usize, 6, 6, 4, 0] {
                let x = Tensor::arange(0f32, (n * 3) as f32, &Device::Cpu)?.reshape((n, 3))?;
                for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64, DType::U32] {
                    let host = x.to_dtype(dtype)?;
                    let back = upload.upload(&host, &gpu)?.to_device(&Device::Cpu)?;
                    assert_eq!(back.dims(), host.dims());
                    let values =
                        |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
                    assert_eq!(values(&back)?, values(&host)?, "{dtype:?}, {n} rows");
                }
                let strided = x.t()?;
                let back = upload.upload(&strided, &gpu)?.to_device(&Device::Cpu)?;
                assert_eq!(back.to_vec2::<f32>()?, strided.to_vec2::<f32>()?);
            }
            Ok(())
        }
    }
}
