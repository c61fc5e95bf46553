//! Strided `f32` matrix products on slices, bounds-checked, over the `gemm` crate.
//!
//! `gemm` picks its micro-kernels at run time from the CPU's features (AVX-512 where present,
//! through the workspace's `x86-v4` feature), and takes raw pointers with arbitrary row and
//! column strides. [`matmul`] is the one place that calls it: every matrix is a slice with an
//! offset and strides, checked to stay inside the slice before the call, so the convolution
//! code around it stays safe Rust.

#![allow(unsafe_code)]

pub(crate) use gemm::Parallelism;

/// A matrix inside `data`: element `(i, j)` is `data[offset + i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

/// A writable matrix inside `data`, laid out as in [`View`].
#[derive(Debug)]
pub(crate) struct ViewMut<'a> {
    pub data: &'a mut [f32],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

/// The sizes of `dst (m x n) = lhs (m x k) * rhs (k x n)`, whether the product is added to
/// `dst` or replaces it, and how `gemm` may split the work.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
    pub parallelism: Parallelism,
}

impl View<'_> {
    /// Whether a `rows x cols` matrix of this view lies inside its slice.
    pub(crate) fn fits(&self, rows: usize, cols: usize) -> bool {
        fits(self.data.len(), self.offset, rows, cols, self.rs, self.cs)
    }

    /// The view's slice length, offset and strides, for an error message.
    pub(crate) fn describe(&self) -> String {
        describe(self.data.len(), self.offset, self.rs, self.cs)
    }
}

impl ViewMut<'_> {
    /// Whether a `rows x cols` matrix of this view lies inside its slice.
    pub(crate) fn fits(&self, rows: usize, cols: usize) -> bool {
        fits(self.data.len(), self.offset, rows, cols, self.rs, self.cs)
    }

    /// The view's slice length, offset and strides, for an error message.
    pub(crate) fn describe(&self) -> String {
        describe(self.data.len(), self.offset, self.rs, self.cs)
    }
}

/// `len at offset strides rs/cs`.
fn describe(len: usize, offset: usize, rs: usize, cs: usize) -> String {
    format!("{len} at {offset} strides {rs}/{cs}")
}

/// Whether a `rows x cols` matrix at `offset` with strides `rs`, `cs` lies inside `len`
/// elements.
fn fits(len: usize, offset: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    if rows == 0 || cols == 0 {
        return true;
    }
    let last = (rows - 1)
        .checked_mul(rs)
        .zip((cols - 1).checked_mul(cs))
        .and_then(|(a, b)| a.checked_add(b))
        .and_then(|a| a.checked_add(offset));
    last.is_some_and(|last| last < len)
}

/// Whether distinct elements of a `rows x cols` matrix with strides `rs`, `cs` have distinct
/// addresses (one axis's stride steps over the whole other axis).
fn distinct(rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    let covers = |inner_len: usize, inner: usize, outer_len: usize, outer: usize| {
        (inner_len <= 1 || inner >= 1) && (outer_len <= 1 || outer >= inner_len * inner.max(1))
    };
    covers(rows, rs, cols, cs) || covers(cols, cs, rows, rs)
}

/// Converts a stride to the signed form `gemm` takes.
fn signed(stride: usize) -> candle_core::Result<isize> {
    isize::try_from(stride)
        .map_err(|_| candle_core::Error::Msg(format!("gemm: stride {stride} is too large")))
}

/// `dst = lhs * rhs`, or `dst += lhs * rhs` when `p.accumulate`. Returns an error (and touches
/// nothing) when a matrix does not fit in its slice or `dst` has overlapping elements.
pub(crate) fn matmul(
    p: Product,
    dst: ViewMut<'_>,
    lhs: View<'_>,
    rhs: View<'_>,
) -> candle_core::Result<()> {
    let Product { m, n, k, .. } = p;
    let ok = dst.fits(m, n) && distinct(m, n, dst.rs, dst.cs) && lhs.fits(m, k) && rhs.fits(k, n);
    if !ok {
        candle_core::bail!(
            "gemm: a {m}x{k} by {k}x{n} product does not fit its buffers (dst {}, lhs {}, rhs {})",
            dst.describe(),
            lhs.describe(),
            rhs.describe()
        );
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !p.accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst.data[dst.offset + i * dst.rs + j * dst.cs] = 0.0;
                }
            }
        }
        return Ok(());
    }
    let strides = [dst.cs, dst.rs, lhs.cs, lhs.rs, rhs.cs, rhs.rs].map(signed);
    let [dst_cs, dst_rs, lhs_cs, lhs_rs, rhs_cs, rhs_rs] = match strides {
        [Ok(a), Ok(b), Ok(c), Ok(d), Ok(e), Ok(f)] => [a, b, c, d, e, f],
        _ => candle_core::bail!("gemm: a stride does not fit in isize"),
    };
    // SAFETY: `fits` checked that every element the product reads or writes, up to the last one
    // at `offset + (rows - 1) * rs + (cols - 1) * cs`, lies inside its slice, so the pointer
    // offsets stay in bounds; `distinct` checked that no two elements of `dst` share an address,
    // so gemm's (possibly parallel) writes do not race. `dst` is borrowed mutably and the inputs
    // shared, so the output cannot alias the inputs. Strides are non-negative and fit in isize.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr().add(dst.offset),
            dst_cs,
            dst_rs,
            p.accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            lhs_cs,
            lhs_rs,
            rhs.data.as_ptr().add(rhs.offset),
            rhs_cs,
            rhs_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            p.parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_product_matches_naive() -> candle_core::Result<()> {
        // lhs 2x3 row-major, rhs 3x2 column-major, dst 2x2 column-major with a gap.
        let lhs = [1., 2., 3., 4., 5., 6.];
        let rhs = [1., 0., 2., -1., 1., 0.];
        let mut dst = [9f32; 6];
        let p = Product {
            m: 2,
            n: 2,
            k: 3,
            accumulate: false,
            parallelism: Parallelism::None,
        };
        let d = ViewMut {
            data: &mut dst,
            offset: 1,
            rs: 1,
            cs: 3,
        };
        let l = View {
            data: &lhs,
            offset: 0,
            rs: 3,
            cs: 1,
        };
        let r = View {
            data: &rhs,
            offset: 0,
            rs: 1,
            cs: 3,
        };
        matmul(p, d, l, r)?;
        // [1 2 3; 4 5 6] * [1 -1; 0 1; 2 0] = [7 1; 16 1]
        assert_eq!(dst, [9., 7., 16., 9., 1., 1.]);
        Ok(())
    }

    #[test]
    fn out_of_bounds_and_overlap_are_errors() {
        let a = [0f32; 4];
        let mut d = [0f32; 4];
        let p = Product {
            m: 2,
            n: 2,
            k: 2,
            accumulate: true,
            parallelism: Parallelism::None,
        };
        let v = |offset| View {
            data: &a,
            offset,
            rs: 2,
            cs: 1,
        };
        let dm = |d: &mut [f32; 4], rs, cs| {
            matmul(
                p,
                ViewMut {
                    data: d,
                    offset: 0,
                    rs,
                    cs,
                },
                v(0),
                v(0),
            )
        };
        assert!(dm(&mut d, 2, 1).is_ok());
        assert!(dm(&mut d, 1, 1).is_err(), "overlapping dst");
        assert!(matmul(
            p,
            ViewMut {
                data: &mut d,
                offset: 0,
                rs: 2,
                cs: 1
            },
            v(1),
            v(0)
        )
        .is_err());
    }
}
