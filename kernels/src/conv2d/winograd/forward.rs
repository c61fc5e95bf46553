//! The correlation of a group of images through Winograd's transforms, a block of tiles at a
//! time: the block's input tiles transformed, thirty-six products (in the micro-kernel, or in
//! the `gemm` crate), and the products transformed back into the outputs with the bias and the
//! ReLU. The forward pass runs it with the layer's kernel, the unit-stride input gradient with
//! the flipped, transposed one.

use super::blocks::element_stride;
use super::kernel::Kernel;
use super::transforms::Transform;
use super::{grow, Buffers, Winograd, ELEMENTS};
use crate::conv2d::epilogue::Epilogue;
use crate::conv2d::gemm::{matmul, Parallelism, Product, View, ViewMut};
use crate::conv2d::microkernel::{self, NR};
use crate::output::ImagesMut;

impl Winograd {
    /// `out = correlate(x) + bias`, then the ReLU if any, for a group of whole images, the
    /// bias and the ReLU the `epilogue`'s (its scale is the kernel's already): `x` holds the
    /// images back to back (`plan.input_len()` each) and `out` their outputs
    /// (`plan.output_len()` each).
    pub(crate) fn correlate(
        &self,
        x: &[f32],
        epilogue: Epilogue<'_>,
        out: &mut ImagesMut<'_>,
        buffers: &mut Buffers,
        parallelism: Parallelism,
    ) -> candle_core::Result<()> {
        let plan = &self.plan;
        let (in_len, out_len) = (plan.input_len(), plan.output_len());
        let images = out.count();
        if x.len() != images * in_len || out.each().any(|image| image.len() != out_len) {
            candle_core::bail!(
                "winograd: {} input values and {} output images do not hold whole images of \
                 {in_len} and {out_len}",
                x.len(),
                images,
            );
        }
        self.pad(x, images, &mut buffers.padded);
        for range in self.blocks(images) {
            self.correlate_block(range, epilogue, out, buffers, parallelism)?;
        }
        Ok(())
    }

    /// Tiles `range` of a group (numbered row-major through its images): transformed from the
    /// padded images, multiplied, and transformed back into `out`.
    fn correlate_block(
        &self,
        range: std::ops::Range<usize>,
        epilogue: Epilogue<'_>,
        out: &mut ImagesMut<'_>,
        buffers: &mut Buffers,
        parallelism: Parallelism,
    ) -> candle_core::Result<()> {
        let (c, o) = (self.plan.c, self.plan.o);
        let width = range.len().next_multiple_of(NR);
        let Buffers {
            padded,
            input,
            products,
            tiles,
            ..
        } = buffers;
        self.block_tiles(range, width, tiles);
        let (v_stride, m_stride) = (element_stride(c * width), element_stride(o * width));
        let v = grow(input, ELEMENTS * v_stride);
        let job = Transform::Inputs { padded, v };
        self.transform(job, tiles, width);
        let m = grow(products, ELEMENTS * m_stride);
        for e in 0..ELEMENTS {
            let (ve, me) = (&v[e * v_stride..][..c * width], &mut m[e * m_stride..]);
            // The micro-kernel runs on this thread: a product split over the pool goes to gemm.
            match (&self.kernel, parallelism) {
                (Kernel::Packed(u), Parallelism::None) => microkernel::product(
                    u.panels(e),
                    View {
                        data: ve,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                    width,
                    ViewMut {
                        data: me,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                    microkernel::Write {
                        start: microkernel::Start::Zero,
                        relu: false,
                    },
                )?,
                _ => matmul(
                    Product {
                        m: o,
                        n: width,
                        k: c,
                        accumulate: false,
                        parallelism,
                    },
                    ViewMut {
                        data: me,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                    View {
                        data: self.plain_kernel(),
                        offset: e * o * c,
                        rs: c,
                        cs: 1,
                    },
                    View {
                        data: ve,
                        offset: 0,
                        rs: width,
                        cs: 1,
                    },
                )?,
            }
        }
        let job = Transform::Outputs {
            m,
            bias: epilogue.bias,
            relu: epilogue.relu,
            out: out.all(),
        };
        self.transform(job, tiles, width);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv2d::plan::Plan;

    /// The direct correlation of one image, for reference.
    /// The direct correlation of `x` and `w`, summed in `f64`, with each output's sum of
    /// `|x * w|` (what bounds the rounding error of any order of summing in `f32`).
    fn direct(plan: &Plan, x: &[f32], w: &[f32]) -> Vec<(f64, f64)> {
        let mut out = vec![(0f64, 0f64); plan.output_len()];
        for o in 0..plan.o {
            for i in 0..plan.ho {
                for j in 0..plan.wo {
                    let (mut sum, mut magnitude) = (0f64, 0f64);
                    for c in 0..plan.c {
                        for ky in 0..3 {
                            for kx in 0..3 {
                                let r = (i + ky) as isize - plan.top;
                                let s = (j + kx) as isize - plan.left;
                                if r < 0 || s < 0 || r >= plan.h as isize || s >= plan.w as isize {
                                    continue;
                                }
                                let xv = x[(c * plan.h + r as usize) * plan.w + s as usize];
                                let term = f64::from(xv)
                                    * f64::from(w[((o * plan.c + c) * 3 + ky) * 3 + kx]);
                                sum += term;
                                magnitude += term.abs();
                            }
                        }
                    }
                    out[(o * plan.ho + i) * plan.wo + j] = (sum, magnitude);
                }
            }
        }
        out
    }

    /// How many `f32` epsilons of an output's sum of `|x * w|` Winograd's F(4x4, 3x3) may be
    /// off by, against a float64 reference. Its transforms scale terms up and back down, so its
    /// error is several times a direct sum's: measured at most 16.5 (AVX-512 and AVX2) and 16.8
    /// (baseline) on a Zen 4 over the cases below; a wrong tap or index is off by thousands.
    const WINOGRAD_EPSILONS: f64 = 64.0;

    #[test]
    fn matches_direct_correlation() -> candle_core::Result<()> {
        // Odd and even sizes, `same` and `valid` padding, long rows, blocks across images
        // (7x7), several blocks per image (32x32), products in the micro-kernel and in `gemm`.
        let cases = [
            (15, 15, 1, 3, 64),
            (18, 17, 0, 2, 64),
            (5, 140, 1, 1, 64),
            (16, 16, 1, 2, 64),
            (7, 7, 1, 5, 40),
            (32, 32, 1, 1, 16),
        ];
        let mut largest = 0f64;
        for ((h, w, pad, images, c), packed) in cases
            .into_iter()
            .flat_map(|case| [(case, true), (case, false)])
        {
            let plan = Plan {
                c,
                h,
                w,
                o: 65,
                kh: 3,
                kw: 3,
                sh: 1,
                sw: 1,
                top: pad,
                left: pad,
                ho: h + 2 * pad as usize - 2,
                wo: w + 2 * pad as usize - 2,
            };
            let value = |i: usize| ((i * 7919 % 199) as f32 - 99.0) / 99.0;
            let x: Vec<f32> = (0..images * plan.input_len()).map(value).collect();
            let wt: Vec<f32> = (0..plan.o * plan.c * 9)
                .map(|i| value(i * 31 + 5))
                .collect();
            let bias: Vec<f32> = (0..plan.o).map(|i| i as f32 * 0.25).collect();
            let tap = |o, c, ky, kx| wt[((o * plan.c + c) * 3 + ky) * 3 + kx];
            let wino = Winograd::with_products(&plan, tap, packed)
                .ok_or_else(|| candle_core::Error::Msg("not lowered".into()))?;
            let mut out = vec![f32::NAN; images * plan.output_len()];
            let mut buffers = Buffers::default();
            let mut images_out = ImagesMut::new(out.chunks_mut(plan.output_len()).collect());
            let epilogue = Epilogue {
                bias: Some(&bias),
                ..Default::default()
            };
            wino.correlate(
                &x,
                epilogue,
                &mut images_out,
                &mut buffers,
                Parallelism::None,
            )?;
            for (i, got) in out.chunks_exact(plan.output_len()).enumerate() {
                let want = direct(&plan, &x[i * plan.input_len()..][..plan.input_len()], &wt);
                for (k, (&g, &(w, magnitude))) in got.iter().zip(&want).enumerate() {
                    let b = f64::from(bias[k / (plan.ho * plan.wo)]);
                    let (w, magnitude) = (w + b, magnitude + b.abs());
                    let epsilons = (f64::from(g) - w).abs() / (f64::from(f32::EPSILON) * magnitude);
                    largest = largest.max(epsilons);
                    assert!(
                        epsilons <= WINOGRAD_EPSILONS,
                        "{plan:?} (packed: {packed}) image {i} at {k}: {g} vs {w}, \
                         {epsilons:.1} epsilons of {magnitude}"
                    );
                }
            }
        }
        eprintln!("Winograd against float64: at most {largest:.2} epsilons of the sum of |x * w|");
        Ok(())
    }
}
