// What kandle's CUDA C kernels share (prepended to each module's source before NVRTC compiles
// it): the element types and their conversions, arithmetic that is never fused into a
// multiply-add, and a block's sum of two doubles.
//
// Tensors are `float`, `double`, or half precision held as its 16 bits (`kf16`, IEEE binary16;
// `kbf16`, bfloat16), so no CUDA header is needed. Each type computes in `Num<T>::C`: `double`
// for `double`, `float` otherwise.

#define KANDLE_FULL_MASK 0xffffffffu
// Positive infinity (NVRTC has no math.h, so no `INFINITY`).
#define KANDLE_INFINITY __int_as_float(0x7f800000)

struct kf16 {
  unsigned short bits;
};
struct kbf16 {
  unsigned short bits;
};

template <typename T> struct Num;
template <> struct Num<float> { typedef float C; };
template <> struct Num<double> { typedef double C; };
template <> struct Num<kf16> { typedef float C; };
template <> struct Num<kbf16> { typedef float C; };

__device__ __forceinline__ float load(float v) { return v; }
__device__ __forceinline__ double load(double v) { return v; }
__device__ __forceinline__ float load(kf16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float load(kbf16 v) {
  return __uint_as_float(((unsigned int)v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T store(typename Num<T>::C v);
template <> __device__ __forceinline__ float store<float>(float v) { return v; }
template <> __device__ __forceinline__ double store<double>(double v) { return v; }
template <> __device__ __forceinline__ kf16 store<kf16>(float v) {
  kf16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
  return h;
}
template <> __device__ __forceinline__ kbf16 store<kbf16>(float v) {
  // Round to nearest even; a NaN stays a (quiet) NaN with its sign.
  unsigned int u = __float_as_uint(v);
  kbf16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = (unsigned short)((u >> 16) | 0x0040u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = (unsigned short)(u >> 16);
  }
  return b;
}

// Products and sums rounded on their own, as the CPU kernels compute them (the compiler would
// otherwise fuse `v * a + b` into one multiply-add, which rounds once).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// `true` where the ReLU after `v * a + b` passes the gradient: the pre-activation is `>= 0`
// or NaN (as the CPU kernels' mask).
template <typename C> __device__ __forceinline__ bool relu_passes(C v, C a, C b) {
  return !(add_rn(mul_rn(v, a), b) < (C)0);
}

// `a` and `b` summed over the block (any size up to 1024 threads); the sums are thread 0's.
// Every thread of the block must call it. The order of the additions is fixed, so the result is
// the same on every run.
__device__ __forceinline__ void block_sum2(double &a, double &b) {
  __shared__ double shared_a[32];
  __shared__ double shared_b[32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_down_sync(KANDLE_FULL_MASK, a, offset);
    b += __shfl_down_sync(KANDLE_FULL_MASK, b, offset);
  }
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  if (lane == 0) {
    shared_a[warp] = a;
    shared_b[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const unsigned warps = (blockDim.x + 31u) >> 5;
    a = lane < warps ? shared_a[lane] : 0.0;
    b = lane < warps ? shared_b[lane] : 0.0;
    for (int offset = 16; offset > 0; offset >>= 1) {
      a += __shfl_down_sync(KANDLE_FULL_MASK, a, offset);
      b += __shfl_down_sync(KANDLE_FULL_MASK, b, offset);
    }
  }
}

// The loop over `total` elements of a kernel launched with `launch::elementwise`.
#define KANDLE_FOR_EACH(i, total)                                                        \
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < (total);                  \
       i += gridDim.x * blockDim.x)
