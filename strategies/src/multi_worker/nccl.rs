//! NCCL across workers (features `mpi` and `nccl`): [`Clique`], the communicators that join every
//! GPU of every worker, and the fused all-reduce of a training step over them.
//!
//! **Ranks.** Worker `w` with `L` local GPUs holds NCCL ranks `w * L .. (w + 1) * L`, one per GPU,
//! in a clique of `W * L` ranks. One NCCL all-reduce then sums the replicas of every worker at
//! once, local and remote, on the GPUs: no separate local reduction and no copy through the host.
//! Every worker must have the same number of GPUs (checked when the model is distributed). The
//! chief creates NCCL's unique id and broadcasts it through MPI, as Horovod does; each worker then
//! creates its communicators, one per local GPU, within one NCCL group.
//!
//! **Liveness.** The communicators are non-blocking (`blocking = 0` in their `ncclConfig_t`, NCCL
//! 2.14 or newer): no NCCL call waits for a peer. Creating them and each all-reduce run as guarded
//! operations: the watchdog's rendezvous first proves that every worker got there, then a
//! [`Vigil`] polls `ncclCommGetAsyncError` and the all-reduce's completion event on every local
//! stream, answering the other workers' pings, until the deadline. If the deadline passes (a
//! worker stopped inside the collective), the workers that no longer answer are named, every
//! local communicator is aborted with `ncclCommAbort`, which makes NCCL's kernels give up, and
//! the step returns that error. A worker that dies is ended by `mpirun`, which takes the job
//! down. An asynchronous NCCL error (`ncclRemoteError` when a peer's connection breaks, for
//! example) also aborts the communicators and fails the step, with NCCL's last error message.
//! Either way the MPI world is broken afterwards, as after any failed collective, and the
//! process must end. What this cannot catch is a GPU that stops making progress on its own
//! (a hung kernel before the all-reduce): the abort then returns, but the device stays busy.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::result::{group_end, group_start};
use candle_core::cuda_backend::cudarc::nccl::safe::Id;
use candle_core::cuda_backend::cudarc::nccl::sys;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{Device, Tensor};
use kandle::{Error, Result};

use crate::mpi::watchdog::{Phase, Vigil};
use crate::mpi::world::World;
use crate::nccl::{check_buffers, cuda_devices, nccl_error, sum_into_new};

/// Bytes of NCCL's unique id.
const ID_BYTES: usize = 128;
/// `NCCL_API_MAGIC`, which marks a config made as `NCCL_CONFIG_INITIALIZER` makes it.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: leave the attribute to NCCL.
const UNDEF: c_int = c_int::MIN;
/// `NCCL_VERSION(2, 28, 0)`, the layout of the config below. A newer NCCL takes the defaults for
/// attributes it added later; an older one reads only the fields it knows (the config's `size`).
const CONFIG_VERSION: u32 = 22_800;

/// One NCCL communicator, aborted when dropped.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap. A `RawComm` lives in a `Clique`, whose calls all take `&mut self`, so they are
// exclusive; moving the clique (with its model) to another thread is therefore sound.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from `ncclCommInitRankConfig`, no operation on it is pending
        // (each all-reduce is waited for, or the communicator is aborted here instead), and it
        // is not used again. Abort, unlike destroy, never waits for peers that may be gone.
        unsafe {
            sys::ncclCommAbort(self.0);
        }
    }
}

/// This worker's communicators in the clique of every worker's GPUs.
pub(crate) struct Clique {
    /// Rank `rank * devices.len() + i` on `devices[i]`; empty once aborted.
    comms: Vec<RawComm>,
    devices: Vec<CudaDevice>,
    /// The same devices, as candle devices, to check buffers against.
    local: Vec<Device>,
    /// This worker's MPI rank, for messages.
    rank: usize,
}

impl std::fmt::Debug for Clique {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clique")
            .field("rank", &self.rank)
            .field("devices", &self.local)
            .field("live", &!self.comms.is_empty())
            .finish()
    }
}

impl Clique {
    /// Creates this worker's communicators, one per local GPU, with every other worker doing the
    /// same: a collective call of every worker, guarded like a training step. Fails on CPU or
    /// repeated devices, when the chief cannot create the unique id, when NCCL fails to
    /// initialise, or when a worker does not join within the timeout.
    pub(crate) fn new(world: &World, devices: &[Device], timeout: Duration) -> Result<Self> {
        let cuda = cuda_devices(devices)?;
        let id = chiefs_id(world, timeout)?;
        let ranks = world.size() * cuda.len();
        world.guarded_external(Phase::NcclSetup, timeout, |vigil| {
            let mut clique = Clique {
                comms: Vec::with_capacity(cuda.len()),
                devices: cuda.clone(),
                local: devices.to_vec(),
                rank: world.rank(),
            };
            group_start().map_err(|e| nccl_error("group start", e.0))?;
            // Every rank must be started before the group ends; a failure is reported after.
            let mut started = Ok(());
            for (i, device) in cuda.iter().enumerate() {
                started = clique.start_rank(device, ranks, id, world.rank() * cuda.len() + i);
                if started.is_err() {
                    break;
                }
            }
            let ended = group_end().map_err(|e| nccl_error("group end", e.0));
            started?;
            ended?;
            clique.settle(
                vigil,
                Phase::NcclSetup,
                "creation of the NCCL communicators",
            )?;
            Ok(clique)
        })
    }

    /// Starts the creation of rank `rank` of `ranks` on `device`, within the caller's group.
    fn start_rank(
        &mut self,
        device: &CudaDevice,
        ranks: usize,
        id: sys::ncclUniqueId,
        rank: usize,
    ) -> Result<()> {
        let (ranks, rank) = (to_c_int(ranks)?, to_c_int(rank)?);
        // NCCL puts the rank on the calling thread's current device.
        device
            .cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(|e| Error::Device(format!("cannot make {device:?} current: {e:?}")))?;
        let mut config = non_blocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for writes for the duration of the call, and
        // `config` was initialised as NCCL_CONFIG_INITIALIZER does. A non-null handle is owned
        // from here on by a `RawComm`, which aborts it when dropped.
        let result =
            unsafe { sys::ncclCommInitRankConfig(&mut comm, ranks, id, rank, &mut config) };
        if !comm.is_null() {
            self.comms.push(RawComm(comm));
        }
        result
            .result()
            .map(|_| ())
            .map_err(|e| nccl_error("communicator initialisation", e.0))
    }

    /// Sums every worker's `buffers` (one contiguous `f32` buffer per local GPU, all of one
    /// length on every worker) and returns the total on each local GPU, in fresh tensors. Must
    /// run inside [`World::guarded_external`], which gives the vigil.
    pub(crate) fn all_reduce(
        &mut self,
        buffers: &[Tensor],
        vigil: &mut Vigil<'_>,
        phase: Phase,
    ) -> Result<Vec<Tensor>> {
        if self.comms.len() != self.devices.len() {
            return Err(Error::Device(
                "the NCCL communicators were aborted after an earlier failure".into(),
            ));
        }
        if buffers.len() != self.devices.len() {
            return Err(Error::invalid(format!(
                "NCCL all-reduce across workers got {} buffers for {} local GPUs",
                buffers.len(),
                self.devices.len()
            )));
        }
        check_buffers(buffers, &self.local)?;
        let (comms, devices) = (&self.comms, &self.devices);
        let summed = sum_into_new(buffers, devices, |inputs, outputs| {
            group_start().map_err(|e| nccl_error("group start", e.0))?;
            let mut enqueued = Ok(());
            for (((comm, device), input), output) in comms
                .iter()
                .zip(devices)
                .zip(inputs)
                .zip(outputs.iter_mut())
            {
                // Candle runs each device's work on one stream: the all-reduce follows the
                // backward pass that wrote the input, and precedes whatever reads the output.
                let stream = device.cuda_stream();
                let (src, _src_done) = input.device_ptr(&stream);
                let (dst, _dst_done) = output.device_ptr_mut(&stream);
                // SAFETY: `src` and `dst` are live device allocations of `input.len()` f32 values
                // on this communicator's device (the output was allocated with the input's
                // length); both stay alive until the all-reduce completes or the communicator
                // is aborted, since they are freed in stream order after it. The stream handle
                // is candle's stream of that device.
                let result = unsafe {
                    sys::ncclAllReduce(
                        src as *const c_void,
                        dst as *mut c_void,
                        input.len(),
                        sys::ncclDataType_t::ncclFloat32,
                        sys::ncclRedOp_t::ncclSum,
                        comm.0,
                        stream.cu_stream() as sys::cudaStream_t,
                    )
                };
                if let Err(e) = result.result() {
                    enqueued = Err(nccl_error("all-reduce", e.0));
                    break;
                }
            }
            let ended = group_end().map_err(|e| nccl_error("group end", e.0));
            enqueued?;
            ended.map(|_| ())
        });
        let summed = match summed {
            Ok(summed) => summed,
            Err(e) => {
                self.abort();
                return Err(e);
            }
        };
        self.settle(vigil, phase, "NCCL all-reduce")?;
        self.wait_for_streams(vigil, phase)?;
        Ok(summed)
    }

    /// Whether a call is still in progress on some communicator, or the first that failed.
    fn poll(&self) -> std::result::Result<bool, (usize, sys::ncclResult_t)> {
        let mut pending = false;
        for (i, comm) in self.comms.iter().enumerate() {
            match async_state(comm) {
                sys::ncclResult_t::ncclSuccess => {}
                sys::ncclResult_t::ncclInProgress => pending = true,
                failed => return Err((i, failed)),
            }
        }
        Ok(pending)
    }

    /// Polls until no communicator has a call in progress (`ncclInProgress`), or fails.
    fn settle(&mut self, vigil: &mut Vigil<'_>, phase: Phase, what: &str) -> Result<()> {
        loop {
            match self.poll() {
                Ok(false) => return Ok(()),
                Ok(true) => {}
                Err((i, state)) => return Err(self.fail(i, state, phase, what)),
            }
            if !vigil.wait() {
                return Err(self.timed_out(vigil, phase, what));
            }
        }
    }

    /// Waits until the all-reduce just enqueued has run on every local GPU, watching the
    /// communicators for asynchronous errors meanwhile.
    fn wait_for_streams(&mut self, vigil: &mut Vigil<'_>, phase: Phase) -> Result<()> {
        const WHAT: &str = "NCCL all-reduce";
        let events = self
            .devices
            .iter()
            .map(|d| d.cuda_stream().record_event(None))
            .collect::<std::result::Result<Vec<_>, _>>();
        let events = match events {
            Ok(events) => events,
            Err(e) => {
                self.abort();
                return Err(Error::Device(format!("cannot record a CUDA event: {e:?}")));
            }
        };
        loop {
            let mut running = false;
            for event in &events {
                match event.try_is_complete() {
                    Ok(done) => running |= !done,
                    Err(e) => {
                        self.abort();
                        return Err(Error::Device(format!(
                            "the {WHAT} of {phase} failed on the GPU: {e:?}"
                        )));
                    }
                }
            }
            if !running {
                return Ok(());
            }
            if let Err((i, state)) = self.poll() {
                return Err(self.fail(i, state, phase, WHAT));
            }
            if !vigil.wait() {
                return Err(self.timed_out(vigil, phase, WHAT));
            }
        }
    }

    /// Aborts every communicator after an asynchronous failure `state` of communicator `index`,
    /// and returns the error, with NCCL's last message for it.
    fn fail(&mut self, index: usize, state: sys::ncclResult_t, phase: Phase, what: &str) -> Error {
        let detail = match self.comms.get(index) {
            // SAFETY: the communicator is live (not yet aborted); NCCL returns a NUL-terminated
            // string it owns, or null, and it is copied before the communicator is aborted.
            Some(comm) => unsafe { text(sys::ncclGetLastError(comm.0)) },
            None => String::new(),
        };
        self.abort();
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!(" ({detail})")
        };
        Error::Replica {
            replica: format!("worker {}", self.rank),
            reason: format!(
                "the {what} of {phase} failed: {}{detail}; the NCCL communicators were aborted",
                describe(state)
            ),
        }
    }

    /// The error for a collective that did not complete by the vigil's deadline, naming the
    /// workers that stopped answering, after aborting every communicator.
    fn timed_out(&mut self, vigil: &Vigil<'_>, phase: Phase, what: &str) -> Error {
        let diagnosis = vigil.diagnosis();
        self.abort();
        Error::Replica {
            replica: format!("worker {}", self.rank),
            reason: format!(
                "the {what} of {phase} started but did not complete within {}: {diagnosis}; \
                 the NCCL communicators were aborted",
                vigil.patience()
            ),
        }
    }

    /// Aborts every communicator (NCCL's kernels waiting on peers give up); the clique refuses
    /// work afterwards.
    fn abort(&mut self) {
        self.comms.clear();
    }
}

/// The chief's NCCL unique id, broadcast to every worker through MPI. The chief sends a flag
/// with it, so that a failure to create it fails every worker at once.
fn chiefs_id(world: &World, timeout: Duration) -> Result<sys::ncclUniqueId> {
    let mut message = [0u8; 1 + ID_BYTES];
    let mut failure = None;
    if world.rank() == 0 {
        match Id::new() {
            Ok(id) => {
                message[0] = 1;
                for (byte, c) in message[1..].iter_mut().zip(id.internal()) {
                    *byte = *c as u8;
                }
            }
            Err(e) => failure = Some(describe(e.0)),
        }
    }
    world.broadcast_from_chief(&mut message, Phase::NcclSetup, timeout)?;
    if message[0] != 1 {
        return Err(Error::Device(match failure {
            Some(why) => format!("NCCL could not create its unique id: {why}"),
            None => "the chief could not create NCCL's unique id (its own error says why)".into(),
        }));
    }
    let mut internal = [0 as c_char; ID_BYTES];
    for (c, byte) in internal.iter_mut().zip(&message[1..]) {
        *c = *byte as c_char;
    }
    Ok(sys::ncclUniqueId { internal })
}

/// A config as `NCCL_CONFIG_INITIALIZER` makes it, every attribute left to NCCL, except that
/// calls do not block.
fn non_blocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// The state of `comm`'s last calls: `ncclInProgress` while they run, an error once they failed.
fn async_state(comm: &RawComm) -> sys::ncclResult_t {
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live communicator and `state` is valid for a write.
    let queried = unsafe { sys::ncclCommGetAsyncError(comm.0, &mut state) };
    match queried {
        sys::ncclResult_t::ncclSuccess => state,
        failed => failed,
    }
}

/// NCCL's name for a result, and its description.
fn describe(result: sys::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static NUL-terminated string for every result (or null).
    let text = unsafe { text(sys::ncclGetErrorString(result)) };
    format!("{result:?} ({text})")
}

/// Copies a C string owned by NCCL; empty for null.
///
/// # Safety
/// `s` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn text(s: *const c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

fn to_c_int(n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::invalid(format!("{n} NCCL ranks are too many")))
}
