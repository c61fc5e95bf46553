//! Downloading and unpacking a dataset archive (cargo feature `download`): an HTTPS download in
//! pure Rust (`ureq` with rustls; no system OpenSSL), streamed to a temporary file while its MD5
//! is computed, then a `.tar.gz` unpacked into a temporary directory. Files only reach their
//! final place by a rename after every check has passed, so an interrupted or corrupt download
//! never leaves a partial dataset behind.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use md5::{Digest, Md5};

use crate::{Error, Result};

/// A file or directory removed (if it exists) when dropped.
#[derive(Debug)]
pub(crate) struct TempPath {
    path: PathBuf,
}

impl TempPath {
    /// A hidden temporary name in `dir` that no other process picks: `.{stem}.{pid}.{n}`.
    pub(crate) fn new_in(dir: &Path, stem: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            path: dir.join(format!(".{stem}.{}.{n}", std::process::id())),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        // Best effort: it may never have been created.
        let _ = std::fs::remove_dir_all(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Downloads `url` into the file `dest` (created or truncated), checking that the bytes have
/// the MD5 digest `md5_hex`. On any error `dest` may hold part of the data: pass a temporary
/// path. Errors name the URL and say what failed (connection, HTTP status, a read, the digest).
pub(crate) fn fetch_verified(url: &str, md5_hex: &str, dest: &Path) -> Result<u64> {
    let failed = |reason: String| Error::Data {
        path: url.into(),
        reason,
    };
    let agent = ureq::Agent::config_builder()
        .timeout_resolve(Some(Duration::from_secs(30)))
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .timeout_per_read(Some(Duration::from_secs(60)))
        .build()
        .new_agent();
    let response = agent
        .get(url)
        .call()
        .map_err(|e| failed(format!("cannot download {url}: {e}")))?;
    let mut body = response.into_body().into_reader();
    let file = File::create(dest).map_err(|e| Error::io("cannot create", dest, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut hasher = Md5::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(failed(format!(
                    "the download of {url} broke off after {total} bytes: {e}"
                )))
            }
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| Error::io("cannot write", dest, e))?;
        total += n as u64;
    }
    let file = out
        .into_inner()
        .map_err(|e| Error::io("cannot write", dest, e.into_error()))?;
    file.sync_all()
        .map_err(|e| Error::io("cannot write", dest, e))?;
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if !digest.eq_ignore_ascii_case(md5_hex) {
        return Err(failed(format!(
            "the {total} bytes downloaded from {url} have MD5 {digest}, not the expected \
             {md5_hex} (corrupt or incomplete download, or the file changed on the server)"
        )));
    }
    Ok(total)
}

/// Unpacks the gzip'd tar `archive` into the directory `into` (created). `tar` refuses
/// entries that would land outside `into`.
pub(crate) fn unpack_tar_gz(archive: &Path, into: &Path) -> Result<()> {
    let file = File::open(archive).map_err(|e| Error::io("cannot open", archive, e))?;
    std::fs::create_dir_all(into).map_err(|e| Error::io("cannot create", into, e))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)));
    tar.unpack(into).map_err(|e| Error::Data {
        path: archive.to_path_buf(),
        reason: format!("cannot unpack the archive: {e}"),
    })
}
