//! What the benchmark runs on: the CPU's name, the load average, and its fp32 peak.
//!
//! The peak is measured: a loop of independent fused multiply-adds on the widest vectors the CPU
//! has (AVX-512 or AVX2, detected at run time), on every benchmark thread at once, the best of a
//! few runs. It is what the cores really sustain at the clock they run at under that load,
//! where `/proc/cpuinfo`'s clock gives a base or a momentary figure. The estimate `cores x clock x
//! SIMD lanes x 2 FMA pipes x 2` is printed beside it, and is the peak only where nothing can be
//! measured (no x86 SIMD). `--peak-gflops` overrides both.

/// The machine's fp32 peak and how it was obtained.
#[derive(Debug, Clone)]
pub struct Peak {
    /// GFLOP/s, if known.
    pub gflops: Option<f64>,
    /// The assumption behind it, in words.
    pub how: String,
}

/// The first `model name` in `/proc/cpuinfo`, or the architecture.
pub fn cpu_name() -> String {
    cpuinfo_values("model name")
        .into_iter()
        .next()
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// The 1-, 5- and 15-minute load averages from `/proc/loadavg`.
pub fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = text.split_whitespace().map(|v| v.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

/// Logical cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn cpuinfo_values(key: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
        .collect()
}

/// fp32 SIMD lanes of the widest FMA unit this CPU reports, and the extension's name.
fn simd_lanes() -> Option<(usize, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some((16, "AVX-512"));
        }
        if std::arch::is_x86_feature_detected!("fma") {
            return Some((8, "AVX2/FMA"));
        }
        Some((4, "SSE"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// The fp32 peak of `threads` cores: `given` GFLOP/s, else measured, else estimated from the
/// clock.
pub fn peak(threads: usize, given: Option<f64>) -> Peak {
    if let Some(gflops) = given {
        return Peak {
            gflops: Some(gflops),
            how: format!("{gflops:.0} GFLOP/s, given with --peak-gflops"),
        };
    }
    let estimate = estimated_peak(threads);
    match fma_loop::measure(threads) {
        Some((gflops, ext)) => Peak {
            gflops: Some(gflops),
            how: format!(
                "{gflops:.1} GFLOP/s measured: independent {ext} FMAs on {threads} thread(s) at \
                 once, best of {} runs (the clock-based estimate: {})",
                fma_loop::RUNS,
                estimate.how
            ),
        },
        None => estimate,
    }
}

/// `cores x clock x SIMD lanes x 2 FMA pipes x 2 flops`, from `/proc/cpuinfo`'s clock.
fn estimated_peak(threads: usize) -> Peak {
    let mhz = cpuinfo_values("cpu MHz")
        .iter()
        .filter_map(|v| v.parse::<f64>().ok())
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    match (simd_lanes(), mhz) {
        (Some((lanes, ext)), Some(mhz)) => {
            let gflops = threads as f64 * mhz / 1e3 * lanes as f64 * 2.0 * 2.0;
            Peak {
                gflops: Some(gflops),
                how: format!(
                    "{gflops:.0} GFLOP/s = {threads} cores x {:.2} GHz (/proc/cpuinfo) x {lanes} \
                     fp32 lanes ({ext}) x 2 FMA pipes (assumed) x 2 flops per FMA",
                    mhz / 1e3
                ),
            }
        }
        _ => Peak {
            gflops: None,
            how: "unknown (no x86 SIMD detection or no clock in /proc/cpuinfo); \
                  pass --peak-gflops"
                .into(),
        },
    }
}

/// The fp32 FMA throughput of the cores, timed.
mod fma_loop {
    use std::sync::Barrier;
    use std::time::Instant;

    /// Runs of the loop on all threads; the best counts.
    pub const RUNS: usize = 3;
    /// Iterations of the loop per thread and run (about 0.2 s on a 3 GHz core with AVX2).
    const ITERATIONS: u64 = 40_000_000;

    /// GFLOP/s of `threads` threads each running the FMA loop, and the extension used.
    pub fn measure(threads: usize) -> Option<(f64, &'static str)> {
        let Kernel {
            run,
            flops_per_iteration,
            name,
        } = kernel()?;
        let threads = threads.max(1);
        let best = (0..RUNS)
            .map(|_| {
                let barrier = Barrier::new(threads + 1);
                std::thread::scope(|scope| {
                    for _ in 0..threads {
                        scope.spawn(|| {
                            barrier.wait();
                            std::hint::black_box(run(ITERATIONS));
                        });
                    }
                    barrier.wait();
                    let start = Instant::now();
                    // The scope waits for every thread.
                    start
                })
                .elapsed()
                .as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        let flops = threads as f64 * ITERATIONS as f64 * flops_per_iteration as f64;
        Some((flops / best / 1e9, name))
    }

    /// A timed loop: `run(iterations)` does `flops_per_iteration` flops per iteration.
    struct Kernel {
        run: fn(u64) -> f32,
        flops_per_iteration: u64,
        name: &'static str,
    }

    fn opaque(v: f32) -> f32 {
        std::hint::black_box(v)
    }

    /// The widest loop this CPU runs.
    #[cfg(target_arch = "x86_64")]
    fn kernel() -> Option<Kernel> {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(Kernel {
                run: avx512,
                flops_per_iteration: 2 * AVX512_VALUES as u64,
                name: "AVX-512",
            });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Some(Kernel {
                run: avx2,
                flops_per_iteration: 2 * AVX2_VALUES as u64,
                name: "AVX2",
            });
        }
        None
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn kernel() -> Option<Kernel> {
        None
    }

    /// A loop of FMAs over `N` independent values, which the compiler keeps in vector
    /// registers: `N / lanes` chains, each one FMA per iteration.
    #[inline(always)]
    fn chains<const N: usize>(iterations: u64) -> f32 {
        // Opaque values, so the compiler cannot fold the chains.
        let (a, b) = (opaque(0.999_9), opaque(1e-4));
        let mut acc = [opaque(0.5); N];
        for _ in 0..iterations {
            for v in &mut acc {
                *v = v.mul_add(a, b);
            }
        }
        acc.iter().sum()
    }

    /// 12 chains of 8 lanes: enough to keep two FMA pipes of latency 4 to 5 busy, within
    /// AVX2's 16 registers.
    const AVX2_VALUES: usize = 12 * 8;
    /// 16 chains of 16 lanes, within AVX-512's 32 registers.
    const AVX512_VALUES: usize = 16 * 16;

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    fn avx2(iterations: u64) -> f32 {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run(iterations: u64) -> f32 {
            chains::<AVX2_VALUES>(iterations)
        }
        // SAFETY: `kernel` hands this function out only when the CPU has AVX2 and FMA.
        unsafe { run(iterations) }
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    fn avx512(iterations: u64) -> f32 {
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn run(iterations: u64) -> f32 {
            chains::<AVX512_VALUES>(iterations)
        }
        // SAFETY: `kernel` hands this function out only when the CPU has AVX-512 F.
        unsafe { run(iterations) }
    }
}
