//! The transforms of a block's tiles, [`LANES`] tiles at a time: the padded inputs into
//! `V = Bt d B`, the padded output gradients into `dM = A dY At`, and the products back into
//! the outputs, `At M A` plus the bias, then the ReLU; in the pair kernels (`pairs_avx2`,
//! `pairs_avx512`) where the tiles lie in pairs of adjacent tiles, lane by lane in portable
//! code elsewhere. A block's transform is compiled for AVX-512 or AVX2 when the kernels use
//! them: those items allow `unsafe`, and each call into them has its `SAFETY` comment.

use super::blocks::element_stride;
use super::{pairs_avx2, pairs_avx512, Tile, Winograd, ELEMENTS, LANES, SIDE, TILE};
use crate::conv2d::epilogue;

impl Winograd {
    /// Runs a transform of a block, compiled for AVX-512 or AVX2 when the kernels use them.
    #[allow(unsafe_code)]
    pub(super) fn transform(&self, job: Transform<'_, '_>, tiles: &[Tile], width: usize) {
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
/// pair's first tile and lane `4 + j` the tile right of it (see [`LANE_TILE`](super::LANE_TILE)).
fn adjacent_pairs(lanes: &[Tile]) -> bool {
    lanes.len() == LANES && (0..LANES / 2).all(|j| lanes[j].precedes(&lanes[LANES / 2 + j]))
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
pub(super) fn transform_gradient<const L: usize>(
    d: &[[f32; L]; TILE * TILE],
) -> [[f32; L]; ELEMENTS] {
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
pub(super) enum Transform<'a, 'o> {
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

/// One column of `A g` (`A` is `At` transposed): 4 output gradients to 6.
#[inline(always)]
fn gradient_column([g0, g1, g2, g3]: [f32; TILE]) -> [f32; SIDE] {
    let (even, odd) = (g0 + g2, g1 + g3);
    let (even4, odd2) = (g0 + 4.0 * g2, 2.0 * g1 + 8.0 * g3);
    [g0, even + odd, even - odd, even4 + odd2, even4 - odd2, g3]
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
