//! The kernel gradient through Winograd's transforms: the transformed kernel's gradient,
//! `dU[e]^T = V[e] dM[e]^T`, summed over a group's blocks (in the micro-kernel, with `dM`
//! written as its strips, or in the `gemm` crate), then transformed back to the 3x3 taps,
//! `dg = Gt dU G`.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::blocks::{element_stride, MAX_BLOCK};
use super::kernel::Kernel;
use super::transforms::Transform;
use super::{gradient_strips, grow, Buffers, Winograd, ELEMENTS, SIDE};
use crate::conv2d::gemm::{matmul, Parallelism, Product, View, ViewMut};
use crate::conv2d::microkernel::{self, Panels, Strips, NR};
use crate::conv2d::plan::Plan;
use crate::conv2d::transpose::transpose;
use crate::SimdLevel;

/// Input channels [`Winograd::kernel_grad`] transforms back at once.
const KERNEL_GRAD_LANES: usize = 16;

impl Winograd {
    /// The lowering of `plan` for its kernel gradient ([`Self::accumulate_kernel_grad`]),
    /// which needs no kernel, or `None` when it does not suit.
    pub(crate) fn for_kernel_grad(plan: &Plan) -> Option<Self> {
        Self::suits(plan).then(|| Self {
            plan: *plan,
            kernel: Kernel::None,
            unpacked: OnceLock::new(),
            // The products add into the whole transformed kernel's gradient once per block:
            // the widest blocks make the fewest passes over it.
            block: MAX_BLOCK,
        })
    }

    /// Adds the gradient of the transformed kernel, `dU[e]^T (c x o) = sum over tiles of
    /// V[e] * dM[e]^T` with `dM = A dY At`, for a group of images to `acc` (`[c][e][o]`,
    /// [`Self::kernel_grad_len`] values): `x` holds the group's inputs and `dy` their output
    /// gradients. Unless `started`, the group starts the sum: `acc` takes its length (zeroed
    /// only where it grows) and the first block's products overwrite its values instead of
    /// adding to them, so a buffer kept between calls is not zeroed again.
    /// [`Self::kernel_grad`] turns the sum into the kernel's gradient.
    ///
    /// With the micro-kernel (and the group on one thread), `dM` is made with output channels
    /// in the lanes, as its strips (`gradient_strips`), and `V` read in place; otherwise both
    /// are made as for the forward pass and multiplied in the `gemm` crate.
    pub(crate) fn accumulate_kernel_grad(
        &self,
        x: &[f32],
        dy: &[f32],
        (acc, started): (&mut Vec<f32>, bool),
        buffers: &mut Buffers,
        parallelism: Parallelism,
    ) -> candle_core::Result<()> {
        let plan = &self.plan;
        let (c, o) = (plan.c, plan.o);
        let (in_len, out_len) = (plan.input_len(), plan.output_len());
        let images = dy.len() / out_len.max(1);
        if x.len() != images * in_len
            || dy.len() != images * out_len
            || (started && acc.len() != self.kernel_grad_len())
        {
            candle_core::bail!(
                "winograd: {} input and {} gradient values do not hold whole images of {in_len} \
                 and {out_len}, or {} values of a started sum are not {}",
                x.len(),
                dy.len(),
                acc.len(),
                self.kernel_grad_len()
            );
        }
        let in_strips = matches!(parallelism, Parallelism::None) && microkernel::supported();
        let nr = microkernel::block_columns(SimdLevel::in_use());
        self.pad(x, images, &mut buffers.padded);
        if in_strips {
            let positions = plan.ho * plan.wo;
            let dyt = grow(&mut buffers.padded_gradient, dy.len());
            for (src, dst) in dy.chunks_exact(out_len).zip(dyt.chunks_exact_mut(out_len)) {
                transpose(src, o, positions, dst);
            }
        } else {
            self.pad_gradient(dy, images, &mut buffers.padded_gradient);
        }
        if acc.len() < self.kernel_grad_len() {
            acc.resize(self.kernel_grad_len(), 0.0);
        }
        acc.truncate(self.kernel_grad_len());
        let mut started = started;
        for range in self.blocks(images) {
            let width = range.len().next_multiple_of(NR);
            let Buffers {
                padded,
                padded_gradient,
                input,
                products,
                tiles,
            } = &mut *buffers;
            self.block_tiles(range, width, tiles);
            let v_stride = element_stride(c * width);
            let v = grow(input, ELEMENTS * v_stride);
            self.transform(Transform::Inputs { padded, v }, tiles, width);
            let m_stride = if in_strips {
                let stride = element_stride(o.next_multiple_of(nr) * width);
                let dm = grow(products, ELEMENTS * stride);
                let shape = (plan.ho, plan.wo, o);
                gradient_strips::write(padded_gradient, shape, tiles, (nr, dm, stride));
                stride
            } else {
                let stride = element_stride(o * width);
                let dm = grow(products, ELEMENTS * stride);
                let job = Transform::Gradients {
                    padded: padded_gradient,
                    dm,
                };
                self.transform(job, tiles, width);
                stride
            };
            let (v, dm) = (&*v, &products[..ELEMENTS * m_stride]);
            for e in 0..ELEMENTS {
                // dU[e]^T (c x o), each input channel's row beside its other elements':
                // `[c][e][o]`.
                let du = ViewMut {
                    data: acc,
                    offset: e * o,
                    rs: ELEMENTS * o,
                    cs: 1,
                };
                let ve = View {
                    data: v,
                    offset: e * v_stride,
                    rs: width,
                    cs: 1,
                };
                if in_strips {
                    let strips = Strips {
                        data: dm,
                        offset: e * m_stride,
                        stride: width * nr,
                        nr,
                    };
                    let write = microkernel::Write {
                        start: if started {
                            microkernel::Start::Dst
                        } else {
                            microkernel::Start::Zero
                        },
                        relu: false,
                    };
                    let lhs = Panels::in_place(ve, c, width);
                    microkernel::product(lhs, strips, o, du, write)?;
                } else {
                    let product = Product {
                        m: c,
                        n: o,
                        k: width,
                        accumulate: started,
                        parallelism,
                    };
                    // dM[e] read as (tiles x o).
                    let dme = View {
                        data: dm,
                        offset: e * m_stride,
                        rs: 1,
                        cs: width,
                    };
                    matmul(product, du, ve, dme)?;
                }
            }
            started = true;
        }
        Ok(())
    }

    /// Values of the transformed kernel's gradient that [`Self::accumulate_kernel_grad`] sums.
    pub(crate) fn kernel_grad_len(&self) -> usize {
        ELEMENTS * self.plan.o * self.plan.c
    }

    /// The kernel's gradient `(o, c, 3, 3)`, `dg = Gt dU G`, from the summed gradient of the
    /// transformed kernel `du` (`[c][e][o]`: each input channel's values one run). Each input channel's output channels go
    /// [`KERNEL_GRAD_LANES`] at a time, every element's values read as one run and transformed
    /// lane by lane (the same operations on each lane, so the same values as one at a time),
    /// into `[c][tap][o]`; then transposed.
    pub(crate) fn kernel_grad(&self, du: &[f32]) -> Vec<f32> {
        let by_channel = self.kernel_grad_by_channel(du);
        let (o, c) = (self.plan.o, self.plan.c);
        let mut dw = vec![0f32; o * c * 9];
        transpose(&by_channel, c * 9, o, &mut dw);
        dw
    }

    /// The kernel's gradient laid out `[c][tap][o]`, from `du` as [`Self::kernel_grad`] takes
    /// it: each input channel's taps, output channels last.
    pub(crate) fn kernel_grad_by_channel(&self, du: &[f32]) -> Vec<f32> {
        const LANES: usize = KERNEL_GRAD_LANES;
        let (o, c) = (self.plan.o, self.plan.c);
        let mut by_channel = vec![0f32; c * 9 * o];
        by_channel
            .par_chunks_mut(9 * o)
            .enumerate()
            .for_each(|(ci, dst)| {
                crate::simd::vectorized(
                    #[inline(always)]
                    || {
                        for o0 in (0..o).step_by(LANES) {
                            let lanes = LANES.min(o - o0);
                            // Gt dU: 6 columns of 3, each a set of lanes; then, its rows
                            // gathered, (Gt dU) G: 3 rows of 3.
                            let mut columns = [[[0f32; LANES]; 3]; SIDE];
                            let mut column = [[0f32; LANES]; SIDE];
                            for (b, gt_du) in columns.iter_mut().enumerate() {
                                for (a, values) in column.iter_mut().enumerate() {
                                    let at = (ci * ELEMENTS + a * SIDE + b) * o + o0;
                                    let run = &du[at..at + lanes];
                                    match <&[f32; LANES]>::try_from(run) {
                                        // A fixed-size copy, inlined: a copy of `lanes` values
                                        // would be a call to `memcpy` per element.
                                        Ok(all) => *values = *all,
                                        Err(_) => {
                                            for (v, d) in values.iter_mut().zip(run) {
                                                *v = *d;
                                            }
                                        }
                                    }
                                }
                                kernel_grad_lanes(&column, gt_du);
                            }
                            let mut taps = [[[0f32; LANES]; 3]; 3];
                            for (ky, row) in taps.iter_mut().enumerate() {
                                for (b, values) in column.iter_mut().enumerate() {
                                    *values = columns[b][ky];
                                }
                                kernel_grad_lanes(&column, row);
                            }
                            for (t, values) in taps.iter().flatten().enumerate() {
                                let run = &mut dst[t * o + o0..][..lanes];
                                match <&mut [f32; LANES]>::try_from(&mut *run) {
                                    // A fixed-size copy, inlined rather than a call to `memcpy`.
                                    Ok(all) => *all = *values,
                                    Err(_) => {
                                        for (d, v) in run.iter_mut().zip(values) {
                                            *d = *v;
                                        }
                                    }
                                }
                            }
                        }
                    },
                )
            });
        by_channel
    }
}

/// One column of `Gt d` on each of `L` lanes: six sets of lanes of a transformed kernel's
/// gradient to three of taps', into `out`.
#[inline(always)]
fn kernel_grad_lanes<const L: usize>(d: &[[f32; L]; SIDE], out: &mut [[f32; L]; 3]) {
    // Multiplications by the reciprocals, as in `kernel_column`.
    const SIXTH: f32 = 1.0 / 6.0;
    let [d0, d1, d2, d3, d4, d5] = d;
    let [o0, o1, o2] = out;
    for l in 0..L {
        o0[l] = d0[l] * 0.25 - (d1[l] + d2[l]) * SIXTH + (d3[l] + d4[l]) * (SIXTH / 4.0);
        o1[l] = (d2[l] - d1[l]) * SIXTH + (d3[l] - d4[l]) * (SIXTH / 2.0);
        o2[l] = (d3[l] + d4[l] - d1[l] - d2[l]) * SIXTH + d5[l];
    }
}
