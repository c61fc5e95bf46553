// Max and average pooling over the (H, W) planes of an (N, C, H, W) tensor, `planes = N * C`, a
// (kh, kw) window at strides (sh, sw) with `pt` rows above and `pl` columns left of padding; the
// output planes are (oh, ow). Padding is never a candidate: each window is its real span,
// `[max(o * s - pad, 0), min(o * s - pad + k, size))` clamped into the plane.
//
// A thread per output for the forward passes, a thread per input for the backward passes, which
// gather the outputs whose windows hold their input in output order (as the CPU kernels add
// them), so no atomics are needed and the sums come out the same on every run.

#define NO_ARGMAX 0xffffffffu

struct Geometry {
  unsigned planes;
  int h, w, oh, ow, kh, kw, sh, sw, pt, pl;
};

// The real span `[*start, *end)` of window `o` along an axis of `size` values.
__device__ __forceinline__ void window_span(int o, int stride, int pad, int k, int size,
                                            int *start, int *end) {
  *start = min(max(o * stride - pad, 0), size);
  *end = min(max(o * stride - pad + k, 0), size);
}

// The windows along an axis that hold position `i`: `[*first, *last]`, empty when `*first > *last`.
__device__ __forceinline__ void covering(int i, int stride, int pad, int k, int outputs,
                                         int *first, int *last) {
  const int t = i + pad - k;
  *first = t < 0 ? 0 : t / stride + 1;
  *last = min((i + pad) / stride, outputs - 1);
}

// A forward pass's output `o`: its plane `p`, its position (orow, ocol) and its window's real
// span, rows `[r0, r1)` and columns `[c0, c1)`.
struct Output {
  unsigned p;
  int orow, ocol, r0, r1, c0, c1;
};

__device__ __forceinline__ Output output_window(unsigned o, unsigned out_plane,
                                                const Geometry &g) {
  Output win;
  win.p = o / out_plane;
  const unsigned at = o - win.p * out_plane;
  win.orow = (int)at / g.ow;
  win.ocol = (int)at - win.orow * g.ow;
  window_span(win.orow, g.sh, g.pt, g.kh, g.h, &win.r0, &win.r1);
  window_span(win.ocol, g.sw, g.pl, g.kw, g.w, &win.c0, &win.c1);
  return win;
}

// A backward pass's input `idx`: its plane `p`, its index `i` in the plane, and the windows that
// hold it, output rows `[or0, or1]` and columns `[oc0, oc1]`.
struct Input {
  unsigned p, i;
  int or0, or1, oc0, oc1;
};

__device__ __forceinline__ Input input_windows(unsigned idx, unsigned in_plane,
                                               const Geometry &g) {
  Input in;
  in.p = idx / in_plane;
  in.i = idx - in.p * in_plane;
  const int r = (int)in.i / g.w, c = (int)in.i - r * g.w;
  covering(r, g.sh, g.pt, g.kh, g.oh, &in.or0, &in.or1);
  covering(c, g.sw, g.pl, g.kw, g.ow, &in.oc0, &in.oc1);
  return in;
}

// The index of output (orow, ocol) of plane `p`.
__device__ __forceinline__ size_t output_index(unsigned p, unsigned out_plane, int orow, int ocol,
                                               const Geometry &g) {
  return (size_t)p * out_plane + (unsigned)(orow * g.ow + ocol);
}

// The index, in a tensor whose images (of `image` values each) lie `stride` values apart, of value
// `o` of the contiguous tensor.
__device__ __forceinline__ size_t strided_output(size_t o, unsigned image, size_t stride) {
  const size_t n = o / image;
  return n * stride + (o - n * image);
}

// Each window's maximum into `y` (whose images of `out_image` values lie `y_stride` values apart:
// a range of a larger tensor's channels, or a tensor of its own) and its index in the plane into
// `argmax` (contiguous), either of them null to skip it. The window is walked column by column, top to bottom, as the CPU kernel folds it: a
// larger value wins, as does a NaN over a number; on a tie the smaller index (the first in
// row-major order) wins, and of several NaNs the first in that walk.
template <typename T>
__device__ void max_pool_forward(const T *x, T *y, unsigned *argmax, Geometry g, unsigned out_image,
                                 size_t y_stride) {
  typedef typename Num<T>::C C;
  const unsigned out_plane = (unsigned)(g.oh * g.ow);
  KANDLE_FOR_EACH(o, g.planes * out_plane) {
    const Output win = output_window(o, out_plane, g);
    const T *xp = x + (size_t)win.p * g.h * g.w;
    C best = -KANDLE_INFINITY;
    unsigned best_at = NO_ARGMAX;
    for (int c = win.c0; c < win.c1; ++c) {
      for (int r = win.r0; r < win.r1; ++r) {
        const unsigned i = (unsigned)(r * g.w + c);
        const C v = load(xp[i]);
        const bool wins = v > best || (isnan(v) && !isnan(best)) || (v == best && i < best_at);
        if (wins) {
          best = v;
          best_at = i;
        }
      }
    }
    if (y) {
      y[strided_output(o, out_image, y_stride)] = store<T>(best);
    }
    if (argmax) {
      argmax[o] = best_at;
    }
  }
}

// One over the number of real values in the window of output (orow, ocol), or 0 for none.
template <typename C>
__device__ __forceinline__ C inverse_count(int orow, int ocol, const Geometry &g) {
  int r0, r1, c0, c1;
  window_span(orow, g.sh, g.pt, g.kh, g.h, &r0, &r1);
  window_span(ocol, g.sw, g.pl, g.kw, g.w, &c0, &c1);
  const int count = (r1 - r0) * (c1 - c0);
  return count == 0 ? (C)0 : (C)1 / (C)count;
}

// Each window's mean over its real values: each row's sum, the rows' sum, times one over the
// count (as the CPU kernel).
template <typename T>
__device__ void avg_pool_forward(const T *x, T *y, Geometry g) {
  typedef typename Num<T>::C C;
  const unsigned out_plane = (unsigned)(g.oh * g.ow);
  KANDLE_FOR_EACH(o, g.planes * out_plane) {
    const Output win = output_window(o, out_plane, g);
    const T *xp = x + (size_t)win.p * g.h * g.w;
    C sum = 0;
    for (int r = win.r0; r < win.r1; ++r) {
      C row = 0;
      for (int c = win.c0; c < win.c1; ++c) {
        row = add_rn(row, load(xp[r * g.w + c]));
      }
      sum = add_rn(sum, row);
    }
    y[o] = store<T>(mul_rn(sum, inverse_count<C>(win.orow, win.ocol, g)));
  }
}

// The input gradient of either pool, gathered over the windows that hold each input. `MAX`: each
// input's sum of the output gradients whose window's maximum it is (`argmax`); otherwise its sum
// of its windows' output gradients, each divided by its window's count (`argmax` unused). `dy`'s
// images of `out_image` values lie `dy_stride` values apart.
template <typename T, bool MAX>
__device__ void pool_backward(const T *dy, const unsigned *argmax, T *dx, Geometry g,
                              unsigned out_image, size_t dy_stride) {
  typedef typename Num<T>::C C;
  const unsigned in_plane = (unsigned)(g.h * g.w), out_plane = (unsigned)(g.oh * g.ow);
  KANDLE_FOR_EACH(idx, g.planes * in_plane) {
    const Input in = input_windows(idx, in_plane, g);
    C sum = 0;
    for (int orow = in.or0; orow <= in.or1; ++orow) {
      for (int ocol = in.oc0; ocol <= in.oc1; ++ocol) {
        const size_t o = output_index(in.p, out_plane, orow, ocol, g);
        if (MAX) {
          if (argmax[o] == in.i) {
            sum = add_rn(sum, load(dy[strided_output(o, out_image, dy_stride)]));
          }
        } else {
          const T g_o = dy[strided_output(o, out_image, dy_stride)];
          sum = add_rn(sum, mul_rn(load(g_o), inverse_count<C>(orow, ocol, g)));
        }
      }
    }
    dx[idx] = store<T>(sum);
  }
}

// The kernels for each element type, named `<kernel>_<dtype>`; the geometry comes as its eleven
// numbers.
#define POOL_GEOMETRY_PARAMS                                                                   \
  unsigned planes, int h, int w, int oh, int ow, int kh, int kw, int sh, int sw, int pt, int pl
#define POOL_GEOMETRY {planes, h, w, oh, ow, kh, kw, sh, sw, pt, pl}
#define POOL_KERNELS(T, NAME)                                                                  \
  extern "C" __global__ void max_pool_forward_##NAME(                                          \
      const T *x, T *y, unsigned *argmax, POOL_GEOMETRY_PARAMS, unsigned out_image,             \
      unsigned long long y_stride) {                                                           \
    const Geometry g = POOL_GEOMETRY;                                                          \
    max_pool_forward<T>(x, y, argmax, g, out_image, y_stride);                                 \
  }                                                                                            \
  extern "C" __global__ void max_pool_backward_##NAME(                                         \
      const T *dy, const unsigned *argmax, T *dx, POOL_GEOMETRY_PARAMS, unsigned out_image,     \
      unsigned long long dy_stride) {                                                          \
    const Geometry g = POOL_GEOMETRY;                                                          \
    pool_backward<T, true>(dy, argmax, dx, g, out_image, dy_stride);                           \
  }                                                                                            \
  extern "C" __global__ void avg_pool_forward_##NAME(const T *x, T *y, POOL_GEOMETRY_PARAMS) { \
    const Geometry g = POOL_GEOMETRY;                                                          \
    avg_pool_forward<T>(x, y, g);                                                              \
  }                                                                                            \
  extern "C" __global__ void avg_pool_backward_##NAME(const T *dy, T *dx,                      \
                                                       POOL_GEOMETRY_PARAMS) {                 \
    const Geometry g = POOL_GEOMETRY;                                                          \
    const unsigned out_plane = (unsigned)(oh * ow);                                            \
    pool_backward<T, false>(dy, 0, dx, g, out_plane, out_plane);                               \
  }

POOL_KERNELS(float, f32)
POOL_KERNELS(double, f64)
POOL_KERNELS(kf16, f16)
POOL_KERNELS(kbf16, bf16)
