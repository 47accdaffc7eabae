// Exact reduction's passes over a bucket, one read each, rounding as the torch ops they replace
// (fixed_point.py names them). A bucket is a [rows, cols] buffer; segment k holds columns
// [starts[k], starts[k] + lengths[k]) of every row and belongs to the parameter of slot slots[k].
// Work is cut into pieces of one row of one segment, at most PIECE elements long, spread over
// `threads` OpenMP threads; per-segment results are combined from the pieces' (max and exact integer
// sums: the same in any order).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PIECE = 1 << 14;
constexpr uint32_t INF_BITS = 0x7f800000u;  // |x|'s bits above this: a NaN
constexpr float INT64_RANGE = 0x1p63f;

struct Piece {
  int64_t segment, offset, length;  // offset into the [rows, cols] buffer
};

std::vector<Piece> pieces(int64_t rows, int64_t cols, int64_t segments, const int64_t* starts, const int64_t* lengths) {
  std::vector<Piece> out;
  for (int64_t k = 0; k < segments; ++k)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t a = 0; a < lengths[k]; a += PIECE)
        out.push_back({k, r * cols + starts[k] + a, lengths[k] - a < PIECE ? lengths[k] - a : PIECE});
  return out;
}

inline uint32_t abs_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits & 0x7fffffffu;  // ordered as |x| for non-NaN x; every NaN above inf
}

inline float from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// torch's float -> int64 conversion on x86: truncation, and INT64_MIN for NaN and out-of-range values
inline int64_t truncated(float x) { return std::fabs(x) < INT64_RANGE ? static_cast<int64_t>(x) : INT64_MIN; }


// q[i] = truncated(v[i] * factor) for i < n; returns the largest abs_bits(v[i]).
uint32_t quantize_into(const float* v, int64_t n, float factor, int64_t* q) {
  uint32_t m = 0;
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // The same arithmetic 16 at a time, the int64s written past the caches (the collective reads them
  // from memory anyway; measured: a third less time than the loop below). vcvttps2qq gives INT64_MIN
  // for NaN and out-of-range values, as truncated() does.
  for (; i < n && (reinterpret_cast<uintptr_t>(q + i) & 63) != 0; ++i) {
    const uint32_t b = abs_bits(v[i]);
    m = b > m ? b : m;
    q[i] = truncated(v[i] * factor);
  }
  const __m512 scale = _mm512_set1_ps(factor);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i top = _mm512_setzero_si512();
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
    const __m512 y = _mm512_mul_ps(x, scale);
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(q + i), _mm512_cvttps_epi64(_mm512_castps512_ps256(y)));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(q + i + 8), _mm512_cvttps_epi64(high));
  }
  _mm_sfence();
  const uint32_t body = _mm512_reduce_max_epu32(top);
  m = body > m ? body : m;
#endif
  for (; i < n; ++i) {
    const uint32_t b = abs_bits(v[i]);
    m = b > m ? b : m;
    q[i] = truncated(v[i] * factor);
  }
  return m;
}

}  // namespace

extern "C" {

// Per segment: max_abs[slot] = max(max_abs[slot], its largest |value| (inf where it holds a NaN));
// each value v: q = truncated(fp32(v * 2^e)) with factors[k] = 2^e, written to out (add == 0) or
// added into it (add == 1, int64 wrapping).
void exact_quantize(const float* values, int64_t rows, int64_t cols, int64_t segments, const int64_t* slots,
                    const int64_t* starts, const int64_t* lengths, const double* factors, float* max_abs,
                    int64_t* out, int add, int threads) {
  const std::vector<Piece> work = pieces(rows, cols, segments, starts, lengths);
  const int64_t n = static_cast<int64_t>(work.size());
  std::vector<uint32_t> top(n, 0);
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
  for (int64_t p = 0; p < n; ++p) {
    const Piece w = work[p];
    const float factor = static_cast<float>(factors[w.segment]);  // a power of two: exact
    const float* v = values + w.offset;
    int64_t* q = out + w.offset;
    uint32_t m = 0;
    if (add) {
      for (int64_t i = 0; i < w.length; ++i) {
        const uint32_t b = abs_bits(v[i]);
        m = b > m ? b : m;
        q[i] = static_cast<int64_t>(static_cast<uint64_t>(q[i]) + static_cast<uint64_t>(truncated(v[i] * factor)));
      }
    } else {
      m = quantize_into(v, w.length, factor, q);
    }
    top[p] = m;
  }
  std::vector<uint32_t> seen(segments, 0);
  for (int64_t p = 0; p < n; ++p) seen[work[p].segment] = top[p] > seen[work[p].segment] ? top[p] : seen[work[p].segment];
  for (int64_t k = 0; k < segments; ++k) {
    const float m = from_bits(seen[k] > INF_BITS ? INF_BITS : seen[k]);
    float& old = max_abs[slots[k]];
    old = m > old ? m : old;
  }
}

// Per segment of a 1-row int64 buffer: maxima[slot] = double(max(max(v), -min(v))) (negation wrapping).
void exact_int_max_abs(const int64_t* sums, int64_t segments, const int64_t* slots, const int64_t* starts,
                       const int64_t* lengths, double* maxima, int threads) {
  const std::vector<Piece> work = pieces(1, 0, segments, starts, lengths);
  const int64_t n = static_cast<int64_t>(work.size());
  std::vector<int64_t> highs(n, INT64_MIN), lows(n, INT64_MAX);
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
  for (int64_t p = 0; p < n; ++p) {
    const int64_t* v = sums + work[p].offset;
    int64_t high = INT64_MIN, low = INT64_MAX;
    for (int64_t i = 0; i < work[p].length; ++i) {
      high = v[i] > high ? v[i] : high;
      low = v[i] < low ? v[i] : low;
    }
    highs[p] = high;
    lows[p] = low;
  }
  std::vector<int64_t> high(segments, INT64_MIN), low(segments, INT64_MAX);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t k = work[p].segment;
    high[k] = highs[p] > high[k] ? highs[p] : high[k];
    low[k] = lows[p] < low[k] ? lows[p] : low[k];
  }
  for (int64_t k = 0; k < segments; ++k) {
    const int64_t negated = static_cast<int64_t>(0 - static_cast<uint64_t>(low[k]));
    maxima[slots[k]] = static_cast<double>(negated > high[k] ? negated : high[k]);
  }
}

// Per segment of a 1-row int64 buffer: d = double(v) * factors[k]; rows = fp32(d);
// squares[slot] = sum of nearbyint(d * d * square_factors[k]). The caller's grid keeps those sums below
// 2**53, so they are integers summed exactly, here in int64 (which vectorizes) as torch's in float64.
void exact_convert(const int64_t* sums, int64_t segments, const int64_t* slots, const int64_t* starts,
                   const int64_t* lengths, const double* factors, const double* square_factors, float* rows,
                   double* squares, int threads) {
  const std::vector<Piece> work = pieces(1, 0, segments, starts, lengths);
  const int64_t n = static_cast<int64_t>(work.size());
  std::vector<int64_t> partial(n, 0);
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
  for (int64_t p = 0; p < n; ++p) {
    const Piece w = work[p];
    const double factor = factors[w.segment], square_factor = square_factors[w.segment];
    const int64_t* v = sums + w.offset;
    float* x = rows + w.offset;
    int64_t total = 0;
    for (int64_t i = 0; i < w.length; ++i) {
      const double d = static_cast<double>(v[i]) * factor;
      x[i] = static_cast<float>(d);
      total += static_cast<int64_t>(std::nearbyint((d * d) * square_factor));
    }
    partial[p] = total;
  }
  std::vector<int64_t> total(segments, 0);
  for (int64_t p = 0; p < n; ++p) total[work[p].segment] += partial[p];
  for (int64_t k = 0; k < segments; ++k) squares[slots[k]] = static_cast<double>(total[k]);
}

}  // extern "C"
