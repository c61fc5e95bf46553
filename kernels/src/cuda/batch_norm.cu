// Batch normalisation over the channels of an (N, C, ...) tensor: `plane` values per image and
// channel, `count = N * plane` per channel. `S` (`Num<T>::C`) is the dtype of the statistics, the
// weight and bias, and the per-channel tables.
//
// Training forward: `bn_stats_partial` (a block per slice of a channel: sums of the values less
// the channel's first value, or a given shift, and of their squares), `bn_stats_finalize` (a thread per channel:
// the table below), `bn_forward_apply` (`y = x * scale + shift`, then the ReLU).
// Backward: `bn_grad_partial` (the sums of `dy'` and `dy' * (x - mean)`, `dy'` the output
// gradient where the ReLU passes it), `bn_grad_finalize` (the gradients of the weight and bias
// and the input gradient's coefficients), `bn_grad_apply` (the input gradient).

// Rows of the statistics table (5, C) that the training forward pass writes and the backward
// pass reads (an inference affine's backward writes mean 0, invstd 1).
#define ROW_MEAN 0
#define ROW_VAR 1
#define ROW_INVSTD 2
#define ROW_SCALE 3
#define ROW_SHIFT 4

// Rows of the backward table (7, C): the bias's and weight's gradients, the input gradient's
// coefficients `dx = mask ? p * (x - mean) + q + k * dy : p * (x - mean) + q` (without the
// centred term for an affine), and the forward map, which gives the ReLU's mask.
#define GROW_DBIAS 0
#define GROW_DWEIGHT 1
#define GROW_P 2
#define GROW_Q 3
#define GROW_SCALE 4
#define GROW_SHIFT 5
#define GROW_MEAN 6

// An output, or an output gradient, may be a range of a larger tensor's channels (a branch's
// part of a concatenation): its images are each contiguous, `stride` values apart (`channels *
// plane` for a tensor of its own).

// The index, in an (N, C, ...) tensor whose images lie `stride` values apart, of value `j` of
// channel `c`.
__device__ __forceinline__ size_t strided_channel_value(unsigned j, unsigned c, unsigned plane,
                                                        size_t stride) {
  const unsigned n = j / plane, i = j - n * plane;
  return (size_t)n * stride + (size_t)c * plane + i;
}

// The index in the (N, C, ...) tensor of value `j` of channel `c`.
__device__ __forceinline__ size_t channel_value(unsigned j, unsigned c, unsigned channels,
                                                unsigned plane) {
  return strided_channel_value(j, c, plane, (size_t)channels * plane);
}

// The index, in a tensor whose images lie `stride` values apart, of value `i` of the contiguous
// (N, C, ...) tensor of `image = C * plane` values per image.
__device__ __forceinline__ size_t strided_value(unsigned i, unsigned image, size_t stride) {
  const unsigned n = i / image;
  return (size_t)n * stride + (i - n * image);
}

// The block's sums of `a` and `b` over its threads into its pair of `partials`. Every thread of
// the block must call it.
__device__ __forceinline__ void store_partials(double *partials, double a, double b) {
  block_sum2(a, b);
  if (threadIdx.x == 0) {
    const size_t at = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * 2;
    partials[at] = a;
    partials[at + 1] = b;
  }
}

// Channel `c`'s two sums from its `splits` blocks' `partials`, added in block order.
__device__ __forceinline__ void sum_partials(const double *partials, unsigned splits, unsigned c,
                                             double *a, double *b) {
  double sum_a = 0.0, sum_b = 0.0;
  for (unsigned k = 0; k < splits; ++k) {
    sum_a += partials[((size_t)c * splits + k) * 2];
    sum_b += partials[((size_t)c * splits + k) * 2 + 1];
  }
  *a = sum_a;
  *b = sum_b;
}

// Per block (slice `blockIdx.x` of channel `blockIdx.y`, `chunk` values from the channel's
// `count`): the sums of `x - shift[c]` and of their squares, in `partials`; without `shift`
// (null), the channel's first value is the shift.
template <typename T>
__device__ void bn_stats_partial(const T *x, const typename Num<T>::C *shift_by,
                                 double *partials, unsigned channels, unsigned plane,
                                 unsigned count, unsigned chunk) {
  typedef typename Num<T>::C C;
  const unsigned c = blockIdx.y;
  const unsigned begin = blockIdx.x * chunk;
  const unsigned end = min(begin + chunk, count);
  const C shift = shift_by ? (C)shift_by[c] : load(x[(size_t)c * plane]);
  C sum = 0, squares = 0;
  for (unsigned j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const C d = load(x[channel_value(j, c, channels, plane)]) - shift;
    sum += d;
    squares += d * d;
  }
  store_partials(partials, sum, squares);
}

// Channel `c`'s row of the (5, C) `table` from its sums of `x - shift` (`sum`) and of their
// squares over `count` values: the mean, the biased variance (zero when rounding makes it
// negative; a NaN stays NaN), `invstd`, and the map `scale = weight * invstd`,
// `shift = bias - mean * scale`.
template <typename S>
__device__ __forceinline__ void store_statistics(double sum, double squares, double count,
                                                 double shift, const S *weight, const S *bias,
                                                 S *table, unsigned channels, unsigned c,
                                                 double epsilon) {
  const double shifted_mean = sum / count;
  double var = squares / count - shifted_mean * shifted_mean;
  if (var < 0.0) {
    var = 0.0;
  }
  const double mean = shift + shifted_mean;
  const double invstd = 1.0 / sqrt(var + epsilon);
  const double scale = (double)weight[c] * invstd;
  table[ROW_MEAN * channels + c] = (S)mean;
  table[ROW_VAR * channels + c] = (S)var;
  table[ROW_INVSTD * channels + c] = (S)invstd;
  table[ROW_SCALE * channels + c] = (S)scale;
  table[ROW_SHIFT * channels + c] = (S)((double)bias[c] - mean * scale);
}

// Per channel: the mean and biased variance from the `splits` partial sums, `invstd`, and the
// map `scale = weight * invstd`, `shift = bias - mean * scale`, into the (5, C) `table`. A
// negative variance from rounding is zero; a NaN stays NaN.
template <typename T>
__device__ void bn_stats_finalize(const double *partials, unsigned splits, const T *x,
                                  const typename Num<T>::C *weight,
                                  const typename Num<T>::C *bias, typename Num<T>::C *table,
                                  unsigned channels, unsigned plane, double count,
                                  double epsilon) {
  typedef typename Num<T>::C S;
  const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) {
    return;
  }
  double sum, squares;
  sum_partials(partials, splits, c, &sum, &squares);
  store_statistics<S>(sum, squares, count, (double)load(x[(size_t)c * plane]), weight, bias,
                      table, channels, c, epsilon);
}

// `y = x * scale[c] + shift[c]`, then `max(y, 0)` when `relu` (a NaN stays NaN); `y`'s images
// lie `y_stride` values apart.
template <typename T>
__device__ void bn_forward_apply(const T *x, const typename Num<T>::C *scale,
                                 const typename Num<T>::C *shift, T *y, unsigned total,
                                 unsigned channels, unsigned plane, int relu, size_t y_stride) {
  typedef typename Num<T>::C C;
  KANDLE_FOR_EACH(i, total) {
    const unsigned c = (i / plane) % channels;
    C z = add_rn(mul_rn(load(x[i]), scale[c]), shift[c]);
    if (relu && z < (C)0) {
      z = 0;
    }
    y[strided_value(i, channels * plane, y_stride)] = store<T>(z);
  }
}

// Per block (as `bn_stats_partial`): the sums of `dy'` and `dy' * (x - mean)`, where `dy'` is
// `dy` where the ReLU (when `relu`) passes it and zero elsewhere, from the (5, C) `table`;
// `dy`'s images lie `dy_stride` values apart.
template <typename T>
__device__ void bn_grad_partial(const T *x, const T *dy, const typename Num<T>::C *table,
                                double *partials, unsigned channels, unsigned plane,
                                unsigned count, unsigned chunk, int relu, size_t dy_stride) {
  typedef typename Num<T>::C C;
  const unsigned c = blockIdx.y;
  const unsigned begin = blockIdx.x * chunk;
  const unsigned end = min(begin + chunk, count);
  const C mean = table[ROW_MEAN * channels + c];
  const C a = table[ROW_SCALE * channels + c];
  const C b = table[ROW_SHIFT * channels + c];
  C sum_dy = 0, sum_centered = 0;
  for (unsigned j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const C v = load(x[channel_value(j, c, channels, plane)]);
    const C g = load(dy[strided_channel_value(j, c, plane, dy_stride)]);
    if (!relu || relu_passes(v, a, b)) {
      sum_dy += g;
      sum_centered += mul_rn(g, v - mean);
    }
  }
  store_partials(partials, sum_dy, sum_centered);
}

// Per channel: the (7, C) backward `grads` table from the partial sums and the forward `table`.
// Training (`centered`): `dbias = sum(dy')`, `dweight = sum(dy' * (x - mean)) * invstd`,
// `p = -k * invstd^2 * sum(dy' * (x - mean)) / count`, `q = -k * sum(dy') / count` with
// `k = weight * invstd` (the map's scale). An affine: `dshift = sum(dy')`,
// `dscale = sum(dy' * x)`, `p = q = 0`.
template <typename T>
__device__ void bn_grad_finalize(const double *partials, unsigned splits,
                                 const typename Num<T>::C *table, typename Num<T>::C *grads,
                                 unsigned channels, double count, int centered) {
  typedef typename Num<T>::C S;
  const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) {
    return;
  }
  double sum_dy, sum_centered;
  sum_partials(partials, splits, c, &sum_dy, &sum_centered);
  const double invstd = (double)table[ROW_INVSTD * channels + c];
  const double k = (double)table[ROW_SCALE * channels + c];
  double dweight = sum_centered, p = 0.0, q = 0.0;
  if (centered) {
    dweight = sum_centered * invstd;
    p = -k * invstd * invstd * sum_centered / count;
    q = -k * sum_dy / count;
  }
  grads[GROW_DBIAS * channels + c] = (S)sum_dy;
  grads[GROW_DWEIGHT * channels + c] = (S)dweight;
  grads[GROW_P * channels + c] = (S)p;
  grads[GROW_Q * channels + c] = (S)q;
  grads[GROW_SCALE * channels + c] = table[ROW_SCALE * channels + c];
  grads[GROW_SHIFT * channels + c] = table[ROW_SHIFT * channels + c];
  grads[GROW_MEAN * channels + c] = table[ROW_MEAN * channels + c];
}

// The input gradient from the (7, C) `grads` table: `rest = p * (x - mean) + q` (`q` alone
// without `centered`, so that a NaN in `x` leaves an affine's gradient finite), then
// `dx = rest + k * dy` where the ReLU passes the gradient and `rest` elsewhere; `dy`'s images lie
// `dy_stride` values apart.
template <typename T>
__device__ void bn_grad_apply(const T *x, const T *dy, const typename Num<T>::C *grads, T *dx,
                              unsigned total, unsigned channels, unsigned plane, int relu,
                              int centered, size_t dy_stride) {
  typedef typename Num<T>::C C;
  KANDLE_FOR_EACH(i, total) {
    const unsigned c = (i / plane) % channels;
    const C v = load(x[i]);
    const C k = grads[GROW_SCALE * channels + c];
    const C q = grads[GROW_Q * channels + c];
    C rest = q;
    if (centered) {
      const C centred = mul_rn(grads[GROW_P * channels + c], v - grads[GROW_MEAN * channels + c]);
      rest = add_rn(centred, q);
    }
    const bool passes = !relu || relu_passes(v, k, grads[GROW_SHIFT * channels + c]);
    const C g = load(dy[strided_value(i, channels * plane, dy_stride)]);
    dx[i] = store<T>(passes ? add_rn(rest, mul_rn(k, g)) : rest);
  }
}

// SyncBatchNorm: each replica's sums go to the other replicas between the kernels, as one
// `float` vector of `2 * channels + 1` values: the two sums of each channel, then the count.
// Forward: `bn_stats_partial` (with the replicas' common shift), `bn_sync_pack`, the sum over
// the replicas, `bn_sync_finalize` (the table from the sums of every replica), `bn_forward_apply`.
// Backward: `bn_grad_partial`, `bn_sync_pack`, the sum over the replicas,
// `bn_sync_grad_finalize`, `bn_grad_apply`.

// A thread per channel: channel `c`'s two sums from its `splits` blocks' `partials` into
// `out[2c]` and `out[2c + 1]`, and `count` into `out[2 * channels]`.
extern "C" __global__ void bn_sync_pack(const double *partials, unsigned splits, float *out,
                                        unsigned channels, double count) {
  const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c == 0) {
    out[2 * (size_t)channels] = (float)count;
  }
  if (c >= channels) {
    return;
  }
  double a, b;
  sum_partials(partials, splits, c, &a, &b);
  out[2 * (size_t)c] = (float)a;
  out[2 * (size_t)c + 1] = (float)b;
}

// Per channel: the (5, C) `table` from every replica's summed `sums` (of `x - shift` and its
// squares, and the count), as `bn_stats_finalize` makes it from one replica's partials.
template <typename T>
__device__ void bn_sync_finalize(const float *sums, const typename Num<T>::C *shift,
                                 const typename Num<T>::C *weight,
                                 const typename Num<T>::C *bias, typename Num<T>::C *table,
                                 unsigned channels, double epsilon) {
  typedef typename Num<T>::C S;
  const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) {
    return;
  }
  store_statistics<S>(sums[2 * (size_t)c], sums[2 * (size_t)c + 1], sums[2 * (size_t)channels],
                      (double)shift[c], weight, bias, table, channels, c, epsilon);
}

// Per channel: the (7, C) backward `grads` table, as `bn_grad_finalize` makes it for training,
// with the input gradient's coefficients from every replica's summed `global` sums (of `dy'`
// and `dy' * (x - mean)`, and the count) and the weight's and bias's gradients from this
// replica's `local` ones (the step sums those over the replicas with the other gradients).
template <typename T>
__device__ void bn_sync_grad_finalize(const float *local, const float *global,
                                      const typename Num<T>::C *table,
                                      typename Num<T>::C *grads, unsigned channels) {
  typedef typename Num<T>::C S;
  const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) {
    return;
  }
  const double count = global[2 * (size_t)channels];
  const double invstd = (double)table[ROW_INVSTD * channels + c];
  const double k = (double)table[ROW_SCALE * channels + c];
  const double sum_dy = global[2 * (size_t)c], sum_centered = global[2 * (size_t)c + 1];
  grads[GROW_DBIAS * channels + c] = (S)local[2 * (size_t)c];
  grads[GROW_DWEIGHT * channels + c] = (S)((double)local[2 * (size_t)c + 1] * invstd);
  grads[GROW_P * channels + c] = (S)(-k * invstd * invstd * sum_centered / count);
  grads[GROW_Q * channels + c] = (S)(-k * sum_dy / count);
  grads[GROW_SCALE * channels + c] = table[ROW_SCALE * channels + c];
  grads[GROW_SHIFT * channels + c] = table[ROW_SHIFT * channels + c];
  grads[GROW_MEAN * channels + c] = table[ROW_MEAN * channels + c];
}

// The kernels for each element type, named `<kernel>_<dtype>`.
#define BN_KERNELS(T, NAME)                                                                    \
  extern "C" __global__ void bn_stats_partial_##NAME(                                           \
      const T *x, const Num<T>::C *shift, double *partials, unsigned channels, unsigned plane,  \
      unsigned count, unsigned chunk) {                                                        \
    bn_stats_partial<T>(x, shift, partials, channels, plane, count, chunk);                    \
  }                                                                                            \
  extern "C" __global__ void bn_sync_finalize_##NAME(                                          \
      const float *sums, const Num<T>::C *shift, const Num<T>::C *weight,                      \
      const Num<T>::C *bias, Num<T>::C *table, unsigned channels, double epsilon) {            \
    bn_sync_finalize<T>(sums, shift, weight, bias, table, channels, epsilon);                  \
  }                                                                                            \
  extern "C" __global__ void bn_sync_grad_finalize_##NAME(                                     \
      const float *local, const float *global, const Num<T>::C *table, Num<T>::C *grads,       \
      unsigned channels) {                                                                     \
    bn_sync_grad_finalize<T>(local, global, table, grads, channels);                           \
  }                                                                                            \
  extern "C" __global__ void bn_stats_finalize_##NAME(                                         \
      const double *partials, unsigned splits, const T *x, const Num<T>::C *weight,            \
      const Num<T>::C *bias, Num<T>::C *table, unsigned channels, unsigned plane,              \
      double count, double epsilon) {                                                          \
    bn_stats_finalize<T>(partials, splits, x, weight, bias, table, channels, plane, count,     \
                         epsilon);                                                             \
  }                                                                                            \
  extern "C" __global__ void bn_forward_apply_##NAME(const T *x, const Num<T>::C *scale,       \
                                                      const Num<T>::C *shift, T *y,            \
                                                      unsigned total, unsigned channels,       \
                                                      unsigned plane, int relu,                \
                                                      unsigned long long y_stride) {           \
    bn_forward_apply<T>(x, scale, shift, y, total, channels, plane, relu, y_stride);           \
  }                                                                                            \
  extern "C" __global__ void bn_grad_partial_##NAME(                                           \
      const T *x, const T *dy, const Num<T>::C *table, double *partials, unsigned channels,     \
      unsigned plane, unsigned count, unsigned chunk, int relu, unsigned long long dy_stride) { \
    bn_grad_partial<T>(x, dy, table, partials, channels, plane, count, chunk, relu, dy_stride);\
  }                                                                                            \
  extern "C" __global__ void bn_grad_finalize_##NAME(const double *partials, unsigned splits,  \
                                                      const Num<T>::C *table,                  \
                                                      Num<T>::C *grads, unsigned channels,     \
                                                      double count, int centered) {            \
    bn_grad_finalize<T>(partials, splits, table, grads, channels, count, centered);            \
  }                                                                                            \
  extern "C" __global__ void bn_grad_apply_##NAME(const T *x, const T *dy,                     \
                                                   const Num<T>::C *grads, T *dx,              \
                                                   unsigned total, unsigned channels,          \
                                                   unsigned plane, int relu, int centered,     \
                                                   unsigned long long dy_stride) {             \
    bn_grad_apply<T>(x, dy, grads, dx, total, channels, plane, relu, centered, dy_stride);     \
  }

BN_KERNELS(float, f32)
BN_KERNELS(double, f64)
BN_KERNELS(kf16, f16)
BN_KERNELS(kbf16, bf16)
