//! An analytic model of synchronous data-parallel scaling: every step, each of `N` replicas
//! computes its gradients in the single-replica step time `t1`, then the replicas sum them with
//! a ring all-reduce over a link of bandwidth `B` and per-message latency `a`:
//!
//! ```text
//! t_allreduce(N) = 2 (N - 1) a + 2 (N - 1) / N * bytes / B
//! efficiency(N)  = t1 / (t1 + t_allreduce(N))          no overlap
//! efficiency(N)  = t1 / max(t1, t_allreduce(N))        communication hidden behind compute
//! ```
//!
//! A ring all-reduce runs `2 (N - 1)` steps (reduce-scatter, then all-gather), each sending a
//! `1/N` slice of the buffer to the next replica, so the bytes each link carries stay near twice
//! the buffer however large `N` grows, while the latency term grows with `N` (Patarasuk and
//! Yuan, 2009; Sergeev and Del Balso, *Horovod*, 2018). The overlapped form is an upper bound:
//! a real step can only hide the all-reduce behind the part of the backward pass that follows
//! each gradient. kandle's Mirrored strategy, and the multi-worker one over MPI, sum their
//! gradients in buckets while the backward pass goes on (`ReplicaOptions::gradient_buckets`):
//! only the last bucket's sum (the first layers') follows the pass, so their steps sit between
//! the two forms.
//!
//! The constants hold the reference figures the `scaling` binary plots: the Keras multi-GPU
//! tutorial's epoch times for MiniGoogLeNet on CIFAR-10 and Horovod's published efficiency.

use anyhow::{bail, Result};

/// Trainable parameters of `kandle_models::mini_googlenet(10)`.
pub const MINI_GOOGLENET_TRAINABLE: usize = 1_652_826;

/// The link bandwidth of Horovod's benchmarks (25 Gbit/s RoCE), in Gbit/s.
pub const DEFAULT_BANDWIDTH_GBIT_S: f64 = 25.0;

/// Per-message latency of one ring step, in microseconds: the order of an RDMA round on such a
/// network.
pub const DEFAULT_LATENCY_US: f64 = 5.0;

/// The Keras tutorial's epoch time for MiniGoogLeNet on CIFAR-10 on one GPU, in seconds.
pub const TUTORIAL_ONE_GPU_EPOCH_S: f64 = 63.0;

/// The Keras tutorial's epoch time on four GPUs (batch 64 per GPU), in seconds.
pub const TUTORIAL_FOUR_GPU_EPOCH_S: f64 = 16.0;

/// Images in the CIFAR-10 training set.
pub const CIFAR10_TRAIN_IMAGES: usize = 50_000;

/// The tutorial's batch per GPU.
pub const TUTORIAL_BATCH: usize = 64;

/// Horovod's published scaling efficiency on 512 GPUs (Inception V3 and ResNet-101).
pub const HOROVOD_512_EFFICIENCY: f64 = 0.90;

/// The replica counts the binary projects to.
pub const PROJECTED_REPLICAS: [usize; 7] = [8, 16, 32, 64, 128, 256, 512];

/// The tutorial's single-GPU step time in milliseconds: its epoch time over the steps of one
/// epoch (50,000 images at 64 per step), about 80.6 ms.
pub fn tutorial_gpu_step_ms() -> f64 {
    TUTORIAL_ONE_GPU_EPOCH_S * 1e3 * TUTORIAL_BATCH as f64 / CIFAR10_TRAIN_IMAGES as f64
}

/// The tutorial's four-GPU scaling efficiency: `63 / (4 x 16)`, about 98.4%.
pub fn tutorial_four_gpu_efficiency() -> f64 {
    TUTORIAL_ONE_GPU_EPOCH_S / (4.0 * TUTORIAL_FOUR_GPU_EPOCH_S)
}

/// The bytes of an `f32` gradient for `trainable` parameters.
pub fn gradient_bytes(trainable: usize) -> f64 {
    trainable as f64 * 4.0
}

/// The network between replicas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    bits_per_second: f64,
    latency_seconds: f64,
}

impl Link {
    /// A link of `gbit_per_s` Gbit/s with `latency_us` microseconds per message. Errors unless
    /// the bandwidth is positive and the latency non-negative, both finite.
    pub fn new(gbit_per_s: f64, latency_us: f64) -> Result<Self> {
        if !(gbit_per_s.is_finite() && gbit_per_s > 0.0) {
            bail!("the link bandwidth must be a positive number of Gbit/s, got {gbit_per_s}");
        }
        if !(latency_us.is_finite() && latency_us >= 0.0) {
            bail!(
                "the link latency must be a non-negative number of microseconds, got {latency_us}"
            );
        }
        Ok(Self {
            bits_per_second: gbit_per_s * 1e9,
            latency_seconds: latency_us * 1e-6,
        })
    }

    /// Seconds a ring all-reduce of `bytes` takes across `replicas` replicas; 0 for one.
    pub fn ring_all_reduce_seconds(&self, replicas: usize, bytes: f64) -> f64 {
        if replicas <= 1 {
            return 0.0;
        }
        let n = replicas as f64;
        let steps = 2.0 * (n - 1.0);
        steps * self.latency_seconds + steps / n * bytes * 8.0 / self.bits_per_second
    }
}

/// Whether the all-reduce runs after the step's computation or hidden behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// Compute, then all-reduce: `t1 + t_allreduce`.
    None,
    /// The all-reduce fully hidden behind compute: `max(t1, t_allreduce)` (an upper bound).
    Full,
}

/// Projects step time and efficiency to `N` replicas from one replica's step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalingModel {
    step_seconds: f64,
    gradient_bytes: f64,
    link: Link,
}

impl ScalingModel {
    /// The model for a single-replica step of `step_seconds` that all-reduces `gradient_bytes`
    /// over `link`. Errors unless the step time is positive and the byte count non-negative.
    pub fn new(step_seconds: f64, gradient_bytes: f64, link: Link) -> Result<Self> {
        if !(step_seconds.is_finite() && step_seconds > 0.0) {
            bail!("the single-replica step time must be positive, got {step_seconds} s");
        }
        if !(gradient_bytes.is_finite() && gradient_bytes >= 0.0) {
            bail!("the gradient size must be a non-negative number of bytes, got {gradient_bytes}");
        }
        Ok(Self {
            step_seconds,
            gradient_bytes,
            link,
        })
    }

    /// The single-replica step time `t1`, in seconds.
    pub fn single_step_seconds(&self) -> f64 {
        self.step_seconds
    }

    /// The all-reduce time at `replicas` replicas, in seconds.
    pub fn all_reduce_seconds(&self, replicas: usize) -> f64 {
        self.link
            .ring_all_reduce_seconds(replicas, self.gradient_bytes)
    }

    /// The step time at `replicas` replicas, in seconds.
    pub fn step_seconds(&self, replicas: usize, overlap: Overlap) -> f64 {
        let reduce = self.all_reduce_seconds(replicas);
        match overlap {
            Overlap::None => self.step_seconds + reduce,
            Overlap::Full => self.step_seconds.max(reduce),
        }
    }

    /// Scaling efficiency at `replicas` replicas: `t1` over the step time there, in `(0, 1]`.
    pub fn efficiency(&self, replicas: usize, overlap: Overlap) -> f64 {
        self.step_seconds / self.step_seconds(replicas, overlap)
    }

    /// Images per second at `replicas` replicas of `batch_per_replica` images each.
    pub fn images_per_second(
        &self,
        replicas: usize,
        batch_per_replica: usize,
        overlap: Overlap,
    ) -> f64 {
        (replicas * batch_per_replica) as f64 / self.step_seconds(replicas, overlap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1e-12)
    }

    fn gpu_model(latency_us: f64) -> Result<ScalingModel> {
        ScalingModel::new(
            tutorial_gpu_step_ms() / 1e3,
            gradient_bytes(MINI_GOOGLENET_TRAINABLE),
            Link::new(DEFAULT_BANDWIDTH_GBIT_S, latency_us)?,
        )
    }

    #[test]
    fn reference_figures() {
        assert!(close(tutorial_gpu_step_ms(), 80.64, 1e-9));
        assert!(close(tutorial_four_gpu_efficiency(), 0.984_375, 1e-12));
        assert!(close(
            gradient_bytes(MINI_GOOGLENET_TRAINABLE),
            6_611_304.0,
            1e-12
        ));
    }

    #[test]
    fn one_replica_has_no_communication() -> Result<()> {
        let model = gpu_model(DEFAULT_LATENCY_US)?;
        assert_eq!(model.all_reduce_seconds(1), 0.0);
        assert_eq!(model.efficiency(1, Overlap::None), 1.0);
        assert_eq!(model.efficiency(1, Overlap::Full), 1.0);
        assert!(close(
            model.images_per_second(1, 64, Overlap::None),
            64.0 / 0.08064,
            1e-12
        ));
        Ok(())
    }

    #[test]
    fn two_replicas_send_the_buffer_once_each_way() -> Result<()> {
        // 2 (N - 1) / N = 1 at N = 2: the whole buffer crosses the link once, plus two latencies.
        let link = Link::new(8.0, 10.0)?; // 1 GB/s
        let seconds = link.ring_all_reduce_seconds(2, 1e6);
        assert!(close(seconds, 1e-3 + 2.0 * 10e-6, 1e-12));
        let model = ScalingModel::new(0.01, 1e6, link)?;
        assert!(close(
            model.efficiency(2, Overlap::None),
            0.01 / 0.01102,
            1e-12
        ));
        assert_eq!(model.efficiency(2, Overlap::Full), 1.0);
        Ok(())
    }

    #[test]
    fn large_rings_approach_twice_the_buffer() -> Result<()> {
        let no_latency = Link::new(DEFAULT_BANDWIDTH_GBIT_S, 0.0)?;
        let bytes = gradient_bytes(MINI_GOOGLENET_TRAINABLE);
        let limit = 2.0 * bytes * 8.0 / 25e9;
        let at_512 = no_latency.ring_all_reduce_seconds(512, bytes);
        assert!(at_512 < limit && close(at_512, limit * 511.0 / 512.0, 1e-12));
        // MiniGoogLeNet on the tutorial's GPU step: 80.64 / (80.64 + 4.22) ms, about 95%.
        let model = gpu_model(0.0)?;
        assert!(close(model.efficiency(512, Overlap::None), 0.9503, 1e-3));
        // Latency adds 2 (N - 1) messages: 5.11 ms more at 512 replicas and 5 us.
        let with_latency = gpu_model(DEFAULT_LATENCY_US)?;
        let extra = with_latency.all_reduce_seconds(512) - model.all_reduce_seconds(512);
        assert!(close(extra, 1022.0 * 5e-6, 1e-9));
        Ok(())
    }

    #[test]
    fn efficiency_falls_monotonically_and_stays_in_range() -> Result<()> {
        for latency in [0.0, DEFAULT_LATENCY_US, 100.0] {
            let model = gpu_model(latency)?;
            let mut last = 1.0;
            for n in (0..=10).map(|k| 1usize << k) {
                let e = model.efficiency(n, Overlap::None);
                assert!(e > 0.0 && e <= last, "N = {n}: {e} after {last}");
                assert!(model.efficiency(n, Overlap::Full) >= e);
                last = e;
            }
        }
        Ok(())
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(Link::new(0.0, 1.0).is_err());
        assert!(Link::new(f64::NAN, 1.0).is_err());
        assert!(Link::new(1.0, -1.0).is_err());
        let link = Link::new(1.0, 0.0);
        assert!(link.is_ok_and(|l| ScalingModel::new(0.0, 1.0, l).is_err()));
    }
}
