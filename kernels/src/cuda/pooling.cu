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

// Each window's maximum into `y` and its index in the plane into `argmax`, either of them null to
// skip it. The window is walked column by column, top to bottom, as the CPU kernel folds it: a
// larger value wins, as does a NaN over a number; on a tie the smaller index (the first in
// row-major order) wins, and of several NaNs the first in that walk.
template <typename T>
__device__ void max_pool_forward(const T *x, T *y, unsigned *argmax, Geometry g) {
  typedef typename Num<T>::C C;
  const unsigned out_plane = (unsigned)(g.oh * g.ow);
  KANDLE_FOR_EACH(o, g.planes * out_plane) {
    const unsigned p = o / out_plane, at = o - p * out_plane;
    const int orow = (int)at / g.ow, ocol = (int)at - orow * g.ow;
    int r0, r1, c0, c1;
    window_span(orow, g.sh, g.pt, g.kh, g.h, &r0, &r1);
    window_span(ocol, g.sw, g.pl, g.kw, g.w, &c0, &c1);
    const T *xp = x + (size_t)p * g.h * g.w;
    C best = -KANDLE_INFINITY;
    unsigned best_at = NO_ARGMAX;
    for (int c = c0; c < c1; ++c) {
      for (int r = r0; r < r1; ++r) {
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
      y[o] = store<T>(best);
    }
    if (argmax) {
      argmax[o] = best_at;
    }
  }
}

// The input gradient: each input's sum of the output gradients whose window's maximum it is.
template <typename T>
__device__ void max_pool_backward(const T *dy, const unsigned *argmax, T *dx, Geometry g) {
  typedef typename Num<T>::C C;
  const unsigned in_plane = (unsigned)(g.h * g.w), out_plane = (unsigned)(g.oh * g.ow);
  KANDLE_FOR_EACH(idx, g.planes * in_plane) {
    const unsigned p = idx / in_plane, i = idx - p * in_plane;
    const int r = (int)i / g.w, c = (int)i - r * g.w;
    int or0, or1, oc0, oc1;
    covering(r, g.sh, g.pt, g.kh, g.oh, &or0, &or1);
    covering(c, g.sw, g.pl, g.kw, g.ow, &oc0, &oc1);
    C sum = 0;
    for (int orow = or0; orow <= or1; ++orow) {
      for (int ocol = oc0; ocol <= oc1; ++ocol) {
        const size_t o = (size_t)p * out_plane + (unsigned)(orow * g.ow + ocol);
        if (argmax[o] == i) {
          sum = add_rn(sum, load(dy[o]));
        }
      }
    }
    dx[idx] = store<T>(sum);
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
    const unsigned p = o / out_plane, at = o - p * out_plane;
    const int orow = (int)at / g.ow, ocol = (int)at - orow * g.ow;
    int r0, r1, c0, c1;
    window_span(orow, g.sh, g.pt, g.kh, g.h, &r0, &r1);
    window_span(ocol, g.sw, g.pl, g.kw, g.w, &c0, &c1);
    const T *xp = x + (size_t)p * g.h * g.w;
    C sum = 0;
    for (int r = r0; r < r1; ++r) {
      C row = 0;
      for (int c = c0; c < c1; ++c) {
        row = add_rn(row, load(xp[r * g.w + c]));
      }
      sum = add_rn(sum, row);
    }
    y[o] = store<T>(mul_rn(sum, inverse_count<C>(orow, ocol, g)));
  }
}

// The input gradient: each input's sum of its windows' output gradients, each divided by its
// window's count.
template <typename T>
__device__ void avg_pool_backward(const T *dy, T *dx, Geometry g) {
  typedef typename Num<T>::C C;
  const unsigned in_plane = (unsigned)(g.h * g.w), out_plane = (unsigned)(g.oh * g.ow);
  KANDLE_FOR_EACH(idx, g.planes * in_plane) {
    const unsigned p = idx / in_plane, i = idx - p * in_plane;
    const int r = (int)i / g.w, c = (int)i - r * g.w;
    int or0, or1, oc0, oc1;
    covering(r, g.sh, g.pt, g.kh, g.oh, &or0, &or1);
    covering(c, g.sw, g.pl, g.kw, g.ow, &oc0, &oc1);
    C sum = 0;
    for (int orow = or0; orow <= or1; ++orow) {
      for (int ocol = oc0; ocol <= oc1; ++ocol) {
        const size_t o = (size_t)p * out_plane + (unsigned)(orow * g.ow + ocol);
        sum = add_rn(sum, mul_rn(load(dy[o]), inverse_count<C>(orow, ocol, g)));
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
  extern "C" __global__ void max_pool_forward_##NAME(const T *x, T *y, unsigned *argmax,       \
                                                      POOL_GEOMETRY_PARAMS) {                  \
    const Geometry g = POOL_GEOMETRY;                                                          \
    max_pool_forward<T>(x, y, argmax, g);                                                      \
  }                                                                                            \
  extern "C" __global__ void max_pool_backward_##NAME(const T *dy, const unsigned *argmax,     \
                                                       T *dx, POOL_GEOMETRY_PARAMS) {          \
    const Geometry g = POOL_GEOMETRY;                                                          \
    max_pool_backward<T>(dy, argmax, dx, g);                                                   \
  }                                                                                            \
  extern "C" __global__ void avg_pool_forward_##NAME(const T *x, T *y, POOL_GEOMETRY_PARAMS) { \
    const Geometry g = POOL_GEOMETRY;                                                          \
    avg_pool_forward<T>(x, y, g);                                                              \
  }                                                                                            \
  extern "C" __global__ void avg_pool_backward_##NAME(const T *dy, T *dx,                      \
                                                       POOL_GEOMETRY_PARAMS) {                 \
    const Geometry g = POOL_GEOMETRY;                                                          \
    avg_pool_backward<T>(dy, dx, g);                                                           \
  }

POOL_KERNELS(float, f32)
POOL_KERNELS(double, f64)
POOL_KERNELS(kf16, f16)
POOL_KERNELS(kbf16, bf16)
