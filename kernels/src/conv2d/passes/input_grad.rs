//! The input gradient ([`input_grad`]): one stride-1 correlation of the output gradient with
//! the flipped, transposed kernel per stride phase, each written into its strided positions of
//! the gradient a row at a time (two column phases at stride 2 interleaved in one pass); at
//! unit strides one correlation of the whole image, through Winograd's transforms where they
//! suit, several small images to a GEMM, or one image at a time.

use rayon::prelude::*;

use super::forward::correlate_image;
use super::side_by_side::{correlate_group, image_group};
use super::{at_least, map_groups, Conv};
use crate::conv2d::epilogue::Epilogue;
use crate::conv2d::lowered::PackedKernel;
use crate::conv2d::plan::Plan;
use crate::conv2d::transpose::transpose;
use crate::conv2d::winograd::Winograd;
use crate::output::ImagesMut;

/// A new output of the 3x3, stride-1 correlation of the `n` images of `x` through
/// [`Winograd`], a group of images per task.
fn winograd_images(
    wino: &Winograd,
    n: usize,
    x: (&[f32], usize),
    out_len: usize,
    bias: Option<&[f32]>,
) -> candle_core::Result<Vec<f32>> {
    let group = wino.group(n, rayon::current_num_threads());
    map_groups(n, group, x, (out_len, None), |x, mut y, s, par| {
        let epilogue = Epilogue {
            bias,
            ..Default::default()
        };
        wino.correlate(x, epilogue, &mut y, &mut s.winograd, par)
    })
}

/// Whether [`input_grad`] adds its `add` as it writes the gradient (its direct correlations
/// do), rather than in a pass of its own after Winograd's correlation.
pub(crate) fn input_grad_adds_in_place(conv: &Conv) -> bool {
    // Winograd's runs only where one phase covers the whole input.
    let winograd = conv.stride == (1, 1)
        && conv
            .phase_plan(0, 0)
            .is_some_and(|(plan, _)| Winograd::suits(&plan));
    !winograd
}

/// One stride phase `(ry, rx)` of the input gradient: the padded-input positions
/// `(sh * a + ry, sw * b + rx)` that fall inside the image, as a stride-1 correlation of the
/// output gradient with the kernel taps `(ry + sh * u, rx + sw * v)`, flipped and transposed.
struct Phase {
    /// The correlation, over `dy`'s `o` channels into `c` channels.
    plan: Plan,
    /// Its packed kernel (empty when lowered to Winograd's).
    kernel: PackedKernel,
    /// The correlation lowered to [`Winograd`], when it suits.
    winograd: Option<Winograd>,
    /// First input row and column (unpadded) of the phase, and the steps between them.
    y0: usize,
    x0: usize,
}

/// The first index `a >= 0` with `s * a + r >= lo`, and one past the last with
/// `s * a + r < hi`.
fn phase_range(r: usize, s: usize, lo: usize, hi: usize) -> (usize, usize) {
    let first = lo.saturating_sub(r).div_ceil(s);
    let end = hi.saturating_sub(r).div_ceil(s);
    (first, end.max(first))
}

impl Conv {
    /// The stride phases of the input gradient that hold at least one input position.
    /// The correlation of stride phase `(ry, rx)` of the input gradient (see [`Phase`]) and the
    /// first padded-input row and column it covers, or `None` when no input position falls in
    /// the phase.
    fn phase_plan(&self, ry: usize, rx: usize) -> Option<(Plan, (usize, usize))> {
        let (sh, sw) = self.stride;
        let (pt, _, pl, _) = self.pad;
        let (a0, a1) = phase_range(ry, sh, pt, pt + self.h);
        let (b0, b1) = phase_range(rx, sw, pl, pl + self.w);
        if a1 == a0 || b1 == b0 {
            return None;
        }
        // Taps of this phase: ky = ry + sh * u for u < kh', likewise kx.
        let khp = self.kh.saturating_sub(ry).div_ceil(sh);
        let kwp = self.kw.saturating_sub(rx).div_ceil(sw);
        let plan = Plan {
            c: self.o,
            h: self.ho,
            w: self.wo,
            o: self.c,
            kh: khp,
            kw: kwp,
            sh: 1,
            sw: 1,
            top: khp as isize - 1 - a0 as isize,
            left: kwp as isize - 1 - b0 as isize,
            ho: a1 - a0,
            wo: b1 - b0,
        };
        Some((plan, (a0, b0)))
    }

    fn phases(&self, w: &[f32]) -> candle_core::Result<Vec<Phase>> {
        let (sh, sw) = self.stride;
        let (pt, _, pl, _) = self.pad;
        let (o, c, kh, kw) = (self.o, self.c, self.kh, self.kw);
        // The kernel with its two channel axes swapped, so each packed row reads it in order.
        let wt = transpose_channels(w, o, c, kh * kw);
        let mut phases = Vec::new();
        for ry in 0..sh {
            for rx in 0..sw {
                let Some((plan, (a0, b0))) = self.phase_plan(ry, rx) else {
                    continue;
                };
                let (khp, kwp) = (plan.kh, plan.kw);
                let tap = |ci, oi, u, v| {
                    let ky = ry + sh * (khp - 1 - u);
                    let kx = rx + sw * (kwp - 1 - v);
                    wt[((ci * o + oi) * kh + ky) * kw + kx]
                };
                let winograd = Winograd::new(&plan, tap);
                let kernel = match winograd {
                    Some(_) => PackedKernel::none(),
                    None => PackedKernel::new(&plan, tap),
                };
                phases.push(Phase {
                    plan,
                    kernel,
                    winograd,
                    y0: sh * a0 + ry - pt,
                    x0: sw * b0 + rx - pl,
                });
            }
        }
        Ok(phases)
    }
}

/// The `(c, o, taps)` kernel of an `(o, c, taps)` one: the channel axes swapped, a block of
/// output channels at a time so that both sides are read and written in runs.
fn transpose_channels(w: &[f32], o: usize, c: usize, taps: usize) -> Vec<f32> {
    const BLOCK: usize = 16;
    let mut wt = vec![0f32; w.len()];
    if taps == 1 {
        // A 1x1 kernel: a plain transpose, 8x8 blocks at a time.
        transpose(w, o, c, &mut wt);
        return wt;
    }
    for o0 in (0..o).step_by(BLOCK) {
        let o1 = (o0 + BLOCK).min(o);
        for ci in 0..c {
            let out = &mut wt[(ci * o + o0) * taps..(ci * o + o1) * taps];
            for (oi, dst) in (o0..o1).zip(out.chunks_exact_mut(taps)) {
                let at = (oi * c + ci) * taps;
                dst.copy_from_slice(&w[at..at + taps]);
            }
        }
    }
    wt
}

/// The gradient of the input, `dx (n, c, h, w)`, from `dy (n, o, ho, wo)` and `w`. At unit
/// strides it is one correlation of `dy` with the flipped, transposed kernel; otherwise each
/// stride phase is one, written into its strided positions of `dx`.
pub(crate) fn input_grad(
    conv: &Conv,
    dy: &[f32],
    w: &[f32],
    add: Option<&[f32]>,
) -> candle_core::Result<Vec<f32>> {
    let phases = conv.phases(w)?;
    let (sh, sw) = conv.stride;
    let in_len = conv.c * conv.h * conv.w;
    if add.is_some_and(|a| a.len() != conv.n * in_len) {
        candle_core::bail!(
            "conv2d_input_grad: {} values to add to {} input-gradient values",
            add.map_or(0, <[f32]>::len),
            conv.n * in_len
        );
    }
    let into = add.is_some();
    let direct = sh == 1 && sw == 1;
    let dy_len = conv.o * conv.ho * conv.wo;
    // Where each phase's result starts in the phase buffer, and the runs of phases that share
    // a row residue (consecutive, since the phases are ordered by row residue first).
    let phase_offsets: Vec<usize> = phases
        .iter()
        .scan(0, |at, p| {
            let start = *at;
            *at += p.plan.output_len();
            Some(start)
        })
        .collect();
    let phase_total: usize = phases.iter().map(|p| p.plan.output_len()).sum();
    let mut row_groups: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, p) in phases.iter().enumerate() {
        match row_groups.last_mut() {
            Some(g) if phases[g.start].y0 == p.y0 => g.end = i + 1,
            _ => row_groups.push(i..i + 1),
        }
    }
    if let [Phase {
        winograd: Some(wino),
        ..
    }] = phases.as_slice()
    {
        // A 3x3 kernel at unit strides: one phase, the whole image, through Winograd's.
        let mut dx = winograd_images(wino, conv.n, (dy, dy_len), in_len, None)?;
        if let Some(add) = add {
            dx.par_chunks_mut(in_len.max(1))
                .zip(add.par_chunks(in_len.max(1)))
                .for_each(|(d, a)| d.iter_mut().zip(a).for_each(|(d, a)| *d += a));
        }
        return Ok(dx);
    }
    let dx_len = (in_len, add);
    if let (true, [phase]) = (direct, phases.as_slice()) {
        let group = image_group(&phase.plan, &phase.kernel, conv.n);
        if group > 1 {
            return map_groups(conv.n, group, (dy, dy_len), dx_len, |dy, mut dx, s, _| {
                let kernel = (&phase.kernel, Epilogue::default());
                correlate_group(&phase.plan, dy, kernel, (&mut dx, into), s)
            });
        }
    }
    // Strided: small phases go several images to a GEMM when every phase with taps can.
    let group = match direct {
        true => 1,
        false => phases
            .iter()
            .filter(|p| p.plan.kh > 0 && p.plan.kw > 0)
            .map(|p| image_group(&p.plan, &p.kernel, conv.n))
            .min()
            .unwrap_or(1),
    };
    map_groups(conv.n, group, (dy, dy_len), dx_len, |dy, mut dx, s, par| {
        if direct {
            let Some(dx) = dx.each().next() else {
                return Ok(());
            };
            // One phase covering the whole image, in place (phases is never empty here: a
            // stride-1 convolution reads every input position).
            return phases.iter().try_for_each(|p| {
                let dx = (&mut *dx, into);
                let kernel = (&p.kernel, Epilogue::default());
                correlate_image(&p.plan, dy, kernel, dx, &mut s.expanded, par)
            });
        }
        // Every phase of every image of the group into its own part of one buffer
        // (`[phase][image][values]`), then `dx` a row at a time, each row gathered from the
        // phases of its row residue, so its cache lines are written at once.
        let g = dx.count();
        let mut buffer = std::mem::take(&mut s.phase);
        let z = at_least(&mut buffer, g * phase_total);
        for (p, &at) in phases.iter().zip(&phase_offsets) {
            let len = p.plan.output_len();
            let zp = &mut z[g * at..g * (at + len)];
            let kernel = (&p.kernel, Epilogue::default());
            if p.plan.kh == 0 || p.plan.kw == 0 {
                // No kernel tap lands on these positions: their gradient is zero.
                zp.fill(0.0);
            } else if g > 1 {
                let mut images = ImagesMut::new(zp.chunks_exact_mut(len.max(1)).collect());
                correlate_group(&p.plan, dy, kernel, (&mut images, false), s)?;
            } else {
                correlate_image(&p.plan, dy, kernel, (zp, false), &mut s.expanded, par)?;
            }
        }
        let z = &*z;
        let (h, w) = (conv.h, conv.w);
        for (i, dx) in dx.each().enumerate() {
            for (ci, dxc) in dx.chunks_exact_mut(h * w).enumerate() {
                for group in row_groups.iter() {
                    let (group, offsets) = (&phases[group.clone()], &phase_offsets[group.clone()]);
                    let (first, rows) = (&group[0], group[0].plan.ho);
                    for a in 0..rows {
                        let row = &mut dxc[(first.y0 + sh * a) * w..][..w];
                        let z_row = |k: usize| {
                            let (wb, len) = (group[k].plan.wo, group[k].plan.output_len());
                            &z[g * offsets[k] + i * len + (ci * rows + a) * wb..][..wb]
                        };
                        match group {
                            // Two column phases at stride 2 side by side: one interleaving pass.
                            [p, q] if sw == 2 && q.x0 == p.x0 + 1 => {
                                interleave(&mut row[p.x0..], (z_row(0), z_row(1)), into);
                            }
                            [p, q] if sw == 2 && p.x0 == q.x0 + 1 => {
                                interleave(&mut row[q.x0..], (z_row(1), z_row(0)), into);
                            }
                            _ => {
                                for (k, p) in group.iter().enumerate() {
                                    let columns = row[p.x0..].iter_mut().step_by(sw);
                                    write_or_add(columns.zip(z_row(k)), into);
                                }
                            }
                        }
                    }
                }
            }
        }
        s.phase = buffer;
        Ok(())
    })
}

/// Writes (or, when `into`, adds) `even[b]` to `row[2 * b]` and `odd[b]` to `row[2 * b + 1]`,
/// pairs of columns at a time.
fn interleave(row: &mut [f32], (even, odd): (&[f32], &[f32]), into: bool) {
    let pairs = even.len().min(odd.len()).min(row.len() / 2);
    let (head, tail) = row.split_at_mut(2 * pairs);
    let slots = head
        .as_chunks_mut::<2>()
        .0
        .iter_mut()
        .zip(even.iter().zip(odd));
    if into {
        slots.for_each(|(pair, (e, o))| *pair = [pair[0] + e, pair[1] + o]);
    } else {
        slots.for_each(|(pair, (e, o))| *pair = [*e, *o]);
    }
    // A last column of an odd width.
    write_or_add(tail.iter_mut().step_by(2).zip(&even[pairs..]), into);
    let odd_tail = tail.get_mut(1..).unwrap_or_default();
    write_or_add(odd_tail.iter_mut().step_by(2).zip(&odd[pairs..]), into);
}

/// Writes (or, when `into`, adds) each value to its slot.
#[inline(always)]
fn write_or_add<'a>(slots: impl Iterator<Item = (&'a mut f32, &'a f32)>, into: bool) {
    if into {
        slots.for_each(|(d, v)| *d += *v);
    } else {
        slots.for_each(|(d, v)| *d = *v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swaps_kernel_channel_axes() {
        for (o, c, taps) in [(35, 6, 9), (40, 17, 1)] {
            let w: Vec<f32> = (0..o * c * taps).map(|v| v as f32).collect();
            let wt = transpose_channels(&w, o, c, taps);
            for oi in 0..o {
                for ci in 0..c {
                    for t in 0..taps {
                        assert_eq!(wt[(ci * o + oi) * taps + t], w[(oi * c + ci) * taps + t]);
                    }
                }
            }
        }
    }
}
