//! `Timeline`: a window of training steps as a Chrome trace, as Horovod's timeline: per step
//! and per thread (the fit loop, each replica), the input wait, forward and backward passes,
//! the reduction, the optimizer update, callbacks and backup writes (see [`crate::timeline`]).

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::{Callback, FitInfo, Logs};
use crate::timeline;
use crate::{Model, Result};

/// Records global steps `steps` (counted from 0 over the whole run: epoch × steps per epoch +
/// step) and writes them to a Chrome trace event file when the window has passed or training
/// ends, atomically. Open it in Perfetto (<https://ui.perfetto.dev>) or `chrome://tracing`.
///
/// Each worker of a multi-process job writes its own file, `path` with `.rank<R>` before the
/// extension for workers other than the chief, its events under its rank as the process id,
/// so the files concatenate into one trace. Only a window is kept, so an hours-long run
/// writes kilobytes.
///
/// ```no_run
/// use kandle::callbacks::Timeline;
/// use kandle::FitOptions;
///
/// let options = FitOptions {
///     callbacks: vec![Box::new(Timeline::new("timeline.json").steps(100..120))],
///     ..Default::default()
/// };
/// ```
pub struct Timeline {
    path: PathBuf,
    steps: Range<usize>,
    rank: usize,
    written: bool,
}

impl Timeline {
    /// Writes to `path`, recording steps 10 to 19 by default (after the first steps' warm-up).
    pub fn new(path: impl AsRef<Path>) -> Self {
        Self {
            path: path.as_ref().to_path_buf(),
            steps: 10..20,
            rank: 0,
            written: false,
        }
    }

    /// The global steps to record.
    pub fn steps(mut self, steps: Range<usize>) -> Self {
        self.steps = steps;
        self
    }

    /// The file this process writes.
    pub fn path(&self) -> PathBuf {
        if self.rank == 0 {
            return self.path.clone();
        }
        let stem = self
            .path
            .file_stem()
            .map_or_else(|| "timeline".into(), |s| s.to_string_lossy().into_owned());
        let name = match self.path.extension() {
            Some(ext) => format!("{stem}.rank{}.{}", self.rank, ext.to_string_lossy()),
            None => format!("{stem}.rank{}", self.rank),
        };
        self.path.with_file_name(name)
    }

    fn write(&mut self) -> Result<()> {
        if self.written {
            return Ok(());
        }
        self.written = true;
        let Some(timeline::Recorded { spans, lanes }) = timeline::finish() else {
            return Ok(());
        };
        let pid = self.rank;
        let mut events: Vec<serde_json::Value> = vec![json!({
            "name": "process_name", "ph": "M", "pid": pid,
            "args": { "name": format!("worker {pid}") },
        })];
        for (lane, name) in lanes {
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": pid, "tid": lane,
                "args": { "name": name },
            }));
        }
        for s in spans {
            events.push(json!({
                "name": s.name, "cat": "kandle", "ph": "X", "pid": pid, "tid": s.lane,
                "ts": s.start_us, "dur": s.duration_us, "args": { "step": s.step },
            }));
        }
        let text = serde_json::to_vec(&json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
        }))
        .map_err(|e| crate::Error::invalid(format!("timeline: {e}")))?;
        crate::checkpoint::write_atomically(&self.path(), &text)
    }
}

impl Callback for Timeline {
    fn on_train_begin(&mut self, _info: &FitInfo, model: &mut Model) -> Result<()> {
        self.rank = model.worker().rank;
        self.written = false;
        timeline::start(self.steps.clone());
        Ok(())
    }

    fn on_train_batch_begin(&mut self, _batch: usize, _model: &mut Model) -> Result<()> {
        if timeline::window_passed(timeline::current_step()) {
            self.write()?;
        }
        Ok(())
    }

    fn on_train_end(&mut self, _logs: &Logs, _model: &mut Model) -> Result<()> {
        self.write()
    }
}
