//! Random affine augmentations: `RandomRotation` and `RandomZoom`, as Keras's. In training each
//! image is resampled (bilinear) through its own random map about its centre; points that fall
//! outside the image take the [`FillMode`]. In inference, the identity. The output is new
//! values, not a function of the input that candle's autograd follows: these layers belong at
//! the model's input, where no gradient is needed.

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::Rng;

use super::image_shape;
use crate::layers::random_stream::RandomStream;
use crate::layers::{BuildContext, Built, FastPath, Layer, LayerSpec};
use crate::Result;

/// What a point outside the image takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FillMode {
    /// The image mirrored about its edge (Keras's default, `reflect`).
    Reflect,
    /// The nearest edge pixel.
    Nearest,
    /// A constant.
    Constant(f32),
}

/// Turns each image by an angle drawn uniformly from `[-factor, factor]` of a full turn, as
/// Keras's `RandomRotation(factor)`.
///
/// ```
/// use kandle::layers::{FillMode, RandomRotation, Sequential};
///
/// let net = Sequential::new().add(RandomRotation::new(0.1).fill_mode(FillMode::Constant(0.0)));
/// assert_eq!(net.summary(&[3, 8, 8])?.rows[0].output_shape, [3, 8, 8]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomRotation {
    factor: f64,
    fill: FillMode,
}

impl RandomRotation {
    /// Angles of up to `factor` of a full turn either way (`0.1`: up to 36 degrees).
    pub fn new(factor: f64) -> Self {
        Self {
            factor,
            fill: FillMode::Reflect,
        }
    }

    /// What points outside the image take (default [`FillMode::Reflect`]).
    pub fn fill_mode(mut self, fill: FillMode) -> Self {
        self.fill = fill;
        self
    }
}

/// Zooms each image by a factor drawn uniformly from `[1 + lower, 1 + upper]`: negative
/// values zoom in, positive ones out, as Keras's `RandomZoom(height_factor)` (the same factor
/// on both axes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomZoom {
    lower: f64,
    upper: f64,
    fill: FillMode,
}

impl RandomZoom {
    /// Zooms of `1 + lower` to `1 + upper` (`-0.2, 0.2`: up to 20% in or out).
    pub fn new(lower: f64, upper: f64) -> Self {
        Self {
            lower,
            upper,
            fill: FillMode::Reflect,
        }
    }

    /// What points outside the image take (default [`FillMode::Reflect`]).
    pub fn fill_mode(mut self, fill: FillMode) -> Self {
        self.fill = fill;
        self
    }
}

/// How an affine layer draws each image's map: `[a, b, c, d]`, the output point `p` (about the
/// centre) sampling the input at `[[a, b], [c, d]] p`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Draw {
    Rotation { factor: f64 },
    Zoom { lower: f64, upper: f64 },
}

impl Draw {
    fn map(self, rng: &mut StdRng) -> [f64; 4] {
        match self {
            Draw::Rotation { factor } => {
                let angle = rng.random_range(-factor..=factor) * std::f64::consts::TAU;
                let (sin, cos) = angle.sin_cos();
                // The inverse rotation: the output point turned back onto the input.
                [cos, sin, -sin, cos]
            }
            Draw::Zoom { lower, upper } => {
                let zoom = 1.0 + rng.random_range(lower..=upper);
                [zoom, 0.0, 0.0, zoom]
            }
        }
    }
}

fn build_affine(
    ctx: &mut BuildContext,
    input_shape: &[usize],
    draw: Draw,
    fill: FillMode,
    valid: bool,
    what: &str,
) -> Result<Built> {
    image_shape(ctx, input_shape)?;
    if !valid {
        return Err(crate::Error::invalid(format!(
            "layer `{}`: {what}",
            ctx.path()
        )));
    }
    let layer = AffineLayer {
        draw,
        fill,
        stream: RandomStream::new(ctx)?,
    };
    Ok(Built::fast(layer, input_shape.to_vec(), Vec::new()))
}

impl LayerSpec for RandomRotation {
    fn kind(&self) -> &'static str {
        "random_rotation"
    }

    fn class_name(&self) -> &'static str {
        "RandomRotation"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let valid = (0.0..=0.5).contains(&self.factor);
        let what = format!(
            "the factor must be in [0, 0.5] of a turn, got {}",
            self.factor
        );
        let draw = Draw::Rotation {
            factor: self.factor,
        };
        build_affine(ctx, input_shape, draw, self.fill, valid, &what)
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

impl LayerSpec for RandomZoom {
    fn kind(&self) -> &'static str {
        "random_zoom"
    }

    fn class_name(&self) -> &'static str {
        "RandomZoom"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let valid = self.lower > -1.0 && self.lower <= self.upper && self.upper.is_finite();
        let what = format!(
            "zoom factors must satisfy -1 < lower <= upper, got {} and {}",
            self.lower, self.upper
        );
        let draw = Draw::Zoom {
            lower: self.lower,
            upper: self.upper,
        };
        build_affine(ctx, input_shape, draw, self.fill, valid, &what)
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

struct AffineLayer {
    draw: Draw,
    fill: FillMode,
    stream: RandomStream,
}

/// The index `i` of an axis of `len` points, or `None` where it falls outside and the fill is
/// a constant.
fn inside(i: i64, len: usize, fill: FillMode) -> Option<usize> {
    let n = len as i64;
    match fill {
        FillMode::Constant(_) => (0..n).contains(&i).then_some(i as usize),
        FillMode::Nearest => Some(i.clamp(0, n - 1) as usize),
        FillMode::Reflect => {
            // Mirrored about the edges (`d c b a | a b c d | d c b a`), period 2n.
            let period = 2 * n;
            let m = i.rem_euclid(period);
            Some(if m < n { m } else { period - 1 - m } as usize)
        }
    }
}

impl AffineLayer {
    /// `image`, `(channels, h, w)` values, sampled through `map` into `out`.
    fn warp(
        &self,
        image: &[f32],
        (c, h, w): (usize, usize, usize),
        map: [f64; 4],
        out: &mut [f32],
    ) {
        let (cy, cx) = ((h as f64 - 1.0) / 2.0, (w as f64 - 1.0) / 2.0);
        let constant = match self.fill {
            FillMode::Constant(v) => v,
            _ => 0.0,
        };
        for i in 0..h {
            for j in 0..w {
                let (py, px) = (i as f64 - cy, j as f64 - cx);
                let sy = map[0] * py + map[1] * px + cy;
                let sx = map[2] * py + map[3] * px + cx;
                let (y0, x0) = (sy.floor(), sx.floor());
                let (fy, fx) = ((sy - y0) as f32, (sx - x0) as f32);
                let corners = [
                    (y0 as i64, x0 as i64, (1.0 - fy) * (1.0 - fx)),
                    (y0 as i64, x0 as i64 + 1, (1.0 - fy) * fx),
                    (y0 as i64 + 1, x0 as i64, fy * (1.0 - fx)),
                    (y0 as i64 + 1, x0 as i64 + 1, fy * fx),
                ];
                for ch in 0..c {
                    let plane = &image[ch * h * w..(ch + 1) * h * w];
                    let value: f32 = corners
                        .iter()
                        .map(|&(y, x, weight)| {
                            let v = match (inside(y, h, self.fill), inside(x, w, self.fill)) {
                                (Some(y), Some(x)) => plane[y * w + x],
                                _ => constant,
                            };
                            v * weight
                        })
                        .sum();
                    out[ch * h * w + i * w + j] = value;
                }
            }
        }
    }
}

impl Layer for AffineLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if !train {
            return Ok(x.clone());
        }
        let (b, c, h, w) = x.dims4()?;
        let values = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut rng = self.stream.next()?;
        let mut out = vec![0f32; values.len()];
        let size = c * h * w;
        for (image, warped) in values.chunks_exact(size).zip(out.chunks_exact_mut(size)) {
            self.warp(image, (c, h, w), self.draw.map(&mut rng), warped);
        }
        Ok(Tensor::from_vec(out, (b, c, h, w), &Device::Cpu)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?)
    }
}

impl FastPath for AffineLayer {}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(fill: FillMode) -> Result<AffineLayer> {
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        Ok(AffineLayer {
            draw: Draw::Zoom {
                lower: 0.0,
                upper: 0.0,
            },
            fill,
            stream: RandomStream::new(&mut ctx)?,
        })
    }

    #[test]
    fn reflect_and_nearest_indices() {
        let reflect: Vec<Option<usize>> =
            (-3..7).map(|i| inside(i, 4, FillMode::Reflect)).collect();
        let want = [2, 1, 0, 0, 1, 2, 3, 3, 2, 1].map(Some);
        assert_eq!(reflect, want);
        assert_eq!(inside(-1, 4, FillMode::Nearest), Some(0));
        assert_eq!(inside(9, 4, FillMode::Nearest), Some(3));
        assert_eq!(inside(4, 4, FillMode::Constant(0.0)), None);
    }

    /// A quarter turn of a square image moves every pixel exactly (the samples fall on
    /// pixels), and the identity map gives the image back.
    #[test]
    fn a_quarter_turn_and_the_identity_are_exact() -> Result<()> {
        let image: Vec<f32> = (0..9).map(|v| v as f32).collect();
        let mut out = vec![0f32; 9];
        let affine = layer(FillMode::Constant(-1.0))?;
        affine.warp(&image, (1, 3, 3), [1.0, 0.0, 0.0, 1.0], &mut out);
        assert_eq!(out, image);
        let (sin, cos) = std::f64::consts::FRAC_PI_2.sin_cos();
        affine.warp(&image, (1, 3, 3), [cos, sin, -sin, cos], &mut out);
        // Output (i, j) samples input (j, 2 - i): the image turned a quarter.
        let turned: Vec<f32> = (0..3)
            .flat_map(|i| (0..3).map(move |j| (j * 3 + (2 - i)) as f32))
            .collect();
        for (a, b) in out.iter().zip(&turned) {
            assert!((a - b).abs() < 1e-5, "{out:?} against {turned:?}");
        }
        Ok(())
    }

    /// Zoomed out by half, a 4x4 image fills its centre and the constant fills the rest.
    #[test]
    fn zooming_out_fills_the_border() -> Result<()> {
        let image = vec![1f32; 16];
        let mut out = vec![0f32; 16];
        layer(FillMode::Constant(0.0))?.warp(&image, (1, 4, 4), [2.0, 0.0, 0.0, 2.0], &mut out);
        assert_eq!(out[0], 0.0, "a corner samples outside");
        assert!((out[5] - 1.0).abs() < 1e-6, "the centre samples inside");
        let mut mirrored = vec![0f32; 16];
        layer(FillMode::Reflect)?.warp(&image, (1, 4, 4), [2.0, 0.0, 0.0, 2.0], &mut mirrored);
        assert!(
            mirrored.iter().all(|v| (v - 1.0).abs() < 1e-6),
            "reflected ones"
        );
        Ok(())
    }
}
