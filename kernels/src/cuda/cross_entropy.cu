// Softmax cross-entropy with class-index labels over the rows of a (rows, classes) tensor of
// logits `x`: `loss = log(sum(exp(x - max))) - (x[label] - max)`, what `-log_softmax(x)[label]`
// gives, and its gradient `dx = dloss * (softmax(x) - onehot(label))`.
//
// The forward pass takes a warp per row: the row's maximum (a NaN wins, so that a NaN makes the
// whole row NaN, as the sum of exponentials would), the sum of `exp(x - max)` (added in a fixed
// order, the same on every run), and the row's loss; it keeps `max` and `log(sum)` per row
// (`stats`, two values per row in `Num<T>::C`) for the backward pass, which takes a thread per
// logit. The label `NO_LABEL` (candle's "no index", which its gathers read as zero) gives a zero
// loss and gradient; any other label outside `[0, classes)` gives a NaN loss and is counted in
// `bad[0]`, with `rows - row` of the first such row the largest value of `bad[1]`, for the
// caller to report.

#define NO_LABEL 0xffffffffu

// `a` unless `b` is larger or NaN (and a NaN `a` stays).
template <typename C> __device__ __forceinline__ C nan_max(C a, C b) {
  return (a != a || a > b) ? a : b;
}

__device__ __forceinline__ float exp_c(float v) { return expf(v); }
__device__ __forceinline__ double exp_c(double v) { return exp(v); }
__device__ __forceinline__ float log_c(float v) { return logf(v); }
__device__ __forceinline__ double log_c(double v) { return log(v); }
__device__ __forceinline__ float nan_c(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double nan_c(double) { return __longlong_as_double(0x7ff8000000000000ll); }

template <typename C> __device__ __forceinline__ C warp_max(C v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = nan_max(v, __shfl_xor_sync(KANDLE_FULL_MASK, v, offset));
  }
  return v;
}

template <typename C> __device__ __forceinline__ C warp_sum(C v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(KANDLE_FULL_MASK, v, offset);
  }
  return v;
}

template <typename T>
__device__ void xent_forward(const T *x, const unsigned *labels, T *loss,
                             typename Num<T>::C *stats, unsigned *bad, unsigned rows,
                             unsigned classes) {
  typedef typename Num<T>::C C;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned warps = (gridDim.x * blockDim.x) >> 5;
  for (unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
    const T *xr = x + (size_t)row * classes;
    C m = -(C)KANDLE_INFINITY;
    for (unsigned j = lane; j < classes; j += 32u) {
      m = nan_max(m, (C)load(xr[j]));
    }
    m = warp_max(m);
    C s = 0;
    for (unsigned j = lane; j < classes; j += 32u) {
      s += exp_c((C)load(xr[j]) - m);
    }
    s = warp_sum(s);
    if (lane == 0) {
      const C log_sum = log_c(s);
      const unsigned label = labels[row];
      C l;
      if (label < classes) {
        l = log_sum - ((C)load(xr[label]) - m);
      } else if (label == NO_LABEL) {
        l = -(C)0;
      } else {
        l = nan_c(m);
        atomicAdd(&bad[0], 1u);
        atomicMax(&bad[1], rows - row);
      }
      loss[row] = store<T>(l);
      stats[2 * (size_t)row] = m;
      stats[2 * (size_t)row + 1] = log_sum;
    }
  }
}

template <typename T>
__device__ void xent_backward(const T *x, const unsigned *labels, const typename Num<T>::C *stats,
                              const T *dloss, T *dx, unsigned rows, unsigned classes) {
  typedef typename Num<T>::C C;
  const size_t total = (size_t)rows * classes;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t row = i / classes;
    const unsigned j = (unsigned)(i - row * classes), label = labels[row];
    const C p = exp_c(((C)load(x[i]) - stats[2 * row]) - stats[2 * row + 1]);
    const C g = load(dloss[row]);
    C d;
    if (label < classes) {
      d = g * (j == label ? p - (C)1 : p);
    } else if (label == NO_LABEL) {
      d = (C)0 * p;
    } else {
      d = nan_c(p);
    }
    dx[i] = store<T>(d);
  }
}

// The kernels for each element type, named `<kernel>_<dtype>`.
#define XENT_KERNELS(T, NAME)                                                                  \
  extern "C" __global__ void xent_forward_##NAME(const T *x, const unsigned *labels, T *loss,   \
                                                  Num<T>::C *stats, unsigned *bad,              \
                                                  unsigned rows, unsigned classes) {            \
    xent_forward<T>(x, labels, loss, stats, bad, rows, classes);                                \
  }                                                                                            \
  extern "C" __global__ void xent_backward_##NAME(const T *x, const unsigned *labels,           \
                                                   const Num<T>::C *stats, const T *dloss,      \
                                                   T *dx, unsigned rows, unsigned classes) {    \
    xent_backward<T>(x, labels, stats, dloss, dx, rows, classes);                               \
  }

XENT_KERNELS(float, f32)
XENT_KERNELS(double, f64)
XENT_KERNELS(kf16, f16)
XENT_KERNELS(kbf16, bf16)
