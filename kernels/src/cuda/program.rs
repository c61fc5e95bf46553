//! kandle's CUDA C kernels, compiled at run time: each module's source (the shared
//! `common.cuh` and its own `.cu` file) compiled to PTX once per process with NVRTC, loaded once
//! per device (candle keeps the module by name beside its own), and its kernels launched on
//! candle's stream of the device.
//!
//! The PTX is NVRTC's default virtual architecture, which the driver compiles for the device
//! when it loads the module, so one compilation serves every device and architecture.

#![allow(unsafe_code)]

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::{self, CompileError, CompileOptions};
use candle_core::cuda_backend::{CudaDevice, WrapErr};

/// A module of CUDA C kernels, compiled the first time a kernel of it is launched.
pub(crate) struct Program {
    /// The module's name, unique among candle's custom modules of a device.
    name: &'static str,
    /// The CUDA C source.
    source: &'static str,
    /// The PTX, or NVRTC's error, once compiled.
    ptx: OnceLock<Result<String, String>>,
}

/// One argument of a kernel, in the kernel's parameter order.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    /// A device address (`T *`), `0` for a null pointer.
    Ptr(u64),
    /// An `unsigned`.
    U32(u32),
    /// An `unsigned long long`.
    U64(u64),
    /// An `int`.
    I32(i32),
    /// A `double`.
    F64(f64),
}

impl Program {
    /// The module `name` of `source`, not compiled yet.
    pub(crate) const fn new(name: &'static str, source: &'static str) -> Self {
        Self {
            name,
            source,
            ptx: OnceLock::new(),
        }
    }

    /// The PTX of the module, compiled on the first call.
    fn ptx(&self) -> candle_core::Result<&str> {
        let ptx = self.ptx.get_or_init(|| {
            let options = CompileOptions {
                name: Some(format!("{}.cu", self.name)),
                ..Default::default()
            };
            match nvrtc::compile_ptx_with_opts(self.source, options) {
                Ok(ptx) => Ok(ptx.to_src()),
                Err(CompileError::CompileError { log, .. }) => Err(format!(
                    "NVRTC could not compile kandle's CUDA module {}: {}",
                    self.name,
                    log.to_string_lossy()
                )),
                Err(e) => Err(format!(
                    "NVRTC could not compile kandle's CUDA module {}: {e:?}",
                    self.name
                )),
            }
        });
        ptx.as_deref()
            .map_err(|e| candle_core::Error::Msg(e.clone()))
    }

    /// Launches `kernel` of this module on `dev`'s stream with `cfg` and `args`.
    ///
    /// # Safety
    ///
    /// `args` are the kernel's parameters, in order and of its types; each pointer addresses
    /// memory on `dev` that holds as many values as the kernel reads or writes through it under
    /// `cfg`, and stays alive, with no other stream writing it, until the kernel has run
    /// (callers hold the operands' `SyncOnDrop` guards until this returns).
    pub(crate) unsafe fn launch(
        &self,
        dev: &CudaDevice,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> candle_core::Result<()> {
        let func = dev.get_or_load_custom_func(kernel, self.name, self.ptx()?)?;
        let mut builder = func.builder();
        for arg in args {
            match arg {
                Arg::Ptr(v) => builder.arg(v),
                Arg::U32(v) => builder.arg(v),
                Arg::U64(v) => builder.arg(v),
                Arg::I32(v) => builder.arg(v),
                Arg::F64(v) => builder.arg(v),
            };
        }
        // SAFETY: the caller's contract above; `args` outlive the launch, which copies them.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }
}

/// Threads per block of every kernel.
pub(crate) const THREADS: u32 = 256;

/// A launch over `items` with a thread per item: blocks of [`THREADS`], at most 65,536 of them
/// (the kernels loop over the rest).
pub(crate) fn per_item(items: usize) -> LaunchConfig {
    let blocks = items.div_ceil(THREADS as usize).clamp(1, 1 << 16);
    blocks_of((blocks as u32, 1))
}

/// A launch of a `(x, y)` grid of blocks of [`THREADS`] threads.
pub(crate) fn blocks_of(grid: (u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
