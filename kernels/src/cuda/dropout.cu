// Dropout's masks from Philox4x32-10 (Salmon et al., SC 2011), the rounds of `philox.rs` on the
// CPU: value `i` of the mask drawn at a generator's position `count` is kept when word `i % 4`
// of Philox at counter `[i / 4, count]` under the key (the layer's seed) is below `threshold`,
// and is then `kept`, else zero. The position lives on the device as two floats,
// `[count / 2^24, count % 2^24]`, read by the mask's kernel and moved on by one by
// `dropout_advance`, so a step never reads it back to the host.

__device__ __forceinline__ void philox_round(unsigned c[4], unsigned k0, unsigned k1) {
  const unsigned hi0 = __umulhi(0xD2511F53u, c[0]);
  const unsigned lo0 = 0xD2511F53u * c[0];
  const unsigned hi1 = __umulhi(0xCD9E8D57u, c[2]);
  const unsigned lo1 = 0xCD9E8D57u * c[2];
  const unsigned n0 = hi1 ^ c[1] ^ k0;
  const unsigned n2 = hi0 ^ c[3] ^ k1;
  c[0] = n0;
  c[1] = lo1;
  c[2] = n2;
  c[3] = lo0;
}

__device__ __forceinline__ void philox4x32_10(unsigned c[4], unsigned k0, unsigned k1) {
  philox_round(c, k0, k1);
  for (int r = 1; r < 10; ++r) {
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
    philox_round(c, k0, k1);
  }
}

// The count a position holds: each part converted toward zero, clamped (NaN as zero), as Rust's
// `as u64` does on the CPU.
__device__ __forceinline__ unsigned long long position_count(const float *position) {
  const unsigned long long high = __float2ull_rz(position[0]);
  const unsigned long long low = __float2ull_rz(position[1]);
  return high * 16777216ull + low;
}

template <typename T>
__device__ void dropout_mask(T *out, const float *position, unsigned key0, unsigned key1,
                             unsigned threshold, double scale, unsigned n) {
  typedef typename Num<T>::C C;
  const unsigned long long count = position_count(position);
  const T kept = store<T>((C)scale);
  const T zero = store<T>((C)0);
  const unsigned blocks = (n + 3u) >> 2;
  for (unsigned b = blockIdx.x * blockDim.x + threadIdx.x; b < blocks;
       b += gridDim.x * blockDim.x) {
    unsigned c[4] = {b, 0u, (unsigned)count, (unsigned)(count >> 32)};
    philox4x32_10(c, key0, key1);
    for (unsigned j = 0; j < 4u; ++j) {
      const unsigned i = 4u * b + j;
      if (i < n) {
        out[i] = c[j] < threshold ? kept : zero;
      }
    }
  }
}

#define DROPOUT_KERNELS(T, NAME)                                                               \
  extern "C" __global__ void dropout_mask_##NAME(T *out, const float *position, unsigned key0, \
                                                 unsigned key1, unsigned threshold,            \
                                                 double scale, unsigned n) {                   \
    dropout_mask<T>(out, position, key0, key1, threshold, scale, n);                          \
  }

DROPOUT_KERNELS(float, f32)
DROPOUT_KERNELS(double, f64)
DROPOUT_KERNELS(kf16, f16)
DROPOUT_KERNELS(kbf16, bf16)

// Moves the position on by one draw (one thread).
extern "C" __global__ void dropout_advance(float *position) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const unsigned long long next = position_count(position) + 1ull;
    position[0] = __ull2float_rn(next >> 24);
    position[1] = __ull2float_rn(next & 0xffffffull);
  }
}
