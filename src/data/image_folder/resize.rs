//! Resizing as `tf.image.resize` does (half-pixel centers, no antialiasing), bilinear or
//! nearest, after an optional center crop to the target aspect ratio (Keras's `smart_resize`).

use super::Interpolation;

/// The centered window `(top, left, height, width)` of an `h × w` image with the aspect ratio
/// of `target`, as Keras's `smart_resize`.
pub(super) fn crop_window(
    h: usize,
    w: usize,
    target: (usize, usize),
) -> (usize, usize, usize, usize) {
    let (th, tw) = (target.0 as f64, target.1 as f64);
    let crop_h = ((w as f64 * th / tw) as usize).clamp(1, h);
    let crop_w = ((h as f64 * tw / th) as usize).clamp(1, w);
    ((h - crop_h) / 2, (w - crop_w) / 2, crop_h, crop_w)
}

/// Resizes the `window` `(top, left, height, width)` of the plane `src` (row length `stride`)
/// into `dst` of size `size`, as `tf.image.resize` with half-pixel centers.
pub(super) fn resize_plane(
    src: &[f32],
    stride: usize,
    window: (usize, usize, usize, usize),
    dst: &mut [f32],
    size: (usize, usize),
    interpolation: Interpolation,
) {
    let (top, left, h, w) = window;
    let (th, tw) = size;
    let at = |r: usize, c: usize| src[(top + r) * stride + left + c];
    match interpolation {
        Interpolation::Nearest => {
            let rows: Vec<usize> = (0..th).map(|o| nearest(o, h, th)).collect();
            let cols: Vec<usize> = (0..tw).map(|o| nearest(o, w, tw)).collect();
            for (row, &r) in dst.chunks_exact_mut(tw).zip(&rows) {
                for (v, &c) in row.iter_mut().zip(&cols) {
                    *v = at(r, c);
                }
            }
        }
        Interpolation::Bilinear => {
            let rows: Vec<(usize, usize, f32)> = (0..th).map(|o| linear(o, h, th)).collect();
            let cols: Vec<(usize, usize, f32)> = (0..tw).map(|o| linear(o, w, tw)).collect();
            for (row, &(r0, r1, fr)) in dst.chunks_exact_mut(tw).zip(&rows) {
                for (v, &(c0, c1, fc)) in row.iter_mut().zip(&cols) {
                    let top = at(r0, c0) + (at(r0, c1) - at(r0, c0)) * fc;
                    let bottom = at(r1, c0) + (at(r1, c1) - at(r1, c0)) * fc;
                    *v = top + (bottom - top) * fr;
                }
            }
        }
    }
}

/// The source index of output index `out` for nearest-neighbour resizing of `len` to
/// `target`.
fn nearest(out: usize, len: usize, target: usize) -> usize {
    let scale = len as f64 / target as f64;
    (((out as f64 + 0.5) * scale).floor() as usize).min(len - 1)
}

/// The two source indices and the weight of the second for bilinear resizing of `len` to
/// `target`.
fn linear(out: usize, len: usize, target: usize) -> (usize, usize, f32) {
    let scale = len as f64 / target as f64;
    let x = (out as f64 + 0.5) * scale - 0.5;
    let floor = x.floor();
    let lower = (floor.max(0.0) as usize).min(len - 1);
    let upper = (x.ceil().max(0.0) as usize).min(len - 1);
    (lower, upper, (x - floor) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_and_linear_follow_half_pixel_centers() {
        // Upsampling 2 to 4: output pixel centers at source 0.25, 0.75, 1.25, 1.75 (minus 0.5).
        assert_eq!(
            (0..4).map(|o| nearest(o, 2, 4)).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        assert_eq!(linear(0, 2, 4), (0, 0, 0.75));
        assert_eq!(linear(1, 2, 4), (0, 1, 0.25));
        assert_eq!(linear(3, 2, 4), (1, 1, 0.25));
        // Downsampling 4 to 2 samples between source pixels 0.5 and 2.5.
        assert_eq!(linear(0, 4, 2), (0, 1, 0.5));
        assert_eq!((0..2).map(|o| nearest(o, 4, 2)).collect::<Vec<_>>(), [1, 3]);
    }

    #[test]
    fn crop_window_keeps_the_target_aspect() {
        // A 7 × 5 image to a square: the middle 5 × 5.
        assert_eq!(crop_window(7, 5, (3, 3)), (1, 0, 5, 5));
        // A 4 × 10 image to 1 × 2: the middle 4 × 8.
        assert_eq!(crop_window(4, 10, (1, 2)), (0, 1, 4, 8));
        // Never empty.
        assert_eq!(crop_window(1, 100, (100, 1)), (0, 49, 1, 1));
    }
}
