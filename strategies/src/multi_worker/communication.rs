//! [`CommunicationImplementation`]: which library carries a multi-worker step's fused buffer
//! between workers, as TensorFlow's `tf.distribute.experimental.CommunicationImplementation`.

use candle_core::Device;
use kandle::{Error, Result};

/// How the fused gradient buffer of a step crosses workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommunicationImplementation {
    /// NCCL when kandle-strategies is built with the `nccl` feature and every local device is a
    /// distinct GPU; MPI otherwise. Every worker must come to the same choice (checked when a
    /// model is distributed).
    #[default]
    Auto,
    /// One `MPI_Allreduce` on the host: the local replicas' sum is reduced with the chosen
    /// [`CrossDeviceOps`](crate::CrossDeviceOps) and copied to the host first.
    Mpi,
    /// One NCCL all-reduce over every GPU of every worker, on the GPUs (features `mpi` and
    /// `nccl`; one replica per GPU).
    Nccl,
}

impl CommunicationImplementation {
    /// Whether a worker with these local devices uses NCCL; an error when NCCL was asked for
    /// and cannot be used.
    pub(crate) fn uses_nccl(self, devices: &[Device]) -> Result<bool> {
        let possible = nccl_possible(devices);
        match (self, possible) {
            (CommunicationImplementation::Mpi, _) => Ok(false),
            (CommunicationImplementation::Auto, possible) => Ok(possible.is_ok()),
            (CommunicationImplementation::Nccl, Ok(())) => Ok(true),
            (CommunicationImplementation::Nccl, Err(why)) => Err(Error::Device(format!(
                "CommunicationImplementation::Nccl: {why}; use CommunicationImplementation::Mpi \
                 or Auto"
            ))),
        }
    }
}

/// Why NCCL cannot carry this worker's buffers, if it cannot.
fn nccl_possible(devices: &[Device]) -> std::result::Result<(), String> {
    #[cfg(feature = "nccl")]
    {
        crate::nccl::cuda_devices(devices)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = devices;
        Err("kandle-strategies was built without the `nccl` feature".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_replicas_use_mpi_and_refuse_nccl() {
        let cpu = vec![Device::Cpu; 2];
        assert_eq!(
            CommunicationImplementation::Auto.uses_nccl(&cpu).ok(),
            Some(false)
        );
        assert_eq!(
            CommunicationImplementation::Mpi.uses_nccl(&cpu).ok(),
            Some(false)
        );
        let err = CommunicationImplementation::Nccl
            .uses_nccl(&cpu)
            .expect_err("NCCL on CPU replicas")
            .to_string();
        let why = if cfg!(feature = "nccl") {
            "NCCL all-reduce needs CUDA replicas, got cpu"
        } else {
            "built without the `nccl` feature"
        };
        assert!(err.contains(why), "{err}");
    }
}
