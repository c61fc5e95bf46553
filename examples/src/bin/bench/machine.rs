//! What the benchmark runs on: the CPU's name, the load average, and its fp32 peak.
//!
//! The peak is `cores x clock x SIMD lanes x FMA pipes x 2` (an FMA is two flops). The lanes
//! come from the CPU features detected at run time (AVX-512: 16 fp32 lanes, AVX2/FMA: 8,
//! otherwise SSE: 4), two FMA pipes per core are assumed, and the clock is the largest
//! `cpu MHz` in `/proc/cpuinfo`. `--peak-gflops` overrides the whole estimate.

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

/// The fp32 peak of `threads` cores, or `given` GFLOP/s.
pub fn peak(threads: usize, given: Option<f64>) -> Peak {
    if let Some(gflops) = given {
        return Peak {
            gflops: Some(gflops),
            how: format!("{gflops:.0} GFLOP/s, given with --peak-gflops"),
        };
    }
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
