//! Winograd's minimal filtering F(4x4, 3x3) for 3x3 correlations at unit strides.
//!
//! The output is cut into 4x4 tiles; each reads a 6x6 tile of the input (zero outside the
//! image). With the transforms `V = Bt d B` of an input tile and `U = G g Gt` of a 3x3 kernel,
//! the tile's output is `At (sum over channels of U ⊙ V) A`: thirty-six products per tile and
//! channel pair instead of the direct correlation's 144. Summed over channels, each of the
//! thirty-six elements is one matrix product, `M[e] (o x tiles) = U[e] (o x c) * V[e]
//! (c x tiles)`: four times fewer multiplications than the direct correlation.
//!
//! The tiles of a group of images are taken a *block* at a time, a few dozen tiles sized so the
//! block's transformed tiles stay in the core's L2 cache: transformed, multiplied (thirty-six
//! products) and transformed back before the next block, so nothing larger than a block goes
//! through memory. On CPUs with AVX2 and FMA or AVX-512, the products run in
//! [`super::microkernel`], reading the block's transformed tiles as they lie and the kernel's
//! panels packed once per layer; elsewhere in the `gemm` crate.
//!
//! The transforms take eight tiles at once, one per vector lane: four pairs of horizontally
//! adjacent tiles, whose input rows are loaded whole and transposed into lanes, and whose
//! output rows come back out of the lanes as runs of eight columns (`pairs_avx2`, on CPUs with
//! AVX2), or one tile per lane, gathered and scattered, where a pair is not adjacent. With
//! AVX-512 in use, two such groups of eight tiles go through one 512-bit vector
//! (`pairs_avx512`): a group's lanes lie right after the previous group's in the block's
//! buffers.
//!
//! The kernel gradient sums `dU[e]^T (c x o) = V[e] (c x tiles) * dM[e]^T (tiles x o)` over
//! blocks, `dM = A dY At` the output gradient's transform. With the micro-kernel, `dM` is made
//! from the output gradient transposed, sixteen output channels per vector, straight into the
//! micro-kernel's strips (`gradient_strips`), and `V` is read where its transform wrote it;
//! otherwise `dM` is made tile by tile in lanes, as the forward pass's transforms, and both go
//! to the `gemm` crate.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::super::output::ImagesMut;
use super::epilogue::{self, Epilogue};
use super::gemm::{matmul, Parallelism, Product, View, ViewMut};
use super::microkernel::{self, PackedStack, Panels, Strips, MR, NR};
use super::plan::Plan;
use super::transpose::transpose;
use crate::SimdLevel;

#[cfg(target_arch = "x86_64")]
mod columns;
mod gradient_strips;
mod pairs_avx2;
mod pairs_avx512;

/// Output values along each side of a tile.
const TILE: usize = 4;

/// Input values along each side of a tile's input tile.
const SIDE: usize = TILE + 2;

/// Elements of a transformed tile (6x6).
const ELEMENTS: usize = SIDE * SIDE;

/// The most `f32`s a block's transformed input tiles should take (512 KiB), so they stay in L2
/// with the products.
const BLOCK_BUDGET: usize = 128 * 1024;

/// The most tiles in a block.
const MAX_BLOCK: usize = 4 * NR;

/// The most `f32`s of a transformed kernel (16 MiB) taken to stay in cache between blocks.
/// A larger one (512 channels on both sides: 36 MiB) is read from memory by every block, so
/// its blocks take twice [`NR`] tiles at least, even past [`BLOCK_BUDGET`]: ResNet's last
/// stage, one tile per image, read it once per 32 images instead of once per 16 (forward pass
/// 36 -> 28 ms at batch 64 on a 2-core Zen 4).
const CACHED_KERNEL: usize = 4 << 20;

/// Input channels [`Winograd::kernel_grad`] transforms back at once.
const KERNEL_GRAD_LANES: usize = 16;

/// Fewest input and output channels for which the transforms pay for themselves.
const MIN_CHANNELS: usize = 16;

/// Fewest output positions per tile, on average over a plane: a tile costs 36 products per
/// channel pair where the direct correlation costs 9 per position, so at 6 positions a tile
/// (output planes of 3x3, 4x4, 5x5 and up; not 2x2, nor 1x1) Winograd's products still number
/// at most two thirds of the direct correlation's. Below that, most of a tile's outputs would
/// fall outside the plane.
const MIN_POSITIONS_PER_TILE: usize = 6;

/// Tiles a transform takes at once, one per vector lane.
const LANES: usize = 8;

/// The tile (counted from the group's first) in each lane: the first tiles of the four pairs,
/// then their second tiles, the order in which a pair's two tiles, loaded as one vector half
/// each, come out of a transpose.
const LANE_TILE: [usize; LANES] = [0, 2, 4, 6, 1, 3, 5, 7];

/// A 3x3, stride-1 correlation lowered to F(4x4, 3x3): the plan and the transformed kernel.
pub(crate) struct Winograd {
    plan: Plan,
    /// The transformed kernel `U`, 36 matrices `o x c`.
    kernel: Kernel,
    /// `U[e][o][c]` unpacked from a packed kernel, made when a product goes to the `gemm`
    /// crate (one split over the pool).
    unpacked: OnceLock<Vec<f32>>,
    /// Tiles per block (a multiple of [`NR`]).
    block: usize,
}

/// A transformed kernel: packed for [`microkernel::product`], or `[e][o][c]` for the `gemm`
/// crate, or absent (a kernel gradient needs none).
enum Kernel {
    Packed(PackedStack),
    Plain(Vec<f32>),
    None,
}

/// The buffers of one task: its group's padded images and output gradients (padded, or
/// transposed for `gradient_strips`), a block's transformed input `V[e][c][column]` and
/// products `M[e][o][column]` or output-gradient transforms (each element's matrix
/// [`element_stride`] apart), and the tile in each column.
#[derive(Default)]
pub(crate) struct Buffers {
    padded: Vec<f32>,
    padded_gradient: Vec<f32>,
    input: Vec<f32>,
    products: Vec<f32>,
    tiles: Vec<Tile>,
}

/// One tile of a block: image `image` of the group, tile row `ti`, tile column `tj`; `real`
/// is false for the columns past the block's last tile, which repeat it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tile {
    image: usize,
    ti: usize,
    tj: usize,
    real: bool,
}

impl Tile {
    /// Whether `next` is the tile right of this one.
    fn precedes(&self, next: &Tile) -> bool {
        (next.image, next.ti, next.tj) == (self.image, self.ti, self.tj + 1)
    }
}

impl Winograd {
    /// The correlation of `plan` with the kernel whose tap `(o, c, ky, kx)` is
    /// `tap(o, c, ky, kx)`, or `None` when the plan is not a 3x3, stride-1 correlation with
    /// enough channels and positions for the transforms to pay.
    pub(crate) fn new(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
    ) -> Option<Self> {
        Self::with_products(plan, tap, microkernel::preferred())
    }

    /// [`Self::new`], with the products in [`microkernel`] when `packed` (and the CPU runs it).
    fn with_products(
        plan: &Plan,
        tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync,
        packed: bool,
    ) -> Option<Self> {
        if !Self::suits(plan) {
            return None;
        }
        let (o, c) = (plan.o, plan.c);
        // `U = G g Gt` of output channel `oi` and input channels `ci0 ..` (up to
        // `KERNEL_LANES`, zero past `c`), one lane each, so the arithmetic vectorises.
        let transformed = |oi: usize, ci0: usize| -> [[f32; KERNEL_LANES]; ELEMENTS] {
            let mut g = [[[0f32; KERNEL_LANES]; 3]; 3];
            for (l, ci) in (ci0..c.min(ci0 + KERNEL_LANES)).enumerate() {
                for (ky, row) in g.iter_mut().enumerate() {
                    for (kx, taps) in row.iter_mut().enumerate() {
                        taps[l] = tap(oi, ci, ky, kx);
                    }
                }
            }
            // G g: 6 rows of 3, then (G g) Gt: 6x6.
            let mut gg = [[[0f32; KERNEL_LANES]; 3]; SIDE];
            for kx in 0..3 {
                let col = kernel_columns([g[0][kx], g[1][kx], g[2][kx]]);
                for (row, v) in gg.iter_mut().zip(col) {
                    row[kx] = v;
                }
            }
            let mut u = [[0f32; KERNEL_LANES]; ELEMENTS];
            for (a, row) in gg.iter().enumerate() {
                u[a * SIDE..][..SIDE].copy_from_slice(&kernel_columns(*row));
            }
            u
        };
        let kernel = if packed && microkernel::supported() {
            // Each task transforms a panel's output channels and writes them straight into
            // their panel of every element's packed matrix.
            // The panel's rows are transformed together, then each element's `[k][rows]`
            // run of those input channels is written in order.
            Kernel::Packed(PackedStack::build(ELEMENTS, (o, c), |p, rows, out| {
                let per_element = rows * c;
                let mut panel = [[[0f32; KERNEL_LANES]; ELEMENTS]; MR];
                for ci0 in (0..c).step_by(KERNEL_LANES) {
                    let lanes = KERNEL_LANES.min(c - ci0);
                    for (r, u) in panel.iter_mut().enumerate().take(rows) {
                        *u = transformed(p * MR + r, ci0);
                    }
                    for e in 0..ELEMENTS {
                        let run = &mut out[e * per_element + ci0 * rows..][..lanes * rows];
                        for (l, values) in run.chunks_exact_mut(rows).enumerate() {
                            for (r, v) in values.iter_mut().enumerate() {
                                *v = panel[r][e][l];
                            }
                        }
                    }
                }
            }))
        } else {
            // `[e][o][c]`, each output channel's in parallel.
            let per_channel: Vec<Vec<[[f32; KERNEL_LANES]; ELEMENTS]>> = (0..o)
                .into_par_iter()
                .map(|oi| {
                    (0..c)
                        .step_by(KERNEL_LANES)
                        .map(|ci0| transformed(oi, ci0))
                        .collect()
                })
                .collect();
            let mut kernel = vec![0f32; ELEMENTS * o * c];
            for (oi, channel) in per_channel.iter().enumerate() {
                for (block, u) in channel.iter().enumerate() {
                    let ci0 = block * KERNEL_LANES;
                    let lanes = KERNEL_LANES.min(c - ci0);
                    for (e, values) in u.iter().enumerate() {
                        let at = (e * o + oi) * c + ci0;
                        kernel[at..at + lanes].copy_from_slice(&values[..lanes]);
                    }
                }
            }
            Kernel::Plain(kernel)
        };
        Some(Self {
            plan: *plan,
            kernel,
            unpacked: OnceLock::new(),
            block: Self::block(plan),
        })
    }

    /// Whether `plan` is a 3x3, stride-1 correlation with enough channels and positions for
    /// the transforms to pay.
    pub(crate) fn suits(plan: &Plan) -> bool {
        plan.kh == 3
            && plan.kw == 3
            && plan.sh == 1
            && plan.sw == 1
            && plan.c >= MIN_CHANNELS
            && plan.o >= MIN_CHANNELS
            && plan.ho * plan.wo
                >= MIN_POSITIONS_PER_TILE * plan.ho.div_ceil(TILE) * plan.wo.div_ceil(TILE)
    }

    /// Tiles per block for `plan`: as many as fit [`BLOCK_BUDGET`], a multiple of [`NR`]; at
    /// least two of them when the transformed kernel is larger than [`CACHED_KERNEL`], since
    /// every block then reads it from memory.
    fn block(plan: &Plan) -> usize {
        let fits = (BLOCK_BUDGET / (ELEMENTS * plan.c) / NR * NR).clamp(NR, MAX_BLOCK);
        if ELEMENTS * plan.o * plan.c > CACHED_KERNEL {
            fits.max(2 * NR)
        } else {
            fits
        }
    }

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

    /// `U[e][o][c]`, for the `gemm` crate (empty for a kernel gradient's lowering).
    fn plain_kernel(&self) -> &[f32] {
        match &self.kernel {
            Kernel::Plain(kernel) => kernel,
            Kernel::Packed(stack) => self.unpacked.get_or_init(|| stack.unpacked()),
            Kernel::None => &[],
        }
    }

    /// Tiles of one image: `(rows, columns)`.
    fn tiles(&self) -> (usize, usize) {
        (self.plan.ho.div_ceil(TILE), self.plan.wo.div_ceil(TILE))
    }

    /// Images to correlate together out of `n`, over `threads` threads: enough to fill a block,
    /// but no fewer groups than threads while there are images.
    pub(crate) fn group(&self, n: usize, threads: usize) -> usize {
        let (th, tw) = self.tiles();
        let wanted = self.block.div_ceil(th * tw).max(1);
        wanted.min(n.div_ceil(threads.max(1))).max(1)
    }

    /// The tiles of a group of `images` images (numbered row-major through them) in blocks of
    /// at most `self.block` tiles, near-equal in size.
    fn blocks(&self, images: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
        let (th, tw) = self.tiles();
        let tiles = images * th * tw;
        let per_block = tiles.div_ceil(tiles.div_ceil(self.block).max(1)).max(1);
        (0..tiles)
            .step_by(per_block)
            .map(move |t0| t0..(t0 + per_block).min(tiles))
    }

    /// Rows and columns of an image plane padded to cover every tile's input tile, and the
    /// next tile's first four columns (which a pair's vector loads reach).
    fn padded_plane(&self) -> (usize, usize) {
        let (th, tw) = self.tiles();
        (TILE * th + 2, TILE * tw + 2 * TILE)
    }

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

    /// Copies each channel of the group's `images` images `x` into `padded`, a plane of
    /// [`Self::padded_plane`] each, zero outside the image, so every tile reads its input tile
    /// without bounds to check.
    fn pad(&self, x: &[f32], images: usize, padded: &mut Vec<f32>) {
        let plan = &self.plan;
        let (ph, pw) = self.padded_plane();
        let planes = images * plan.c;
        let padded = grow(padded, planes * ph * pw);
        let (lo, hi) = column_window(plan.left, plan.w, pw);
        for (dst, src) in padded
            .chunks_exact_mut(ph * pw)
            .zip(x.chunks_exact(plan.h * plan.w))
        {
            // Padded rows `top ..` hold the image's rows.
            let first = plan.top.max(0) as usize;
            let end = (plan.h as isize + plan.top).clamp(0, ph as isize) as usize;
            let part = pairs_avx2::PaddedRows {
                rows: if lo < hi { first..end.max(first) } else { 0..0 },
                src_row: (first as isize - plan.top) as usize,
                src_stride: plan.w,
                src_col: (lo as isize - plan.left).max(0) as usize,
                len: hi - lo,
                col: lo,
            };
            fill_padded_plane(dst, pw, src, &part);
        }
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

    /// The tile in each of a block's `width` columns, for tiles `range` of a group: column
    /// `8g + l` holds tile `8g + LANE_TILE[l]`; the columns past the block's tiles repeat its
    /// last one (their products are computed, the micro-kernel's width, but never written out).
    fn block_tiles(&self, range: std::ops::Range<usize>, width: usize, tiles: &mut Vec<Tile>) {
        let (th, tw) = self.tiles();
        tiles.clear();
        tiles.extend((0..width).map(|col| {
            let at = col - col % LANES + LANE_TILE[col % LANES];
            let t = range.start + at.min(range.len() - 1);
            let (image, within) = (t / (th * tw), t % (th * tw));
            Tile {
                image,
                ti: within / tw,
                tj: within % tw,
                real: at < range.len(),
            }
        }));
    }

    /// Adds the gradient of the transformed kernel, `dU[e]^T (c x o) = sum over tiles of
    /// V[e] * dM[e]^T` with `dM = A dY At`, for a group of images to `acc` (`[e][c][o]`,
    /// [`Self::kernel_grad_len`] values): `x` holds the group's inputs and `dy` their output
    /// gradients. An empty `acc` starts the sum: the first block's products write each
    /// element's slice as it is made, in cache, instead of adding to a buffer zeroed in a pass
    /// over memory of its own. [`Self::kernel_grad`] turns the sum into the kernel's gradient.
    ///
    /// With the micro-kernel (and the group on one thread), `dM` is made with output channels
    /// in the lanes, as its strips (`gradient_strips`), and `V` read in place; otherwise both
    /// are made as for the forward pass and multiplied in the `gemm` crate.
    pub(crate) fn accumulate_kernel_grad(
        &self,
        x: &[f32],
        dy: &[f32],
        acc: &mut Vec<f32>,
        buffers: &mut Buffers,
        parallelism: Parallelism,
    ) -> candle_core::Result<()> {
        let plan = &self.plan;
        let (c, o) = (plan.c, plan.o);
        let (in_len, out_len) = (plan.input_len(), plan.output_len());
        let images = dy.len() / out_len.max(1);
        if x.len() != images * in_len
            || dy.len() != images * out_len
            || !(acc.is_empty() || acc.len() == self.kernel_grad_len())
        {
            candle_core::bail!(
                "winograd: {} input and {} gradient values do not hold whole images of {in_len} \
                 and {out_len}, or {} accumulated values are not {}",
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
            let started = !acc.is_empty();
            for e in 0..ELEMENTS {
                if !started {
                    acc.resize((e + 1) * o * c, 0.0);
                }
                // dU[e]^T (c x o), row-major: `[e][c][o]`.
                let du = ViewMut {
                    data: acc,
                    offset: e * o * c,
                    rs: o,
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
        }
        Ok(())
    }

    /// Values of the transformed kernel's gradient that [`Self::accumulate_kernel_grad`] sums.
    pub(crate) fn kernel_grad_len(&self) -> usize {
        ELEMENTS * self.plan.o * self.plan.c
    }

    /// The kernel's gradient `(o, c, 3, 3)`, `dg = Gt dU G`, from the summed gradient of the
    /// transformed kernel `du` (`[e][c][o]`). Each input channel's output channels go
    /// [`KERNEL_GRAD_LANES`] at a time, every element's values read as one run and transformed
    /// lane by lane (the same operations on each lane, so the same values as one at a time),
    /// into `[c][tap][o]`; then transposed.
    pub(crate) fn kernel_grad(&self, du: &[f32]) -> Vec<f32> {
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
                                    let at = ((a * SIDE + b) * c + ci) * o + o0;
                                    for (v, d) in values.iter_mut().zip(&du[at..at + lanes]) {
                                        *v = *d;
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
        let mut dw = vec![0f32; o * c * 9];
        transpose(&by_channel, c * 9, o, &mut dw);
        dw
    }

    /// Copies each output-gradient plane of the group's `images` images `dy` into `padded`, a
    /// plane of whole tiles each (`4 th x 4 tw`), zero past the plane.
    fn pad_gradient(&self, dy: &[f32], images: usize, padded: &mut Vec<f32>) {
        let plan = &self.plan;
        let (th, tw) = self.tiles();
        let (ph, pw) = (TILE * th, TILE * tw);
        let padded = grow(padded, images * plan.o * ph * pw);
        for (dst, src) in padded
            .chunks_exact_mut(ph * pw)
            .zip(dy.chunks_exact(plan.ho * plan.wo))
        {
            let part = pairs_avx2::PaddedRows {
                rows: 0..plan.ho,
                src_row: 0,
                src_stride: plan.wo,
                src_col: 0,
                len: plan.wo,
                col: 0,
            };
            fill_padded_plane(dst, pw, src, &part);
        }
    }

    /// Runs a transform of a block, compiled for AVX-512 or AVX2 when the kernels use them.
    #[allow(unsafe_code)]
    fn transform(&self, job: Transform<'_, '_>, tiles: &[Tile], width: usize) {
        #[cfg(target_arch = "x86_64")]
        if pairs_avx512::usable() {
            // SAFETY: AVX-512 is in use, so the CPU has it (and AVX2 and FMA).
            unsafe { self.transform_avx512(job, tiles, width) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx2_fma() {
            // SAFETY: the CPU has AVX2, checked just above.
            unsafe { self.transform_avx2(job, tiles, width) };
            return;
        }
        self.transform_any(job, tiles, width);
    }

    /// [`Self::transform_any`], compiled with AVX2.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(unsafe_code)]
    unsafe fn transform_avx2(&self, job: Transform<'_, '_>, tiles: &[Tile], width: usize) {
        self.transform_any(job, tiles, width);
    }

    /// One group's input tiles of one channel (its plane at `plane` in `padded`, its lanes'
    /// tiles at `start`, four pairs of adjacent tiles when `pairs`) into `v` (element `e` of
    /// lane `l` at `v[e * stride + l]`): in AVX2's pairs, or one lane at a time.
    #[inline(always)]
    fn input_group(
        &self,
        padded: &[f32],
        (start, pairs): (&[usize; LANES], bool),
        plane: usize,
        v: &mut [f32],
        stride: usize,
    ) {
        let (_, pw) = self.padded_plane();
        if pairs {
            let starts = [0, 1, 2, 3].map(|j| plane + start[j]);
            if pairs_avx2::input_tiles(padded, starts, pw, v, stride) {
                return;
            }
        }
        let d = gather::<SIDE, ELEMENTS>(padded, (plane, pw), start, [true; LANES]);
        for (e, vals) in transform_input(&d).iter().enumerate() {
            v[e * stride..][..LANES].copy_from_slice(vals);
        }
    }

    /// [`Self::transform_any`], compiled with AVX-512.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512 (F, VL, BW, DQ), AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
    #[allow(unsafe_code)]
    unsafe fn transform_avx512(&self, job: Transform<'_, '_>, tiles: &[Tile], width: usize) {
        self.transform_any(job, tiles, width);
    }

    /// Transforms the block's `tiles` of each padded input channel into `v` (`[e][c][width]`),
    /// or writes them to each output channel from `m` (`[e][o][width]`), [`LANES`] tiles at a
    /// time (see [`Transform`]).
    #[inline(always)]
    fn transform_any(&self, job: Transform<'_, '_>, tiles: &[Tile], width: usize) {
        let plan = &self.plan;
        let (ph, pw) = self.padded_plane();
        match job {
            Transform::Inputs { padded, v } => {
                let stride = element_stride(plan.c * width);
                let groups: Vec<&[Tile]> = tiles.chunks_exact(LANES).collect();
                // Each lane's input tile starts at `start[l] + plane offset`.
                let starts: Vec<[usize; LANES]> = groups
                    .iter()
                    .map(|lanes| {
                        lanes.map_lanes(|t| t.image * plan.c * ph * pw + TILE * (t.ti * pw + t.tj))
                    })
                    .collect();
                let pairs: Vec<bool> = groups.iter().map(|lanes| adjacent_pairs(lanes)).collect();
                for (g, both) in group_steps(&pairs) {
                    for ci in 0..plan.c {
                        let plane = ci * ph * pw;
                        let at = ci * width + g * LANES;
                        if both {
                            let four = |s: &[usize; LANES]| [0, 1, 2, 3].map(|j| plane + s[j]);
                            let starts2 = [four(&starts[g]), four(&starts[g + 1])];
                            if pairs_avx512::input_tiles(padded, starts2, pw, &mut v[at..], stride)
                            {
                                continue;
                            }
                            let next = &mut v[at + LANES..];
                            self.input_group(padded, (&starts[g + 1], true), plane, next, stride);
                        }
                        let group = (&starts[g], pairs[g]);
                        self.input_group(padded, group, plane, &mut v[at..], stride);
                    }
                }
            }
            Transform::Gradients { padded, dm } => {
                let stride = element_stride(plan.o * width);
                let (th, tw) = self.tiles();
                let (gh, gw) = (TILE * th, TILE * tw);
                let groups: Vec<&[Tile]> = tiles.chunks_exact(LANES).collect();
                let starts: Vec<[usize; LANES]> = groups
                    .iter()
                    .map(|lanes| {
                        lanes.map_lanes(|t| t.image * plan.o * gh * gw + TILE * (t.ti * gw + t.tj))
                    })
                    .collect();
                let pairs: Vec<bool> = groups.iter().map(|lanes| real_pairs(lanes)).collect();
                for (g, both) in group_steps(&pairs) {
                    for oi in 0..plan.o {
                        let plane = oi * gh * gw;
                        let at = oi * width + g * LANES;
                        let four = |s: &[usize; LANES]| [0, 1, 2, 3].map(|j| plane + s[j]);
                        if both {
                            let starts2 = [four(&starts[g]), four(&starts[g + 1])];
                            if pairs_avx512::gradient_tiles(
                                padded,
                                starts2,
                                gw,
                                &mut dm[at..],
                                stride,
                            ) {
                                continue;
                            }
                        }
                        for h in g..g + if both { 2 } else { 1 } {
                            let at = oi * width + h * LANES;
                            let dm = &mut dm[at..];
                            if pairs[h]
                                && pairs_avx2::gradient_tiles(
                                    padded,
                                    four(&starts[h]),
                                    gw,
                                    dm,
                                    stride,
                                )
                            {
                                continue;
                            }
                            let real: [bool; LANES] = std::array::from_fn(|l| groups[h][l].real);
                            let d = gather::<TILE, { TILE * TILE }>(
                                padded,
                                (plane, gw),
                                &starts[h],
                                real,
                            );
                            for (e, vals) in transform_gradient(&d).iter().enumerate() {
                                dm[e * stride..][..LANES].copy_from_slice(vals);
                            }
                        }
                    }
                }
            }
            Transform::Outputs { m, bias, relu, out } => {
                let stride = element_stride(plan.o * width);
                let groups: Vec<&[Tile]> = tiles.chunks_exact(LANES).collect();
                let pairs: Vec<bool> = groups.iter().map(|lanes| real_pairs(lanes)).collect();
                for (g, both) in group_steps(&pairs) {
                    for oi in 0..plan.o {
                        let at = oi * width + g * LANES;
                        let write = (bias.map_or(0.0, |b| b[oi]), relu);
                        if both {
                            let mut rows = [[[0f32; 2 * TILE]; 4 * TILE]; 2];
                            if pairs_avx512::output_tiles(&m[at..], stride, write, &mut rows) {
                                self.store_pairs(groups[g], &rows[0], oi, out);
                                self.store_pairs(groups[g + 1], &rows[1], oi, out);
                                continue;
                            }
                            let next = (groups[g + 1], true);
                            self.output_group(&m[at + LANES..], stride, next, (oi, write), out);
                        }
                        let group = (groups[g], pairs[g]);
                        self.output_group(&m[at..], stride, group, (oi, write), out);
                    }
                }
            }
        }
    }

    /// One group's outputs of output channel `oi` (its lanes' tiles `lanes`, four pairs of
    /// adjacent real tiles when `pairs`) from its products `m` (element `e` of lane `l` at
    /// `m[e * stride + l]`), with the bias and the ReLU of `write`: in AVX2's pairs, or one lane
    /// at a time.
    #[inline(always)]
    fn output_group(
        &self,
        m: &[f32],
        stride: usize,
        (lanes, pairs): (&[Tile], bool),
        (oi, write): (usize, (f32, bool)),
        out: &mut [&mut [f32]],
    ) {
        let plan = &self.plan;
        if pairs {
            let mut rows = [[0f32; 2 * TILE]; 4 * TILE];
            if pairs_avx2::output_tiles(m, stride, write, &mut rows) {
                self.store_pairs(lanes, &rows, oi, out);
                return;
            }
        }
        let (b, relu) = write;
        let (plane, wo) = (plan.ho * plan.wo, plan.wo);
        let first = lanes.map_lanes(|t| TILE * (t.ti * wo + t.tj));
        let mut products = [[0f32; LANES]; ELEMENTS];
        for (e, p) in products.iter_mut().enumerate() {
            p.copy_from_slice(&m[e * stride..][..LANES]);
        }
        let y = transform_output(&products, b);
        for (l, t) in lanes.iter().enumerate().filter(|(_, t)| t.real) {
            let image = &mut out[t.image][first[l] + oi * plane..];
            let rows = plan.ho.saturating_sub(TILE * t.ti).min(TILE);
            let cols = plan.wo.saturating_sub(TILE * t.tj).min(TILE);
            for r in 0..rows {
                for (k, yv) in y[r * TILE..][..cols].iter().enumerate() {
                    image[r * wo + k] = if relu { epilogue::relu(yv[l]) } else { yv[l] };
                }
            }
        }
    }

    /// Stores the output rows of a group's four pairs of adjacent tiles (`lanes`), as the
    /// pair kernels leave them, into output channel `oi`.
    #[inline(always)]
    fn store_pairs(
        &self,
        lanes: &[Tile],
        rows: &pairs_avx2::PairRows,
        oi: usize,
        out: &mut [&mut [f32]],
    ) {
        let plan = &self.plan;
        let (plane, wo) = (plan.ho * plan.wo, plan.wo);
        for (j, pair) in rows.chunks_exact(TILE).enumerate() {
            let t = lanes[j];
            let image = &mut out[t.image][TILE * (t.ti * wo + t.tj) + oi * plane..];
            let height = plan.ho.saturating_sub(TILE * t.ti).min(TILE);
            let cols = plan.wo.saturating_sub(TILE * t.tj).min(2 * TILE);
            for (r, row) in pair.iter().take(height).enumerate() {
                let dst = &mut image[r * wo..];
                if cols == 2 * TILE {
                    dst[..2 * TILE].copy_from_slice(row);
                } else {
                    dst[..cols].copy_from_slice(&row[..cols]);
                }
            }
        }
    }
}

/// Each lane's `N x N` tile of a padded plane (at `plane` in `padded`, rows `pitch` apart;
/// lane `l`'s from `start[l]`), one value per lane (`NN = N * N` of them), lanes not `real`
/// left zero: the tiles a transform takes one lane at a time.
#[inline(always)]
fn gather<const N: usize, const NN: usize>(
    padded: &[f32],
    (plane, pitch): (usize, usize),
    start: &[usize; LANES],
    real: [bool; LANES],
) -> [[f32; LANES]; NN] {
    let mut d = [[0f32; LANES]; NN];
    for (l, s) in start.iter().enumerate().filter(|&(l, _)| real[l]) {
        for (q, row) in d.chunks_exact_mut(N).enumerate() {
            let src = &padded[plane + s + q * pitch..][..N];
            for (dv, sv) in row.iter_mut().zip(src) {
                dv[l] = *sv;
            }
        }
    }
    d
}

/// Per-lane values of a group of [`LANES`] tiles.
trait MapLanes {
    fn map_lanes(&self, f: impl Fn(&Tile) -> usize) -> [usize; LANES];
}

impl MapLanes for [Tile] {
    fn map_lanes(&self, f: impl Fn(&Tile) -> usize) -> [usize; LANES] {
        let mut values = [0; LANES];
        for (v, t) in values.iter_mut().zip(self) {
            *v = f(t);
        }
        values
    }
}

/// The groups a transform takes in turn, as `(g, both)`: with AVX-512 in use, groups `g` and
/// `g + 1` at once (`both`) where both are pairs of adjacent tiles (`pairs`), else one at a time.
fn group_steps(pairs: &[bool]) -> Vec<(usize, bool)> {
    let wide = pairs_avx512::usable();
    let mut steps = Vec::with_capacity(pairs.len());
    let mut g = 0;
    while g < pairs.len() {
        let both = wide && pairs[g] && pairs.get(g + 1) == Some(&true);
        steps.push((g, both));
        g += if both { 2 } else { 1 };
    }
    steps
}

/// Whether the lanes' tiles are four pairs of adjacent tiles, every one real (a block's last
/// columns repeat its last tile).
fn real_pairs(lanes: &[Tile]) -> bool {
    adjacent_pairs(lanes) && lanes.iter().all(|t| t.real)
}

/// Whether the lanes' tiles are four pairs of adjacent tiles: lane `j` (`j < 4`) holds a
/// pair's first tile and lane `4 + j` the tile right of it (see [`LANE_TILE`]).
fn adjacent_pairs(lanes: &[Tile]) -> bool {
    lanes.len() == LANES && (0..LANES / 2).all(|j| lanes[j].precedes(&lanes[LANES / 2 + j]))
}

/// The distance between consecutive elements' matrices of `len` values in a block's buffers:
/// `len` and one cache line more, so the rows a transform writes (or reads) at once fall in
/// distinct cache sets even when `len` is a multiple of the L1 cache's way size.
fn element_stride(len: usize) -> usize {
    len + 16
}

/// The columns `lo .. hi` of a padded row of `pw` that hold columns `lo - left ..` of an image
/// row `w` wide (the others are zero).
fn column_window(left: isize, w: usize, pw: usize) -> (usize, usize) {
    let lo = left.clamp(0, pw as isize) as usize;
    let hi = (left + w as isize).clamp(0, pw as isize) as usize;
    (lo, hi.max(lo))
}

/// `Bt d B` of [`LANES`] 6x6 input tiles, `d[6 * row + column][lane]`, laid out alike.
#[inline(always)]
fn transform_input(d: &[[f32; LANES]; ELEMENTS]) -> [[f32; LANES]; ELEMENTS] {
    // d B: each row's six values to six.
    let mut z = [[0f32; LANES]; ELEMENTS];
    for (zr, dr) in z.chunks_exact_mut(SIDE).zip(d.chunks_exact(SIDE)) {
        for l in 0..LANES {
            let col = input_column([0, 1, 2, 3, 4, 5].map(|k| dr[k][l]));
            for (zv, v) in zr.iter_mut().zip(col) {
                zv[l] = v;
            }
        }
    }
    // Bt (d B): across the rows, column by column.
    let mut v = [[0f32; LANES]; ELEMENTS];
    for k in 0..SIDE {
        for l in 0..LANES {
            let col = input_column([0, 1, 2, 3, 4, 5].map(|r| z[SIDE * r + k][l]));
            for (a, value) in col.into_iter().enumerate() {
                v[SIDE * a + k][l] = value;
            }
        }
    }
    v
}

/// `At m A + bias` of [`LANES`] tiles' products, `m[e][lane]`: the 4x4 outputs as
/// `[4 * row + column][lane]`.
#[inline(always)]
fn transform_output(m: &[[f32; LANES]; ELEMENTS], bias: f32) -> [[f32; LANES]; TILE * TILE] {
    // At m: across the rows, column by column, to four rows of six.
    let mut s = [[0f32; LANES]; TILE * SIDE];
    for k in 0..SIDE {
        for l in 0..LANES {
            let col = output_column([0, 1, 2, 3, 4, 5].map(|r| m[SIDE * r + k][l]));
            for (r, value) in col.into_iter().enumerate() {
                s[SIDE * r + k][l] = value;
            }
        }
    }
    // (At m) A: each row's six values to four.
    let mut y = [[0f32; LANES]; TILE * TILE];
    for (yr, sr) in y.chunks_exact_mut(TILE).zip(s.chunks_exact(SIDE)) {
        for l in 0..LANES {
            let row = output_column([0, 1, 2, 3, 4, 5].map(|k| sr[k][l]));
            for (yv, v) in yr.iter_mut().zip(row) {
                yv[l] = v + bias;
            }
        }
    }
    y
}

/// `A dY At` of `L` 4x4 output-gradient tiles, `d[4 * row + column][lane]`: the 6x6 gradients
/// of their products, `[6 * row + column][lane]`.
#[inline(always)]
fn transform_gradient<const L: usize>(d: &[[f32; L]; TILE * TILE]) -> [[f32; L]; ELEMENTS] {
    // dY At: each row's four values to six.
    let mut z = [[0f32; L]; TILE * SIDE];
    for (zr, dr) in z.chunks_exact_mut(SIDE).zip(d.chunks_exact(TILE)) {
        for l in 0..L {
            let row = gradient_column([0, 1, 2, 3].map(|k| dr[k][l]));
            for (zv, v) in zr.iter_mut().zip(row) {
                zv[l] = v;
            }
        }
    }
    // A (dY At): across the rows, column by column.
    let mut dm = [[0f32; L]; ELEMENTS];
    for k in 0..SIDE {
        for l in 0..L {
            let col = gradient_column([0, 1, 2, 3].map(|r| z[SIDE * r + k][l]));
            for (a, value) in col.into_iter().enumerate() {
                dm[SIDE * a + k][l] = value;
            }
        }
    }
    dm
}

/// A transform of a block: the group's padded inputs into `V`, its output gradients into
/// `dM`, or the products `M` into the group's outputs.
enum Transform<'a, 'o> {
    /// The padded images `padded` into `v`.
    Inputs { padded: &'a [f32], v: &'a mut [f32] },
    /// The padded output gradients `padded` into `dm = A dY At`, zero in the columns that
    /// repeat a block's last tile.
    Gradients {
        padded: &'a [f32],
        dm: &'a mut [f32],
    },
    /// The products `m`, plus the bias, then the ReLU when `relu`, into the output images
    /// `out`.
    Outputs {
        m: &'a [f32],
        bias: Option<&'a [f32]>,
        relu: bool,
        out: &'a mut [&'o mut [f32]],
    },
}

/// A padded plane (see [`pairs_avx2::PaddedRows`]) in the widest vectors in use.
fn fill_padded_plane(dst: &mut [f32], pw: usize, src: &[f32], part: &pairs_avx2::PaddedRows) {
    if !pairs_avx512::padded_plane(dst, pw, src, part)
        && !pairs_avx2::padded_plane(dst, pw, src, part)
    {
        fill_padded(dst, pw, src, part);
    }
}

/// The portable [`pairs_avx2::padded_plane`].
fn fill_padded(dst: &mut [f32], pw: usize, src: &[f32], part: &pairs_avx2::PaddedRows) {
    for (r, row) in dst.chunks_exact_mut(pw).enumerate() {
        row.fill(0.0);
        if part.rows.contains(&r) {
            let from = (part.src_row + (r - part.rows.start)) * part.src_stride + part.src_col;
            row[part.col..part.col + part.len].copy_from_slice(&src[from..from + part.len]);
        }
    }
}

/// Input channels [`Winograd::new`] transforms at once, a lane each.
const KERNEL_LANES: usize = 8;

/// [`kernel_column`] of each lane: the taps of [`KERNEL_LANES`] kernels at once.
#[inline(always)]
fn kernel_columns(g: [[f32; KERNEL_LANES]; 3]) -> [[f32; KERNEL_LANES]; SIDE] {
    let mut out = [[0f32; KERNEL_LANES]; SIDE];
    for l in 0..KERNEL_LANES {
        let column = kernel_column([g[0][l], g[1][l], g[2][l]]);
        for (row, v) in out.iter_mut().zip(column) {
            row[l] = v;
        }
    }
    out
}

/// One column of `G g`: the 3 taps `g` to 6 values.
#[inline(always)]
fn kernel_column([g0, g1, g2]: [f32; 3]) -> [f32; SIDE] {
    // Multiplications by the reciprocals: divisions would dominate the kernel's transform.
    const SIXTH: f32 = 1.0 / 6.0;
    let (outer, inner) = (g0 * (SIXTH / 4.0) + g2 * SIXTH, g1 * (SIXTH / 2.0));
    [
        g0 * 0.25,
        -(g0 + g1 + g2) * SIXTH,
        -(g0 - g1 + g2) * SIXTH,
        outer + inner,
        outer - inner,
        g2,
    ]
}

/// One column of `A g` (`A` is `At` transposed): 4 output gradients to 6.
#[inline(always)]
fn gradient_column([g0, g1, g2, g3]: [f32; TILE]) -> [f32; SIDE] {
    let (even, odd) = (g0 + g2, g1 + g3);
    let (even4, odd2) = (g0 + 4.0 * g2, 2.0 * g1 + 8.0 * g3);
    [g0, even + odd, even - odd, even4 + odd2, even4 - odd2, g3]
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

/// One column of `Bt d`: 6 input values to 6.
#[inline(always)]
pub(super) fn input_column([d0, d1, d2, d3, d4, d5]: [f32; SIDE]) -> [f32; SIDE] {
    [
        4.0 * d0 - 5.0 * d2 + d4,
        -4.0 * (d1 + d2) + d3 + d4,
        4.0 * (d1 - d2) - d3 + d4,
        2.0 * (d3 - d1) - d2 + d4,
        2.0 * (d1 - d3) - d2 + d4,
        4.0 * d1 - 5.0 * d3 + d5,
    ]
}

/// One column of `At m`: 6 products to 4 outputs.
#[inline(always)]
pub(super) fn output_column([m0, m1, m2, m3, m4, m5]: [f32; SIDE]) -> [f32; TILE] {
    let (a, b) = (m1 + m2, m1 - m2);
    let (c, d) = (m3 + m4, m3 - m4);
    [m0 + a + c, b + 2.0 * d, a + 4.0 * c, b + 8.0 * d + m5]
}

/// A slice of `buf` exactly `len` long, growing `buf` when needed.
fn grow(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn blocks_widen_for_kernels_read_from_memory() {
        // (channels in and out), the tiles a block takes, and why.
        let cases = [
            ((64, 64), 48, "as many as fit the L2 budget"),
            ((16, 16), MAX_BLOCK, "no more than the most a block takes"),
            ((256, 256), NR, "fewest: 9 MiB of kernel stay cached"),
            ((512, 512), 2 * NR, "36 MiB of kernel read from memory"),
        ];
        for ((c, o), tiles, why) in cases {
            let plan = Plan {
                c,
                h: 4,
                w: 4,
                o,
                kh: 3,
                kw: 3,
                sh: 1,
                sw: 1,
                top: 1,
                left: 1,
                ho: 4,
                wo: 4,
            };
            assert_eq!(Winograd::block(&plan), tiles, "{c} -> {o} channels: {why}");
        }
    }

    #[test]
    fn declines_other_correlations() {
        let plan = |c, h, kh, sh| Plan {
            c,
            h,
            w: h,
            o: 64,
            kh,
            kw: kh,
            sh,
            sw: sh,
            top: 0,
            left: 0,
            ho: (h - kh) / sh + 1,
            wo: (h - kh) / sh + 1,
        };
        let tap = |_, _, _, _| 1.0;
        // (channels, input side, kernel side, stride), whether Winograd takes it, and why.
        let cases = [
            ((64, 17, 3, 1), true, "15x15 outputs"),
            ((64, 9, 3, 1), true, "7x7 outputs"),
            ((64, 6, 3, 1), true, "4x4 outputs: one whole tile"),
            ((64, 5, 3, 1), true, "3x3 outputs"),
            ((64, 34, 3, 1), true, "32x32 outputs"),
            ((64, 4, 3, 1), false, "2x2 outputs: a quarter of the tile"),
            ((8, 17, 3, 1), false, "too few channels"),
            ((64, 17, 3, 2), false, "strided"),
            ((64, 17, 1, 1), false, "1x1"),
        ];
        for ((c, h, kh, sh), takes, why) in cases {
            let taken = Winograd::new(&plan(c, h, kh, sh), tap).is_some();
            assert_eq!(taken, takes, "{why}");
        }
    }
}
