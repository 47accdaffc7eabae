// Our host Adam/AdamW step over many fp32 tensors in one call, rounding as torch's fused CPU kernel.
//
// Loaded by host_adamw.py through runtime/native.py (g++ -O3 -march=native -ffp-contract=off -fopenmp).
// [Note: rounding as torch's fused Adam] (kernel.py): every element of a tensor but its last
// `numel % tail_width` takes torch's vector formula (an explicit FMA for the lerp of exp_avg), those
// take its scalar formula; `fused`: whether torch's compiler contracted its sums of products into
// FMAs (measured against torch at load). The compiler may not contract on its own here
// (-ffp-contract=off), so each rounding below is one the source writes down; it vectorizes the
// element loop (-fno-math-errno, host_adamw.py's flag, lets sqrtf become one instruction).
//
// Beyond torch's kernel: gradients in bf16 or fp16 (promoted here, exactly), and an optional output
// where the updated param is also written in bf16 or fp16, rounded to nearest even as `.to()` does.
// The gradient is divided by `grad_scale` (torch's semantics), or multiplied by it (`scale_multiplies`:
// the step's unscale-and-clip factor, one rounding as the multiply of the rows on the device), and is
// not written back (the caller discards it).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>
#include <omp.h>

namespace {

enum Dtype : int32_t { kFloat = 0, kBFloat16 = 1, kHalf = 2, kNone = 3 };

struct Coefs {
  float decay;      // AdamW: 1 - lr * weight_decay (params scaled by it)
  float wd;         // Adam: weight_decay (added to the gradient)
  float lerp_coef;  // the lerp's weight, or weight - 1 when the weight is not small
  bool lerp_small;  // |1 - beta1| < 0.5: exp_avg + w * (g - exp_avg); else g - (g - exp_avg) * (1 - w)
  float one_minus_w;
  float beta2, c2, bc2_sqrt, eps, neg_step_size, step_size;
  bool decoupled, has_wd, update;
};

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

template <int32_t Dtype>
inline float load_grad(const void* __restrict grad, int64_t i) {  // bf16 and fp16 widen exactly
  if constexpr (Dtype == kFloat) return static_cast<const float*>(grad)[i];
  if constexpr (Dtype == kBFloat16) return bits_to_float(uint32_t(static_cast<const uint16_t*>(grad)[i]) << 16);
  if constexpr (Dtype == kHalf) return static_cast<float>(static_cast<const _Float16*>(grad)[i]);
  return 0.0f;
}

inline float load_grad(const void* grad, int64_t i, int32_t dtype) {
  if (dtype == kBFloat16) return load_grad<kBFloat16>(grad, i);
  if (dtype == kHalf) return load_grad<kHalf>(grad, i);
  return load_grad<kFloat>(grad, i);
}

inline uint16_t to_bf16(float f) {  // round to nearest even, a quiet NaN for NaN (as c10::BFloat16)
  uint32_t u = float_to_bits(f);
  uint16_t rounded = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t(0x7FC0) : rounded;
}

enum Scale : int { kNoScale = 0, kDivide = 1, kMultiply = 2 };

template <bool Decoupled, bool HasWd, int ScaleMode, int32_t GradDtype>
void vector_formula(float* __restrict p, const void* __restrict grad, float* __restrict m, float* __restrict v,
                    int64_t n, const Coefs& c, float scale, bool fused) {
  // locals, not c's fields: the stores below could alias them, which would stop vectorization
  const bool small = c.lerp_small;
  const float decay = c.decay, wd = c.wd, lerp_coef = c.lerp_coef, beta2 = c.beta2, c2 = c.c2;
  const float bc2_sqrt = c.bc2_sqrt, eps = c.eps, neg_step_size = c.neg_step_size;
  for (int64_t i = 0; i < n; ++i) {
    float g = load_grad<GradDtype>(grad, i);  // bf16 widens in the loop: a shift, vectorized
    if constexpr (ScaleMode == kDivide) g = g / scale;
    if constexpr (ScaleMode == kMultiply) g = g * scale;
    float param = p[i];
    if constexpr (HasWd) {
      if constexpr (Decoupled) param = param * decay;
      else g = fused ? __builtin_fmaf(param, wd, g) : g + param * wd;
    }
    float mi = m[i];
    const float base = small ? mi : g;
    mi = __builtin_fmaf(lerp_coef, g - mi, base);
    const float decayed = v[i] * beta2;
    const float vi = fused ? __builtin_fmaf(c2 * g, g, decayed) : decayed + (c2 * g) * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = __builtin_sqrtf(vi) / bc2_sqrt + eps;
    p[i] = param + (neg_step_size * mi) / denom;
  }
}

template <int32_t Dtype>
void widen(const void* __restrict from, float* __restrict to, int64_t n) {  // exact
  int64_t i = 0;
#ifdef __F16C__
  if constexpr (Dtype == kHalf)  // the compiler does not vectorize _Float16 conversions by itself
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(from) + i))));
#endif
  for (; i < n; ++i) to[i] = load_grad<Dtype>(from, i);
}

template <int32_t Dtype>
void narrow(const float* __restrict from, void* __restrict to, int64_t n) {  // round to nearest even
  int64_t i = 0;
#ifdef __F16C__
  if constexpr (Dtype == kHalf)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(to) + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) {
    if constexpr (Dtype == kBFloat16) static_cast<uint16_t*>(to)[i] = to_bf16(from[i]);
    if constexpr (Dtype == kHalf) static_cast<_Float16*>(to)[i] = static_cast<_Float16>(from[i]);
  }
}

inline void write_out(void* out, int32_t out_dtype, int64_t i, float value) {
  if (out_dtype == kBFloat16) static_cast<uint16_t*>(out)[i] = to_bf16(value);
  else if (out_dtype == kHalf) static_cast<_Float16*>(out)[i] = static_cast<_Float16>(value);
}

// torch's scalar tail, element by element (`fused`: with the FMAs its compiler formed)
void scalar_formula(float* p, const void* grad, int32_t grad_dtype, float* m, float* v, void* out,
                    int32_t out_dtype, int64_t begin, int64_t end, const Coefs& c, const float* scale,
                    bool multiplies, bool fused) {
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad(grad, i, grad_dtype);
    if (scale) g = multiplies ? g * *scale : g / *scale;
    if (c.has_wd) {
      if (c.decoupled) p[i] = p[i] * c.decay;
      else g = fused ? std::fma(p[i], c.wd, g) : g + p[i] * c.wd;
    }
    float mi = m[i];
    if (c.lerp_small) {
      const float w = c.lerp_coef;
      mi = fused ? std::fma(w, g - mi, mi) : mi + w * (g - mi);
    } else {
      mi = fused ? std::fma(-(g - mi), c.one_minus_w, g) : g - (g - mi) * c.one_minus_w;
    }
    m[i] = mi;
    const float square = (c.c2 * g) * g;  // torch's tail contracts the decay, its body the square
    const float vi = fused ? std::fma(v[i], c.beta2, square) : v[i] * c.beta2 + square;
    v[i] = vi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    p[i] = p[i] - (c.step_size * mi) / denom;
    write_out(out, out_dtype, i, p[i]);
  }
}

constexpr int64_t kPiece = 1024;  // a piece's 16-bit gradients and params convert while in L1

template <int32_t GradDtype>
void vector_piece(float* p, const void* grad, float* m, float* v, int64_t n, const Coefs& c, const float* scale,
                  bool multiplies, bool fused) {
  const float s = scale ? *scale : 1.0f;
  const int mode = scale == nullptr ? kNoScale : multiplies ? kMultiply : kDivide;
#define HOST_ADAMW_CASE(D, W, S) \
  if (c.decoupled == D && c.has_wd == W && mode == S)      \
    return vector_formula<D, W, S, GradDtype>(p, grad, m, v, n, c, s, fused);
#define HOST_ADAMW_CASES(D, W) HOST_ADAMW_CASE(D, W, kNoScale) HOST_ADAMW_CASE(D, W, kDivide) HOST_ADAMW_CASE(D, W, kMultiply)
  HOST_ADAMW_CASES(true, true) HOST_ADAMW_CASES(true, false) HOST_ADAMW_CASES(false, true) HOST_ADAMW_CASES(false, false)
#undef HOST_ADAMW_CASES
#undef HOST_ADAMW_CASE
}

void vector_range(float* p, const void* grad, int32_t grad_dtype, float* m, float* v, void* out, int32_t out_dtype,
                  int64_t begin, int64_t end, const Coefs& c, const float* scale, bool multiplies, bool fused) {
  float widened[kPiece];
  for (int64_t at = begin; at < end; at += kPiece) {
    const int64_t n = end - at < kPiece ? end - at : kPiece;
    if (grad_dtype == kHalf) {  // fp16 widens a piece at a time (F16C), then steps from L1
      widen<kHalf>(static_cast<const _Float16*>(grad) + at, widened, n);
      vector_piece<kFloat>(p + at, widened, m + at, v + at, n, c, scale, multiplies, fused);
    } else if (grad_dtype == kBFloat16) {
      vector_piece<kBFloat16>(p + at, static_cast<const uint16_t*>(grad) + at, m + at, v + at, n, c, scale,
                              multiplies, fused);
    } else {
      vector_piece<kFloat>(p + at, static_cast<const float*>(grad) + at, m + at, v + at, n, c, scale, multiplies,
                           fused);
    }
    if (out_dtype == kBFloat16) narrow<kBFloat16>(p + at, static_cast<uint16_t*>(out) + at, n);
    if (out_dtype == kHalf) narrow<kHalf>(p + at, static_cast<_Float16*>(out) + at, n);
  }
}

Coefs coefs_for(const double* h, float step, bool update) {
  // h: lr, beta1, beta2, eps, weight_decay, decoupled (1.0 or 0.0); doubles as torch computes them
  const double lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], weight_decay = h[4];
  const double bias_correction1 = 1 - std::pow(beta1, double(step));
  const double bias_correction2 = 1 - std::pow(beta2, double(step));
  const double step_size = lr / bias_correction1;
  Coefs c;
  c.update = update;
  c.decoupled = h[5] != 0.0;
  c.has_wd = weight_decay != 0.0;
  c.decay = float(1 - lr * weight_decay);
  c.wd = float(weight_decay);
  const float w = float(1 - beta1);
  c.lerp_small = std::fabs(w) < 0.5f;
  c.lerp_coef = c.lerp_small ? w : w - 1.0f;
  c.one_minus_w = 1.0f - w;
  c.beta2 = float(beta2);
  c.c2 = float(1 - beta2);
  c.bc2_sqrt = float(std::sqrt(bias_correction2));
  c.eps = float(eps);
  c.neg_step_size = float(-step_size);
  c.step_size = float(step_size);
  return c;
}

}  // namespace

extern "C" {

// One Adam/AdamW step of `count` fp32 tensors (torch's fused CPU kernel's numbers), or only the cast
// into `outs` of those whose `update` is 0 (params this step does not touch).
//   params, exp_avgs, exp_avg_sqs: fp32; grads: `grad_dtype` (0 fp32, 1 bf16, 2 fp16), null where not updated;
//   steps: torch's float32 step counters, incremented here for the updated tensors;
//   hyper: 6 doubles per tensor (lr, beta1, beta2, eps, weight_decay, decoupled);
//   outs: the params again in `out_dtype` (1 bf16, 2 fp16; 3: none, outs may be null);
//   grad_scale: null, or the divisor of every gradient (`scale_multiplies`: its multiplier);
//   tail_width: torch's Vec::size();
//   block: elements per task (a multiple of 64); threads: OpenMP threads.
// Returns the number of elements stepped.
int64_t host_adam_step(int64_t count, float* const* params, const void* const* grads, int32_t grad_dtype,
                       float* const* exp_avgs, float* const* exp_avg_sqs, float* const* steps,
                       const int64_t* numels, const double* hyper, const uint8_t* update, void* const* outs,
                       int32_t out_dtype, const float* grad_scale, int32_t scale_multiplies, int64_t tail_width,
                       int32_t fused, int64_t block, int32_t threads) {
  std::vector<Coefs> coefs(count);
  std::vector<int64_t> first_task(count + 1, 0);
  int64_t stepped = 0;
  for (int64_t t = 0; t < count; ++t) {
    if (update[t]) {
      steps[t][0] += 1.0f;  // torch: state_steps += 1, then step = state_step.item<float>()
      stepped += numels[t];
    }
    coefs[t] = coefs_for(hyper + 6 * t, update[t] ? steps[t][0] : 1.0f, update[t] != 0);
    first_task[t + 1] = first_task[t] + (numels[t] + block - 1) / block;
  }
  const int64_t tasks = first_task[count];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    int64_t t = 0, lo = 0, hi = count;  // the tensor of this task: first_task[t] <= task < first_task[t + 1]
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (first_task[mid + 1] <= task) lo = mid + 1;
      else hi = mid;
    }
    t = lo;
    const int64_t n = numels[t];
    const int64_t begin = (task - first_task[t]) * block;
    const int64_t end = begin + block < n ? begin + block : n;
    const Coefs& c = coefs[t];
    void* out = out_dtype == kNone ? nullptr : outs[t];
    if (!c.update) {
      for (int64_t i = begin; i < end; ++i) write_out(out, out_dtype, i, params[t][i]);
      continue;
    }
    const int64_t tail = n - n % tail_width;  // torch's scalar formula from here on
    const int64_t vector_end = end < tail ? end : tail;
    if (begin < vector_end)
      vector_range(params[t], grads[t], grad_dtype, exp_avgs[t], exp_avg_sqs[t], out, out_dtype, begin,
                   vector_end, c, grad_scale, scale_multiplies != 0, fused != 0);
    const int64_t scalar_begin = begin > tail ? begin : tail;
    if (scalar_begin < end)
      scalar_formula(params[t], grads[t], grad_dtype, exp_avgs[t], exp_avg_sqs[t], out, out_dtype, scalar_begin,
                     end, c, grad_scale, scale_multiplies != 0, fused != 0);
  }
  return stepped;
}

}  // extern "C"
