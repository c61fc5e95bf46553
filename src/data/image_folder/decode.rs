//! Decoding a file into a sample: the `image` crate's reader with its format told by the
//! content and its allocations bounded, the header and size checks, a decoder's panic turned
//! into an error naming the file, and the decoded image as `(channels, height, width)` planes,
//! cropped and resized.

use std::io::BufReader;
use std::path::Path;

use super::resize::{crop_window, resize_plane};
use super::{ColorMode, Interpolation};
use crate::{Error, Result};

/// How a file becomes a sample.
#[derive(Debug, Clone, Copy)]
pub(super) struct Decode {
    pub(super) color_mode: ColorMode,
    pub(super) interpolation: Interpolation,
    pub(super) crop_to_aspect_ratio: bool,
    pub(super) size: (usize, usize),
    pub(super) max_pixels: u64,
}

impl Decode {
    fn bad(path: &Path, reason: impl Into<String>) -> Error {
        Error::Data {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// An image reader for `path` with its format guessed from the content and the decoder's
    /// allocations bounded.
    fn reader(&self, path: &Path) -> Result<image::io::Reader<BufReader<std::fs::File>>> {
        let mut reader = image::io::Reader::open(path)
            .map_err(|e| Error::io("cannot read the image", path, e))?
            .with_guessed_format()
            .map_err(|e| Error::io("cannot read the image", path, e))?;
        if reader.format().is_none() {
            return Err(Self::bad(
                path,
                "not an image in a known format (JPEG, PNG, BMP, GIF or WebP)",
            ));
        }
        if reader.format() == Some(image::ImageFormat::WebP) {
            // The WebP decoder decodes the whole image when it is created, before any limit
            // applies: check the size its header declares first.
            if let Some((w, h)) = webp_dimensions(path)? {
                self.check_size(path, w, h)?;
            }
        }
        let mut limits = image::io::Limits::default();
        // Eight bytes a pixel covers RGBA at 16 bits, the largest decoded layout.
        limits.max_alloc = Some(self.max_pixels.saturating_mul(8).max(1 << 20));
        reader.limits(limits);
        Ok(reader)
    }

    /// Reads the header of `path`: its width and height, checked against the limit.
    pub(super) fn check_header(&self, path: &Path) -> Result<(u32, u32)> {
        let reader = self.reader(path)?;
        let (w, h) = catch_decoder_panic(path, || reader.into_dimensions())?
            .map_err(|e| Self::bad(path, format!("cannot read the image header: {e}")))?;
        self.check_size(path, w, h)?;
        Ok((w, h))
    }

    fn check_size(&self, path: &Path, w: u32, h: u32) -> Result<()> {
        if w == 0 || h == 0 {
            return Err(Self::bad(path, format!("the image is empty: {w} × {h}")));
        }
        if u64::from(w) * u64::from(h) > self.max_pixels {
            return Err(Self::bad(
                path,
                format!(
                    "the image is {w} × {h}, more than the limit of {} pixels (see \
                     `max_pixels`)",
                    self.max_pixels
                ),
            ));
        }
        Ok(())
    }

    /// Decodes `path` and turns it into a sample: `(channels, height, width)`, cropped and
    /// resized.
    pub(super) fn sample(&self, path: &Path) -> Result<Vec<f32>> {
        let reader = self.reader(path)?;
        let image = catch_decoder_panic(path, || reader.decode())?
            .map_err(|e| Self::bad(path, format!("cannot decode the image: {e}")))?;
        let (w, h) = (image.width(), image.height());
        self.check_size(path, w, h)?;
        let rgb = image.into_rgb8();
        let (w, h) = (w as usize, h as usize);
        let pixels = rgb.as_raw();
        let channels = self.color_mode.channels();
        // One plane per channel, 8-bit values as f32, at the source size.
        let mut planes = vec![0f32; channels * h * w];
        match self.color_mode {
            ColorMode::Rgb => {
                for (i, px) in pixels.chunks_exact(3).enumerate() {
                    for (c, &v) in px.iter().enumerate() {
                        planes[c * h * w + i] = f32::from(v);
                    }
                }
            }
            ColorMode::Grayscale => {
                for (out, px) in planes.iter_mut().zip(pixels.chunks_exact(3)) {
                    let [r, g, b] = [px[0], px[1], px[2]].map(f32::from);
                    *out = (0.299 * r + 0.587 * g + 0.114 * b).round().min(255.0);
                }
            }
        }
        let window = if self.crop_to_aspect_ratio {
            crop_window(h, w, self.size)
        } else {
            (0, 0, h, w)
        };
        let (th, tw) = self.size;
        let mut out = vec![0f32; channels * th * tw];
        for (src, dst) in planes
            .chunks_exact(h * w)
            .zip(out.chunks_exact_mut(th * tw))
        {
            resize_plane(src, w, window, dst, self.size, self.interpolation);
        }
        Ok(out)
    }
}

/// The width and height a WebP file's header declares (simple lossy, lossless or extended
/// format), or `None` when the header is not one of those; the decoder then reports it.
fn webp_dimensions(path: &Path) -> Result<Option<(u32, u32)>> {
    use std::io::Read;
    let mut header = [0u8; 30];
    let file =
        std::fs::File::open(path).map_err(|e| Error::io("cannot read the image", path, e))?;
    let mut len = 0;
    let mut reader = file.take(header.len() as u64);
    loop {
        match reader.read(&mut header[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("cannot read the image", path, e)),
        }
    }
    let header = &header[..len];
    let le = |at: usize, n: usize| -> Option<u32> {
        let bytes = header.get(at..at + n)?;
        Some(bytes.iter().rev().fold(0, |v, &b| (v << 8) | u32::from(b)))
    };
    Ok(match header.get(12..16) {
        // Lossy: a 14-bit width and height after the frame tag and start code.
        Some(b"VP8 ") => le(26, 2)
            .zip(le(28, 2))
            .map(|(w, h)| (w & 0x3fff, h & 0x3fff)),
        // Lossless: the signature byte, then 14 bits of width - 1 and of height - 1.
        Some(b"VP8L") => le(21, 4).map(|v| ((v & 0x3fff) + 1, ((v >> 14) & 0x3fff) + 1)),
        // Extended: 24 bits of canvas width - 1 and of height - 1.
        Some(b"VP8X") => le(24, 3).zip(le(27, 3)).map(|(w, h)| (w + 1, h + 1)),
        _ => None,
    })
}

/// Runs a decoder call, turning a panic inside the decoder into an error naming the file.
fn catch_decoder_panic<T>(path: &Path, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        Decode::bad(
            path,
            format!(
                "the image decoder failed on this file: {}",
                crate::error::panic_message(payload.as_ref())
            ),
        )
    })
}
