//! The kernel gradient's output-gradient transform with output channels in the lanes:
//! `dM = A dY At` of each tile of a block, sixteen output channels at a time, read from the
//! output gradient transposed (its channels contiguous) and written as the micro-kernel's
//! strips ([`super::microkernel::Strips`]). So `dU[e]^T (c x o) = V[e] (c x tiles) *
//! dM[e]^T (tiles x o)` runs in the micro-kernel with `V` read where its transform wrote it and
//! nothing packed: the `gemm` crate, which these products went to before, packs both operands
//! of every product.

use super::transforms::transform_gradient;
use super::{Tile, ELEMENTS, TILE};

/// Output channels the transform takes at once, one per lane (a strip holds one or more sets).
pub(super) const CHANNELS: usize = 16;

/// The sizes of the output gradient a block's tiles are read from: `(ho, wo, o)`.
pub(super) type GradientShape = (usize, usize, usize);

/// Writes `dM[e]` of the block's `tiles` (column `j` holds `tiles[j]`; its values are zero
/// where the tile is not real) into `dm`: element `e` at `e * stride`, as strips of `nr` output
/// channels (`nr` a multiple of [`CHANNELS`]), strip `s` at `s * tiles.len() * nr` holding a
/// row of `nr` channels per column, zero past the `o` channels. `dyt` holds the group's output
/// gradients transposed: image `i`'s value at `(y, x)` of channel `oi` at `((i * ho + y) * wo
/// + x) * o + oi`; the tiles' positions past the plane read zero.
pub(super) fn write(
    dyt: &[f32],
    (ho, wo, o): GradientShape,
    tiles: &[Tile],
    (nr, dm, stride): (usize, &mut [f32], usize),
) {
    let width = tiles.len();
    debug_assert_eq!(nr % CHANNELS, 0);
    debug_assert!(dm.len() >= (ELEMENTS - 1) * stride + o.div_ceil(nr) * width * nr);
    crate::simd::vectorized(
        #[inline(always)]
        || {
            for (column, tile) in tiles.iter().enumerate() {
                for o0 in (0..o.next_multiple_of(nr)).step_by(CHANNELS) {
                    let lanes = o.saturating_sub(o0).min(CHANNELS);
                    let mut d = [[0f32; CHANNELS]; TILE * TILE];
                    if tile.real && lanes > 0 {
                        for (q, values) in d.iter_mut().enumerate() {
                            let (y, x) = (TILE * tile.ti + q / TILE, TILE * tile.tj + q % TILE);
                            if y < ho && x < wo {
                                let from = ((tile.image * ho + y) * wo + x) * o + o0;
                                let src = &dyt[from..from + lanes];
                                match <&[f32; CHANNELS]>::try_from(src) {
                                    // A fixed-size copy, one vector load.
                                    Ok(all) => *values = *all,
                                    Err(_) => values[..lanes].copy_from_slice(src),
                                }
                            }
                        }
                    }
                    let at = o0 / nr * width * nr + column * nr + o0 % nr;
                    for (e, values) in transform_gradient(&d).iter().enumerate() {
                        dm[e * stride + at..][..CHANNELS].copy_from_slice(values);
                    }
                }
            }
        },
    );
}
