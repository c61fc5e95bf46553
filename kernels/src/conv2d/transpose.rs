//! Transposes of a row-major matrix: plain, or into the micro-kernel's strips
//! ([`super::microkernel::Strips`]). A kernel gradient's products read an output gradient with
//! its channels contiguous (`positions x o`), where the passes hold it the other way
//! (`o x positions`). Blocks of 8x8 go through AVX registers (eight loads, twenty-four
//! shuffles, eight stores) where the kernels use AVX2; the edges, and other CPUs, a value at a
//! time.

#![allow(unsafe_code)]

/// Rows and columns of a block transposed in registers.
const BLOCK: usize = 8;

/// Writes the `cols x rows` transpose of the row-major `rows x cols` matrix `src` into `dst`.
pub(crate) fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    transpose_part(src, (rows, cols), cols, dst);
}

/// Writes the `cols x rows` transpose of the `rows x cols` matrix whose rows start `ld` apart
/// in `src` (the first `cols` columns of a wider matrix) into `dst`, row-major.
pub(crate) fn transpose_part(
    src: &[f32],
    (rows, cols): (usize, usize),
    ld: usize,
    dst: &mut [f32],
) {
    transpose_with((src, ld), (rows, cols), &mut dst[..rows * cols], |c, r| {
        c * rows + r
    });
}

/// Values of [`transpose_to_strips`]'s output for a `rows x cols` matrix.
pub(crate) fn strips_len(rows: usize, cols: usize, nr: usize) -> usize {
    rows.div_ceil(nr) * nr * cols
}

/// Writes the transposes of the `images` row-major `rows x cols` matrices of `src` (back to
/// back), one under the other (an `(images * cols) x rows` matrix), into `dst` as strips of
/// `nr` (a multiple of 8) of its columns: strip `s` holds, at `s * images * cols * nr`,
/// `images * cols` rows of `nr` values, `dst[(s * images * cols + i * cols + j) * nr + l] =
/// src[i * rows * cols + (s * nr + l) * cols + j]`, zero where `s * nr + l` is past `rows`.
pub(crate) fn transpose_to_strips(
    src: &[f32],
    images: usize,
    (rows, cols): (usize, usize),
    nr: usize,
    dst: &mut [f32],
) {
    debug_assert_eq!(nr % BLOCK, 0);
    let k = images * cols;
    let dst = &mut dst[..strips_len(rows, k, nr)];
    for (i, image) in src
        .chunks_exact((rows * cols).max(1))
        .take(images)
        .enumerate()
    {
        let at = |c: usize, r: usize| r / nr * k * nr + (i * cols + c) * nr + r % nr;
        transpose_with((image, cols), (rows, cols), dst, at);
    }
    // The last strip's lanes past `rows`.
    let at = |j: usize, r: usize| r / nr * k * nr + j * nr + r % nr;
    for r in rows..rows.next_multiple_of(nr) {
        for j in 0..k {
            dst[at(j, r)] = 0.0;
        }
    }
}

/// `dst[at(c, r)] = src[r * ld + c]` for the `rows x cols` matrix `src` whose rows start `ld`
/// apart, where `at(c, r + i) = at(c, r) + i` within each run of eight rows from a multiple of
/// eight.
fn transpose_with(
    (src, ld): (&[f32], usize),
    (rows, cols): (usize, usize),
    dst: &mut [f32],
    at: impl Fn(usize, usize) -> usize,
) {
    let (full_rows, full_cols) = (rows / BLOCK * BLOCK, cols / BLOCK * BLOCK);
    #[cfg(target_arch = "x86_64")]
    let in_registers = crate::simd::avx2_fma();
    #[cfg(not(target_arch = "x86_64"))]
    let in_registers = false;
    for r0 in (0..full_rows).step_by(BLOCK) {
        for c0 in (0..full_cols).step_by(BLOCK) {
            #[cfg(target_arch = "x86_64")]
            if in_registers {
                let rows_in: [&[f32]; BLOCK] =
                    std::array::from_fn(|i| &src[(r0 + i) * ld + c0..][..BLOCK]);
                let mut block = [[0f32; BLOCK]; BLOCK];
                // SAFETY: AVX2 is in use, so the CPU has AVX.
                unsafe { block_avx(rows_in, &mut block) };
                for (j, column) in block.iter().enumerate() {
                    dst[at(c0 + j, r0)..][..BLOCK].copy_from_slice(column);
                }
                continue;
            }
            for r in r0..r0 + BLOCK {
                for c in c0..c0 + BLOCK {
                    dst[at(c, r)] = src[r * ld + c];
                }
            }
        }
    }
    // The edges: the last rows, then the last columns of the others.
    for r in full_rows..rows {
        for c in 0..cols {
            dst[at(c, r)] = src[r * ld + c];
        }
    }
    for r in 0..full_rows {
        for c in full_cols..cols {
            dst[at(c, r)] = src[r * ld + c];
        }
    }
}

/// The transpose of the 8x8 block whose rows are `rows`, into `out` (`out[j][i] =
/// rows[i][j]`), in AVX registers.
///
/// # Safety
///
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn block_avx(rows: [&[f32]; BLOCK], out: &mut [[f32; BLOCK]; BLOCK]) {
    use std::arch::x86_64::{
        _mm256_loadu_ps, _mm256_permute2f128_ps, _mm256_shuffle_ps, _mm256_storeu_ps,
        _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };
    // Each row holds eight values: the slices were cut to length. (A loop, not a closure: a
    // closure would be compiled without AVX, and called.)
    let mut r = [std::arch::x86_64::_mm256_setzero_ps(); BLOCK];
    for (v, row) in r.iter_mut().zip(rows) {
        *v = _mm256_loadu_ps(row[..BLOCK].as_ptr());
    }
    // Pairs of rows interleaved, then quads, within each 128-bit half.
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let q = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    // The low halves of rows 0-3's quads with rows 4-7's make columns 0-3, the high halves
    // columns 4-7.
    for j in 0..4 {
        let low = _mm256_permute2f128_ps::<0x20>(q[j], q[j + 4]);
        let high = _mm256_permute2f128_ps::<0x31>(q[j], q[j + 4]);
        _mm256_storeu_ps(out[j].as_mut_ptr(), low);
        _mm256_storeu_ps(out[j + 4].as_mut_ptr(), high);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposes_whole_and_partial_blocks() {
        for (rows, cols) in [(1, 1), (16, 16), (20, 37), (35, 16), (3, 50)] {
            let src: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            let mut dst = vec![f32::NAN; rows * cols];
            transpose(&src, rows, cols, &mut dst);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        dst[c * rows + r],
                        src[r * cols + c],
                        "{rows}x{cols} at {r},{c}"
                    );
                }
            }
        }
    }

    #[test]
    fn transposes_the_first_columns_of_a_wider_matrix() {
        for (rows, cols, ld) in [(16, 16, 40), (20, 13, 21), (9, 8, 8), (33, 17, 64)] {
            let src: Vec<f32> = (0..rows * ld).map(|v| v as f32).collect();
            let mut dst = vec![f32::NAN; rows * cols];
            transpose_part(&src, (rows, cols), ld, &mut dst);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(dst[c * rows + r], src[r * ld + c], "{rows}x{cols} of {ld}");
                }
            }
        }
    }

    #[test]
    fn transposes_into_strips_padded_with_zeros() {
        // Rows filling strips exactly, ending inside a block, and leaving a strip's last
        // blocks empty (at 32 and 64 wide strips); one image and several under one another.
        for (images, rows, cols, nr) in [
            (1, 32, 5, 16),
            (1, 20, 37, 16),
            (1, 35, 16, 32),
            (1, 3, 50, 32),
            (1, 80, 9, 64),
            (3, 20, 7, 16),
            (4, 40, 49, 32),
        ] {
            let src: Vec<f32> = (0..images * rows * cols).map(|v| v as f32 + 1.0).collect();
            let k = images * cols;
            let mut dst = vec![f32::NAN; strips_len(rows, k, nr)];
            transpose_to_strips(&src, images, (rows, cols), nr, &mut dst);
            for s in 0..rows.div_ceil(nr) {
                for (i, j) in (0..images).flat_map(|i| (0..cols).map(move |j| (i, j))) {
                    for l in 0..nr {
                        let r = s * nr + l;
                        let want = match r < rows {
                            true => src[(i * rows + r) * cols + j],
                            false => 0.0,
                        };
                        assert_eq!(
                            dst[(s * k + i * cols + j) * nr + l],
                            want,
                            "{images} of {rows}x{cols} in strips of {nr}: strip {s}, image {i}, \
                             column {j}, lane {l}"
                        );
                    }
                }
            }
        }
    }
}
