//! The left operand of a product as the micro-kernel reads it, in panels of [`MR`] rows:
//! matrices packed panel by panel into one stack ([`PackedStack`]: a layer's kernel, one
//! matrix per GEMM, or Winograd's 36 transformed kernels), or rows read where they lie
//! ([`Panels::in_place`]); the tests pack one matrix from a view (`PackedLhs`). Nothing here needs `unsafe`, so the module denies it again under
//! `microkernel`'s allowance.

#![deny(unsafe_code)]

use super::MR;
use crate::conv2d::gemm::View;
use crate::output;

/// An `m x k` row-major matrix packed into panels of [`MR`] rows (the last one may be
/// shorter), each laid out `[k][rows]`, so the kernel reads a panel's column as consecutive
/// values.
#[cfg(test)]
#[derive(Debug, Clone, Default)]
pub(crate) struct PackedLhs {
    pub(super) data: Vec<f32>,
    m: usize,
    k: usize,
}

#[cfg(test)]
impl PackedLhs {
    /// Packs the row-major `m x k` matrix `lhs`.
    pub(crate) fn new(lhs: &[f32], m: usize, k: usize) -> candle_core::Result<Self> {
        let mut packed = Self::default();
        let view = View {
            data: lhs,
            offset: 0,
            rs: k,
            cs: 1,
        };
        packed.pack(view, m, k)?;
        Ok(packed)
    }

    /// Packs the `m x k` matrix `lhs` (any strides) in place of this one, reusing its memory.
    /// Returns an error (and packs nothing) when `lhs` does not fit its slice.
    pub(crate) fn pack(&mut self, lhs: View<'_>, m: usize, k: usize) -> candle_core::Result<()> {
        if !lhs.fits(m, k) {
            candle_core::bail!(
                "microkernel: a {m}x{k} matrix does not fit {}",
                lhs.describe()
            );
        }
        self.data.clear();
        self.data.resize(m * k, 0.0);
        for (r0, panel) in (0..m)
            .step_by(MR)
            .zip(self.data.chunks_mut((MR * k).max(1)))
        {
            let rows = MR.min(m - r0);
            for (kk, column) in panel.chunks_exact_mut(rows).enumerate() {
                let at = lhs.offset + r0 * lhs.rs + kk * lhs.cs;
                for (r, slot) in column.iter_mut().enumerate() {
                    *slot = lhs.data[at + r * lhs.rs];
                }
            }
        }
        (self.m, self.k) = (m, k);
        Ok(())
    }

    /// The panels, for [`product`](super::product).
    pub(crate) fn panels(&self) -> Panels<'_> {
        Panels {
            data: &self.data,
            m: self.m,
            k: self.k,
            layout: Layout::Packed {
                panel_stride: MR * self.k,
                matrix: 0,
            },
        }
    }
}

/// `count` matrices of `m x k`, each packed as [`PackedLhs`] packs one, stored panel by panel:
/// panel `p` of every matrix together, `[p][matrix][k][rows]`, so one task writes one panel of
/// all of them (Winograd's 36 transformed kernels, each output channel's at once).
#[derive(Debug, Clone, Default)]
pub(crate) struct PackedStack {
    data: Vec<f32>,
    count: usize,
    m: usize,
    k: usize,
}

impl PackedStack {
    /// The stack written by `fill(p, rows, out)` for each panel `p` (rows `MR * p ..
    /// MR * p + rows` of every matrix), in parallel: `out` is the panel of each matrix in
    /// turn, `[matrix][k][rows]`.
    pub(crate) fn build(
        count: usize,
        (m, k): (usize, usize),
        fill: impl Fn(usize, usize, &mut [f32]) + Sync + Send,
    ) -> Self {
        let chunk = count * MR * k;
        let data = output::try_by_chunk(count * m * k, chunk, true, None, |p, out| {
            fill(p, MR.min(m - MR * p), out);
            Ok::<(), std::convert::Infallible>(())
        });
        let Ok(data) = data;
        Self { data, count, m, k }
    }

    /// The panels of matrix `i`.
    pub(crate) fn panels(&self, i: usize) -> Panels<'_> {
        Panels {
            data: &self.data,
            m: self.m,
            k: self.k,
            layout: Layout::Packed {
                panel_stride: self.count * MR * self.k,
                matrix: i.min(self.count.saturating_sub(1)),
            },
        }
    }

    /// How many matrices the stack holds.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// The matrices unpacked, row-major, one after the other: `[matrix][m][k]`.
    pub(crate) fn unpacked(&self) -> Vec<f32> {
        let (m, k) = (self.m, self.k);
        let mut out = vec![0f32; self.count * m * k];
        for (i, matrix) in out.chunks_exact_mut((m * k).max(1)).enumerate() {
            let panels = self.panels(i);
            for r0 in (0..m).step_by(MR) {
                let rows = MR.min(m - r0);
                let panel = &self.data[panels.panel_start(r0 / MR, rows)..][..rows * k];
                for (kk, column) in panel.chunks_exact(rows).enumerate() {
                    for (r, v) in column.iter().enumerate() {
                        matrix[(r0 + r) * k + kk] = *v;
                    }
                }
            }
        }
        out
    }
}

/// The panels of an `m x k` left operand: packed (panel `p`, rows `MR * p ..`, `rows` of them,
/// holds `[k][rows]` at its start), or rows read in place, each value broadcast from where it
/// lies ([`Panels::in_place`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Panels<'a> {
    pub(super) data: &'a [f32],
    pub(super) m: usize,
    pub(super) k: usize,
    layout: Layout,
}

/// Where a [`Panels`]' values lie.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Packed: `panel_stride` from one panel of the matrix to the next, and which matrix of a
    /// [`PackedStack`] (0 for a [`PackedLhs`]).
    Packed { panel_stride: usize, matrix: usize },
    /// Row `r`, step `p` at `offset + r * rs + p * cs`.
    InPlace { offset: usize, rs: usize, cs: usize },
}

impl<'a> Panels<'a> {
    /// The `m x k` matrix `lhs` read where it lies, as rows of the micro-kernel's panels: for
    /// a left operand made once and read by one product (so packing it would cost a pass of
    /// its own), with rows a few at a time in cache.
    pub(crate) fn in_place(lhs: View<'a>, m: usize, k: usize) -> Self {
        Self {
            data: lhs.data,
            m,
            k,
            layout: Layout::InPlace {
                offset: lhs.offset,
                rs: lhs.rs,
                cs: lhs.cs,
            },
        }
    }

    /// Where panel `p` (of `rows` rows) starts, from one of its rows to the next, and from one
    /// step along `k` to the next.
    pub(super) fn panel(&self, p: usize, rows: usize) -> (usize, usize, usize) {
        match self.layout {
            Layout::Packed {
                panel_stride,
                matrix,
            } => (p * panel_stride + matrix * rows * self.k, 1, rows),
            Layout::InPlace { offset, rs, cs } => (offset + p * MR * rs, rs, cs),
        }
    }

    /// Where packed panel `p` (of `rows` rows) starts.
    fn panel_start(&self, p: usize, rows: usize) -> usize {
        self.panel(p, rows).0
    }

    /// Whether every panel lies inside `data`.
    pub(super) fn fits(&self) -> bool {
        if self.m == 0 {
            return true;
        }
        match self.layout {
            Layout::Packed { panel_stride, .. } => {
                let last = (self.m - 1) / MR;
                let rows = self.m - MR * last;
                let end = self.panel_start(last, rows) + rows * self.k;
                (last == 0 || panel_stride >= MR * self.k) && end <= self.data.len()
            }
            Layout::InPlace { offset, rs, cs } => View {
                data: self.data,
                offset,
                rs,
                cs,
            }
            .fits(self.m, self.k),
        }
    }
}
