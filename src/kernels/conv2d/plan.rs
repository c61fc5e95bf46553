//! The geometry of one image's correlation and its lowering to GEMMs by row shifts.
//!
//! A [`Plan`] correlates a `(c, h, w)` image with an `(o, c, kh, kw)` kernel at strides
//! `(sh, sw)`, reading input row `sh * i + ky - top` and column `sw * j + kx - left` for output
//! `(i, j)` (outside the image reads zero), into an `(o, ho, wo)` output.
//!
//! Instead of a full im2col matrix (`c * kh * kw` rows), the input is *expanded* along one axis
//! only: for each channel `c`, kernel column `kx` and row phase `r < sh`, a plane holds
//! `E[c, kx, r][y][j] = x[sh * y + r - top][sw * j + kx - left]`, `wo` columns wide. Kernel row
//! `ky = sh * u + r` then reads plane `(c, kx, r)` shifted down by `u` rows, and since the planes
//! are exactly `wo` wide, that shift is a constant offset `u * wo` of the flattened output
//! position. So the correlation is `kh` GEMMs, one per kernel row, each
//! `out (positions x o) += E_shifted (positions x c*kw) * W_ky (c*kw x o)`, with no wasted
//! columns and a copy `kh` times smaller than im2col's. The expansion is built a few output
//! rows at a time, a tile that stays in the core's L2 cache; when it would equal the input
//! (1xN kernels at stride 1 without horizontal padding or vertical padding) the GEMMs read the
//! input directly.

/// Output positions per tile the GEMMs aim for: enough rows for the micro-kernels to run at
/// full speed, few enough that the expanded tile stays in L2.
const TARGET_POSITIONS: usize = 256;

/// The most `f32`s an expanded tile may take (512 KiB), halved until it fits.
const TILE_BUDGET: usize = 128 * 1024;

/// The geometry of one image's correlation (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Input channels, height and width.
    pub c: usize,
    pub h: usize,
    pub w: usize,
    /// Output channels.
    pub o: usize,
    /// Kernel height and width.
    pub kh: usize,
    pub kw: usize,
    /// Vertical and horizontal strides.
    pub sh: usize,
    pub sw: usize,
    /// Input row and column read by output `(0, 0)` at kernel tap `(0, 0)`, negated.
    pub top: isize,
    pub left: isize,
    /// Output height and width.
    pub ho: usize,
    pub wo: usize,
}

/// Where a GEMM's expanded operand lives: in the input itself or in the scratch buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    Input,
    Expanded,
}

/// One tile's expanded operand: its buffer, the stride between its `c * kw` GEMM rows
/// (channels-and-columns), and the offset of kernel row 0.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand {
    pub source: Source,
    pub k_stride: usize,
    pub base: usize,
    /// Elements per plane (offset of the next row phase).
    pub plane: usize,
}

impl Operand {
    /// Offset of kernel row `ky`'s shifted plane, for a plan with vertical stride `sh`.
    pub(crate) fn row_offset(&self, ky: usize, sh: usize, wo: usize) -> usize {
        self.base + (ky % sh) * self.plane + (ky / sh) * wo
    }
}

impl Plan {
    /// Elements of one input image and of one output image.
    pub(crate) fn input_len(&self) -> usize {
        self.c * self.h * self.w
    }

    /// Elements of one output image.
    pub(crate) fn output_len(&self) -> usize {
        self.o * self.ho * self.wo
    }

    /// The GEMMs' inner dimension: channels times kernel columns.
    pub(crate) fn depth(&self) -> usize {
        self.c * self.kw
    }

    /// Row phases the expansion keeps: `sh`, or fewer when the kernel is shorter.
    fn phases(&self) -> usize {
        self.sh.min(self.kh)
    }

    /// Elements of one expansion plane for a tile of `rows` output rows.
    fn plane_len(&self, rows: usize) -> usize {
        (rows + (self.kh - 1) / self.sh) * self.wo
    }

    /// Elements of the expansion of a tile of `rows` output rows (0 when the GEMMs read the
    /// input directly).
    pub(crate) fn expanded_len(&self, rows: usize) -> usize {
        if self.reads_input() {
            0
        } else {
            self.depth() * self.phases() * self.plane_len(rows)
        }
    }

    /// Whether the expansion would equal the input, so the GEMMs read it directly: one kernel
    /// column, unit strides, no padding, full-width rows.
    fn reads_input(&self) -> bool {
        self.kw == 1
            && self.sh == 1
            && self.sw == 1
            && self.top == 0
            && self.left == 0
            && self.wo == self.w
            && self.ho + self.kh - 1 <= self.h
    }

    /// Output rows per tile: about [`TARGET_POSITIONS`] positions within [`TILE_BUDGET`],
    /// balanced so the tiles have near-equal heights.
    pub(crate) fn tile_rows(&self) -> usize {
        let mut rows = TARGET_POSITIONS
            .div_ceil(self.wo.max(1))
            .clamp(1, self.ho.max(1));
        while rows > 1 && self.expanded_len(rows) > TILE_BUDGET {
            rows = rows.div_ceil(2);
        }
        let tiles = self.ho.div_ceil(rows).max(1);
        self.ho.div_ceil(tiles).max(1)
    }

    /// Writes the expansion of output rows `i0 .. i0 + rows` of image `x` into `buf` (at least
    /// [`Plan::expanded_len`] long) and describes it, or describes `x` itself when it can be
    /// read directly.
    pub(crate) fn expand(&self, x: &[f32], i0: usize, rows: usize, buf: &mut [f32]) -> Operand {
        if self.reads_input() {
            return Operand {
                source: Source::Input,
                k_stride: self.h * self.w,
                base: i0 * self.wo,
                plane: self.h * self.w,
            };
        }
        let plane = self.plane_len(rows);
        let phases = self.phases();
        let rows_in = rows + (self.kh - 1) / self.sh;
        let (h, w, wo) = (self.h, self.w, self.wo);
        for c in 0..self.c {
            let xc = &x[c * h * w..(c + 1) * h * w];
            for kx in 0..self.kw {
                let shift = kx as isize - self.left;
                let (j0, j1) = valid_range(shift, self.sw, w, wo);
                for r in 0..phases {
                    let start = ((c * self.kw + kx) * phases + r) * plane;
                    let planes = &mut buf[start..start + rows_in * wo];
                    for (y, row) in planes.chunks_exact_mut(wo).enumerate() {
                        let yy = (self.sh * (i0 + y) + r) as isize - self.top;
                        if yy < 0 || yy >= h as isize {
                            row.fill(0.0);
                            continue;
                        }
                        let src = &xc[yy as usize * w..(yy as usize + 1) * w];
                        row[..j0].fill(0.0);
                        row[j1..].fill(0.0);
                        // First input column read, at output column j0.
                        let x0 = (self.sw * j0) as isize + shift;
                        if j1 > j0 {
                            let x0 = x0 as usize;
                            if self.sw == 1 {
                                row[j0..j1].copy_from_slice(&src[x0..x0 + (j1 - j0)]);
                            } else {
                                for (d, s) in row[j0..j1]
                                    .iter_mut()
                                    .zip(src[x0..].iter().step_by(self.sw))
                                {
                                    *d = *s;
                                }
                            }
                        }
                    }
                }
            }
        }
        Operand {
            source: Source::Expanded,
            k_stride: phases * plane,
            base: 0,
            plane,
        }
    }
}

/// The output columns `j0 .. j1` of `0 .. wo` whose input column `stride * j + shift` lies in
/// `0 .. w`.
fn valid_range(shift: isize, stride: usize, w: usize, wo: usize) -> (usize, usize) {
    let s = stride as isize;
    // Smallest j with s * j + shift >= 0, and one past the largest with s * j + shift < w.
    let lo = (-shift).max(0);
    let j0 = ((lo + s - 1) / s) as usize;
    let hi = w as isize - shift;
    let j1 = if hi <= 0 {
        0
    } else {
        ((hi + s - 1) / s) as usize
    };
    let j0 = j0.min(wo);
    (j0, j1.clamp(j0, wo))
}

/// Packs a kernel for the row-shift GEMMs: `packed[ky][o][c * kw + kx] = tap(o, c, ky, kx)`
/// for an `(o, c, kh, kw)` kernel, where `tap` reads the source weights (so a caller can
/// transpose, flip or subsample them while packing).
pub(crate) fn pack_kernel(
    (o, c, kh, kw): (usize, usize, usize, usize),
    tap: impl Fn(usize, usize, usize, usize) -> f32,
) -> Vec<f32> {
    let mut packed = Vec::with_capacity(kh * o * c * kw);
    for ky in 0..kh {
        for oi in 0..o {
            for ci in 0..c {
                for kx in 0..kw {
                    packed.push(tap(oi, ci, ky, kx));
                }
            }
        }
    }
    packed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_columns() {
        // 3-wide kernel, padding 1, stride 1, width 5: column 0 reads x[-1] at kx = 0.
        assert_eq!(valid_range(-1, 1, 5, 5), (1, 5));
        assert_eq!(valid_range(1, 1, 5, 5), (0, 4));
        // Stride 2 over width 5 without padding: columns 0, 2 read x[0], x[2], x[4].
        assert_eq!(valid_range(0, 2, 5, 2), (0, 2));
        assert_eq!(valid_range(2, 2, 5, 2), (0, 2));
        // Entirely outside.
        assert_eq!(valid_range(7, 1, 5, 3), (0, 0));
        assert_eq!(valid_range(-9, 1, 5, 3), (3, 3));
    }

    #[test]
    fn expansion_reads_shifted_rows() {
        // One 3x3 channel, 3x3 kernel, padding 1: plane (kx = 0) for output rows 0..3.
        let plan = Plan {
            c: 1,
            h: 3,
            w: 3,
            o: 1,
            kh: 3,
            kw: 3,
            sh: 1,
            sw: 1,
            top: 1,
            left: 1,
            ho: 3,
            wo: 3,
        };
        let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
        let mut buf = vec![f32::NAN; plan.expanded_len(3)];
        let op = plan.expand(&x, 0, 3, &mut buf);
        assert_eq!(op.k_stride, 15);
        // Rows -1..4 of the padded image, column shifted right by one (kx = 0).
        assert_eq!(
            &buf[..15],
            &[0., 0., 0., 0., 1., 2., 0., 4., 5., 0., 7., 8., 0., 0., 0.]
        );
        // Kernel row 2 starts two rows down.
        assert_eq!(op.row_offset(2, 1, 3), 6);
    }
}
