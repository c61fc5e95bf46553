//! `PlotHistory` and [`plot_history`]: training curves drawn to a PNG with plotters.
//!
//! The picture has the title on top and panels side by side: loss (`loss`, `val_loss`), then
//! one per metric (by default `accuracy` and `val_accuracy`; any log key with
//! [`PlotHistory::metrics`]) against the epoch, numbered from 1. A metric the history does not
//! have gets no panel. NaN and infinite values are left out of the
//! lines. Text uses the DejaVu Sans font bundled in the crate, so drawing works on a headless
//! machine with no system fonts. The file is written atomically: drawn to a hidden temporary
//! file in the same directory, then renamed over the target.

mod draw;

use std::path::{Path, PathBuf};

use super::{Callback, CallbackState, FitInfo, History, Logs};
use crate::{Error, Model, Result};

/// Draws `history`'s loss and accuracy curves to the PNG `path`, under `title`.
///
/// The loss panel is always drawn; the accuracy panel only if the history has `accuracy` or
/// `val_accuracy`. Missing directories are created. Fails with [`Error::Plot`] if drawing or
/// writing fails.
///
/// ```no_run
/// # fn demo(history: &kandle::callbacks::History) -> kandle::Result<()> {
/// kandle::callbacks::plot_history(history, "runs/history.png", "MiniGoogLeNet on CIFAR-10")?;
/// # Ok(())
/// # }
/// ```
pub fn plot_history(history: &History, path: impl AsRef<Path>, title: &str) -> Result<()> {
    plot_metrics(history, path.as_ref(), title, &["accuracy".to_string()])
}

/// [`plot_history`] with a panel for each of `metrics` (log keys, drawn with their `val_`
/// twins) after the loss.
fn plot_metrics(history: &History, path: &Path, title: &str, metrics: &[String]) -> Result<()> {
    let plot_err = |reason: String| Error::Plot {
        path: path.to_path_buf(),
        reason,
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| plot_err("not a file path".into()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create directory", &dir, e))?;
    let tmp = dir.join(format!(".{}.tmp.png", file_name.to_string_lossy()));

    let drawn = draw::render(history, &tmp, title, metrics);
    let result = drawn.and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(plot_err)
}

/// Registers the DejaVu Sans font bundled with kandle as plotters' `sans-serif` family (once
/// per process) and returns that family name, so that other pictures drawn with plotters 0.3
/// render their text on a machine without system fonts, as the training curves do.
///
/// ```
/// let family = kandle::callbacks::plot_font()?;
/// let style = plotters::style::TextStyle::from((family, 16));
/// # let _ = style;
/// # Ok::<(), kandle::Error>(())
/// ```
pub fn plot_font() -> Result<&'static str> {
    draw::register_font().map_err(|reason| Error::Plot {
        path: PathBuf::from("assets/fonts/DejaVuSans.ttf"),
        reason,
    })?;
    Ok(draw::FONT)
}

/// Redraws the training curves to a PNG after every epoch, so an interrupted run still leaves
/// a picture. Runs on the chief worker only.
///
/// ```no_run
/// use kandle::callbacks::PlotHistory;
///
/// let plot = PlotHistory::new("runs/history.png").title("MiniGoogLeNet on CIFAR-10");
/// ```
#[derive(Debug, Clone)]
pub struct PlotHistory {
    path: PathBuf,
    title: String,
    metrics: Vec<String>,
    history: History,
}

impl PlotHistory {
    /// Draws to the PNG `path`, titled "Training history".
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            title: "Training history".into(),
            metrics: vec!["accuracy".into()],
            history: History::new(),
        }
    }

    /// The title drawn above the panels.
    pub fn title(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// The metrics drawn after the loss, one panel each with its `val_` twin (default
    /// `["accuracy"]`), e.g. `.metrics(["accuracy", "macro_f1"])`.
    pub fn metrics<S: Into<String>>(mut self, metrics: impl IntoIterator<Item = S>) -> Self {
        self.metrics = metrics.into_iter().map(Into::into).collect();
        self
    }

    /// The file drawn.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Callback for PlotHistory {
    fn on_train_begin(&mut self, _info: &FitInfo, _model: &mut Model) -> Result<()> {
        self.history = History::new();
        Ok(())
    }

    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        self.history.on_epoch_end(epoch, logs, model)?;
        plot_metrics(&self.history, &self.path, &self.title, &self.metrics)
    }

    /// The epochs drawn so far, so that a resumed run draws the whole run.
    fn state(&self) -> Option<CallbackState> {
        self.history.state()
    }

    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        self.history.load_state(state)
    }

    fn chief_only(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::draw::{HEIGHT, PANEL_WIDTH};
    use super::*;
    use crate::callbacks::test_support::{fit_info, logs, tiny_model};

    fn fake_history(epochs: usize, accuracy: bool) -> History {
        let mut h = History::new();
        for e in 0..epochs {
            let t = e as f64;
            let mut l = logs(&[
                ("loss", 2.0 / (t + 1.0)),
                ("val_loss", 2.2 / (t + 1.0) + 0.1),
            ]);
            if accuracy {
                l.set("accuracy", 0.5 + 0.08 * t);
                l.set("val_accuracy", 0.45 + 0.07 * t);
            }
            l.set("lr", 0.01);
            h.epochs.push(e);
            h.logs.push(l);
        }
        h
    }

    /// Copies a drawn picture into `$KANDLE_KEEP_PLOTS` (if set), to look at it.
    fn keep(path: &Path, name: &str) {
        if let Some(dir) = std::env::var_os("KANDLE_KEEP_PLOTS") {
            let _ = std::fs::copy(path, Path::new(&dir).join(name));
        }
    }

    /// Decodes the PNG; returns its size and the share of non-white pixels in each half.
    fn inspect(path: &Path) -> (u32, u32, f64, f64) {
        let bytes = std::fs::read(path).unwrap_or_default();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let (w, h) = (be(&bytes[16..20]), be(&bytes[20..24]));
        let img = image::load_from_memory(&bytes)
            .map(|i| i.to_rgb8())
            .unwrap_or_default();
        assert_eq!((img.width(), img.height()), (w, h));
        let share = |x0: u32, x1: u32| {
            let mut ink = 0usize;
            for x in x0..x1 {
                for y in 0..h {
                    if img.get_pixel(x, y).0 != [255, 255, 255] {
                        ink += 1;
                    }
                }
            }
            ink as f64 / ((x1 - x0) * h) as f64
        };
        (w, h, share(0, w / 2), share(w / 2, w))
    }

    #[test]
    fn draws_both_panels() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let path = dir.path().join("plots/history.png");
        plot_history(&fake_history(5, true), &path, "MiniGoogLeNet on CIFAR-10")?;
        let (w, h, left, right) = inspect(&path);
        assert_eq!((w, h), (2 * PANEL_WIDTH, HEIGHT));
        assert!(left > 0.01 && right > 0.01, "ink: {left} {right}");
        assert!(left < 0.5 && right < 0.5, "mostly white: {left} {right}");
        let names: Vec<_> = std::fs::read_dir(dir.path().join("plots"))
            .map_err(|e| Error::io("read_dir", dir.path(), e))?
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        assert_eq!(names, ["history.png"], "no temporary file remains");
        keep(&path, "both_panels.png");
        Ok(())
    }

    #[test]
    fn loss_only_nan_and_single_epoch() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let path = dir.path().join("loss.png");
        let mut h = fake_history(4, false);
        h.logs[1].set("loss", f64::NAN);
        h.logs[2].set("val_loss", f64::INFINITY);
        plot_history(&h, &path, "loss only")?;
        let (w, h_px, left, right) = inspect(&path);
        assert_eq!((w, h_px), (PANEL_WIDTH, HEIGHT));
        assert!(left > 0.01 && right > 0.01);
        keep(&path, "loss_only_with_gaps.png");

        plot_history(&fake_history(1, true), &path, "one epoch")?;
        keep(&path, "one_epoch.png");
        plot_history(&History::new(), &path, "nothing yet")?;
        keep(&path, "empty.png");
        let mut all_nan = History::new();
        all_nan.epochs.push(0);
        all_nan.logs.push(logs(&[("loss", f64::NAN)]));
        plot_history(&all_nan, &path, "all NaN")?;
        Ok(())
    }

    #[test]
    fn bad_path_is_a_plot_error() {
        let err = plot_history(&fake_history(2, true), "/", "t");
        assert!(matches!(err, Err(Error::Plot { .. })), "{err:?}");
    }

    #[test]
    fn callback_redraws_each_epoch() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let path = dir.path().join("cb.png");
        let mut model = tiny_model()?;
        let mut plot = PlotHistory::new(&path).title("callback");
        assert!(plot.chief_only());
        plot.on_train_begin(&fit_info(2), &mut model)?;
        plot.on_epoch_end(0, &logs(&[("loss", 1.0), ("accuracy", 0.5)]), &mut model)?;
        assert!(path.is_file());
        let first = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
        plot.on_epoch_end(1, &logs(&[("loss", 0.5), ("accuracy", 0.7)]), &mut model)?;
        let second = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
        assert_ne!(first, second);
        Ok(())
    }
}
