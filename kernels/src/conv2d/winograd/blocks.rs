//! Block sizing: how many tiles a block takes, so that its transformed tiles stay in L2 (and at
//! least twice the micro-kernel's width when every block reads the transformed kernel from
//! memory), how many images a group takes, how a group's tiles are cut into blocks of
//! near-equal size, and which tile each of a block's columns holds; and the distance between a
//! block's element matrices.

use super::{Tile, Winograd, ELEMENTS, LANES, LANE_TILE, TILE};
use crate::conv2d::microkernel::NR;
use crate::conv2d::plan::Plan;

/// The most `f32`s a block's transformed input tiles should take (512 KiB), so they stay in L2
/// with the products.
const BLOCK_BUDGET: usize = 128 * 1024;

/// The most tiles in a block.
pub(super) const MAX_BLOCK: usize = 4 * NR;

/// The most `f32`s of a transformed kernel (16 MiB) taken to stay in cache between blocks.
/// A larger one (512 channels on both sides: 36 MiB) is read from memory by every block, so
/// its blocks take twice [`NR`] tiles at least, even past [`BLOCK_BUDGET`]: ResNet's last
/// stage, one tile per image, read it once per 32 images instead of once per 16 (forward pass
/// 36 -> 28 ms at batch 64 on a 2-core Zen 4).
const CACHED_KERNEL: usize = 4 << 20;

impl Winograd {
    /// Tiles per block for `plan`: as many as fit [`BLOCK_BUDGET`], a multiple of [`NR`]; at
    /// least two of them when the transformed kernel is larger than [`CACHED_KERNEL`], since
    /// every block then reads it from memory.
    pub(super) fn block(plan: &Plan) -> usize {
        let fits = (BLOCK_BUDGET / (ELEMENTS * plan.c) / NR * NR).clamp(NR, MAX_BLOCK);
        if ELEMENTS * plan.o * plan.c > CACHED_KERNEL {
            fits.max(2 * NR)
        } else {
            fits
        }
    }

    /// Tiles of one image: `(rows, columns)`.
    pub(super) fn tiles(&self) -> (usize, usize) {
        (self.plan.ho.div_ceil(TILE), self.plan.wo.div_ceil(TILE))
    }

    /// Images whose tiles fill a block.
    pub(crate) fn images_per_block(&self) -> usize {
        let (th, tw) = self.tiles();
        self.block.div_ceil(th * tw).max(1)
    }

    /// Images to correlate together out of `n`, over `threads` threads: enough to fill a block,
    /// but no fewer groups than threads while there are images. (Groups sized in whole rounds
    /// over the threads, as the side-by-side GEMMs take them, change a block's width with the
    /// batch, and with it an image's bits: inference at batch 64 and 100 differed.)
    pub(crate) fn group(&self, n: usize, threads: usize) -> usize {
        self.images_per_block()
            .min(n.div_ceil(threads.max(1)))
            .max(1)
    }

    /// The tiles of a group of `images` images (numbered row-major through them) in blocks of
    /// at most `self.block` tiles, near-equal in size.
    pub(super) fn blocks(&self, images: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
        let (th, tw) = self.tiles();
        let tiles = images * th * tw;
        let per_block = tiles.div_ceil(tiles.div_ceil(self.block).max(1)).max(1);
        (0..tiles)
            .step_by(per_block)
            .map(move |t0| t0..(t0 + per_block).min(tiles))
    }

    /// The tile in each of a block's `width` columns, for tiles `range` of a group: column
    /// `8g + l` holds tile `8g + LANE_TILE[l]`; the columns past the block's tiles repeat its
    /// last one (their products are computed, the micro-kernel's width, but never written out).
    pub(super) fn block_tiles(
        &self,
        range: std::ops::Range<usize>,
        width: usize,
        tiles: &mut Vec<Tile>,
    ) {
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
}

/// The distance between consecutive elements' matrices of `len` values in a block's buffers:
/// `len` and one cache line more, so the rows a transform writes (or reads) at once fall in
/// distinct cache sets even when `len` is a multiple of the L1 cache's way size.
pub(super) fn element_stride(len: usize) -> usize {
    len + 16
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
