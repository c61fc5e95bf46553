//! Where a training step's time goes: spans of named phases (input wait, forward, backward,
//! the reduction, the optimizer update, callbacks, backups) recorded per thread while a window
//! of steps runs, for the [`Timeline`](crate::callbacks::Timeline) callback to write as a
//! Chrome trace (the JSON that Perfetto and `chrome://tracing` open), as Horovod's timeline.
//!
//! Recording is off unless a `Timeline` callback switches it on for its window: a [`span`]
//! then costs one relaxed atomic load. Strategies record their own phases with [`span`] (the
//! reduction is theirs); the thread that records names its lane, so each replica thread has
//! its own row. On a GPU the spans time what the host waits for, not the kernels themselves.

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SpanRecord {
    /// The phase.
    pub(crate) name: &'static str,
    /// Start, in microseconds since the recording began.
    pub(crate) start_us: f64,
    /// Duration in microseconds.
    pub(crate) duration_us: f64,
    /// The thread's lane.
    pub(crate) lane: u32,
    /// The global step (counted from 0 over the whole run) it belongs to.
    pub(crate) step: usize,
}

/// Whether spans are recorded now (a step of the window is running).
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The global step running, for the spans of every thread.
static STEP: AtomicUsize = AtomicUsize::new(0);
/// The next lane number.
static NEXT_LANE: AtomicU32 = AtomicU32::new(0);

thread_local! {
    static LANE: Cell<Option<u32>> = const { Cell::new(None) };
}

/// What the recording holds: the window, the clock's origin, the spans and the lanes' names.
struct Recording {
    window: Range<usize>,
    origin: Instant,
    spans: Vec<SpanRecord>,
    lanes: Vec<(u32, String)>,
}

fn recording() -> &'static Mutex<Option<Recording>> {
    static RECORDING: OnceLock<Mutex<Option<Recording>>> = OnceLock::new();
    RECORDING.get_or_init(|| Mutex::new(None))
}

fn with_recording<T>(f: impl FnOnce(&mut Option<Recording>) -> T) -> T {
    let mut guard = recording().lock().unwrap_or_else(|e| e.into_inner());
    f(&mut guard)
}

/// Starts recording the global steps of `window` (spans of other steps are not kept).
pub(crate) fn start(window: Range<usize>) {
    with_recording(|r| {
        *r = Some(Recording {
            window,
            origin: Instant::now(),
            spans: Vec::new(),
            lanes: Vec::new(),
        })
    });
    ACTIVE.store(false, Ordering::SeqCst);
}

/// What a finished recording holds: its spans, and each lane's number and thread name.
pub(crate) struct Recorded {
    pub(crate) spans: Vec<SpanRecord>,
    pub(crate) lanes: Vec<(u32, String)>,
}

/// Ends the recording and returns what it holds.
pub(crate) fn finish() -> Option<Recorded> {
    ACTIVE.store(false, Ordering::SeqCst);
    with_recording(|r| {
        r.take().map(|r| Recorded {
            spans: r.spans,
            lanes: r.lanes,
        })
    })
}

/// Whether a recording's window has passed `step`.
pub(crate) fn window_passed(step: usize) -> bool {
    with_recording(|r| r.as_ref().is_some_and(|r| step >= r.window.end))
}

/// The global step running (the last one marked by [`step`]).
pub(crate) fn current_step() -> usize {
    STEP.load(Ordering::SeqCst)
}

/// Marks global step `step` as running (recording its spans when it is in the window) and
/// returns its span, which covers the whole step.
pub(crate) fn step(step: usize) -> Span {
    let inside = with_recording(|r| r.as_ref().is_some_and(|r| r.window.contains(&step)));
    STEP.store(step, Ordering::SeqCst);
    ACTIVE.store(inside, Ordering::SeqCst);
    span("step")
}

/// A span of the phase `name`, recorded from now until it is dropped, when a timeline is
/// recording this step; otherwise nothing.
///
/// ```
/// let _reduce = kandle::timeline::span("all-reduce");
/// // ... the reduction ...
/// ```
pub fn span(name: &'static str) -> Span {
    match ACTIVE.load(Ordering::Relaxed) {
        true => Span {
            open: Some((name, Instant::now(), STEP.load(Ordering::Relaxed))),
        },
        false => Span { open: None },
    }
}

/// A phase being timed; recorded when dropped.
#[must_use = "a span records the time until it is dropped"]
pub struct Span {
    open: Option<(&'static str, Instant, usize)>,
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some((name, start, step)) = self.open.take() else {
            return;
        };
        let end = Instant::now();
        let lane = lane();
        with_recording(|r| {
            if let Some(r) = r.as_mut() {
                if !r.lanes.iter().any(|(l, _)| *l == lane) {
                    let thread = std::thread::current();
                    let name = thread.name().unwrap_or("thread").to_string();
                    r.lanes.push((lane, name));
                }
                let micros = |t: Instant| t.saturating_duration_since(r.origin).as_secs_f64() * 1e6;
                r.spans.push(SpanRecord {
                    name,
                    start_us: micros(start),
                    duration_us: (end - start).as_secs_f64() * 1e6,
                    lane,
                    step,
                });
            }
        });
    }
}

/// This thread's lane: numbered in the order threads first record.
fn lane() -> u32 {
    LANE.with(|l| match l.get() {
        Some(n) => n,
        None => {
            let n = NEXT_LANE.fetch_add(1, Ordering::Relaxed);
            l.set(Some(n));
            n
        }
    })
}
