// edgeattn's CPU kernel for ONNX Runtime's com.microsoft.MatMulNBits in the form edgeattn's int4 exports take
// (4 bits, symmetric: no zero points, blocks of 32, 64, 128 or 256 along K, K a multiple of 64, float32 A and
// scales, accuracy_level 4, no g_idx or bias; anything else refuses at load). Built into the same custom-op
// library as attention.cc and registered under the op's own domain and name when the session asks for it
// (edgeattn/runtimes/attention.py).
//
// Y = A B^T with B [N, K/bs, bs/2] bytes in MatMulNBits' own layout (element 2j of a block in the low nibble of
// byte j, 2j+1 in the high one; the value is nibble - 8) times one float scale per block. Like ONNX Runtime's
// accuracy level 4 it quantizes each row of A to int8 per block (scale = max |a| / 127, rounded to nearest) and
// sums products of integers: nibble x int8 with vpmaddubsw (vpdpbusd where the CPU has VNNI), the -8 taken out
// of each block's integer sums through the quantized activations' sums (exactly, before scaling; with blocks of 32
// in the fused multiply-subtract that scales them). It reads B as ONNX Runtime stores it (no packed copy)
// straight from memory, prefetched ahead of the loads: a token's decode reads every weight once and is bound by
// memory, which is where ONNX Runtime's AVX2 kernel fell short (benchmarks/RESULTS.md, issue 39).
#include "kernels.h"

namespace {

using edgeattn_kernels::attr;
using edgeattn_kernels::hsum;
using Ort::Custom::Tensor;

constexpr int64_t kAhead = 6144;  // bytes of B prefetched ahead of the loads (measured: 2048-16384 within 5%)
constexpr int64_t kCols = 64;     // columns a task
constexpr int TR = 4, TC = 2;     // rows x columns a tile where A has more than one row (measured: 4x2, 4x3 and 6x2 best)

// The integer dot products of 64 weights (one 32-byte load: lo holds elements 0, 2, .., 62, hi 1, 3, .., 63)
// with 64 activations stored evens first: acc += lo . a_even + hi . a_odd, in int32 lanes.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define EDGEATTN_VNNI 1
inline __m256i dot64(__m256i acc, __m256i lo, __m256i hi, const int8_t* a) {
#if defined(__AVXVNNI__)
  acc = _mm256_dpbusd_avx_epi32(acc, lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  return _mm256_dpbusd_avx_epi32(acc, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32)));
#else
  acc = _mm256_dpbusd_epi32(acc, lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  return _mm256_dpbusd_epi32(acc, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32)));
#endif
}
#else
// vpmaddubsw: pairs of nibble (0..15) x int8 (-127..127) summed into int16, at most 3810: two of them
// (128 weights) fit an int16 lane before vpmaddwd widens them
inline __m256i dot64_16(__m256i lo, __m256i hi, const int8_t* a) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                          _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32))));
}
#endif

// the int32 sums of 64 weights with 64 activations (lanes 0-3 from the first 32 of each, 4-7 the second)
inline __m256i dot(__m256i lo, __m256i hi, const int8_t* a) {
#ifdef EDGEATTN_VNNI
  return dot64(_mm256_setzero_si256(), lo, hi, a);
#else
  return _mm256_madd_epi16(dot64_16(lo, hi, a), _mm256_set1_epi16(1));
#endif
}

struct Args {
  const float* a;
  const uint8_t* b;
  const float* s;
  float* y;
  int64_t M, N, K, bs, nb;
  int8_t* q;
  float* qs;  // per block and row ([nb][M]): the activations' scale
  // per row and group of max(bs, 64) activations (a block, or 64 holding two blocks of 32), 8 lanes: the
  // nibbles' offset as integer sums (8 x the activations each int32 lane of the group's dot products covers),
  // taken from a dot product before it is scaled
  int32_t* z;
  // with blocks of 32, per row and 64 activations (two blocks), 16 floats: the two blocks' scales, 4 lanes each,
  // then the offset's sums scaled by them (z x scale), so that a dot product d adds (d scale - z scale) x the
  // weights' scale in two fused multiply-adds
  float* qv;
};

inline int64_t group(const Args& g) { return std::max<int64_t>(g.bs, 64); }

// quantize row m of A: per block the scale max |a| / 127 (qs), the int8s of each 64 stored evens first, then
// odds, and the offset's sums (z, qv)
void quantize(void* data, size_t m) {
  const Args& g = *static_cast<const Args*>(data);
  const float* x = g.a + static_cast<int64_t>(m) * g.K;
  int8_t* q = g.q + static_cast<int64_t>(m) * g.K;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  thread_local std::vector<float> inv;
  inv.resize(static_cast<size_t>(g.nb));
  for (int64_t b = 0; b < g.nb; ++b) {
    const float* xb = x + b * g.bs;
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = 0; i < g.bs; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + i), absmask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    g.qs[b * g.M + m] = amax / 127.0f;
    inv[static_cast<size_t>(b)] = amax > 0.0f ? 127.0f / amax : 0.0f;
  }
  for (int64_t u = 0; u < g.K; u += 64) {
    __m256i ev[4], od[4];
    for (int j = 0; j < 4; ++j) {  // 16 floats -> 8 evens, 8 odds (of one block: blocks are 32 or more)
      const int64_t b = (u + 16 * j) / g.bs;
      const __m256 f = _mm256_set1_ps(inv[static_cast<size_t>(b)]);
      const __m256 x0 = _mm256_loadu_ps(x + u + 16 * j), x1 = _mm256_loadu_ps(x + u + 16 * j + 8);
      const __m256 e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0x88)), 0xD8));
      const __m256 o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0xDD)), 0xD8));
      ev[j] = _mm256_cvtps_epi32(_mm256_mul_ps(e, f));
      od[j] = _mm256_cvtps_epi32(_mm256_mul_ps(o, f));
    }
    const __m256i e8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(ev[0], ev[1]), _mm256_packs_epi32(ev[2], ev[3])), order);
    const __m256i o8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(od[0], od[1]), _mm256_packs_epi32(od[2], od[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + u), e8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + u + 32), o8);
  }
  const __m256i eights = _mm256_set1_epi8(8);
  const int64_t G = group(g);
  for (int64_t u0 = 0; u0 < g.K; u0 += G) {
    const int64_t i = (static_cast<int64_t>(m) * (g.K / G) + u0 / G) * 8;
    __m256i z = _mm256_setzero_si256();
    for (int64_t u = u0; u < u0 + G; u += 64) z = _mm256_add_epi32(z, dot(eights, eights, q + u));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(g.z + i), z);
    if (g.bs == 32) {
      const int64_t b = u0 / 32;
      const __m256 qv = _mm256_set_m128(_mm_set1_ps(g.qs[(b + 1) * g.M + m]), _mm_set1_ps(g.qs[b * g.M + m]));
      _mm256_storeu_ps(g.qv + 2 * i, qv);
      _mm256_storeu_ps(g.qv + 2 * i + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(z), qv));
    }
  }
}

inline void split(const uint8_t* w, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_and_si256(v, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

// one row (m), C consecutive columns from n: the decode form, each column's bytes read once
template <int BS, int C>
void row_cols(const Args& g, int64_t m, int64_t n) {
  const int8_t* q = g.q + m * g.K;
  const int64_t col = g.nb * BS / 2;  // bytes a column
  const uint8_t* w0 = g.b + n * col;
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  if constexpr (BS == 32) {  // a 32-byte load holds two blocks: int32 lanes 0-3 the first, 4-7 the second
    for (int64_t u = 0; u < g.K; u += 64) {
      const int64_t b = u / 32, i = (m * (g.K / 64) + u / 64) * 8;
      const __m256 qv = _mm256_loadu_ps(g.qv + 2 * i), zf = _mm256_loadu_ps(g.qv + 2 * i + 8);
      for (int c = 0; c < C; ++c) {
        const uint8_t* w = w0 + c * col + u / 2;
        _mm_prefetch(reinterpret_cast<const char*>(w) + kAhead, _MM_HINT_T0);
        __m256i lo, hi;
        split(w, lo, hi);
        const __m256 d = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dot(lo, hi, q + u)), qv, zf);  // the nibbles less 8
        const float* sc = g.s + (n + c) * g.nb + b;
        acc[c] = _mm256_fmadd_ps(d, _mm256_set_m128(_mm_broadcast_ss(sc + 1), _mm_broadcast_ss(sc)), acc[c]);
      }
    }
  } else {
  for (int64_t b = 0; b < g.nb; ++b) {
    __m256i d[C];
    for (int c = 0; c < C; ++c) d[c] = _mm256_setzero_si256();
    for (int64_t u = 0; u < BS; u += 128) {  // 128 weights: two 32-byte loads a column
      const int64_t units = std::min<int64_t>(2, (BS - u) / 64);
      for (int c = 0; c < C; ++c) {
        const uint8_t* w = w0 + c * col + (b * BS + u) / 2;
        _mm_prefetch(reinterpret_cast<const char*>(w) + kAhead, _MM_HINT_T0);
        __m256i lo, hi;
#ifdef EDGEATTN_VNNI
        for (int64_t i = 0; i < units; ++i) {
          split(w + 32 * i, lo, hi);
          d[c] = dot64(d[c], lo, hi, q + b * BS + u + 64 * i);
        }
#else
        split(w, lo, hi);
        __m256i s16 = dot64_16(lo, hi, q + b * BS + u);
        if (units == 2) {
          split(w + 32, lo, hi);
          s16 = _mm256_add_epi16(s16, dot64_16(lo, hi, q + b * BS + u + 64));
        }
        d[c] = _mm256_add_epi32(d[c], _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
#endif
      }
    }
    const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.z + (m * g.nb + b) * 8));
    for (int c = 0; c < C; ++c) {
      const float sc = g.s[(n + c) * g.nb + b];
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(d[c], z)), _mm256_set1_ps(sc * g.qs[b * g.M + m]),
                               acc[c]);
    }
  }
  }
  for (int c = 0; c < C; ++c) g.y[m * g.N + n + c] = hsum(acc[c]);
}

// R rows from m, C columns from n: the prefill form, each column's weights split once for R rows and each row's
// activations loaded once for C columns
template <int BS, int R, int C>
void rows_cols(const Args& g, int64_t m, int64_t n) {
  const int64_t col = g.nb * BS / 2;
  const uint8_t* w0 = g.b + n * col;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  if constexpr (BS == 32) {  // two blocks a 32-byte load, as in row_cols
    for (int64_t u = 0; u < g.K; u += 64) {
      const int64_t b = u / 32;
      __m256i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* w = w0 + c * col + u / 2;
        _mm_prefetch(reinterpret_cast<const char*>(w) + kAhead, _MM_HINT_T0);
        split(w, lo[c], hi[c]);
      }
      __m256 sv[C];
      for (int c = 0; c < C; ++c) {
        const float* sc = g.s + (n + c) * g.nb + b;
        sv[c] = _mm256_set_m128(_mm_broadcast_ss(sc + 1), _mm_broadcast_ss(sc));
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* q = g.q + (m + r) * g.K + u;
        const int64_t i = ((m + r) * (g.K / 64) + u / 64) * 8;
        const __m256 qv = _mm256_loadu_ps(g.qv + 2 * i), zf = _mm256_loadu_ps(g.qv + 2 * i + 8);
        for (int c = 0; c < C; ++c) {
          const __m256 d = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dot(lo[c], hi[c], q)), qv, zf);
          acc[r][c] = _mm256_fmadd_ps(d, sv[c], acc[r][c]);
        }
      }
    }
  } else {
  for (int64_t b = 0; b < g.nb; ++b) {
    __m256i d[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) d[r][c] = _mm256_setzero_si256();
    for (int64_t u = 0; u < BS; u += 64) {
      __m256i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* w = w0 + c * col + (b * BS + u) / 2;
        _mm_prefetch(reinterpret_cast<const char*>(w) + kAhead, _MM_HINT_T0);
        split(w, lo[c], hi[c]);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* q = g.q + (m + r) * g.K + b * BS + u;
#ifdef EDGEATTN_VNNI
        for (int c = 0; c < C; ++c) d[r][c] = dot64(d[r][c], lo[c], hi[c], q);
#else
        // int16 sums over up to 256 weights (4 x 2 x 3810 fits), widened once a block of up to 256
        const __m256i ae = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i ao = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
        for (int c = 0; c < C; ++c) {
          const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], ae), _mm256_maddubs_epi16(hi[c], ao));
          d[r][c] = u == 0 ? t : _mm256_add_epi16(d[r][c], t);
        }
#endif
      }
    }
#ifndef EDGEATTN_VNNI
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) d[r][c] = _mm256_madd_epi16(d[r][c], _mm256_set1_epi16(1));
#endif
    const float* qs = g.qs + b * g.M + m;
    for (int r = 0; r < R; ++r) {
      const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.z + ((m + r) * g.nb + b) * 8));
      for (int c = 0; c < C; ++c) {
        const float sc = g.s[(n + c) * g.nb + b];
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(d[r][c], z)), _mm256_set1_ps(sc * qs[r]),
                                    acc[r][c]);
      }
    }
  }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) g.y[(m + r) * g.N + n + c] = hsum(acc[r][c]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define EDGEATTN_ZMM 1
constexpr int TRZ = 8;  // rows a tile of rows_cols2 (measured: 6 and 8 ahead of 4)
static_assert(TC == 2, "rows_cols2 takes the tiles' two columns");
// The prefill form on AVX-512 VNNI: two columns a 512-bit register (column n in lanes 0-7, n + 1 in lanes
// 8-15), each row's 32 activations broadcast to both halves, so one vpdpbusd serves both columns.
inline void split2(const uint8_t* w0, const uint8_t* w1, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0))),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1)), 1);
  lo = _mm512_and_si512(v, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
}

inline __m512i both(const void* a) {  // 32 bytes, twice
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(static_cast<const __m256i*>(a)));
}

inline __m512 halves(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

// R rows from m, columns n and n + 1
template <int BS, int R>
void rows_cols2(const Args& g, int64_t m, int64_t n) {
  const int64_t col = g.nb * BS / 2;
  const uint8_t* w0 = g.b + n * col;
  const uint8_t* w1 = w0 + col;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  if constexpr (BS == 32) {  // two blocks a 32-byte load: lanes 0-3 / 4-7 of each half
    for (int64_t u = 0; u < g.K; u += 64) {
      const int64_t b = u / 32;
      _mm_prefetch(reinterpret_cast<const char*>(w0 + u / 2) + kAhead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + u / 2) + kAhead, _MM_HINT_T0);
      __m512i lo, hi;
      split2(w0 + u / 2, w1 + u / 2, lo, hi);
      const float* s0 = g.s + n * g.nb + b;
      const float* s1 = s0 + g.nb;
      const __m512 sv = halves(_mm256_set_m128(_mm_broadcast_ss(s0 + 1), _mm_broadcast_ss(s0)),
                               _mm256_set_m128(_mm_broadcast_ss(s1 + 1), _mm_broadcast_ss(s1)));
      for (int r = 0; r < R; ++r) {
        const int8_t* q = g.q + (m + r) * g.K + u;
        const int64_t i = ((m + r) * (g.K / 64) + u / 64) * 8;
        const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(g.qv + 2 * i));
        const __m512 zf = _mm512_broadcast_f32x8(_mm256_loadu_ps(g.qv + 2 * i + 8));
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, both(q));
        d = _mm512_dpbusd_epi32(d, hi, both(q + 32));
        acc[r] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(d), qv, zf), sv, acc[r]);
      }
    }
  } else {
    for (int64_t b = 0; b < g.nb; ++b) {
      __m512i d[R];
      for (int r = 0; r < R; ++r) d[r] = _mm512_setzero_si512();
      for (int64_t u = 0; u < BS; u += 64) {
        const int64_t at = (b * BS + u) / 2;
        _mm_prefetch(reinterpret_cast<const char*>(w0 + at) + kAhead, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + at) + kAhead, _MM_HINT_T0);
        __m512i lo, hi;
        split2(w0 + at, w1 + at, lo, hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = g.q + (m + r) * g.K + b * BS + u;
          d[r] = _mm512_dpbusd_epi32(d[r], lo, both(q));
          d[r] = _mm512_dpbusd_epi32(d[r], hi, both(q + 32));
        }
      }
      const __m512 sc = halves(_mm256_set1_ps(g.s[n * g.nb + b]), _mm256_set1_ps(g.s[(n + 1) * g.nb + b]));
      const float* qs = g.qs + b * g.M + m;
      for (int r = 0; r < R; ++r) {
        const __m512i z = both(g.z + ((m + r) * g.nb + b) * 8);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d[r], z)), _mm512_mul_ps(sc, _mm512_set1_ps(qs[r])),
                                 acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    g.y[(m + r) * g.N + n] = hsum(_mm512_castps512_ps256(acc[r]));
    g.y[(m + r) * g.N + n + 1] = hsum(_mm512_extractf32x8_ps(acc[r], 1));
  }
}
#endif

// task t: columns [t kCols, (t + 1) kCols) for every row
template <int BS>
void cols(const Args& g, size_t t) {
  const int64_t n0 = static_cast<int64_t>(t) * kCols, n1 = std::min(g.N, n0 + kCols);
  int64_t n = n0;
  if (g.M == 1) {
    for (; n + 4 <= n1; n += 4) row_cols<BS, 4>(g, 0, n);
    for (; n < n1; ++n) row_cols<BS, 1>(g, 0, n);
    return;
  }
  // rows outer: a tile's rows of A stay in L1 across the task's columns, whose weights stay in L2
  const int64_t pairs = n0 + (n1 - n0) / TC * TC;
  int64_t m = 0;
#ifdef EDGEATTN_ZMM
  for (; m + TRZ <= g.M; m += TRZ) {
    for (n = n0; n < pairs; n += TC) rows_cols2<BS, TRZ>(g, m, n);
    for (; n < n1; ++n) rows_cols<BS, TRZ, 1>(g, m, n);
  }
#endif
  for (; m + TR <= g.M; m += TR) {
#ifdef EDGEATTN_ZMM
    for (n = n0; n < pairs; n += TC) rows_cols2<BS, TR>(g, m, n);
#else
    for (n = n0; n < pairs; n += TC) rows_cols<BS, TR, TC>(g, m, n);
#endif
    for (; n < n1; ++n) rows_cols<BS, TR, 1>(g, m, n);
  }
  for (; m < g.M; ++m) {
#ifdef EDGEATTN_ZMM
    for (n = n0; n < pairs; n += TC) rows_cols2<BS, 1>(g, m, n);
#else
    for (n = n0; n < pairs; n += TC) rows_cols<BS, 1, TC>(g, m, n);
#endif
    for (; n < n1; ++n) rows_cols<BS, 1, 1>(g, m, n);
  }
}

void run_cols(void* data, size_t t) {
  const Args& g = *static_cast<const Args*>(data);
  if (g.bs == 32)
    cols<32>(g, t);
  else if (g.bs == 64)
    cols<64>(g, t);
  else if (g.bs == 128)
    cols<128>(g, t);
  else
    cols<256>(g, t);
}

struct MatMulNBits {
  MatMulNBits(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    K_ = attr<int64_t>(ki, "K", 0);
    N_ = attr<int64_t>(ki, "N", 0);
    bs_ = attr<int64_t>(ki, "block_size", 0);
    const char* unsupported = nullptr;
    if (attr<int64_t>(ki, "bits", 4) != 4)
      unsupported = "bits other than 4";
    else if (bs_ != 32 && bs_ != 64 && bs_ != 128 && bs_ != 256)
      unsupported = "block_size other than 32, 64, 128 or 256";
    else if (K_ <= 0 || N_ <= 0 || K_ % bs_ != 0 || K_ % 64 != 0)
      unsupported = "K not a multiple of block_size and of 64";
    else if (attr<int64_t>(ki, "accuracy_level", 0) != 4)
      unsupported = "accuracy_level other than 4 (int8 activations)";
    else if (ki.GetInputCount() != 3 || ki.GetOutputCount() != 1)
      unsupported = "zero points, g_idx or bias";
    if (unsupported)
      ORT_CXX_API_THROW(std::string("edgeattn MatMulNBits: unsupported: ") + unsupported, ORT_NOT_IMPLEMENTED);
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& a, const Tensor<uint8_t>& b,
                      const Tensor<float>& scales, Tensor<float>& y) {
    const auto& as = a.Shape();
    const int64_t nb = K_ / bs_;
    if (as.empty() || as.back() != K_)
      return Ort::Status("MatMulNBits: A's last dimension is not K", ORT_INVALID_ARGUMENT);
    if (b.NumberOfElement() != N_ * nb * bs_ / 2 || scales.NumberOfElement() != N_ * nb)
      return Ort::Status("MatMulNBits: B or scales do not hold N x K / block_size blocks", ORT_INVALID_ARGUMENT);
    std::vector<int64_t> ys(as.begin(), as.end());
    ys.back() = N_;
    Args g{};
    g.M = a.NumberOfElement() / K_, g.N = N_, g.K = K_, g.bs = bs_, g.nb = nb;
    g.a = a.Data(), g.b = b.Data(), g.s = scales.Data();
    g.y = y.Allocate(ys);
    if (g.M == 0) return Ort::Status{nullptr};
    // scratch of the calling thread, reused across calls
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> qs, qv;
    thread_local std::vector<int32_t> z;
    const size_t lanes = static_cast<size_t>(g.M * (K_ / group(g)) * 8);
    if (q.size() < static_cast<size_t>(g.M * K_)) q.resize(static_cast<size_t>(g.M * K_));
    if (qs.size() < static_cast<size_t>(g.M * nb)) qs.resize(static_cast<size_t>(g.M * nb));
    if (z.size() < lanes) z.resize(lanes);
    if (bs_ == 32 && qv.size() < 2 * lanes) qv.resize(2 * lanes);
    g.q = q.data(), g.qs = qs.data(), g.z = z.data(), g.qv = qv.data();
    Ort::KernelContext context(ctx);
    if (g.M >= 16)
      context.ParallelFor(quantize, static_cast<size_t>(g.M), static_cast<size_t>(g.M), &g);
    else
      for (int64_t m = 0; m < g.M; ++m) quantize(&g, static_cast<size_t>(m));
    const size_t tasks = static_cast<size_t>((N_ + kCols - 1) / kCols);
    context.ParallelFor(run_cols, tasks, tasks, &g);
    return Ort::Status{nullptr};
  }

  int64_t K_ = 0, N_ = 0, bs_ = 0;
};

}  // namespace

Ort::Custom::OrtLiteCustomOp* edgeattn_matmul_nbits() {
  return Ort::Custom::CreateLiteCustomOp<MatMulNBits>("MatMulNBits", "CPUExecutionProvider");
}
