//! The kernel gradient through Winograd's transforms, split over the pool by images or by
//! input channels.
//!
//! Split by images, each task sums the transformed kernel's gradient `dU` (36 x c x o values)
//! over a contiguous run of images into an accumulator of its own; the accumulators are added
//! in a fixed order and transformed back to the taps. Where `dU` is large and the tiles are few
//! (ResNet's last stage: 512 channels on both sides, 36 MiB of `dU`, one tile per 4x4 image),
//! that writes, reads and adds tens of megabytes through memory for little arithmetic. Split
//! by input channels instead, each task sums the gradient of its own channels over all the
//! images into a `dU` of its own channels and transforms it back itself: no accumulator is
//! added to another, and each value of `dU` is written once and read once, by the task that
//! made it. The price is that every task transforms every tile's output gradient, which the
//! split by images does once: small where the channels are many.

use super::kernel_grad::{add_channel_sums, each_task, sum_partials};
use super::{at_least, gemm_parallelism, with_scratch, Conv};
use crate::conv2d::gemm::Parallelism;
use crate::conv2d::plan::Plan;
use crate::conv2d::transpose::transpose;
use crate::conv2d::winograd::{Winograd, MIN_CHANNELS};

/// The most values of `dU` the split by images keeps per task (4 Mi `f32`, 16 MiB: the
/// transformed kernel's gradient of 256 channels on both sides, 9 MiB, stays below it).
/// Larger, and with several threads, the split is by input channels.
const SPLIT_BY_IMAGES_MAX: usize = 4 << 20;

/// The kernel's gradient `dw (o, c, 3, 3)` of the Winograd lowering `wino` of `conv`, followed
/// by the bias gradient `(o,)` when `with_bias`: split by input channels where `dU` is large
/// and the pool has several threads ([`by_channels`]), otherwise by images ([`by_images`]).
pub(super) fn weight_grad(
    conv: &Conv,
    wino: &Winograd,
    x: &[f32],
    dy: &[f32],
    with_bias: bool,
) -> candle_core::Result<Vec<f32>> {
    let plan = conv.forward_plan();
    let tasks = channel_tasks(&plan, rayon::current_num_threads());
    if conv.n > 0 && tasks > 1 && wino.kernel_grad_len() > SPLIT_BY_IMAGES_MAX {
        by_channels(conv, tasks, x, dy, with_bias)
    } else {
        by_images(conv, wino, x, dy, with_bias)
    }
}

/// Tasks a split of `plan`'s input channels over `threads` threads takes: one per thread, each
/// with [`MIN_CHANNELS`] channels at least (the fewest Winograd's transforms take).
fn channel_tasks(plan: &Plan, threads: usize) -> usize {
    threads.min(plan.c / MIN_CHANNELS).max(1)
}

/// The input channels of task `t` of `tasks` out of `c`: near-equal runs, in order, each at
/// least `c / tasks` long.
fn task_channels(c: usize, tasks: usize, t: usize) -> std::ops::Range<usize> {
    t * c / tasks..(t + 1) * c / tasks
}

/// Each task sums the gradient of the transformed kernel over a contiguous run of images, a
/// group at a time; the sums are added in a fixed order and transformed back into the kernel's
/// gradient.
fn by_images(
    conv: &Conv,
    wino: &Winograd,
    x: &[f32],
    dy: &[f32],
    with_bias: bool,
) -> candle_core::Result<Vec<f32>> {
    let plan = conv.forward_plan();
    let (in_len, dy_len) = (plan.input_len(), plan.output_len());
    let grad_len = wino.kernel_grad_len();
    let bias_len = if with_bias { plan.o } else { 0 };
    let threads = rayon::current_num_threads();
    let tasks = threads.min(conv.n).max(1);
    let per_task = conv.n.div_ceil(tasks).max(1);
    // One task's images, one group after another: as many as fill a block.
    let group = wino.images_per_block().min(per_task).max(1);
    let par = gemm_parallelism(tasks);
    let run = |t: usize| -> candle_core::Result<Vec<f32>> {
        // The transformed kernel's gradient, started by the first group's products, then the
        // bias's.
        let mut du = Vec::with_capacity(grad_len + bias_len);
        let mut bias = vec![0f32; bias_len];
        let images = t * per_task..((t + 1) * per_task).min(conv.n);
        with_scratch(|s| -> candle_core::Result<()> {
            for i0 in images.clone().step_by(group) {
                let i1 = (i0 + group).min(images.end);
                let (xs, dys) = (&x[i0 * in_len..i1 * in_len], &dy[i0 * dy_len..i1 * dy_len]);
                if with_bias {
                    for dyi in dys.chunks_exact(dy_len) {
                        add_channel_sums(dyi, &mut bias);
                    }
                }
                let started = !du.is_empty();
                wino.accumulate_kernel_grad(xs, dys, (&mut du, started), &mut s.winograd, par)?;
            }
            Ok(())
        })?;
        // A task without images (none: every task gets at least one) would leave it empty.
        du.resize(grad_len, 0.0);
        du.extend_from_slice(&bias);
        Ok(du)
    };
    let mut partials = each_task(tasks, run)?;
    let total = sum_partials(&mut partials);
    let mut dw = wino.kernel_grad(&total[..grad_len]);
    dw.extend_from_slice(&total[grad_len..]);
    Ok(dw)
}

/// Each of `tasks` tasks takes a run of input channels ([`task_channels`]): it copies those
/// channels of a group of images at a time side by side, sums the gradient of their transformed
/// kernel over all the images, and transforms it back to their taps, `[c][tap][o]`; the runs,
/// in order, are then transposed into the kernel's gradient. The bias gradient is summed after.
fn by_channels(
    conv: &Conv,
    tasks: usize,
    x: &[f32],
    dy: &[f32],
    with_bias: bool,
) -> candle_core::Result<Vec<f32>> {
    let plan = conv.forward_plan();
    let (in_len, dy_len) = (plan.input_len(), plan.output_len());
    let plane = plan.h * plan.w;
    let run = |t: usize| -> candle_core::Result<Vec<f32>> {
        let channels = task_channels(plan.c, tasks, t);
        let part = Plan {
            c: channels.len(),
            ..plan
        };
        let Some(wino) = Winograd::for_kernel_grad(&part) else {
            candle_core::bail!(
                "winograd: {} input channels of {} are too few for the transforms",
                part.c,
                plan.c
            );
        };
        let group = wino.images_per_block().max(1);
        let run_len = channels.len() * plane;
        with_scratch(|s| -> candle_core::Result<Vec<f32>> {
            // The sum lives in the thread's buffer, kept between calls: the first group's
            // products overwrite it, so it is never zeroed again.
            let du = &mut s.kernel_grad_sum;
            for i0 in (0..conv.n).step_by(group) {
                let i1 = (i0 + group).min(conv.n);
                let xs = at_least(&mut s.grouped, (i1 - i0) * run_len);
                for (i, dst) in (i0..i1).zip(xs.chunks_exact_mut(run_len.max(1))) {
                    dst.copy_from_slice(&x[i * in_len + channels.start * plane..][..run_len]);
                }
                let dys = &dy[i0 * dy_len..i1 * dy_len];
                let job = (&mut *du, i0 > 0);
                wino.accumulate_kernel_grad(xs, dys, job, &mut s.winograd, Parallelism::None)?;
            }
            if du.len() != wino.kernel_grad_len() {
                candle_core::bail!("winograd: the kernel gradient of no image");
            }
            Ok(wino.kernel_grad_by_channel(du))
        })
    };
    let by_channel = each_task(tasks, run)?.concat();
    let mut dw = vec![0f32; plan.o * plan.c * 9];
    transpose(&by_channel, plan.c * 9, plan.o, &mut dw);
    if with_bias {
        let mut bias = vec![0f32; plan.o];
        for dyi in dy.chunks_exact(dy_len.max(1)) {
            add_channel_sums(dyi, &mut bias);
        }
        dw.extend_from_slice(&bias);
    }
    Ok(dw)
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// A 3x3 `same` convolution of `n` images of `c x h x h` into `o` channels.
    fn same_3x3(n: usize, c: usize, h: usize, o: usize) -> Conv {
        Conv {
            n,
            c,
            h,
            w: h,
            o,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1, 1, 1),
            ho: h,
            wo: h,
        }
    }

    /// The largest difference between `a` and `b`, relative to `b`'s largest magnitude.
    fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        diff / scale
    }

    #[test]
    fn the_split_by_channels_gives_the_split_by_images_gradient() -> candle_core::Result<()> {
        let mut rng = StdRng::seed_from_u64(7);
        // Planes of one tile and of four part tiles; channel runs of unequal lengths; a pool
        // of three threads, so the split runs whatever the machine.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .map_err(candle_core::Error::wrap)?;
        for conv in [
            same_3x3(5, 40, 4, 24),
            same_3x3(3, 50, 7, 20),
            same_3x3(2, 49, 9, 33),
        ] {
            let x: Vec<f32> = (0..conv.n * conv.c * conv.h * conv.w)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let dy: Vec<f32> = (0..conv.n * conv.o * conv.ho * conv.wo)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let Some(wino) = Winograd::for_kernel_grad(&conv.forward_plan()) else {
                panic!("{conv:?} suits Winograd's transforms");
            };
            let want = by_images(&conv, &wino, &x, &dy, true)?;
            for threads in [2, 3] {
                let tasks = channel_tasks(&conv.forward_plan(), threads);
                assert!(tasks > 1, "{conv:?}");
                let got = pool.install(|| by_channels(&conv, tasks, &x, &dy, true))?;
                // float32 sums of the same products in another order: at most 2.6e-6 measured (AVX2
                // and baseline kernels).
                let diff = rel_diff(&got, &want);
                assert!(diff < 1e-5, "{conv:?}, {tasks} tasks: {diff}");
                // Twice the same split: the same bits.
                let again = pool.install(|| by_channels(&conv, tasks, &x, &dy, true))?;
                assert_eq!(got, again, "{conv:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn channel_runs_cover_the_channels_in_order_and_suit_the_transforms() {
        for c in [16, 31, 32, 47, 49, 64, 100, 512] {
            for threads in 1..=16 {
                let plan = Plan {
                    c,
                    h: 4,
                    w: 4,
                    o: 16,
                    kh: 3,
                    kw: 3,
                    sh: 1,
                    sw: 1,
                    top: 1,
                    left: 1,
                    ho: 4,
                    wo: 4,
                };
                let tasks = channel_tasks(&plan, threads);
                assert!((1..=threads).contains(&tasks));
                let runs: Vec<_> = (0..tasks).map(|t| task_channels(c, tasks, t)).collect();
                assert_eq!(runs[0].start, 0);
                assert_eq!(runs[tasks - 1].end, c);
                for pair in runs.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                }
                for run in &runs {
                    let part = Plan {
                        c: run.len(),
                        ..plan
                    };
                    assert!(
                        Winograd::for_kernel_grad(&part).is_some(),
                        "{c} {threads} {run:?}"
                    );
                }
            }
        }
    }
}
