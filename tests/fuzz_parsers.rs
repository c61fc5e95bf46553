//! Property-based fuzzing of every parser of outside bytes: the CIFAR-10 binary reader
//! (`cifar10::load`, `cifar10::load_file`), the checkpoint loader (`checkpoint::load`,
//! safetensors), the digits reader (`digits::load_from`, gzip'd CSV) and the image decoding of
//! `ImageFolder` (JPEG, PNG, BMP, GIF, WebP: its header check at build time and its decode in
//! `read`).
//!
//! Each parser gets random bytes and mutations of valid files (bit flips, truncation, byte
//! insertions and deletions, corrupted header and length fields, oversized declared lengths,
//! duplicated tensors, wrong dtypes, ragged and non-UTF-8 rows, NaN and huge values, bad gzip),
//! written to temporary files. Every case must return within a time bound (a panic fails the
//! test), with no allocation out of proportion to the file whatever a header declares, and every
//! failure must be an `Err` whose message names the file. Where the expected outcome is known
//! (CIFAR-10 records, hand-built safetensors, CSV edits) the result must match it exactly, and
//! valid files must load and round-trip through the writers.
//!
//! `KANDLE_FUZZ_CASES` sets the number of cases per parser (default [`DEFAULT_CASES`]);
//! `KANDLE_FUZZ_SEED` replays a run (each run prints its seed). Long runs, one parser at a time:
//!
//! ```text
//! KANDLE_FUZZ_CASES=1000000 cargo test --release -p kandle --test fuzz_parsers -- \
//!     --nocapture fuzz_cifar10
//! ```

// The counting global allocator below is the only unsafe code: it forwards to `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Debug;
use std::io::Write;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use kandle::data::{cifar10, digits, Dataset, ImageFolder, Interpolation};
use kandle::params::Weights;
use kandle::{checkpoint, Error};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};

use kandle_testing::cifar10_fixture::write_fixture;
use kandle_testing::webp::solid_webp;

/// Cases per parser when `KANDLE_FUZZ_CASES` is not set: the whole file takes about a minute in
/// a debug test build on two busy cores.
const DEFAULT_CASES: u32 = 25_000;

/// The longest one case may take before it counts as a hang.
const CASE_LIMIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Allocation accounting: the thread that runs a case records its largest single allocation and
// the bytes it allocated in all.

struct Counting;

thread_local! {
    static WATCHED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    static TOTAL: Cell<usize> = const { Cell::new(0) };
}

fn record(size: usize) {
    let _ = WATCHED.try_with(|watched| {
        if watched.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
            let _ = TOTAL.try_with(|t| t.set(t.get().saturating_add(size)));
        }
    });
}

// SAFETY: every call forwards to `System` with the same arguments; `record` only touches
// constant-initialised thread-locals without destructors, and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

// ---------------------------------------------------------------------------------------------
// Running one case: on its own thread, bounded in time, with its allocations counted.

/// What one parser call did.
struct Outcome<T> {
    value: kandle::Result<T>,
    /// The largest single allocation, in bytes.
    largest: usize,
    /// All bytes allocated, in bytes (growth by `realloc` counts the new size).
    total: usize,
    elapsed: Duration,
}

/// Runs `f` on a fresh thread; a panic or a run past [`CASE_LIMIT`] fails the case.
fn bounded<T: Send + 'static>(
    f: impl FnOnce() -> kandle::Result<T> + Send + 'static,
) -> Result<Outcome<T>, TestCaseError> {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("fuzz-case".into())
        .spawn(move || {
            WATCHED.with(|w| w.set(true));
            let start = Instant::now();
            let value = f();
            let elapsed = start.elapsed();
            WATCHED.with(|w| w.set(false));
            let _ = tx.send(Outcome {
                value,
                largest: LARGEST.with(Cell::get),
                total: TOTAL.with(Cell::get),
                elapsed,
            });
        })
        .map_err(|e| TestCaseError::fail(format!("cannot spawn a thread: {e}")))?;
    match rx.recv_timeout(CASE_LIMIT) {
        Ok(outcome) => {
            let _ = handle.join();
            Ok(outcome)
        }
        Err(mpsc::RecvTimeoutError::Timeout) => Err(TestCaseError::fail(format!(
            "the parser did not return within {CASE_LIMIT:?} (hang?)"
        ))),
        Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Err(payload) => Err(TestCaseError::fail(format!(
                "the parser panicked: {}",
                kandle::strategy::panic_message(payload.as_ref())
            ))),
            Ok(()) => Err(TestCaseError::fail(
                "the parser thread ended without a result",
            )),
        },
    }
}

/// Checks that a call reading `input_len` bytes allocated in proportion to them.
fn check_allocations<T>(outcome: &Outcome<T>, input_len: usize) -> Result<(), TestCaseError> {
    let largest_cap = (16 << 20) + 64 * input_len;
    let total_cap = (256 << 20) + 256 * input_len;
    prop_assert!(
        outcome.largest <= largest_cap,
        "one allocation of {} bytes for an input of {input_len} bytes",
        outcome.largest
    );
    prop_assert!(
        outcome.total <= total_cap,
        "{} bytes allocated in all for an input of {input_len} bytes",
        outcome.total
    );
    Ok(())
}

/// Checks that `err` is the `expected` variant naming `file`, in its fields and its message.
fn check_error(err: &Error, file: &Path, expected: &str) -> Result<(), TestCaseError> {
    let (variant, path) = match err {
        Error::Data { path, .. } => ("Data", path),
        Error::Checkpoint { path, .. } => ("Checkpoint", path),
        Error::Io { path, .. } => ("Io", path),
        other => return Err(TestCaseError::fail(format!("unexpected error {other:?}"))),
    };
    prop_assert_eq!(variant, expected, "{:?}", err);
    prop_assert_eq!(path.as_path(), file, "{:?}", err);
    let msg = err.to_string();
    prop_assert!(
        msg.contains(&file.display().to_string()),
        "the message does not name the file: {}",
        msg
    );
    Ok(())
}

/// Per-parser totals, printed at the end of a run.
#[derive(Default)]
struct Totals {
    runs: Cell<u64>,
    loaded: Cell<u64>,
    slowest: Cell<Duration>,
    largest: Cell<usize>,
}

impl Totals {
    fn add<T>(&self, outcome: &Outcome<T>) {
        self.runs.set(self.runs.get() + 1);
        self.loaded
            .set(self.loaded.get() + u64::from(outcome.value.is_ok()));
        self.slowest.set(self.slowest.get().max(outcome.elapsed));
        self.largest.set(self.largest.get().max(outcome.largest));
    }
}

fn cases() -> u32 {
    match std::env::var("KANDLE_FUZZ_CASES") {
        Ok(v) => v
            .trim()
            .parse()
            .expect("KANDLE_FUZZ_CASES must be a whole number of cases"),
        Err(_) => DEFAULT_CASES,
    }
}

fn seed() -> u64 {
    match std::env::var("KANDLE_FUZZ_SEED") {
        Ok(v) => v
            .trim()
            .parse()
            .expect("KANDLE_FUZZ_SEED must be a whole number"),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            splitmix(nanos ^ u64::from(std::process::id()))
        }
    }
}

/// Runs `case` on [`cases`] inputs drawn from `strategy`, then prints what the parser did.
fn fuzz<S>(parser: &str, strategy: S, case: impl Fn(S::Value, &Totals) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: Debug,
{
    fuzz_cases(parser, cases(), strategy, case)
}

/// [`fuzz`] on `cases` inputs.
fn fuzz_cases<S>(
    parser: &str,
    cases: u32,
    strategy: S,
    case: impl Fn(S::Value, &Totals) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug,
{
    let seed = seed();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(seed),
        max_shrink_time: 120_000,
        ..Config::default()
    });
    let totals = Totals::default();
    let start = Instant::now();
    let result = runner.run(&strategy, |input| case(input, &totals));
    eprintln!(
        "fuzz {parser}: {cases} cases, {} parser calls ({} loaded) in {:.1} s; slowest call \
         {:.1} ms; largest allocation {} KiB; KANDLE_FUZZ_SEED={seed}",
        totals.runs.get(),
        totals.loaded.get(),
        start.elapsed().as_secs_f64(),
        totals.slowest.get().as_secs_f64() * 1e3,
        totals.largest.get() >> 10,
    );
    if let Err(e) = result {
        panic!("fuzz {parser}: {e}\n(KANDLE_FUZZ_SEED={seed} replays this run)");
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs shared by the parsers.

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `len` pseudo-random bytes from `seed`.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        state = splitmix(state);
        let take = (len - out.len()).min(8);
        out.extend_from_slice(&state.to_le_bytes()[..take]);
    }
    out
}

/// Bytes that print compactly when a case fails.
#[derive(Clone)]
struct Bytes(Vec<u8>);

impl Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "b\"{}\" ({} bytes)", self.0.escape_ascii(), self.0.len())
    }
}

fn bytes(len: std::ops::Range<usize>) -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), len).prop_map(Bytes)
}

/// Arbitrary bytes, mostly short.
fn random_bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop_oneof![bytes(0..24), bytes(0..max)]
}

/// One edit of a file's bytes.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(Index, u8),
    /// A bit flip within 32 bytes of the start (`false`) or the end (`true`): headers, length
    /// fields, gzip trailers.
    FlipNear(bool, u8, u8),
    SetByte(Index, u8),
    Truncate(Index),
    Insert(Index, Bytes),
    Delete(Index, usize),
    /// Inserts a copy of up to this many bytes right after them.
    Repeat(Index, usize),
    Append(Bytes),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        2 => (any::<bool>(), 0u8..32, 0u8..8).prop_map(|(e, o, b)| Mutation::FlipNear(e, o, b)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::SetByte(i, v)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => (any::<Index>(), bytes(1..16)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Delete(i, n)),
        1 => (any::<Index>(), 1usize..4096).prop_map(|(i, n)| Mutation::Repeat(i, n)),
        1 => bytes(1..16).prop_map(Mutation::Append),
    ]
}

fn mutations(max: usize) -> impl Strategy<Value = Vec<Mutation>> {
    vec(mutation(), 1..max)
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let len = bytes.len();
    // A position in 0..len, or in 0..=len for `Truncate` and `Insert`.
    let at = |i: &Index, n: usize| if n == 0 { 0 } else { i.index(n) };
    match mutation {
        Mutation::FlipBit(i, bit) if len > 0 => bytes[i.index(len)] ^= 1 << bit,
        Mutation::FlipNear(from_end, offset, bit) => {
            let offset = usize::from(*offset);
            if offset < len {
                let p = if *from_end { len - 1 - offset } else { offset };
                bytes[p] ^= 1 << bit;
            }
        }
        Mutation::SetByte(i, v) if len > 0 => bytes[i.index(len)] = *v,
        Mutation::Truncate(i) => bytes.truncate(at(i, len + 1)),
        Mutation::Insert(i, new) => {
            let p = at(i, len + 1);
            bytes.splice(p..p, new.0.iter().copied());
        }
        Mutation::Delete(i, n) if len > 0 => {
            let p = i.index(len);
            bytes.drain(p..(p + n).min(len));
        }
        Mutation::Repeat(i, n) if len > 0 => {
            let p = i.index(len);
            let end = (p + n).min(len);
            let copy = bytes[p..end].to_vec();
            bytes.splice(end..end, copy);
        }
        Mutation::Append(new) => bytes.extend_from_slice(&new.0),
        _ => {}
    }
}

/// Writes `bytes` to a new file at `path`. Removing the old file first, rather than truncating
/// it, spares a flush to disk per case on file systems that guard truncate-then-rewrite (ext4).
fn write(path: &Path, bytes: &[u8]) -> Result<(), TestCaseError> {
    let fail =
        |e: std::io::Error| TestCaseError::fail(format!("cannot write {}: {e}", path.display()));
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(fail(e)),
        _ => {}
    }
    std::fs::write(path, bytes).map_err(fail)
}

fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary directory")
}

// ---------------------------------------------------------------------------------------------
// CIFAR-10.

const RECORD_LEN: usize = cifar10::RECORD_LEN;

#[derive(Debug, Clone)]
enum CifarInput {
    /// Arbitrary bytes read by `load_file`.
    Random(Bytes),
    /// Records with these labels and seeded pixels, labels then bytes edited, read by
    /// `load_file` (`file: None`) or as file `file` of the six that `load` reads.
    Records {
        labels: Vec<u8>,
        seed: u64,
        label_edits: Vec<(Index, u8)>,
        mutations: Vec<Mutation>,
        file: Option<usize>,
    },
    /// A set written by `cifar10::save` and read back by `load`.
    RoundTrip {
        train: Vec<u8>,
        test: Vec<u8>,
        seed: u64,
    },
}

fn cifar_labels(n: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u8>> {
    vec(prop_oneof![9 => 0u8..10, 1 => any::<u8>()], n)
}

fn cifar_input() -> impl Strategy<Value = CifarInput> {
    let records = (
        cifar_labels(1..5),
        any::<u64>(),
        vec((any::<Index>(), any::<u8>()), 0..3),
        prop_oneof![1 => Just(Vec::new()), 3 => mutations(4)],
        prop::option::weighted(0.3, 0..6usize),
    )
        .prop_map(
            |(labels, seed, label_edits, mutations, file)| CifarInput::Records {
                labels,
                seed,
                label_edits,
                mutations,
                file,
            },
        );
    prop_oneof![
        20 => random_bytes(3 * RECORD_LEN + 8).prop_map(CifarInput::Random),
        10 => (1..4usize, any::<u64>())
            .prop_map(|(n, seed)| CifarInput::Random(Bytes(noise(n * RECORD_LEN, seed)))),
        80 => records,
        // Rare: `save` syncs six files to disk.
        1 => (cifar_labels(5..12), cifar_labels(1..4), any::<u64>())
            .prop_map(|(train, test, seed)| {
                let valid = |l: Vec<u8>| l.into_iter().map(|b| b % 10).collect();
                CifarInput::RoundTrip { train: valid(train), test: valid(test), seed }
            }),
    ]
}

/// Records with `labels` and pixels from `seed`.
fn cifar_records(labels: &[u8], seed: u64) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(labels.len() * RECORD_LEN);
    for (k, &label) in labels.iter().enumerate() {
        bytes.push(label);
        bytes.extend(noise(cifar10::IMAGE_LEN, seed ^ k as u64));
    }
    bytes
}

/// What the reader must make of one file's bytes: its labels and pixels, or what the error
/// message must say.
fn cifar_expected(bytes: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    if bytes.is_empty() {
        return Err("the file is empty".into());
    }
    let (whole, rest) = (bytes.len() / RECORD_LEN, bytes.len() % RECORD_LEN);
    if rest != 0 {
        return Err(format!(
            "record {whole} (counting from 0) is cut short after {rest} bytes"
        ));
    }
    let mut labels = Vec::new();
    let mut pixels = Vec::new();
    for (i, record) in bytes.chunks_exact(RECORD_LEN).enumerate() {
        if record[0] >= 10 {
            return Err(format!(
                "record {i} (counting from 0, at byte {})",
                i * RECORD_LEN
            ));
        }
        labels.push(record[0]);
        pixels.extend_from_slice(&record[1..]);
    }
    Ok((labels, pixels))
}

fn check_cifar(
    outcome: &Outcome<cifar10::Cifar10Dataset>,
    file: &Path,
    expected: Result<(Vec<u8>, Vec<u8>), String>,
) -> Result<(), TestCaseError> {
    match (&outcome.value, expected) {
        (Ok(ds), Ok((labels, pixels))) => {
            prop_assert_eq!(ds.labels(), &labels[..]);
            prop_assert!(
                ds.pixels() == &pixels[..],
                "the pixels differ from the file's"
            );
            prop_assert_eq!(ds.len(), labels.len());
        }
        (Err(err), Err(what)) => {
            check_error(err, file, "Data")?;
            prop_assert!(err.to_string().contains(&what), "{} lacks `{}`", err, what);
        }
        (Ok(ds), Err(what)) => {
            return Err(TestCaseError::fail(format!(
                "loaded {} records, expected an error saying `{what}`",
                ds.len()
            )))
        }
        (Err(err), Ok((labels, _))) => {
            return Err(TestCaseError::fail(format!(
                "expected {} records, got {err}",
                labels.len()
            )))
        }
    }
    Ok(())
}

#[test]
fn fuzz_cifar10() {
    let dir = temp_dir();
    let single = dir.path().join("case.bin");
    // Six valid files of one record each; a case replaces one of them, then restores it.
    let set = dir.path().join("set");
    write_fixture(&set, 1, 1, 17).expect("fixture");
    let names: Vec<&str> = cifar10::TRAIN_FILES
        .into_iter()
        .chain([cifar10::TEST_FILE])
        .collect();
    let originals: Vec<Vec<u8>> = names
        .iter()
        .map(|n| std::fs::read(set.join(n)).expect("fixture file"))
        .collect();
    let round_trips = dir.path().join("saved");

    fuzz("cifar10", cifar_input(), |input, totals| match input {
        CifarInput::Random(Bytes(bytes)) => {
            write(&single, &bytes)?;
            let path = single.clone();
            let outcome = bounded(move || cifar10::load_file(path))?;
            totals.add(&outcome);
            check_allocations(&outcome, bytes.len())?;
            check_cifar(&outcome, &single, cifar_expected(&bytes))
        }
        CifarInput::Records {
            labels,
            seed,
            label_edits,
            mutations,
            file,
        } => {
            let mut bytes = cifar_records(&labels, seed);
            for (record, value) in &label_edits {
                bytes[record.index(labels.len()) * RECORD_LEN] = *value;
            }
            for m in &mutations {
                apply(&mut bytes, m);
            }
            let Some(k) = file else {
                write(&single, &bytes)?;
                let path = single.clone();
                let outcome = bounded(move || cifar10::load_file(path))?;
                totals.add(&outcome);
                check_allocations(&outcome, bytes.len())?;
                return check_cifar(&outcome, &single, cifar_expected(&bytes));
            };
            let target = set.join(names[k]);
            write(&target, &bytes)?;
            let dir = set.clone();
            let outcome = bounded(move || cifar10::load(dir));
            write(&target, &originals[k])?;
            let outcome = outcome?;
            totals.add(&outcome);
            check_allocations(&outcome, bytes.len() + 5 * RECORD_LEN)?;
            let mut files = originals.clone();
            files[k] = bytes;
            match (&outcome.value, cifar_expected(&files[k])) {
                (Ok(data), Ok(_)) => {
                    let train: Vec<u8> = files[..5].concat();
                    let (labels, pixels) = cifar_expected(&train).map_err(TestCaseError::fail)?;
                    prop_assert_eq!(data.train.labels(), &labels[..]);
                    prop_assert!(data.train.pixels() == &pixels[..]);
                    let (labels, pixels) =
                        cifar_expected(&files[5]).map_err(TestCaseError::fail)?;
                    prop_assert_eq!(data.test.labels(), &labels[..]);
                    prop_assert!(data.test.pixels() == &pixels[..]);
                }
                (Err(err), Err(what)) => {
                    check_error(err, &target, "Data")?;
                    prop_assert!(err.to_string().contains(&what), "{} lacks `{}`", err, what);
                }
                (value, expected) => {
                    return Err(TestCaseError::fail(format!(
                        "file {}: got {:?}, expected {expected:?}",
                        names[k],
                        value.as_ref().map(|d| (d.train.len(), d.test.len()))
                    )))
                }
            }
            Ok(())
        }
        CifarInput::RoundTrip { train, test, seed } => {
            let set_of = |labels: Vec<u8>, seed: u64| {
                let pixels = noise(labels.len() * cifar10::IMAGE_LEN, seed);
                cifar10::Cifar10Dataset::new(pixels, labels)
            };
            let data = cifar10::Cifar10 {
                train: set_of(train, seed).map_err(|e| TestCaseError::fail(e.to_string()))?,
                test: set_of(test, !seed).map_err(|e| TestCaseError::fail(e.to_string()))?,
            };
            cifar10::save(&round_trips, &data).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let dir = round_trips.clone();
            let outcome = bounded(move || cifar10::load(dir))?;
            totals.add(&outcome);
            let back = outcome
                .value
                .map_err(|e| TestCaseError::fail(format!("a saved set does not load: {e}")))?;
            prop_assert_eq!(back.train.labels(), data.train.labels());
            prop_assert!(back.train.pixels() == data.train.pixels());
            prop_assert_eq!(back.test.labels(), data.test.labels());
            prop_assert!(back.test.pixels() == data.test.pixels());
            Ok(())
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Checkpoints (safetensors).

/// Safetensors dtypes: name and bits per element.
const DTYPES: [(&str, usize); 18] = [
    ("F32", 32),
    ("F16", 16),
    ("BF16", 16),
    ("F64", 64),
    ("I64", 64),
    ("I32", 32),
    ("I16", 16),
    ("I8", 8),
    ("U8", 8),
    ("U16", 16),
    ("U32", 32),
    ("U64", 64),
    ("BOOL", 8),
    ("F8_E4M3", 8),
    ("F8_E5M2", 8),
    ("F8_E8M0", 8),
    ("F4", 4),
    ("C64", 64),
];

/// The dtypes `checkpoint::load` reads.
const SUPPORTED: usize = 4;

#[derive(Debug, Clone)]
struct TensorSpec {
    name: String,
    dtype: usize,
    shape: Vec<usize>,
    seed: u64,
}

impl TensorSpec {
    fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    fn data(&self) -> Vec<u8> {
        noise(
            (self.elements() * DTYPES[self.dtype].1).div_ceil(8),
            self.seed,
        )
    }
}

/// A large or odd number for a length, offset or dimension.
fn big_number() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(1 << 32),
        Just((1 << 32) + 1),
        Just(1 << 40),
        Just(1 << 62),
        Just(100_000_000),
        Just(100_000_001),
        0u64..64,
        any::<u64>(),
    ]
}

/// One corruption of a hand-built safetensors file.
#[derive(Debug, Clone)]
enum Corruption {
    /// The 8-byte header length replaced by this value.
    HeaderLen(u64),
    /// The header length off by this much.
    HeaderLenDelta(i8),
    /// A data offset (start or end) replaced.
    Offset(Index, bool, u64),
    /// A dimension replaced by a number.
    Dim(Index, Index, u64),
    /// A dimension replaced by this JSON text.
    DimText(Index, &'static str),
    /// A dimension appended.
    ExtraDim(Index, u64),
    /// The dtype replaced by this name.
    Dtype(Index, String),
    /// A tensor's entry written twice: with the same offsets, or over bytes appended to the data.
    Duplicate(Index, bool),
    /// A `__metadata__` entry with this JSON value.
    Metadata(&'static str),
    /// A `__metadata__` entry of arrays nested this deep.
    NestedMetadata(usize),
    /// Bytes after the data.
    Trailing(Bytes),
    /// The data cut short.
    Missing(usize),
    /// Spaces after the JSON, inside the declared header (valid).
    Padding(u8),
}

fn corruption() -> impl Strategy<Value = Corruption> {
    let dtype_name = prop_oneof![
        (0..DTYPES.len()).prop_map(|i| DTYPES[i].0.to_string()),
        Just("F33".to_string()),
        Just(String::new()),
        Just("f32".to_string()),
        "[A-Z0-9_]{1,8}",
    ];
    prop_oneof![
        (big_number()).prop_map(Corruption::HeaderLen),
        any::<i8>().prop_map(Corruption::HeaderLenDelta),
        (any::<Index>(), any::<bool>(), big_number())
            .prop_map(|(t, e, v)| Corruption::Offset(t, e, v)),
        (any::<Index>(), any::<Index>(), big_number())
            .prop_map(|(t, d, v)| Corruption::Dim(t, d, v)),
        (
            any::<Index>(),
            prop::sample::select(vec![
                "-1",
                "1.5",
                "1e3",
                "99999999999999999999999",
                "null",
                "\"2\"",
                "[2]",
                "18446744073709551616",
            ])
        )
            .prop_map(|(t, s)| Corruption::DimText(t, s)),
        (any::<Index>(), big_number()).prop_map(|(t, v)| Corruption::ExtraDim(t, v)),
        (any::<Index>(), dtype_name).prop_map(|(t, d)| Corruption::Dtype(t, d)),
        (any::<Index>(), any::<bool>()).prop_map(|(t, s)| Corruption::Duplicate(t, s)),
        prop::sample::select(vec![
            "{\"format\":\"pt\"}",
            "{\"a\":1}",
            "[]",
            "\"x\"",
            "null",
            "{}",
        ])
        .prop_map(Corruption::Metadata),
        (1usize..100_000).prop_map(Corruption::NestedMetadata),
        bytes(1..32).prop_map(Corruption::Trailing),
        (1usize..64).prop_map(Corruption::Missing),
        any::<u8>().prop_map(Corruption::Padding),
    ]
}

/// The JSON entry of one tensor, dimensions as text so that they can be corrupted.
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<String>,
    offsets: (u64, u64),
}

/// A safetensors file of `specs`, corrupted by `corruptions`.
fn build_safetensors(specs: &[TensorSpec], corruptions: &[Corruption]) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut data = Vec::new();
    for spec in specs {
        let bytes = spec.data();
        let start = data.len() as u64;
        data.extend_from_slice(&bytes);
        entries.push(Entry {
            name: serde_json::to_string(&spec.name).unwrap_or_default(),
            dtype: DTYPES[spec.dtype].0.to_string(),
            shape: spec.shape.iter().map(usize::to_string).collect(),
            offsets: (start, data.len() as u64),
        });
    }
    let mut len_override = None;
    let mut len_delta = 0i64;
    let mut extra = String::new();
    let mut padding = 0;
    for c in corruptions {
        let n = entries.len();
        match c {
            Corruption::HeaderLen(v) => len_override = Some(*v),
            Corruption::HeaderLenDelta(d) => len_delta = i64::from(*d),
            Corruption::Offset(t, end, v) if n > 0 => {
                let e = &mut entries[t.index(n)];
                if *end {
                    e.offsets.1 = *v;
                } else {
                    e.offsets.0 = *v;
                }
            }
            Corruption::Dim(t, d, v) if n > 0 => {
                let e = &mut entries[t.index(n)];
                if !e.shape.is_empty() {
                    let i = d.index(e.shape.len());
                    e.shape[i] = v.to_string();
                }
            }
            Corruption::DimText(t, s) if n > 0 => {
                let e = &mut entries[t.index(n)];
                match e.shape.first_mut() {
                    Some(dim) => *dim = (*s).to_string(),
                    None => e.shape.push((*s).to_string()),
                }
            }
            Corruption::ExtraDim(t, v) if n > 0 => entries[t.index(n)].shape.push(v.to_string()),
            Corruption::Dtype(t, name) if n > 0 => entries[t.index(n)].dtype = name.clone(),
            Corruption::Duplicate(t, same) if n > 0 => {
                let e = &entries[t.index(n)];
                let offsets = if *same {
                    e.offsets
                } else {
                    // The offsets may be corrupted already: bound the bytes added.
                    let size = e.offsets.1.saturating_sub(e.offsets.0).min(1 << 16);
                    let start = data.len() as u64;
                    data.extend(noise(size as usize, start));
                    (start, start + size)
                };
                let copy = Entry {
                    name: e.name.clone(),
                    dtype: e.dtype.clone(),
                    shape: e.shape.clone(),
                    offsets,
                };
                entries.push(copy);
            }
            Corruption::Metadata(v) => extra = format!("\"__metadata__\":{v}"),
            Corruption::NestedMetadata(depth) => {
                extra = format!(
                    "\"__metadata__\":{}{}",
                    "[".repeat(*depth),
                    "]".repeat(*depth)
                );
            }
            Corruption::Trailing(b) => data.extend_from_slice(&b.0),
            Corruption::Missing(k) => data.truncate(data.len().saturating_sub(*k)),
            Corruption::Padding(p) => padding = usize::from(*p),
            _ => {}
        }
    }
    let mut fields: Vec<String> = entries
        .iter()
        .map(|e| {
            format!(
                "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                e.name,
                e.dtype,
                e.shape.join(","),
                e.offsets.0,
                e.offsets.1
            )
        })
        .collect();
    if !extra.is_empty() {
        fields.insert(0, extra);
    }
    let header = format!("{{{}}}{}", fields.join(","), " ".repeat(padding));
    let len = len_override.unwrap_or((header.len() as i64 + len_delta).max(0) as u64);
    let mut file = len.to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&data);
    file
}

#[derive(Debug, Clone)]
enum CheckpointInput {
    /// Arbitrary bytes.
    Random(Bytes),
    /// A correct header length, then random JSON-like text and data.
    RandomHeader(String, Bytes),
    /// A hand-built file, corrupted, then its bytes edited.
    Built {
        tensors: Vec<TensorSpec>,
        corruptions: Vec<Corruption>,
        mutations: Vec<Mutation>,
    },
    /// `f32` tensors written by `checkpoint::save`, read back.
    RoundTrip(Vec<TensorSpec>),
}

fn tensor_specs(max_dtype: usize) -> impl Strategy<Value = Vec<TensorSpec>> {
    let dtype = prop_oneof![4 => 0..SUPPORTED, 1 => 0..max_dtype];
    let dim = prop_oneof![6 => 1usize..5, 1 => Just(0usize), 1 => 5usize..40];
    let spec = (
        "[a-z_.0-9]{1,10}|\\PC{0,6}",
        dtype,
        vec(dim, 0..4),
        any::<u64>(),
    );
    vec(spec, 0..5).prop_map(|specs| {
        specs
            .into_iter()
            .enumerate()
            .map(|(i, (name, dtype, shape, seed))| TensorSpec {
                // Unique names; never `__metadata__`.
                name: format!("t{i}.{name}"),
                dtype,
                shape,
                seed,
            })
            .collect()
    })
}

fn checkpoint_input() -> impl Strategy<Value = CheckpointInput> {
    let header = concat!(
        r#"\{(("[a-z_]{0,12}"|"t"):\{"dtype":"(F32|F16|BF16|F64|I8|U8|F4|BOOL|X)","#,
        r#""shape":\[([0-9]{1,3}(,[0-9]{1,20}){0,3})?\],"#,
        r#""data_offsets":\[[0-9]{1,3},[0-9]{1,3}\]\},?){0,3}\}[ ]{0,3}"#,
    );
    prop_oneof![
        20 => random_bytes(256).prop_map(CheckpointInput::Random),
        20 => (header, bytes(0..80)).prop_map(|(h, d)| CheckpointInput::RandomHeader(h, d)),
        20 => tensor_specs(DTYPES.len()).prop_map(|tensors| CheckpointInput::Built {
            tensors,
            corruptions: Vec::new(),
            mutations: Vec::new(),
        }),
        40 => (tensor_specs(DTYPES.len()), vec(corruption(), 1..4))
            .prop_map(|(tensors, corruptions)| {
                CheckpointInput::Built { tensors, corruptions, mutations: Vec::new() }
            }),
        40 => (tensor_specs(DTYPES.len()), mutations(4)).prop_map(|(tensors, mutations)| {
            CheckpointInput::Built { tensors, corruptions: Vec::new(), mutations }
        }),
        // Rare: `save` syncs the file to disk.
        1 => tensor_specs(1).prop_map(CheckpointInput::RoundTrip),
    ]
}

/// An IEEE half-precision number, exactly, as `f32`.
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((h >> 10) & 0x1f);
    let mantissa = f32::from(h & 0x3ff);
    match exponent {
        0 => sign * mantissa * 2f32.powi(-24),
        31 if mantissa == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        e => sign * (1.0 + mantissa / 1024.0) * 2f32.powi(e - 15),
    }
}

/// The values of a supported tensor as the loader must give them, as `f32`.
fn decode(spec: &TensorSpec) -> Vec<f32> {
    let data = spec.data();
    match DTYPES[spec.dtype].0 {
        "F32" => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "F64" => data
            .chunks_exact(8)
            .map(|c| {
                let b: [u8; 8] = [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
                f64::from_le_bytes(b) as f32
            })
            .collect(),
        "F16" => data
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        "BF16" => data
            .chunks_exact(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect(),
        other => unreachable!("{other} is not a supported dtype"),
    }
}

/// Equal as bits, or both NaN.
fn same_values(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

fn values(t: &Tensor) -> Result<Vec<f32>, TestCaseError> {
    t.flatten_all()
        .and_then(|f| f.to_vec1::<f32>())
        .map_err(|e| TestCaseError::fail(e.to_string()))
}

/// Checks that `weights` hold exactly `specs`, decoded to `f32`.
fn check_weights(weights: &Weights, specs: &[TensorSpec]) -> Result<(), TestCaseError> {
    prop_assert_eq!(weights.len(), specs.len());
    for spec in specs {
        let t = weights
            .get(&spec.name)
            .ok_or_else(|| TestCaseError::fail(format!("tensor `{}` is missing", spec.name)))?;
        prop_assert_eq!(t.dtype(), DType::F32);
        prop_assert_eq!(t.dims(), &spec.shape[..]);
        prop_assert!(
            same_values(&values(t)?, &decode(spec)),
            "`{}` differs",
            spec.name
        );
    }
    Ok(())
}

fn load_checkpoint(
    path: &Path,
    bytes: &[u8],
    totals: &Totals,
) -> Result<Outcome<Weights>, TestCaseError> {
    write(path, bytes)?;
    let owned = path.to_path_buf();
    let outcome = bounded(move || checkpoint::load(owned))?;
    totals.add(&outcome);
    check_allocations(&outcome, bytes.len())?;
    match &outcome.value {
        Err(err) => check_error(err, path, "Checkpoint")?,
        Ok(weights) => {
            for (name, t) in weights {
                prop_assert_eq!(t.dtype(), DType::F32, "{}", name);
                prop_assert!(t.device().is_cpu());
                // Every value can be read back.
                prop_assert_eq!(values(t)?.len(), t.elem_count(), "{}", name);
            }
        }
    }
    Ok(outcome)
}

#[test]
fn fuzz_checkpoint() {
    let dir = temp_dir();
    let path = dir.path().join("case.safetensors");
    let saved = dir.path().join("saved.safetensors");
    fuzz(
        "checkpoint",
        checkpoint_input(),
        |input, totals| match input {
            CheckpointInput::Random(Bytes(bytes)) => {
                load_checkpoint(&path, &bytes, totals)?;
                Ok(())
            }
            CheckpointInput::RandomHeader(header, Bytes(data)) => {
                let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
                bytes.extend_from_slice(header.as_bytes());
                bytes.extend_from_slice(&data);
                load_checkpoint(&path, &bytes, totals)?;
                Ok(())
            }
            CheckpointInput::Built {
                tensors,
                corruptions,
                mutations,
            } => {
                let mut bytes = build_safetensors(&tensors, &corruptions);
                for m in &mutations {
                    apply(&mut bytes, m);
                }
                let outcome = load_checkpoint(&path, &bytes, totals)?;
                if corruptions.is_empty() && mutations.is_empty() {
                    // An intact file: it loads exactly when every dtype is one the loader reads.
                    let unsupported = tensors.iter().find(|t| t.dtype >= SUPPORTED);
                    match (&outcome.value, unsupported) {
                        (Ok(weights), None) => check_weights(weights, &tensors)?,
                        (Err(err), Some(_)) => {
                            let msg = err.to_string();
                            prop_assert!(
                                msg.contains("unsupported dtype") || msg.contains("not a valid"),
                                "{}",
                                msg
                            );
                        }
                        (Ok(_), Some(t)) => {
                            return Err(TestCaseError::fail(format!(
                                "loaded a file with tensor `{}` of dtype {}",
                                t.name, DTYPES[t.dtype].0
                            )))
                        }
                        (Err(err), None) => {
                            return Err(TestCaseError::fail(format!("a valid file fails: {err}")))
                        }
                    }
                }
                Ok(())
            }
            CheckpointInput::RoundTrip(tensors) => {
                let mut weights = Weights::new();
                for spec in &tensors {
                    let t = Tensor::from_vec(decode(spec), spec.shape.as_slice(), &Device::Cpu)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    weights.insert(spec.name.clone(), t);
                }
                checkpoint::save(&weights, &saved)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let owned = saved.clone();
                let outcome = bounded(move || checkpoint::load(owned))?;
                totals.add(&outcome);
                let back = outcome
                    .value
                    .map_err(|e| TestCaseError::fail(format!("a saved checkpoint fails: {e}")))?;
                check_weights(&back, &tensors)
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Digits (gzip'd CSV).

const EMBEDDED: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/digits/digits.csv.gz"
));

/// How the numbers of a generated CSV are written.
#[derive(Debug, Clone, Copy)]
enum NumberStyle {
    Plain,
    Decimal,
    Spaced,
    Exponent,
}

/// A valid CSV: rows of 64 pixels 0..16 and a label 0..9.
#[derive(Clone)]
struct Csv {
    rows: Vec<(Vec<u8>, u8)>,
    style: NumberStyle,
    crlf: bool,
    final_newline: bool,
}

impl Csv {
    fn lines(&self) -> Vec<Vec<Vec<u8>>> {
        let number = |v: u8| -> Vec<u8> {
            match self.style {
                NumberStyle::Plain => v.to_string(),
                NumberStyle::Decimal => format!("{v}.0"),
                NumberStyle::Spaced => format!(" {v} "),
                NumberStyle::Exponent => format!("{v}e0"),
            }
            .into_bytes()
        };
        self.rows
            .iter()
            .map(|(pixels, label)| pixels.iter().chain([label]).map(|&v| number(v)).collect())
            .collect()
    }

    fn render(&self, lines: &[Vec<Vec<u8>>]) -> Vec<u8> {
        let end: &[u8] = if self.crlf { b"\r\n" } else { b"\n" };
        let mut out = Vec::new();
        for (i, fields) in lines.iter().enumerate() {
            out.extend_from_slice(&fields.join(&b","[..]));
            if i + 1 < lines.len() || self.final_newline {
                out.extend_from_slice(end);
            }
        }
        out
    }
}

impl Debug for Csv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = self.render(&self.lines());
        write!(f, "Csv(b\"{}\")", text.escape_ascii())
    }
}

fn csv() -> impl Strategy<Value = Csv> {
    let row = (vec(0u8..=16, 64), 0u8..10);
    (
        vec(row, 1..6),
        prop_oneof![
            Just(NumberStyle::Plain),
            Just(NumberStyle::Decimal),
            Just(NumberStyle::Spaced),
            Just(NumberStyle::Exponent)
        ],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(rows, style, crlf, final_newline)| Csv {
            rows,
            style,
            crlf,
            final_newline,
        })
}

/// One edit of a CSV, by line and field.
#[derive(Debug, Clone)]
enum CsvEdit {
    Field(Index, Index, String),
    DropField(Index, Index),
    AddField(Index, String),
    /// Raw bytes inserted into a field.
    Raw(Index, Index, Bytes),
    JoinLines(Index),
    InsertLine(Index, Bytes),
    /// A long line of one byte.
    LongLine(Index, usize, u8),
}

fn csv_token() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "NaN",
            "nan",
            "-NaN",
            "inf",
            "-inf",
            "infinity",
            "1e39",
            "-1e39",
            "3.4028236e38",
            "1e-45",
            "1e-400",
            "-0",
            "-0.0",
            "+3",
            "17",
            "16.000001",
            "16",
            "-1",
            "",
            "   ",
            "0x10",
            "3.5",
            "10",
            "9.5",
            "9.0000001",
            "1e1",
            "\u{663}",
            "3\u{a0}",
            "\u{feff}3",
            "99999999999999999999999999999999999999999999",
            "\"3\"",
            "3;4",
        ])
        .prop_map(str::to_string),
        "\\PC{0,6}",
        "[0-9.eE+-]{1,8}",
    ]
}

fn csv_edit() -> impl Strategy<Value = CsvEdit> {
    let raw = prop_oneof![
        bytes(1..6),
        prop::sample::select(vec![
            vec![0xff],
            vec![0xc3],
            vec![0xe2, 0x82],
            vec![0],
            vec![b'\r'],
            vec![b'\n'],
            vec![b','],
            vec![0xed, 0xa0, 0x80],
        ])
        .prop_map(Bytes),
    ];
    prop_oneof![
        4 => (any::<Index>(), any::<Index>(), csv_token())
            .prop_map(|(l, f, t)| CsvEdit::Field(l, f, t)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(l, f)| CsvEdit::DropField(l, f)),
        1 => (any::<Index>(), csv_token()).prop_map(|(l, t)| CsvEdit::AddField(l, t)),
        2 => (any::<Index>(), any::<Index>(), raw).prop_map(|(l, f, b)| CsvEdit::Raw(l, f, b)),
        1 => any::<Index>().prop_map(CsvEdit::JoinLines),
        1 => (any::<Index>(), prop_oneof![bytes(0..40), Just(Bytes(b"  \t ".to_vec()))])
            .prop_map(|(l, t)| CsvEdit::InsertLine(l, t)),
        1 => (any::<Index>(), 1usize..100_000, prop::sample::select(vec![b'x', b',', b'9']))
            .prop_map(|(l, n, b)| CsvEdit::LongLine(l, n, b)),
    ]
}

fn edit(lines: &mut Vec<Vec<Vec<u8>>>, e: &CsvEdit) {
    let n = lines.len();
    match e {
        CsvEdit::Field(l, f, token) if n > 0 => {
            let line = &mut lines[l.index(n)];
            if !line.is_empty() {
                let i = f.index(line.len());
                line[i] = token.clone().into_bytes();
            }
        }
        CsvEdit::DropField(l, f) if n > 0 => {
            let line = &mut lines[l.index(n)];
            if !line.is_empty() {
                let i = f.index(line.len());
                line.remove(i);
            }
        }
        CsvEdit::AddField(l, token) if n > 0 => lines[l.index(n)].push(token.clone().into_bytes()),
        CsvEdit::Raw(l, f, bytes) if n > 0 => {
            let line = &mut lines[l.index(n)];
            if !line.is_empty() {
                let i = f.index(line.len());
                let at = line[i].len() / 2;
                line[i].splice(at..at, bytes.0.iter().copied());
            }
        }
        CsvEdit::JoinLines(l) if n > 1 => {
            let i = l.index(n - 1);
            let mut next = lines.remove(i + 1);
            let line = &mut lines[i];
            if let (Some(last), false) = (line.last_mut(), next.is_empty()) {
                last.extend(next.remove(0));
            }
            line.extend(next);
        }
        CsvEdit::InsertLine(l, text) => {
            let i = l.index(n + 1);
            lines.insert(i, vec![text.0.clone()]);
        }
        CsvEdit::LongLine(l, len, byte) => {
            let i = l.index(n + 1);
            lines.insert(i, vec![vec![*byte; *len]]);
        }
        _ => {}
    }
}

/// What `load_from` must make of this CSV text, from the documented format: the inputs and
/// labels, or the line the error names (`None`: the file holds no sample).
fn digits_expected(csv: &[u8]) -> Result<(Vec<f32>, Vec<f32>), Option<usize>> {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for (i, raw) in csv.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        if raw.len() > 64 * 1024 {
            return Err(Some(line));
        }
        let text = std::str::from_utf8(raw).map_err(|_| Some(line))?.trim();
        if text.is_empty() {
            continue;
        }
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        if fields.len() != 65 {
            return Err(Some(line));
        }
        for (col, field) in fields.iter().enumerate() {
            let v: f32 = field.parse().map_err(|_| Some(line))?;
            if col < 64 {
                if !(0.0..=16.0).contains(&v) {
                    return Err(Some(line));
                }
                x.push(v / 16.0);
            } else {
                if v.fract() != 0.0 || !(0.0..10.0).contains(&v) {
                    return Err(Some(line));
                }
                y.push(v);
            }
        }
    }
    if y.is_empty() {
        return Err(None);
    }
    Ok((x, y))
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).expect("gzip into memory");
    enc.finish().expect("gzip into memory")
}

#[derive(Debug, Clone)]
enum DigitsInput {
    /// Arbitrary bytes, some after a gzip magic number.
    Raw(Bytes),
    /// Arbitrary bytes, gzip'd.
    GzipOf(Bytes),
    /// A CSV, edited, gzip'd, in two gzip members when split at a byte.
    Csv(Csv, Vec<CsvEdit>, Option<Index>),
    /// A gzip'd CSV (the embedded set when `None`) with its bytes edited.
    Gz(Option<Csv>, Vec<Mutation>),
}

/// Where to split a file into two gzip members, if at all.
fn split() -> impl Strategy<Value = Option<Index>> {
    prop::option::weighted(0.2, any::<Index>())
}

fn digits_input() -> impl Strategy<Value = DigitsInput> {
    let raw = prop_oneof![
        random_bytes(512),
        bytes(0..64).prop_map(|tail| Bytes([&[0x1f, 0x8b, 0x08][..], &tail.0].concat())),
    ];
    prop_oneof![
        2 => raw.prop_map(DigitsInput::Raw),
        1 => random_bytes(512).prop_map(DigitsInput::GzipOf),
        2 => (csv(), split()).prop_map(|(c, s)| DigitsInput::Csv(c, Vec::new(), s)),
        6 => (csv(), vec(csv_edit(), 1..4), split())
            .prop_map(|(c, e, s)| DigitsInput::Csv(c, e, s)),
        3 => (csv(), mutations(4)).prop_map(|(c, m)| DigitsInput::Gz(Some(c), m)),
        1 => mutations(4).prop_map(|m| DigitsInput::Gz(None, m)),
    ]
}

fn load_digits(
    path: &Path,
    bytes: &[u8],
    totals: &Totals,
) -> Result<Outcome<kandle::data::InMemoryDataset>, TestCaseError> {
    write(path, bytes)?;
    let owned = path.to_path_buf();
    let outcome = bounded(move || digits::load_from(owned))?;
    totals.add(&outcome);
    check_allocations(&outcome, bytes.len())?;
    match &outcome.value {
        Err(err) => check_error(err, path, "Data")?,
        Ok(ds) => {
            prop_assert!(!ds.is_empty());
            prop_assert_eq!(ds.sample_shape(), &[1, 8, 8]);
            prop_assert_eq!(ds.input_values().len(), ds.len() * 64);
            prop_assert!(ds.input_values().iter().all(|v| (0.0..=1.0).contains(v)));
            prop_assert!(ds
                .target_values()
                .iter()
                .all(|v| v.fract() == 0.0 && (0.0..10.0).contains(v)));
        }
    }
    Ok(outcome)
}

#[test]
fn fuzz_digits() {
    let dir = temp_dir();
    let path = dir.path().join("case.csv.gz");
    fuzz("digits", digits_input(), |input, totals| match input {
        DigitsInput::Raw(Bytes(bytes)) => {
            load_digits(&path, &bytes, totals)?;
            Ok(())
        }
        DigitsInput::GzipOf(Bytes(text)) => {
            let outcome = load_digits(&path, &gzip(&text), totals)?;
            let expected = digits_expected(&text);
            prop_assert_eq!(
                outcome.value.is_ok(),
                expected.is_ok(),
                "{:?}",
                outcome.value.err()
            );
            Ok(())
        }
        DigitsInput::Csv(csv, edits, split) => {
            let mut lines = csv.lines();
            for e in &edits {
                edit(&mut lines, e);
            }
            let text = csv.render(&lines);
            let gz = match split {
                // Concatenated gzip members are one valid gzip file (`cat a.gz b.gz`).
                Some(at) => {
                    let (a, b) = text.split_at(at.index(text.len() + 1));
                    [gzip(a), gzip(b)].concat()
                }
                None => gzip(&text),
            };
            let outcome = load_digits(&path, &gz, totals)?;
            if edits.is_empty() {
                // A valid file round-trips.
                let ds = outcome
                    .value
                    .map_err(|e| TestCaseError::fail(format!("a valid file fails: {e}")))?;
                let x: Vec<f32> = csv
                    .rows
                    .iter()
                    .flat_map(|(p, _)| p.iter().map(|&v| f32::from(v) / 16.0))
                    .collect();
                let y: Vec<f32> = csv.rows.iter().map(|(_, l)| f32::from(*l)).collect();
                prop_assert_eq!(ds.input_values(), &x[..]);
                prop_assert_eq!(ds.target_values(), &y[..]);
                return Ok(());
            }
            match (&outcome.value, digits_expected(&text)) {
                (Ok(ds), Ok((x, y))) => {
                    prop_assert!(same_values(ds.input_values(), &x), "the inputs differ");
                    prop_assert_eq!(ds.target_values(), &y[..]);
                }
                (Err(err), Err(line)) => {
                    let msg = err.to_string();
                    match line {
                        Some(n) => prop_assert!(
                            msg.contains(&format!("line {n}:"))
                                || msg.contains(&format!("line {n},")),
                            "expected an error naming line {}, got: {}",
                            n,
                            msg
                        ),
                        None => prop_assert!(msg.contains("no sample"), "{}", msg),
                    }
                }
                (Ok(ds), Err(line)) => {
                    return Err(TestCaseError::fail(format!(
                        "loaded {} samples, expected an error at {line:?}",
                        ds.len()
                    )))
                }
                (Err(err), Ok((_, y))) => {
                    return Err(TestCaseError::fail(format!(
                        "expected {} samples, got {err}",
                        y.len()
                    )))
                }
            }
            Ok(())
        }
        DigitsInput::Gz(csv, mutations) => {
            let mut bytes = match &csv {
                Some(csv) => gzip(&csv.render(&csv.lines())),
                None => EMBEDDED.to_vec(),
            };
            for m in &mutations {
                apply(&mut bytes, m);
            }
            load_digits(&path, &bytes, totals)?;
            Ok(())
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Images (`ImageFolder`): one file read through `from_files`, `build` (the header check) and
// `read` (the decode and resize).

/// The formats the fuzzer writes: PNG, BMP and WebP losslessly, GIF and JPEG lossily.
const IMAGE_FORMATS: [&str; 5] = ["png", "bmp", "webp", "gif", "jpg"];

/// Decoding costs more than the other parsers' cases: a tenth as many cases.
const IMAGE_CASE_SHARE: u32 = 10;

/// The largest image the fuzzed `ImageFolder` accepts, in pixels: keeps what a header declares
/// within the allocation bounds.
const IMAGE_MAX_PIXELS: u64 = 1 << 16;

#[derive(Debug, Clone)]
enum ImageInput {
    /// Arbitrary bytes, in a file with the extension of format `.1`.
    Random(Bytes, usize),
    /// A `w × h` image of seeded pixels in format `format`, its bytes then edited.
    Encoded {
        format: usize,
        w: u32,
        h: u32,
        seed: u64,
        mutations: Vec<Mutation>,
    },
}

fn image_input() -> impl Strategy<Value = ImageInput> {
    let format = 0..IMAGE_FORMATS.len();
    prop_oneof![
        1 => (random_bytes(256), format.clone()).prop_map(|(b, f)| ImageInput::Random(b, f)),
        4 => (
            format,
            1u32..9,
            1u32..9,
            any::<u64>(),
            prop_oneof![1 => Just(Vec::new()), 3 => mutations(4)],
        )
            .prop_map(|(format, w, h, seed, mutations)| ImageInput::Encoded {
                format,
                w,
                h,
                seed,
                mutations,
            }),
    ]
}

/// The image of an `Encoded` input: its pixels (HWC, RGB) and its file's bytes. WebP images are
/// one colour (the test writer's only kind).
fn encode_image(format: usize, w: u32, h: u32, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut pixels = noise((w * h * 3) as usize, seed);
    if IMAGE_FORMATS[format] == "webp" {
        let rgb = [pixels[0], pixels[1], pixels[2]];
        pixels = rgb.repeat((w * h) as usize);
        return (pixels, solid_webp(w, h, rgb));
    }
    let output = match IMAGE_FORMATS[format] {
        "png" => image::ImageOutputFormat::Png,
        "bmp" => image::ImageOutputFormat::Bmp,
        "gif" => image::ImageOutputFormat::Gif,
        _ => image::ImageOutputFormat::Jpeg(90),
    };
    let image = image::RgbImage::from_raw(w, h, pixels.clone()).expect("a whole image");
    let mut bytes = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut bytes, output)
        .expect("the image crate encodes it");
    (pixels, bytes.into_inner())
}

/// Builds an `ImageFolder` of the one file `path`, resized to `size` (nearest: the image's own
/// size gives its pixels back), and reads its sample.
fn read_image(path: &Path, size: (usize, usize)) -> kandle::Result<Vec<f32>> {
    let ds = ImageFolder::from_files([(path, 0)])
        .image_size(size.0, size.1)
        .interpolation(Interpolation::Nearest)
        .max_pixels(IMAGE_MAX_PIXELS)
        .build()?;
    let mut x = vec![0.0; 3 * size.0 * size.1];
    ds.read(0, &mut x, &mut [0.0])?;
    Ok(x)
}

#[test]
fn fuzz_image_folder() {
    let dir = temp_dir();
    let cases = (cases() / IMAGE_CASE_SHARE).max(1);
    fuzz_cases("image folder", cases, image_input(), |input, totals| {
        let (format, bytes, size, expected) = match input {
            ImageInput::Random(Bytes(bytes), format) => (format, bytes, (4, 4), None),
            ImageInput::Encoded {
                format,
                w,
                h,
                seed,
                mutations,
            } => {
                let (pixels, mut bytes) = encode_image(format, w, h, seed);
                for m in &mutations {
                    apply(&mut bytes, m);
                }
                let lossless = IMAGE_FORMATS[format] != "gif" && IMAGE_FORMATS[format] != "jpg";
                let expected = (mutations.is_empty() && lossless).then_some(pixels);
                (format, bytes, (h as usize, w as usize), expected)
            }
        };
        let path = dir.path().join(format!("case.{}", IMAGE_FORMATS[format]));
        write(&path, &bytes)?;
        let owned = path.clone();
        let outcome = bounded(move || read_image(&owned, size))?;
        totals.add(&outcome);
        check_allocations(&outcome, bytes.len())?;
        match (&outcome.value, expected) {
            (Err(err), None) => {
                check_error(err, &path, "Data")?;
            }
            (Ok(x), None) => prop_assert!(x.iter().all(|v| (0.0..=255.0).contains(v))),
            (Ok(x), Some(pixels)) => {
                // CHW from HWC.
                let plane = size.0 * size.1;
                let chw: Vec<f32> = (0..3)
                    .flat_map(|c| (0..plane).map(move |i| (c, i)))
                    .map(|(c, i)| f32::from(pixels[i * 3 + c]))
                    .collect();
                prop_assert!(x == &chw, "the pixels differ from the image's");
            }
            (Err(err), Some(_)) => {
                return Err(TestCaseError::fail(format!(
                    "a valid {} file did not load: {err}",
                    IMAGE_FORMATS[format]
                )))
            }
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// Cases the fuzzer found, kept as plain tests.

fn expect_outcome<T>(outcome: Result<Outcome<T>, TestCaseError>) -> Outcome<T> {
    outcome.unwrap_or_else(|e| panic!("{e}"))
}

/// A zero in a shape makes a tensor of no bytes whatever its other dimensions, so the
/// safetensors checks pass; dimensions whose product overflows must be refused (they used to
/// overflow candle's stride computation), while an empty tensor of a sane shape still loads.
#[test]
fn checkpoint_shape_with_a_zero_and_huge_dimensions() {
    let dir = temp_dir();
    let path = dir.path().join("zero.safetensors");
    for (shape, ok) in [
        (format!("[0,2,{}]", u64::MAX), false),
        (format!("[0,{},{}]", 1u64 << 32, 1u64 << 32), false),
        ("[0,3]".to_string(), true),
        (format!("[{},0]", u64::MAX), true),
    ] {
        let header = format!(r#"{{"w":{{"dtype":"F16","shape":{shape},"data_offsets":[0,0]}}}}"#);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        write(&path, &bytes).expect("write");
        let owned = path.clone();
        let outcome = expect_outcome(bounded(move || checkpoint::load(owned)));
        check_allocations(&outcome, bytes.len()).expect("bounded allocations");
        match outcome.value {
            Ok(weights) if ok => assert_eq!(weights["w"].elem_count(), 0, "{shape}"),
            Err(err) if !ok => {
                check_error(&err, &path, "Checkpoint").expect("names the file");
                let msg = err.to_string();
                assert!(msg.contains("`w`") && msg.contains("too large"), "{msg}");
            }
            other => panic!("shape {shape}: {other:?}"),
        }
    }
}

/// The WebP decoder of `image` 0.24 decodes the whole image when it is created: a 36-byte
/// lossless WebP declaring 16384 × 16384 pixels would take a gigabyte before any limit applies.
/// `ImageFolder` reads the size from the header first and refuses it, naming the file.
#[test]
fn image_folder_refuses_a_huge_webp_before_decoding() {
    let dir = temp_dir();
    let path = dir.path().join("huge.webp");
    let bytes = solid_webp(16384, 16384, [1, 2, 3]);
    write(&path, &bytes).expect("write");
    let owned = path.clone();
    let outcome = expect_outcome(bounded(move || read_image(&owned, (2, 2))));
    check_allocations(&outcome, bytes.len()).expect("bounded allocations");
    let err = outcome.value.expect_err("over the pixel limit");
    check_error(&err, &path, "Data").expect("names the file");
    assert!(err.to_string().contains("16384 × 16384"), "{err}");
}

/// A gzip'd file whose text has no line break is refused at the line limit, without being
/// decompressed into memory whole (64 MiB here, from about 300 KiB of gzip).
#[test]
fn digits_line_without_end_is_refused_early() {
    let dir = temp_dir();
    let path = dir.path().join("one-line.csv.gz");
    let gz = gzip(&vec![b'7'; 64 << 20]);
    write(&path, &gz).expect("write");
    let owned = path.clone();
    let outcome = expect_outcome(bounded(move || digits::load_from(owned)));
    check_allocations(&outcome, gz.len()).expect("bounded allocations");
    assert!(outcome.largest < 1 << 20, "{} bytes", outcome.largest);
    let err = outcome.value.expect_err("no line break");
    check_error(&err, &path, "Data").expect("names the file");
    assert!(err.to_string().contains("line 1: longer than"), "{err}");
}

/// A line that is not UTF-8 is named as such, not as a decompression error before it.
#[test]
fn digits_non_utf8_line_is_named() {
    let dir = temp_dir();
    let path = dir.path().join("latin1.csv.gz");
    let good = ["3"; 65].join(",");
    let text = [good.as_bytes(), b"\n3,\xe9", good.as_bytes()].concat();
    write(&path, &gzip(&text)).expect("write");
    let err = digits::load_from(&path).expect_err("not UTF-8");
    check_error(&err, &path, "Data").expect("names the file");
    assert!(err.to_string().contains("line 2: not UTF-8"), "{err}");
}

/// A file of two gzip members holds the rows of both (it used to stop after the first).
#[test]
fn digits_gzip_members_are_all_read() {
    let dir = temp_dir();
    let path = dir.path().join("two-members.csv.gz");
    let row = |label: u8| format!("{},{label}\n", ["5"; 64].join(","));
    let gz = [gzip(row(1).as_bytes()), gzip(b""), gzip(row(2).as_bytes())].concat();
    write(&path, &gz).expect("write");
    let ds = digits::load_from(&path).expect("a valid file");
    assert_eq!(ds.target_values(), &[1.0, 2.0]);
    assert_eq!(ds.input_values()[64], 5.0 / 16.0);
}

// ---------------------------------------------------------------------------------------------
// Training states (`Model::save`): safetensors with a versioned JSON-bearing header.

/// A valid training state: a small model with SGD momentum after one step, saved.
fn training_state_bytes(dir: &Path) -> Vec<u8> {
    use kandle::prelude::*;
    let path = dir.join("valid.state.safetensors");
    let build = || -> kandle::Result<()> {
        let mut model = Sequential::new()
            .input_shape(&[4])
            .add(Dense::new(3))
            .add(Activation::Softmax)
            .compile(
                Sgd::new(0.1).momentum(0.9),
                SparseCategoricalCrossentropy::new(),
                [Accuracy],
                &OneDeviceStrategy::cpu(),
            )?;
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
        let y = Tensor::new(&[0u32, 2], &Device::Cpu)?;
        model.train_on_batch(&x, &y, None)?;
        model.save(&path)
    };
    build().expect("a training state");
    std::fs::read(&path).expect("the saved state")
}

#[test]
fn fuzz_training_state() {
    let dir = temp_dir();
    let valid = training_state_bytes(dir.path());
    let path = dir.path().join("case.state.safetensors");
    let strategy = prop_oneof![
        1 => random_bytes(4096).prop_map(|Bytes(b)| (b, Vec::new())),
        4 => mutations(6).prop_map(|m| (Vec::new(), m)),
    ];
    fuzz_cases(
        "training state",
        cases(),
        strategy,
        |(random, edits), totals| {
            let bytes = if edits.is_empty() {
                random
            } else {
                let mut bytes = valid.clone();
                for m in &edits {
                    apply(&mut bytes, m);
                }
                bytes
            };
            write(&path, &bytes)?;
            let owned = path.clone();
            let outcome = bounded(move || kandle::training_state::TrainingState::load(owned))?;
            totals.add(&outcome);
            check_allocations(&outcome, bytes.len())?;
            if let Err(err) = &outcome.value {
                check_error(err, &path, "Checkpoint")?;
            }
            Ok(())
        },
    );
}
