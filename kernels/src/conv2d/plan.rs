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
//! rows at a time, a tile that stays in the core's L2 cache. When it would equal the input
//! (kernels one column wide, at unit strides, without padding) the GEMMs read the input
//! directly; when `c * kw` is too shallow for a GEMM to run well (the 3-channel images a first
//! layer sees), the kernel rows are folded into the expansion too, a full im2col, and each
//! tile takes one GEMM.

use rayon::prelude::*;

/// Output positions per tile the GEMMs aim for: enough rows for the micro-kernels to run at
/// full speed, few enough that the expanded tile stays in L2.
const TARGET_POSITIONS: usize = 512;

/// The most `f32`s an expanded tile may take (512 KiB), halved until it fits.
const TILE_BUDGET: usize = 128 * 1024;

/// Below this GEMM depth (`c * kw`, e.g. a 3-channel input image), the kernel rows are folded
/// into the expansion as well (a full im2col), so one deeper GEMM replaces `kh` shallow ones.
const FOLD_BELOW_DEPTH: usize = 64;

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

/// One tile's operand for the GEMMs: the input itself or the expansion in the scratch buffer,
/// the stride between consecutive GEMM depth indices, and the elements per plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Operand {
    /// Whether the GEMMs read the expansion (`true`) or the input directly.
    pub expanded: bool,
    /// Stride between consecutive GEMM depth indices.
    pub k_stride: usize,
    /// Offset of output position 0 at call 0.
    pub base: usize,
    /// Elements per plane (offset of the next row phase).
    pub plane: usize,
}

impl Plan {
    /// Elements of one input image.
    pub(crate) fn input_len(&self) -> usize {
        self.c * self.h * self.w
    }

    /// Elements of one output image.
    pub(crate) fn output_len(&self) -> usize {
        self.o * self.ho * self.wo
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

    /// Whether the kernel rows are folded into the expansion (one GEMM per tile).
    fn folded(&self) -> bool {
        self.kh > 1 && self.c * self.kw < FOLD_BELOW_DEPTH && !self.reads_input()
    }

    /// GEMMs per tile: one per kernel row, or one when the rows are folded.
    pub(crate) fn calls(&self) -> usize {
        if self.folded() {
            1
        } else {
            self.kh
        }
    }

    /// Row phases per `(channel, kernel column)`: every kernel row when folded, else the
    /// stride's phases the kernel reaches.
    fn phases(&self) -> usize {
        if self.folded() {
            self.kh
        } else {
            self.sh.min(self.kh)
        }
    }

    /// The GEMMs' inner dimension.
    pub(crate) fn depth(&self) -> usize {
        self.c * self.kw * if self.folded() { self.kh } else { 1 }
    }

    /// Elements of one expansion plane for a tile of `rows` output rows.
    fn plane_len(&self, rows: usize) -> usize {
        let extra = if self.folded() {
            0
        } else {
            (self.kh - 1) / self.sh
        };
        (rows + extra) * self.wo
    }

    /// Elements of the expansion of a tile of `rows` output rows (0 when the GEMMs read the
    /// input directly).
    pub(crate) fn expanded_len(&self, rows: usize) -> usize {
        if self.reads_input() {
            0
        } else {
            self.c * self.kw * self.phases() * self.plane_len(rows)
        }
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

    /// Offset in the operand of output position 0 for GEMM `call` (a kernel row, unless
    /// folded): kernel row `sh * u + r` reads phase `r` shifted down by `u` rows.
    pub(crate) fn call_offset(&self, operand: &Operand, call: usize) -> usize {
        if self.folded() {
            operand.base
        } else {
            operand.base + (call % self.sh) * operand.plane + (call / self.sh) * self.wo
        }
    }

    /// The kernel tap `(c, ky, kx)` that GEMM `call` multiplies at depth index `k`.
    fn tap(&self, call: usize, k: usize) -> (usize, usize, usize) {
        if self.folded() {
            let (ck, ky) = (k / self.kh, k % self.kh);
            (ck / self.kw, ky, ck % self.kw)
        } else {
            (k / self.kw, call, k % self.kw)
        }
    }

    /// Packs a kernel for the GEMMs: `packed[call][o][k] = tap(o, c, ky, kx)` for the tap
    /// `(c, ky, kx)` at depth `k` of `call`, where `tap` reads the source weights (so a caller
    /// can transpose, flip or subsample them while packing). The rows `(call, o)` are filled in
    /// parallel, each in depth order ([`Plan::pack_row`]).
    pub(crate) fn pack(&self, tap: impl Fn(usize, usize, usize, usize) -> f32 + Sync) -> Vec<f32> {
        /// Rows per rayon task, so a small kernel is packed in one.
        const MIN_ROWS: usize = 64;
        let depth = self.depth();
        let mut packed = vec![0f32; self.calls() * self.o * depth];
        if depth == 0 {
            return packed;
        }
        packed
            .par_chunks_mut(depth)
            .with_min_len(MIN_ROWS)
            .enumerate()
            .for_each(|(row, dst)| self.pack_row((row / self.o, row % self.o), &tap, dst));
        packed
    }

    /// Writes row `o` of GEMM `call` of the packed kernel (see [`Plan::pack`]) into `dst`,
    /// [`Plan::depth`] values in depth order: channel, kernel column, then (folded) kernel row.
    pub(crate) fn pack_row(
        &self,
        (call, o): (usize, usize),
        tap: &impl Fn(usize, usize, usize, usize) -> f32,
        dst: &mut [f32],
    ) {
        let folded = self.folded();
        let mut slots = dst.iter_mut();
        for c in 0..self.c {
            for kx in 0..self.kw {
                if folded {
                    for ky in 0..self.kh {
                        if let Some(slot) = slots.next() {
                            *slot = tap(o, c, ky, kx);
                        }
                    }
                } else if let Some(slot) = slots.next() {
                    *slot = tap(o, c, call, kx);
                }
            }
        }
    }

    /// Kernel-gradient entries per output channel: `c * kh * kw`.
    pub(crate) fn taps(&self) -> usize {
        self.c * self.kh * self.kw
    }

    /// Where packed depth index `k` of GEMM `call` lands within one output channel's
    /// `(c, kh, kw)` block of the kernel gradient.
    pub(crate) fn unpacked_index(&self, call: usize, k: usize) -> usize {
        let (c, ky, kx) = self.tap(call, k);
        (c * self.kh + ky) * self.kw + kx
    }

    /// Writes the expansion of output rows `i0 .. i0 + rows` of image `x` into `buf` (at least
    /// [`Plan::expanded_len`] long) and describes it, or describes `x` itself when it can be
    /// read directly.
    pub(crate) fn expand(&self, x: &[f32], i0: usize, rows: usize, buf: &mut [f32]) -> Operand {
        if self.reads_input() {
            return Operand {
                expanded: false,
                k_stride: self.h * self.w,
                base: i0 * self.wo,
                plane: self.h * self.w,
            };
        }
        let plane = self.plane_len(rows);
        let phases = self.phases();
        let hw = self.h * self.w;
        for (g, planes) in buf[..self.expanded_len(rows)]
            .chunks_exact_mut(phases * plane)
            .enumerate()
        {
            let (c, kx) = (g / self.kw, g % self.kw);
            let xc = &x[c * hw..(c + 1) * hw];
            for (r, plane) in planes.chunks_exact_mut(plane).enumerate() {
                self.expand_plane(xc, plane, (self.sh * i0 + r) as isize - self.top, kx);
            }
        }
        Operand {
            expanded: true,
            // Folded, every plane is a depth index; otherwise a depth index spans its phases.
            k_stride: if self.folded() { plane } else { phases * plane },
            base: 0,
            plane,
        }
    }

    /// Fills one plane: row `y` holds input row `row0 + sh * y` of channel `xc`, read from
    /// column `kx - left` at stride `sw`, zero outside the image.
    fn expand_plane(&self, xc: &[f32], plane: &mut [f32], row0: isize, kx: usize) {
        let (h, w, wo, sw) = (self.h, self.w, self.wo, self.sw);
        let shift = kx as isize - self.left;
        let (j0, j1) = valid_range(shift, sw, w, wo);
        if self.sh == 1 && sw == 1 && wo == w {
            // Consecutive rows of the plane are consecutive input rows, so the whole plane is
            // the channel shifted by a constant: one copy, then zero what wrapped around the
            // row ends or fell outside the image.
            let start = row0 * w as isize + shift;
            let lo = (-start).clamp(0, plane.len() as isize) as usize;
            let hi = (hw_isize(h, w) - start).clamp(lo as isize, plane.len() as isize) as usize;
            plane[..lo].fill(0.0);
            let from = (start + lo as isize) as usize;
            plane[lo..hi].copy_from_slice(&xc[from..from + (hi - lo)]);
            plane[hi..].fill(0.0);
            if j0 > 0 || j1 < wo {
                for row in plane.chunks_exact_mut(wo) {
                    row[..j0].fill(0.0);
                    row[j1..].fill(0.0);
                }
            }
            return;
        }
        for (y, row) in plane.chunks_exact_mut(wo).enumerate() {
            let yy = row0 + (self.sh * y) as isize;
            if yy < 0 || yy >= h as isize || j0 == j1 {
                row.fill(0.0);
                continue;
            }
            row[..j0].fill(0.0);
            row[j1..].fill(0.0);
            // The first input column read, at output column j0, lies inside the row.
            let x0 = yy as usize * w + ((sw * j0) as isize + shift) as usize;
            let n = j1 - j0;
            let src = &xc[x0..x0 + sw * (n - 1) + 1];
            gather(&mut row[j0..j1], src, sw);
        }
    }
}

/// `h * w` as a signed offset.
fn hw_isize(h: usize, w: usize) -> isize {
    (h * w) as isize
}

/// `dst[j] = src[stride * j]`, with `src` exactly `stride * (dst.len() - 1) + 1` long.
fn gather(dst: &mut [f32], src: &[f32], stride: usize) {
    match stride {
        1 => dst.copy_from_slice(src),
        2 => {
            // A constant stride the compiler vectorises; the last element has no pair.
            let (last, init) = dst.split_last_mut().unzip();
            for (d, pair) in init.unwrap_or_default().iter_mut().zip(src.chunks_exact(2)) {
                *d = pair[0];
            }
            if let (Some(d), Some(s)) = (last, src.last()) {
                *d = *s;
            }
        }
        _ => {
            for (d, s) in dst.iter_mut().zip(src.iter().step_by(stride)) {
                *d = *s;
            }
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

    fn plan(c: usize, (kh, kw): (usize, usize), (sh, sw): (usize, usize)) -> Plan {
        Plan {
            c,
            h: 3,
            w: 3,
            o: 1,
            kh,
            kw,
            sh,
            sw,
            top: 1,
            left: 1,
            ho: 3,
            wo: 3,
        }
    }

    #[test]
    fn folded_expansion_is_im2col() {
        // One 3x3 channel, 3x3 kernel, padding 1: shallow, so the kernel rows are folded.
        let plan = plan(1, (3, 3), (1, 1));
        assert!(plan.folded());
        assert_eq!((plan.calls(), plan.depth()), (1, 9));
        let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
        let mut buf = vec![f32::NAN; plan.expanded_len(3)];
        let op = plan.expand(&x, 0, 3, &mut buf);
        assert_eq!((op.k_stride, plan.call_offset(&op, 0)), (9, 0));
        // Tap (ky, kx) = (0, 0) reads rows -1..2, columns -1..2; tap (1, 0) rows 0..3.
        assert_eq!(&buf[..9], &[0., 0., 0., 0., 1., 2., 0., 4., 5.]);
        assert_eq!(&buf[9..18], &[0., 1., 2., 0., 4., 5., 0., 7., 8.]);
        // The packed kernel follows the same (c, kx, ky) order.
        let packed = plan.pack(|_, c, ky, kx| (100 * c + 10 * ky + kx) as f32);
        assert_eq!(&packed[..4], &[0., 10., 20., 1.]);
    }

    #[test]
    fn row_shifts_by_stride_phase() {
        // Deep enough not to fold: kernel row ky = 2u + r reads phase r, u rows down.
        let plan = plan(32, (3, 2), (2, 1));
        assert!(!plan.folded());
        assert_eq!((plan.calls(), plan.depth()), (3, 64));
        let x = vec![1f32; plan.input_len()];
        let mut buf = vec![f32::NAN; plan.expanded_len(2)];
        let op = plan.expand(&x, 0, 2, &mut buf);
        // Two phases of (2 + 1) rows of 3 per (channel, column).
        assert_eq!((op.plane, op.k_stride), (9, 18));
        let offsets: Vec<usize> = (0..3).map(|ky| plan.call_offset(&op, ky)).collect();
        assert_eq!(offsets, vec![0, 9, 3]);
        assert!(buf.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn packed_rows_follow_the_taps() {
        // Folded and unfolded plans, with more rows than one packing task takes.
        for plan in [plan(5, (3, 2), (1, 1)), plan(40, (3, 2), (2, 1))] {
            let mut plan = plan;
            plan.o = 70;
            let code = |o: usize, c: usize, ky: usize, kx: usize| {
                (((o * 100 + c) * 10 + ky) * 10 + kx) as f32
            };
            let packed = plan.pack(code);
            let depth = plan.depth();
            assert_eq!(packed.len(), plan.calls() * plan.o * depth);
            for (row, values) in packed.chunks_exact(depth).enumerate() {
                let (call, o) = (row / plan.o, row % plan.o);
                for (k, v) in values.iter().enumerate() {
                    let (c, ky, kx) = plan.tap(call, k);
                    assert_eq!(
                        *v,
                        code(o, c, ky, kx),
                        "{plan:?}: call {call}, o {o}, k {k}"
                    );
                }
            }
        }
    }
}
