//! `CsvLogger`: streams each epoch's logs to a CSV file, as Keras's `CSVLogger` does.
//!
//! The header is `epoch,` followed by the first epoch's log keys in their log order (`loss`,
//! the metrics, `val_*`, `lr`). Each epoch appends one row and flushes it to disk, so a run that
//! crashes keeps every finished epoch. Epochs are counted from 0, as in Keras; values are written
//! with full precision (the shortest text that reads back as the same `f64`, e.g. `0.001` or `1e-5`), a key missing
//! from an epoch's logs as `NA`.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use super::{state_usize, Callback, CallbackState, FitInfo, Logs};
use crate::{Error, Model, Result};

/// Writes one CSV row per epoch. Runs on the chief worker only.
///
/// ```no_run
/// use kandle::callbacks::CsvLogger;
/// use kandle::FitOptions;
///
/// let options = FitOptions {
///     epochs: 10,
///     callbacks: vec![Box::new(CsvLogger::new("runs/training.csv").append(true))],
///     ..Default::default()
/// };
/// ```
#[derive(Debug)]
pub struct CsvLogger {
    path: PathBuf,
    append: bool,
    file: Option<File>,
    keys: Option<Vec<String>>,
    /// Whether `on_train_begin` ran: the file is opened with the first row, not before.
    begun: bool,
    /// Epoch rows written to the file, counting those of the run this one resumes.
    rows: usize,
    /// Set when resuming from a backup: the file keeps its header and this many rows (any row
    /// written after the backup is dropped), and rows are appended after them.
    resume_rows: Option<usize>,
}

impl CsvLogger {
    /// Logs to `path`, replacing any file there when training begins.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            append: false,
            file: None,
            keys: None,
            begun: false,
            rows: 0,
            resume_rows: None,
        }
    }

    /// With `true`, appends to an existing file instead of replacing it (to resume training),
    /// keeping its columns and writing no second header.
    pub fn append(mut self, append: bool) -> Self {
        self.append = append;
        self
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The columns of an existing file's header, without `epoch`; `None` for an empty file.
    fn existing_keys(&self) -> Result<Option<Vec<String>>> {
        let file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("cannot read CSV log", &self.path, e)),
        };
        let mut header = String::new();
        BufReader::new(file)
            .read_line(&mut header)
            .map_err(|e| Error::io("cannot read CSV log", &self.path, e))?;
        let header = header.trim_end_matches(['\n', '\r']);
        if header.is_empty() {
            return Ok(None);
        }
        Ok(Some(
            header
                .split(',')
                .skip(1)
                .map(str::to_string)
                .collect::<Vec<_>>(),
        ))
    }

    fn write(&mut self, text: &str) -> Result<()> {
        let Some(file) = self.file.as_mut() else {
            return Err(Error::NotReady(format!(
                "CSV log `{}` is not open: on_train_begin was not called",
                self.path.display()
            )));
        };
        file.write_all(text.as_bytes())
            .and_then(|()| file.flush())
            .and_then(|()| file.sync_data())
            .map_err(|e| Error::io("cannot write CSV log", &self.path, e))
    }
}

impl CsvLogger {
    /// Opens the file for the first row of this `fit`: replaced, appended to, or (resuming from
    /// a backup) cut back to its header and the rows the backup had seen, then appended to.
    fn open(&mut self) -> Result<()> {
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io("cannot create directory", dir, e))?;
        }
        if let Some(rows) = self.resume_rows {
            self.keep_rows(rows)?;
        }
        let append = self.append || self.resume_rows.is_some();
        self.keys = if append { self.existing_keys()? } else { None };
        let mut options = OpenOptions::new();
        if append {
            options.append(true).create(true);
        } else {
            options.write(true).create(true).truncate(true);
        }
        let file = options
            .open(&self.path)
            .map_err(|e| Error::io("cannot open CSV log", &self.path, e))?;
        self.file = Some(file);
        Ok(())
    }

    /// Cuts the file after its header and `rows` rows.
    fn keep_rows(&self, rows: usize) -> Result<()> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io("cannot read CSV log", &self.path, e)),
        };
        let keep: usize = text
            .split_inclusive('\n')
            .take(rows + 1)
            .map(str::len)
            .sum();
        if keep < text.len() {
            crate::checkpoint::write_atomically(&self.path, &text.as_bytes()[..keep])?;
        }
        Ok(())
    }
}

impl Callback for CsvLogger {
    fn on_train_begin(&mut self, _info: &FitInfo, _model: &mut Model) -> Result<()> {
        // The file opens with the first row, after a resume has said which rows to keep.
        self.file = None;
        self.keys = None;
        self.begun = true;
        self.rows = 0;
        self.resume_rows = None;
        Ok(())
    }

    /// The number of rows written, so that a resumed run keeps exactly those.
    fn state(&self) -> Option<CallbackState> {
        Some(serde_json::json!({ "rows": self.rows }))
    }

    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        let rows = state_usize(state, "CsvLogger", "rows")?;
        self.rows = rows;
        self.resume_rows = Some(rows);
        Ok(())
    }

    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, _model: &mut Model) -> Result<()> {
        if self.file.is_none() && self.begun {
            self.open()?;
        }
        let mut text = String::new();
        let keys = match &self.keys {
            Some(keys) => keys.clone(),
            None => {
                let keys: Vec<String> = logs.keys().map(str::to_string).collect();
                text.push_str(&header_line(&keys));
                self.keys = Some(keys.clone());
                keys
            }
        };
        text.push_str(&row_line(epoch, &keys, logs));
        self.write(&text)?;
        self.rows += 1;
        Ok(())
    }

    fn on_train_end(&mut self, _logs: &Logs, _model: &mut Model) -> Result<()> {
        self.file = None;
        self.begun = false;
        Ok(())
    }

    fn chief_only(&self) -> bool {
        true
    }
}

fn header_line(keys: &[String]) -> String {
    let mut line = String::from("epoch");
    for k in keys {
        line.push(',');
        line.push_str(k);
    }
    line.push('\n');
    line
}

fn row_line(epoch: usize, keys: &[String], logs: &Logs) -> String {
    let mut line = epoch.to_string();
    for k in keys {
        line.push(',');
        match logs.get(k) {
            // `{:?}` prints the shortest text that parses back to the same f64, in scientific
            // notation for very small or large values (`1e-5`, not `0.00001`).
            Some(v) => line.push_str(&format!("{v:?}")),
            None => line.push_str("NA"),
        }
    }
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callbacks::test_support::{fit_info, logs, tiny_model};

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_default()
    }

    #[test]
    fn a_resumed_logger_keeps_the_rows_of_its_backup_and_writes_each_epoch_once() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let path = dir.path().join("log.csv");
        let mut model = tiny_model()?;
        let mut first = CsvLogger::new(&path);
        first.on_train_begin(&fit_info(4), &mut model)?;
        first.on_epoch_end(0, &logs(&[("loss", 0.5)]), &mut model)?;
        first.on_epoch_end(1, &logs(&[("loss", 0.4)]), &mut model)?;
        // The backup is taken here; the run writes one more row, then dies.
        let state = first.state().ok_or_else(|| Error::invalid("no state"))?;
        first.on_epoch_end(2, &logs(&[("loss", 0.3)]), &mut model)?;
        drop(first);

        let mut resumed = CsvLogger::new(&path);
        resumed.on_train_begin(&fit_info(4), &mut model)?;
        resumed.load_state(&state)?;
        resumed.on_epoch_end(2, &logs(&[("loss", 0.31)]), &mut model)?;
        resumed.on_epoch_end(3, &logs(&[("loss", 0.2)]), &mut model)?;
        resumed.on_train_end(&Logs::new(), &mut model)?;
        assert_eq!(read(&path), "epoch,loss\n0,0.5\n1,0.4\n2,0.31\n3,0.2\n");
        assert!(resumed.load_state(&serde_json::json!({})).is_err());
        Ok(())
    }

    #[test]
    fn writes_header_and_one_flushed_row_per_epoch() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let path = dir.path().join("sub/log.csv");
        let mut model = tiny_model()?;
        let mut csv = CsvLogger::new(&path);
        assert!(csv.chief_only());
        csv.on_train_begin(&fit_info(3), &mut model)?;
        let third = 1.0 / 3.0;
        csv.on_epoch_end(
            0,
            &logs(&[("loss", third), ("accuracy", 0.5), ("lr", 1e-3)]),
            &mut model,
        )?;
        // Flushed before training ends: a crash now loses nothing.
        assert_eq!(
            read(&path),
            "epoch,loss,accuracy,lr\n0,0.3333333333333333,0.5,0.001\n"
        );
        csv.on_epoch_end(
            1,
            &logs(&[("loss", f64::NAN), ("lr", 1e-4), ("extra", 1.0)]),
            &mut model,
        )?;
        csv.on_train_end(&Logs::new(), &mut model)?;
        let text = read(&path);
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[2], "1,NaN,NA,0.0001");
        let back: f64 = rows[1]
            .split(',')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_default();
        assert_eq!(back, third, "full precision round-trips");

        // A new run without append replaces the file.
        let mut csv = CsvLogger::new(&path);
        csv.on_train_begin(&fit_info(1), &mut model)?;
        csv.on_epoch_end(0, &logs(&[("loss", 2.0)]), &mut model)?;
        assert_eq!(read(&path), "epoch,loss\n0,2.0\n");
        Ok(())
    }

    #[test]
    fn append_resumes_with_the_existing_columns() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let path = dir.path().join("log.csv");
        let mut model = tiny_model()?;
        let mut csv = CsvLogger::new(&path).append(true);
        csv.on_train_begin(&fit_info(1), &mut model)?;
        csv.on_epoch_end(0, &logs(&[("loss", 1.5), ("lr", 0.1)]), &mut model)?;
        csv.on_train_end(&Logs::new(), &mut model)?;

        let mut resumed = CsvLogger::new(&path).append(true);
        resumed.on_train_begin(&fit_info(2), &mut model)?;
        resumed.on_epoch_end(1, &logs(&[("lr", 0.01), ("loss", 1.25)]), &mut model)?;
        resumed.on_train_end(&Logs::new(), &mut model)?;
        assert_eq!(read(&path), "epoch,loss,lr\n0,1.5,0.1\n1,1.25,0.01\n");
        Ok(())
    }

    #[test]
    fn writing_before_train_begin_is_an_error() -> Result<()> {
        let mut model = tiny_model()?;
        let mut csv = CsvLogger::new("never-written.csv");
        let err = csv.on_epoch_end(0, &logs(&[("loss", 1.0)]), &mut model);
        assert!(matches!(err, Err(Error::NotReady(_))));
        Ok(())
    }
}
