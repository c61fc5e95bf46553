//! `RandomResizedCrop`: torchvision's augmentation of ImageNet training. In training, each image
//! gives a window of a random area (a fraction of the image's in `scale`, 0.08 to 1 by default)
//! and aspect ratio (log-uniform in `ratio`, 3/4 to 4/3), drawn as torchvision draws it (ten
//! tries, then the central window of the nearest allowed ratio), resized bilinearly to the
//! output size. In inference, the largest central window of the output's aspect ratio, resized.

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::Rng;

use super::image_shape;
use crate::layers::random_stream::RandomStream;
use crate::layers::{BuildContext, Built, FastPath, Layer, LayerSpec};
use crate::Result;

/// Crops a random window of each image and resizes it to `height` x `width`, as torchvision's
/// `RandomResizedCrop` (bilinear, without antialiasing); in inference, the largest central
/// window of the output's aspect ratio, resized.
///
/// ```
/// use kandle::layers::{RandomResizedCrop, Sequential};
///
/// let crop = RandomResizedCrop::new(224, 224).scale(0.25, 1.0);
/// let summary = Sequential::new().add(crop).summary(&[3, 256, 320])?;
/// assert_eq!(summary.rows[0].output_shape, [3, 224, 224]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomResizedCrop {
    height: usize,
    width: usize,
    scale: (f64, f64),
    ratio: (f64, f64),
}

impl RandomResizedCrop {
    /// Outputs of `height` x `width`, with torchvision's defaults: scale (0.08, 1), ratio
    /// (3/4, 4/3).
    pub fn new(height: usize, width: usize) -> Self {
        Self {
            height,
            width,
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        }
    }

    /// The window's area as a fraction of the image's, drawn uniformly in `[low, high]`.
    pub fn scale(mut self, low: f64, high: f64) -> Self {
        self.scale = (low, high);
        self
    }

    /// The window's aspect ratio (width over height), drawn log-uniformly in `[low, high]`.
    pub fn ratio(mut self, low: f64, high: f64) -> Self {
        self.ratio = (low, high);
        self
    }
}

impl LayerSpec for RandomResizedCrop {
    fn kind(&self) -> &'static str {
        "random_resized_crop"
    }

    fn class_name(&self) -> &'static str {
        "RandomResizedCrop"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let (c, h, w) = image_shape(ctx, input_shape)?;
        let (s0, s1) = self.scale;
        let (r0, r1) = self.ratio;
        let valid = self.height > 0
            && self.width > 0
            && s0 > 0.0
            && s0 <= s1
            && s1.is_finite()
            && r0 > 0.0
            && r0 <= r1
            && r1.is_finite();
        if !valid {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: RandomResizedCrop needs a positive output size, 0 < scale low <= \
                 high and 0 < ratio low <= high; got output {}x{}, scale {:?}, ratio {:?}",
                ctx.path(),
                self.height,
                self.width,
                self.scale,
                self.ratio
            )));
        }
        let layer = ResizedCropLayer {
            spec: *self,
            input: (h, w),
            stream: RandomStream::new(ctx)?,
        };
        Ok(Built::fast(
            layer,
            vec![c, self.height, self.width],
            Vec::new(),
        ))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

/// A window of an image: top, left, height, width.
type Window = (usize, usize, usize, usize);

struct ResizedCropLayer {
    spec: RandomResizedCrop,
    input: (usize, usize),
    stream: RandomStream,
}

impl ResizedCropLayer {
    /// torchvision's `RandomResizedCrop.get_params`: up to ten draws of an area and a ratio
    /// whose window fits, then the central window of the nearest allowed ratio.
    fn draw(&self, rng: &mut StdRng) -> Window {
        let (height, width) = self.input;
        let area = (height * width) as f64;
        let (s0, s1) = self.spec.scale;
        let (l0, l1) = (self.spec.ratio.0.ln(), self.spec.ratio.1.ln());
        for _ in 0..10 {
            let target = area * uniform(rng, s0, s1);
            let ratio = uniform(rng, l0, l1).exp();
            let w = (target * ratio).sqrt().round() as usize;
            let h = (target / ratio).sqrt().round() as usize;
            if (1..=width).contains(&w) && (1..=height).contains(&h) {
                let top = rng.random_range(0..=height - h);
                let left = rng.random_range(0..=width - w);
                return (top, left, h, w);
            }
        }
        let in_ratio = width as f64 / height as f64;
        let (h, w) = if in_ratio < self.spec.ratio.0 {
            ((width as f64 / self.spec.ratio.0).round() as usize, width)
        } else if in_ratio > self.spec.ratio.1 {
            (height, (height as f64 * self.spec.ratio.1).round() as usize)
        } else {
            (height, width)
        };
        central(self.input, (h.clamp(1, height), w.clamp(1, width)))
    }

    /// The largest central window of the output's aspect ratio: what inference resizes.
    fn inference_window(&self) -> Window {
        let (height, width) = self.input;
        let (oh, ow) = (self.spec.height as f64, self.spec.width as f64);
        let scale = (height as f64 / oh).min(width as f64 / ow);
        let h = ((oh * scale).round() as usize).clamp(1, height);
        let w = ((ow * scale).round() as usize).clamp(1, width);
        central(self.input, (h, w))
    }

    fn crop_all(&self, x: &Tensor, mut window: impl FnMut() -> Window) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let values = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let (oh, ow) = (self.spec.height, self.spec.width);
        let mut out = vec![0f32; b * c * oh * ow];
        let size = c * h * w;
        for (image, resized) in values
            .chunks_exact(size)
            .zip(out.chunks_exact_mut(c * oh * ow))
        {
            resize_window(image, (c, h, w), window(), (oh, ow), resized);
        }
        Ok(Tensor::from_vec(out, (b, c, oh, ow), &Device::Cpu)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?)
    }
}

/// A uniform draw in `[low, high)`, or `low` when the range is empty.
fn uniform(rng: &mut StdRng, low: f64, high: f64) -> f64 {
    if high > low {
        rng.random_range(low..high)
    } else {
        low
    }
}

/// The window of `size` centred in an image of `input`, rounded down as torchvision does.
fn central((height, width): (usize, usize), (h, w): (usize, usize)) -> Window {
    ((height - h) / 2, (width - w) / 2, h, w)
}

/// Resizes `window` of `image` (`(c, h, w)` values) bilinearly to `out_size` into `out`, with
/// the pixel centres aligned as PyTorch's `align_corners=False`.
fn resize_window(
    image: &[f32],
    (c, h, w): (usize, usize, usize),
    (top, left, wh, ww): Window,
    (oh, ow): (usize, usize),
    out: &mut [f32],
) {
    // The source coordinate of each output row or column, as two neighbours and a weight.
    let axis = |out_len: usize, len: usize, start: usize| -> Vec<(usize, usize, f32)> {
        let step = len as f64 / out_len as f64;
        (0..out_len)
            .map(|i| {
                let s = ((i as f64 + 0.5) * step - 0.5).max(0.0);
                let i0 = (s.floor() as usize).min(len - 1);
                let i1 = (i0 + 1).min(len - 1);
                (start + i0, start + i1, (s - i0 as f64) as f32)
            })
            .collect()
    };
    let rows = axis(oh, wh, top);
    let cols = axis(ow, ww, left);
    for ch in 0..c {
        let plane = &image[ch * h * w..(ch + 1) * h * w];
        let target = &mut out[ch * oh * ow..(ch + 1) * oh * ow];
        for (i, &(y0, y1, fy)) in rows.iter().enumerate() {
            for (j, &(x0, x1, fx)) in cols.iter().enumerate() {
                let top = plane[y0 * w + x0] * (1.0 - fx) + plane[y0 * w + x1] * fx;
                let bottom = plane[y1 * w + x0] * (1.0 - fx) + plane[y1 * w + x1] * fx;
                target[i * ow + j] = top * (1.0 - fy) + bottom * fy;
            }
        }
    }
}

impl Layer for ResizedCropLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if !train {
            let window = self.inference_window();
            return self.crop_all(x, || window);
        }
        let mut rng = self.stream.next()?;
        self.crop_all(x, || self.draw(&mut rng))
    }
}

impl FastPath for ResizedCropLayer {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over many draws on a 60x80 image every window fits, its area and ratio stay in range
    /// (up to the rounding of its sides), and areas spread over the range.
    #[test]
    fn windows_follow_torchvision_s_draw() -> Result<()> {
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        let layer = ResizedCropLayer {
            spec: RandomResizedCrop::new(8, 8),
            input: (60, 80),
            stream: RandomStream::new(&mut ctx)?,
        };
        let mut rng = layer.stream.next()?;
        let (mut small, mut large) = (0, 0);
        for _ in 0..2000 {
            let (top, left, h, w) = layer.draw(&mut rng);
            assert!(top + h <= 60 && left + w <= 80, "{top} {left} {h} {w}");
            let fraction = (h * w) as f64 / 4800.0;
            let ratio = w as f64 / h as f64;
            assert!((0.07..=1.0).contains(&fraction), "area {fraction}");
            assert!((0.7..=1.45).contains(&ratio), "ratio {ratio}");
            small += usize::from(fraction < 0.3);
            large += usize::from(fraction > 0.7);
        }
        assert!(small > 300 && large > 100, "{small} small, {large} large");
        Ok(())
    }

    /// Resizing a window to its own size copies it; halving averages neighbouring pairs.
    #[test]
    fn resizing_copies_or_averages() {
        let image: Vec<f32> = (0..24).map(|v| v as f32).collect(); // (1, 4, 6)
        let mut same = vec![0f32; 6];
        resize_window(&image, (1, 4, 6), (1, 2, 2, 3), (2, 3), &mut same);
        assert_eq!(same, [8.0, 9.0, 10.0, 14.0, 15.0, 16.0]);
        let mut half = vec![0f32; 6];
        resize_window(&image, (1, 4, 6), (0, 0, 4, 6), (2, 3), &mut half);
        // Output (0, 0) is centred between rows 0-1 and columns 0-1.
        assert_eq!(half, [3.5, 5.5, 7.5, 15.5, 17.5, 19.5]);
    }
}
