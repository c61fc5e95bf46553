//! `ComputePath`: which code a network runs (kandle's CPU kernels or candle's device-generic
//! ops) and which backward pass differentiates it (kandle's recorded one or candle's autograd),
//! with the switch that makes the CPU run exactly what a GPU runs.

use std::str::FromStr;

use candle_core::Device;

/// The environment variable [`ComputePath::from_env`] reads: `auto`, `autograd` or
/// `device-generic`.
const COMPUTE_ENV: &str = "KANDLE_COMPUTE";

/// Which kernels run and which backward pass differentiates them.
///
/// On the CPU, `f32` tensors go through kandle's own kernels and a replica trains through the
/// layers' recorded backward pass. On CUDA devices (the `cuda` feature) batch normalisation and
/// pooling run kandle's CUDA kernels (convolutions cuDNN's with `cudnn`), the other layers
/// compose candle's device-generic ops, and a replica trains through the recorded backward
/// pass too: the layers with a CUDA kernel record its backward, the others their backward in
/// candle's ops or, one layer at a time, under candle's autograd.
/// [`ComputePath::DeviceGeneric`] makes every layer compose candle's ops on any device, so the
/// code a GPU runs without kandle's kernels is exercised, and can be compared, on a machine
/// without one; [`ComputePath::Autograd`]
/// keeps the kernels but differentiates with candle's autograd, to compare the two backward
/// passes.
///
/// Layers read the path from the [`BuildContext`](crate::params::BuildContext) they are built
/// in ([`BuildContext::with_compute_path`](crate::params::BuildContext::with_compute_path)) and
/// decide once, at build time, whether they may call kernels ([`Self::uses_kernels`]); whoever
/// runs the training step asks [`Self::records_backward`] which backward pass to take.
/// [`Self::from_env`] reads the choice from `KANDLE_COMPUTE`, for programs that let their user
/// pick it.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use kandle::layers::{Activation, BuildContext, Conv2D, LayerSpec, Padding};
/// use kandle::ComputePath;
///
/// let path = ComputePath::DeviceGeneric;
/// assert!(!path.uses_kernels());
/// assert!(!path.records_backward(&Device::Cpu));
/// assert!(ComputePath::Auto.records_backward(&Device::Cpu));
/// assert_eq!("device-generic".parse::<ComputePath>()?, path);
///
/// // A convolution built for the device-generic path runs candle's `conv2d` on the CPU, as it
/// // would on a GPU.
/// let mut ctx = BuildContext::new(&Device::Cpu, 0).with_compute_path(path);
/// let conv = Conv2D::new(4, 3).padding(Padding::Same).activation(Activation::Relu);
/// let built = conv.build(&mut ctx, &[2, 5, 5])?;
/// let x = Tensor::ones((1, 2, 5, 5), DType::F32, &Device::Cpu)?;
/// assert_eq!(built.layer().forward_t(&x, true)?.dims(), &[1, 4, 5, 5]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ComputePath {
    /// The default: kandle's kernels for the tensors they take (`f32` on the CPU; on CUDA
    /// devices, with the `cuda` feature, batch normalisation and pooling), and the recorded
    /// backward pass on the CPU and on CUDA devices. Other devices take the device-generic
    /// path.
    #[default]
    Auto,
    /// kandle's kernels for `f32` CPU tensors, differentiated by candle's autograd (the
    /// kernels register their backward passes with candle).
    Autograd,
    /// No kandle kernel and candle's autograd: the path a device without kandle's kernels
    /// takes, here taken by CPU and CUDA tensors too.
    DeviceGeneric,
}

impl ComputePath {
    /// The path named by `KANDLE_COMPUTE` (`auto`, `autograd` or `device-generic`, in any
    /// case); [`ComputePath::Auto`] when it is unset or names none of them.
    pub fn from_env() -> Self {
        Self::from_value(std::env::var(COMPUTE_ENV).ok().as_deref())
    }

    /// [`Self::from_env`] for the given value of `KANDLE_COMPUTE`.
    fn from_value(compute: Option<&str>) -> Self {
        compute.and_then(|v| v.parse().ok()).unwrap_or_default()
    }

    /// Whether layers may call kandle's kernels (they still do so only for the tensors a
    /// kernel supports: `f32` on the CPU).
    pub fn uses_kernels(self) -> bool {
        self != ComputePath::DeviceGeneric
    }

    /// Whether a replica on `device` trains through the layers' recorded backward pass rather
    /// than candle's autograd: [`ComputePath::Auto`] on the CPU and on CUDA devices does (each
    /// layer records its kernel's backward where it has one for the tensor, its backward in
    /// candle's ops or under candle's autograd otherwise, with the same gradients);
    /// [`ComputePath::Autograd`] and [`ComputePath::DeviceGeneric`] keep candle's autograd, for
    /// comparison.
    pub fn records_backward(self, device: &Device) -> bool {
        self == ComputePath::Auto && (device.is_cpu() || device.is_cuda())
    }

    /// The name [`Self::from_env`] and [`FromStr`] accept.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputePath::Auto => "auto",
            ComputePath::Autograd => "autograd",
            ComputePath::DeviceGeneric => "device-generic",
        }
    }
}

impl std::fmt::Display for ComputePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ComputePath {
    type Err = crate::Error;

    /// `auto`, `autograd` or `device-generic` (also `device_generic`), in any case.
    fn from_str(s: &str) -> crate::Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "auto" => Ok(ComputePath::Auto),
            "autograd" => Ok(ComputePath::Autograd),
            "device-generic" => Ok(ComputePath::DeviceGeneric),
            _ => Err(crate::Error::invalid(format!(
                "unknown compute path `{s}`: expected `auto`, `autograd` or `device-generic`"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_values() {
        let path = ComputePath::from_value;
        assert_eq!(path(None), ComputePath::Auto);
        assert_eq!(path(Some("auto")), ComputePath::Auto);
        assert_eq!(path(Some("autograd")), ComputePath::Autograd);
        assert_eq!(path(Some("device-generic")), ComputePath::DeviceGeneric);
        assert_eq!(path(Some("Device_Generic")), ComputePath::DeviceGeneric);
        assert_eq!(path(Some("gpu")), ComputePath::Auto);
    }

    #[test]
    fn kernels_and_backward() {
        let cpu = Device::Cpu;
        assert!(ComputePath::Auto.uses_kernels() && ComputePath::Auto.records_backward(&cpu));
        assert!(ComputePath::Autograd.uses_kernels());
        assert!(!ComputePath::Autograd.records_backward(&cpu));
        assert!(!ComputePath::DeviceGeneric.uses_kernels());
        assert!(!ComputePath::DeviceGeneric.records_backward(&cpu));
        for p in [
            ComputePath::Auto,
            ComputePath::Autograd,
            ComputePath::DeviceGeneric,
        ] {
            assert_eq!(p.to_string().parse::<ComputePath>().ok(), Some(p));
        }
        assert!("cuda".parse::<ComputePath>().is_err());
    }
}
