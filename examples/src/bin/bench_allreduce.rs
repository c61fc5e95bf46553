//! Measures the all-reduce that [`MultiWorkerMirroredStrategy`] runs once per training step on
//! its fused buffer against a raw `MPI_Allreduce` of the same buffer, in the same run, and prints
//! the ratio per buffer size (rank 0 prints, as a markdown table).
//!
//! ```text
//! cargo build --release -p kandle-examples --features mpi --bin bench_allreduce
//! mpirun -n 2 target/release/bench_allreduce
//! ```
//!
//! Four ways of summing one `f32` buffer across the workers are timed, interleaved rep by rep:
//! - *raw*: `MPI_Allreduce` (sum) from the buffer into a separate receive buffer, through the
//!   mpi crate's `all_reduce_into` (the crate has no `MPI_IN_PLACE`);
//! - *Iallreduce*: `MPI_Iallreduce` from the buffer into a separate receive buffer, then
//!   `MPI_Wait`: the collective the fused path uses, without its guard;
//! - *polled*: the same `MPI_Iallreduce`, completed by `MPI_Test` with the back-off the fused
//!   path waits with between tests (8 yields, then sleeps from 50 µs doubling to 1.6 ms; a copy
//!   of the watchdog's `Backoff`): the fused path without the heartbeat exchange;
//! - *fused*: [`MultiWorkerMirroredStrategy::all_reduce_sum`], the guarded path of a training
//!   step: the watchdog's heartbeat rendezvous, then `MPI_Iallreduce` polled against the
//!   deadline (its receive buffer is swapped with the caller's afterwards).
//!
//! The first table compares raw and fused; the second splits the difference between the
//! collective (blocking or not), its polling, and the heartbeat exchange.
//!
//! MPI is initialised once, by the strategy; the raw reference uses the same `MPI_COMM_WORLD`.
//! Each rep starts after a barrier; a rep's time is the slowest worker's, and the table shows
//! the median over the reps. Bandwidth is bus bandwidth as NCCL-tests defines it for an
//! all-reduce, `2(n-1)/n · bytes / time`, comparable across worker counts. These are
//! measurements, never pass/fail tests.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Parser;
use kandle::strategy::Strategy;
use kandle_strategies::MultiWorkerMirroredStrategy;
use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::request::{Request, Scope};
use mpi::topology::SimpleCommunicator;

#[derive(Parser, Debug)]
#[command(about = "Benchmark the guarded multi-worker all-reduce against raw MPI_Allreduce")]
struct Args {
    /// Buffer sizes in `f32` elements: 1 K, 64 K, MiniGoogLeNet's 1,652,826 trainable
    /// parameters (its gradient count) and 16 M.
    #[arg(long, value_delimiter = ',', default_values_t = [1 << 10, 1 << 16, 1_652_826, 1 << 24])]
    sizes: Vec<usize>,
    /// Timed reps of each method per size.
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// Untimed reps of each method per size before the timed ones (the first also checks the
    /// sums).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
}

/// Seconds per rep of each method, this worker's own.
#[derive(Default)]
struct Samples {
    raw: Vec<f64>,
    nonblocking: Vec<f64>,
    polled: Vec<f64>,
    fused: Vec<f64>,
}

/// Medians (of the slowest worker per rep) of each method, in seconds.
struct Medians {
    raw: f64,
    nonblocking: f64,
    polled: f64,
    fused: f64,
}

/// Completes `request` by `MPI_Test` with the fused path's back-off between tests: 8 yields,
/// then sleeps of 50 µs doubling up to 1.6 ms (as `watchdog::Backoff`).
fn poll_with_backoff<'a, D: ?Sized, S: Scope<'a>>(mut request: Request<'a, D, S>) {
    let mut tries = 0u32;
    loop {
        match request.test() {
            Ok(_) => return,
            Err(pending) => request = pending,
        }
        if tries < 8 {
            std::thread::yield_now();
        } else {
            let micros = 50u64 << (tries - 8).min(5);
            std::thread::sleep(Duration::from_micros(micros.min(2000)));
        }
        tries = tries.saturating_add(1);
    }
}

/// Fills `buffer` with this worker's contribution, `rank + 1`, so every element sums to
/// `n(n+1)/2` and values never grow from rep to rep.
fn fill(buffer: &mut [f32], rank: usize) {
    buffer.fill((rank + 1) as f32);
}

fn check(what: &str, sums: &[f32], size: usize) -> Result<()> {
    let expected = (size * (size + 1) / 2) as f32;
    if let Some(i) = sums.iter().position(|&s| s != expected) {
        bail!("{what}: element {i} is {}, expected {expected}", sums[i]);
    }
    Ok(())
}

/// Runs `f` after a barrier and returns its seconds on this worker.
fn timed(comm: &SimpleCommunicator, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    comm.barrier();
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Per rep, the slowest worker's time; then the median over reps.
fn slowest_median(comm: &SimpleCommunicator, local: &[f64]) -> f64 {
    let mut slowest = vec![0f64; local.len()];
    comm.all_reduce_into(local, &mut slowest[..], SystemOperation::max());
    slowest.sort_by(f64::total_cmp);
    slowest[slowest.len() / 2]
}

fn measure(
    strategy: &MultiWorkerMirroredStrategy,
    comm: &SimpleCommunicator,
    len: usize,
    args: &Args,
) -> Result<Medians> {
    let rank = strategy.worker().rank;
    let size = strategy.worker().size;
    let mut buffer = vec![0f32; len];
    let mut receive = vec![0f32; len];
    let mut samples = Samples::default();
    for rep in 0..args.warmup + args.reps {
        let first = rep == 0;
        let warm = rep >= args.warmup;

        fill(&mut buffer, rank);
        let t = timed(comm, || {
            comm.all_reduce_into(&buffer[..], &mut receive[..], SystemOperation::sum());
            Ok(())
        })?;
        if first {
            check("raw MPI_Allreduce", &receive, size)?;
        }
        if warm {
            samples.raw.push(t);
        }

        fill(&mut buffer, rank);
        receive.fill(0.0);
        let t = timed(comm, || {
            mpi::request::scope(|scope| {
                comm.immediate_all_reduce_into(
                    scope,
                    &buffer[..],
                    &mut receive[..],
                    SystemOperation::sum(),
                )
                .wait_without_status();
            });
            Ok(())
        })?;
        if first {
            check("MPI_Iallreduce", &receive, size)?;
        }
        if warm {
            samples.nonblocking.push(t);
        }

        fill(&mut buffer, rank);
        receive.fill(0.0);
        let t = timed(comm, || {
            mpi::request::scope(|scope| {
                poll_with_backoff(comm.immediate_all_reduce_into(
                    scope,
                    &buffer[..],
                    &mut receive[..],
                    SystemOperation::sum(),
                ));
            });
            Ok(())
        })?;
        if first {
            check("MPI_Iallreduce polled", &receive, size)?;
        }
        if warm {
            samples.polled.push(t);
        }

        fill(&mut buffer, rank);
        let t = timed(comm, || Ok(strategy.all_reduce_sum(&mut buffer)?))?;
        if first {
            check("fused all_reduce_sum", &buffer, size)?;
        }
        if warm {
            samples.fused.push(t);
        }
    }
    Ok(Medians {
        raw: slowest_median(comm, &samples.raw),
        nonblocking: slowest_median(comm, &samples.nonblocking),
        polled: slowest_median(comm, &samples.polled),
        fused: slowest_median(comm, &samples.fused),
    })
}

/// Bus bandwidth in GB/s (NCCL-tests: algorithm bandwidth `bytes / time` times `2(n-1)/n`).
fn bus_bandwidth(bytes: usize, seconds: f64, workers: usize) -> f64 {
    let n = workers as f64;
    bytes as f64 / seconds * 2.0 * (n - 1.0) / n / 1e9
}

fn size_label(len: usize) -> String {
    match len {
        l if l >= 1 << 20 && l % (1 << 20) == 0 => format!("{} Mi", l >> 20),
        l if l >= 1 << 10 && l % (1 << 10) == 0 => format!("{} Ki", l >> 10),
        l if l >= 1_000_000 => format!("{:.2} M", l as f64 / 1e6),
        l => l.to_string(),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    kandle_examples::init();
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    // MPI is initialised here, once; the raw reference below uses the same MPI_COMM_WORLD
    // (a handle to it, which initialises nothing).
    let strategy = MultiWorkerMirroredStrategy::from_env()?;
    let comm = SimpleCommunicator::world();
    let workers = strategy.worker().size;
    let chief = strategy.worker().rank == 0;
    let mut rows = Vec::with_capacity(args.sizes.len());
    for &len in &args.sizes {
        rows.push((len, measure(&strategy, &comm, len, &args)?));
    }
    if !chief {
        return Ok(());
    }
    println!("## All-reduce of one f32 buffer across {workers} workers: raw MPI against the fused guarded path");
    println!(
        "median of {} reps after {} warm-up, slowest worker per rep; busbw = 2(n-1)/n · bytes / \
         time (NCCL-tests), GB/s = 1e9 B/s",
        args.reps, args.warmup
    );
    println!();
    println!(
        "| floats | bytes | raw MPI_Allreduce (ms) | raw busbw (GB/s) | fused (ms) | \
         fused busbw (GB/s) | fused/raw (time) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (len, m) in &rows {
        let bytes = len * std::mem::size_of::<f32>();
        println!(
            "| {} ({len}) | {bytes} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} |",
            size_label(*len),
            m.raw * 1e3,
            bus_bandwidth(bytes, m.raw, workers),
            m.fused * 1e3,
            bus_bandwidth(bytes, m.fused, workers),
            m.fused / m.raw,
        );
    }
    println!();
    println!(
        "The fused path adds the watchdog's heartbeat exchange to every call (heartbeat to the \
         chief, go, ready: small messages waited for with yields and sleeps), which dominates \
         for small buffers."
    );
    println!();
    println!("### Where the fused path's time goes (ms)");
    println!();
    println!(
        "| floats | MPI_Allreduce | MPI_Iallreduce + Wait | MPI_Iallreduce polled with \
         back-off | fused | fused − polled (heartbeat, the skew it adds, buffer reset) |"
    );
    println!("|---|---|---|---|---|---|");
    for (len, m) in &rows {
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            size_label(*len),
            m.raw * 1e3,
            m.nonblocking * 1e3,
            m.polled * 1e3,
            m.fused * 1e3,
            (m.fused - m.polled) * 1e3,
        );
    }
    println!();
    println!(
        "Raw = all_reduce_into from the buffer into a separate receive buffer (the mpi crate has \
         no MPI_IN_PLACE); each worker may run on {} core(s) as mpirun bound it.",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    Ok(())
}
