// Optimizers' updates of many `float` variables in place, in one launch: SGD's (with its momentum
// buffers) and Adam's (with its two moments), each value computed with the operations of the CPU
// kernels (`kandle_kernels::optimizer`), in their order and each rounded on its own.
//
// A launch's tensors are listed in a table of 64-bit words on the device: `operands` rows of
// `tensors` addresses (row `k` holds operand `k` of every tensor), the tensors' lengths, then the
// first chunk of each tensor and the total (`tensors + 1` words). A tensor is cut into chunks of
// `OPT_CHUNK` values; a block takes a chunk at a time, finds its tensor by a binary search of the
// first chunks, and its threads take the chunk's values. Every value is read and written by one
// thread, so the operands of one tensor may be the same buffer, but not overlap otherwise.
//
// A gated update (what a CUDA graph replays) reads its step's scalars from device memory:
// `rates`, when not null, replaces the scalar arguments that change from step to step (each
// kernel says which), and `gate`, when not null, holds one value that is 0 when the step may
// be applied and NaN when it may not (something in it was not finite): every thread returns
// before writing anything unless it is 0.

#define OPT_CHUNK 4096u

// Whether a gated update is skipped: its gate is not 0 (NaN).
__device__ __forceinline__ bool gate_closed(const float *gate) {
  return gate != 0 && !(*gate == 0.0f);
}

// The tensor that chunk `chunk` belongs to: the last one whose first chunk is at most `chunk`
// (tensors are never empty, so their first chunks increase).
__device__ __forceinline__ unsigned chunk_tensor(unsigned chunk,
                                                 const unsigned long long *first,
                                                 unsigned tensors) {
  unsigned lo = 0, hi = tensors - 1;
  while (lo < hi) {
    const unsigned mid = (lo + hi + 1) / 2;
    if (first[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The span `[*start, *end)` of chunk `chunk` in its tensor `t`.
__device__ __forceinline__ void chunk_span(unsigned chunk, unsigned t,
                                           const unsigned long long *lengths,
                                           const unsigned long long *first,
                                           unsigned long long *start, unsigned long long *end) {
  *start = ((unsigned long long)chunk - first[t]) * OPT_CHUNK;
  const unsigned long long stop = *start + OPT_CHUNK;
  *end = stop < lengths[t] ? stop : lengths[t];
}

// `g + wd * p` as candle's `p * wd + g` computes it (an affine `p * wd + 0`, then the sum), or `g`
// without decay.
__device__ __forceinline__ float decayed(float g, float p, float wd, bool decay) {
  return decay ? add_rn(add_rn(mul_rn(p, wd), 0.0f), g) : g;
}

// SGD: operands `(p, g, buf)`. `buffers` is 0 without momentum (no buffer), 1 on the first step
// (the buffer takes the decayed gradient, torch's `clone`), 2 after (`buf = mu * buf + g`).
// `d` is the gradient, the buffer, or `g + mu * buf` (Nesterov); `p -= lr * d`. `rates`:
// `[learning_rate, started]`, `started` not 0 once the buffers have taken a step (then
// `buffers` is 2 where it is not 0, 1 where it is).
extern "C" __global__ void sgd_step_f32(const unsigned long long *table, unsigned tensors,
                                        unsigned chunks, double learning_rate,
                                        double momentum, double weight_decay, int nesterov,
                                        int buffers, const double *rates, const float *gate) {
  if (gate_closed(gate)) {
    return;
  }
  if (rates != 0) {
    learning_rate = rates[0];
    if (buffers != 0) {
      buffers = rates[1] != 0.0 ? 2 : 1;
    }
  }
  const float lr = (float)learning_rate, mu = (float)momentum, wd = (float)weight_decay;
  const bool decay = wd != 0.0f;
  const unsigned long long *lengths = table + 3ull * tensors;
  const unsigned long long *first = lengths + tensors;
  for (unsigned chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const unsigned t = chunk_tensor(chunk, first, tensors);
    float *p = (float *)table[t];
    const float *grad = (const float *)table[tensors + t];
    float *buf = (float *)table[2ull * tensors + t];
    unsigned long long start, end;
    chunk_span(chunk, t, lengths, first, &start, &end);
    for (unsigned long long i = start + threadIdx.x; i < end; i += blockDim.x) {
      const float pv = p[i];
      const float g = decayed(grad[i], pv, wd, decay);
      float d = g;
      if (buffers != 0) {
        const float b = buffers == 1 ? g : add_rn(add_rn(mul_rn(buf[i], mu), 0.0f), g);
        buf[i] = b;
        d = nesterov ? add_rn(add_rn(mul_rn(b, mu), 0.0f), g) : b;
      }
      p[i] = __fsub_rn(pv, add_rn(mul_rn(d, lr), 0.0f));
    }
  }
}

// Adam and AdamW: operands `(p, g, m, v)`. The moments take the gradient with `wd_1 * p` (first)
// and `wd_2 * p` (second) added where `l2_1` and `l2_2` (Adam's L2 penalty):
// `m = beta_1 * m + rest_1 * g`, `v = beta_2 * v + rest_2 * g * g`; then
// `p = p' - m / (sqrt(v) * inv_sqrt_bc2 + eps) * step_size`, `p'` being `p * decay_factor`
// (AdamW's) where `decoupled`, else `p`. `rates`: `[step_size, inv_sqrt_bc2, decay_factor]`.
extern "C" __global__ void adam_step_f32(const unsigned long long *table, unsigned tensors,
                                         unsigned chunks, double beta_1, double rest_1,
                                         double wd_1, int l2_1, double beta_2, double rest_2,
                                         double wd_2, int l2_2, double step_size,
                                         double inv_sqrt_bc2, double epsilon, int decoupled,
                                         double decay_factor, const double *rates,
                                         const float *gate) {
  if (gate_closed(gate)) {
    return;
  }
  if (rates != 0) {
    step_size = rates[0];
    inv_sqrt_bc2 = rates[1];
    decay_factor = rates[2];
  }
  const float b1 = (float)beta_1, r1 = (float)rest_1, w1 = (float)wd_1;
  const float b2 = (float)beta_2, r2 = (float)rest_2, w2 = (float)wd_2;
  const float step = (float)step_size, inv = (float)inv_sqrt_bc2, eps = (float)epsilon;
  const float factor = (float)decay_factor;
  const unsigned long long *lengths = table + 4ull * tensors;
  const unsigned long long *first = lengths + tensors;
  for (unsigned chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const unsigned t = chunk_tensor(chunk, first, tensors);
    float *p = (float *)table[t];
    const float *grad = (const float *)table[tensors + t];
    float *m = (float *)table[2ull * tensors + t];
    float *v = (float *)table[3ull * tensors + t];
    unsigned long long start, end;
    chunk_span(chunk, t, lengths, first, &start, &end);
    for (unsigned long long i = start + threadIdx.x; i < end; i += blockDim.x) {
      const float pv = p[i], gv = grad[i];
      const float g1 = decayed(gv, pv, w1, l2_1 != 0);
      const float mv = add_rn(add_rn(mul_rn(m[i], b1), 0.0f), add_rn(mul_rn(g1, r1), 0.0f));
      const float g2 = decayed(gv, pv, w2, l2_2 != 0);
      const float vv =
          add_rn(add_rn(mul_rn(v[i], b2), 0.0f), add_rn(mul_rn(mul_rn(g2, g2), r2), 0.0f));
      m[i] = mv;
      v[i] = vv;
      const float denom = add_rn(mul_rn(__fsqrt_rn(vv), inv), eps);
      const float update = add_rn(mul_rn(__fdiv_rn(mv, denom), step), 0.0f);
      const float base = decoupled ? add_rn(mul_rn(pv, factor), 0.0f) : pv;
      p[i] = __fsub_rn(base, update);
    }
  }
}
