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
//!
//! The lowering's kernel (`kernel`), the blocks' sizes (`blocks`), the padded copies the
//! transforms read (`padding`), the tile transforms (`transforms`), the correlation of a group
//! of images (`forward`, which the input gradient runs too) and the kernel gradient
//! (`kernel_grad`) each have a module of their own.

use std::sync::OnceLock;

use super::plan::Plan;
use kernel::Kernel;

mod blocks;
#[cfg(target_arch = "x86_64")]
mod columns;
mod forward;
mod gradient_strips;
mod kernel;
mod kernel_grad;
mod padding;
mod pairs_avx2;
mod pairs_avx512;
mod transforms;

/// Output values along each side of a tile.
const TILE: usize = 4;

/// Input values along each side of a tile's input tile.
const SIDE: usize = TILE + 2;

/// Elements of a transformed tile (6x6).
const ELEMENTS: usize = SIDE * SIDE;

/// Fewest input and output channels for which the transforms pay for themselves.
pub(crate) const MIN_CHANNELS: usize = 16;

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
    /// Tiles per block (a multiple of [`NR`](super::microkernel::NR)).
    block: usize,
}

/// The buffers of one task: its group's padded images and output gradients (padded, or
/// transposed for `gradient_strips`), a block's transformed input `V[e][c][column]` and
/// products `M[e][o][column]` or output-gradient transforms (each element's matrix
/// [`element_stride`](blocks::element_stride) apart), and the tile in each column.
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
