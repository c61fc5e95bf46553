//! The padded copies a group's transforms read, so that no tile checks bounds: each input
//! channel in a plane of whole tiles (and the columns a pair's vector loads reach past the last
//! one), zero outside the image, and each output-gradient plane in whole tiles, zero past the
//! plane; written in the widest vectors in use.

use super::{grow, pairs_avx2, pairs_avx512, Winograd, TILE};

impl Winograd {
    /// Rows and columns of an image plane padded to cover every tile's input tile, and the
    /// next tile's first four columns (which a pair's vector loads reach).
    pub(super) fn padded_plane(&self) -> (usize, usize) {
        let (th, tw) = self.tiles();
        (TILE * th + 2, TILE * tw + 2 * TILE)
    }

    /// Copies each channel of the group's `images` images `x` into `padded`, a plane of
    /// [`Self::padded_plane`] each, zero outside the image, so every tile reads its input tile
    /// without bounds to check.
    pub(super) fn pad(&self, x: &[f32], images: usize, padded: &mut Vec<f32>) {
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

    /// Copies each output-gradient plane of the group's `images` images `dy` into `padded`, a
    /// plane of whole tiles each (`4 th x 4 tw`), zero past the plane.
    pub(super) fn pad_gradient(&self, dy: &[f32], images: usize, padded: &mut Vec<f32>) {
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
}

/// The columns `lo .. hi` of a padded row of `pw` that hold columns `lo - left ..` of an image
/// row `w` wide (the others are zero).
fn column_window(left: isize, w: usize, pw: usize) -> (usize, usize) {
    let lo = left.clamp(0, pw as isize) as usize;
    let hi = (left + w as isize).clamp(0, pw as isize) as usize;
    (lo, hi.max(lo))
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
