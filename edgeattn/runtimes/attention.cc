// edgeattn's CPU kernel for ONNX Runtime's com.microsoft.GroupQueryAttention over a float32 KV buffer, as a
// custom-op library that the Python runtime registers on its CPU sessions (edgeattn/runtimes/attention.py builds
// it with the machine's g++ on first use). Registered under the op's own domain and name, it takes the place of
// ONNX Runtime's kernel for every float32-cache GroupQueryAttention of the session; the artifact stays the
// stock graph that every other runtime runs.
//
// It computes what ONNX Runtime's kernel computes for the forms edgeattn exports (do_rotary 0 or 1 with
// rotary_interleaved 0, past and present one buffer [B, Hkv, L, D], seqlens_k per row, no softcap, local
// window, smooth softmax, position ids, attention bias or head sink; anything else refuses at load): the new
// tokens' keys (rotated) and values written at slots seqlens_k + 1 - S .. seqlens_k, each query head attending
// over slots 0 .. its position. Unlike ONNX Runtime's kernel, which reads a KV head once for each of its query
// heads, it reads each KV head once for the whole group (Qwen3.5: 4 query heads a KV head) and, in a prefill,
// for blocks of 16 query tokens; it splits long contexts into slices across the threads (the partial softmaxes
// merged as flash decoding does).
#include "kernels.h"

#include <memory>
#include <mutex>
#include <optional>

namespace {

using edgeattn_kernels::attr;
using edgeattn_kernels::hsum;
using Ort::Custom::Tensor;

constexpr int64_t kSlice = 2048;           // slots a task at least, when a context is split across tasks
constexpr int64_t kScores = 256 * 1024;    // scores a task holds at most (rows x slots): 1 MiB
constexpr int64_t kTokens = 16;            // query tokens a task (prefill): each key and value row read once for them

struct Args {
  const float *q, *k, *v, *cos, *sin;
  const int32_t* seqlens;
  float *ck, *cv, *out;
  int64_t B, S, H, Hkv, D, L, R;  // R: rotary dims (2 x cos columns; 0 without do_rotary)
  float scale;
  int64_t G, blocks, parts;       // query heads a KV head; query-token blocks a row; slices of the context a block
  float* partial;                 // per task and row: max, sum, unnormalised output [D]
};

// rotate-half over the first R dims of x [D] at position pos (rotary_interleaved = 0)
inline void rotate(const float* x, float* y, const float* cos, const float* sin, int64_t pos, int64_t R,
                   int64_t D) {
  const int64_t h = R / 2;
  if (h > 0) {
    const float* c = cos + pos * h;
    const float* s = sin + pos * h;
    for (int64_t i = 0; i < h; ++i) {
      y[i] = x[i] * c[i] - x[i + h] * s[i];
      y[i + h] = x[i + h] * c[i] + x[i] * s[i];
    }
  }
  for (int64_t i = R; i < D; ++i) y[i] = x[i];
}


// The dot products and the value sums in the widest vectors the compiler targets (-march=native: AVX-512 where
// the CPU has it, else AVX2): W floats a vector.
#ifdef __AVX512F__
using vec = __m512;
constexpr int64_t W = 16;
constexpr int kRowTile = 4;  // q.K tiles of 4 rows x 4 slots: 16 accumulators of the 32 registers
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
using vec = __m256;
constexpr int64_t W = 8;
constexpr int kRowTile = 2;  // q.K tiles of 2 rows x 4 slots: 8 accumulators of the 16 registers
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline float vsum(vec v) { return hsum(v); }
#endif

#ifdef __AVX512F__
inline __m256 fold(vec v) {  // 16 floats -> 8 (pairwise sums)
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
inline __m256 fold(vec v) { return v; }
#endif

// the sums of 8 vectors, as one vector [sum v0, ..., sum v7]
inline __m256 reduce8(const vec* v) {
  const __m256 t0 = _mm256_hadd_ps(fold(v[0]), fold(v[1])), t1 = _mm256_hadd_ps(fold(v[2]), fold(v[3]));
  const __m256 t2 = _mm256_hadd_ps(fold(v[4]), fold(v[5])), t3 = _mm256_hadd_ps(fold(v[6]), fold(v[7]));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// e^x for x <= 0 (Cephes' expf: 2^n e^r, |r| <= ln 2 / 2, a degree-6 polynomial; relative error ~1e-7)
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// softmax numerator of one row in place over its first ``valid`` scores: returns (max, sum of exponentials)
inline std::pair<float, float> exp_row(float* pr, int64_t valid) {
  float m = -INFINITY;
  int64_t j = 0;
  if (valid >= 8) {
    __m256 mv = _mm256_loadu_ps(pr);
    for (j = 8; j + 8 <= valid; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(pr + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    m = _mm_cvtss_f32(h);
  }
  for (; j < valid; ++j) m = std::max(m, pr[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (j = 0; j + 8 <= valid; j += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(pr + j), mv));
    _mm256_storeu_ps(pr + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  float l = hsum(sv);
  for (; j < valid; ++j) {
    pr[j] = std::exp(pr[j] - m);
    l += pr[j];
  }
  return {m, l};
}

// scores of RR query rows (qs, stride D) against SS key rows (kj, stride D): out[r * n + s]. RR x SS
// accumulators in registers, each key and query chunk loaded once for the tile.
template <int RR, int SS>
inline void dot_tile(const float* qs, const float* kj, int64_t D, float* out, int64_t n) {
  constexpr int NS = (RR * SS + 7) / 8 * 8;  // accumulators, in reductions of 8
  vec s[NS];
  for (int i = 0; i < NS; ++i) s[i] = vzero();
  for (int64_t d = 0; d < D; d += W) {
    vec qv[RR];
    for (int r = 0; r < RR; ++r) qv[r] = vload(qs + r * D + d);
    for (int c = 0; c < SS; ++c) {
      const vec kv = vload(kj + c * D + d);
      for (int r = 0; r < RR; ++r) s[r * SS + c] = vfma(qv[r], kv, s[r * SS + c]);
    }
  }
  alignas(32) float sums[NS];
  for (int i = 0; i < NS; i += 8)  // one transposing reduction for 8 dot products, not one each
    _mm256_store_ps(sums + i, reduce8(s + i));
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < SS; ++c) out[r * n + c] = sums[r * SS + c];
}

// RR rows against slots [jb, je) of K (tiles of 4 slots)
template <int RR>
inline void dot_rows(const float* qs, const float* K, int64_t jb, int64_t je, int64_t D, float* out, int64_t n) {
  int64_t j = jb;
  for (; j + 4 <= je; j += 4) dot_tile<RR, 4>(qs, K + j * D, D, out + j, n);
  for (; j < je; ++j) dot_tile<RR, 1>(qs, K + j * D, D, out + j, n);
}

// acc[c] += p[c * n + j] v_j over slots [jb, je) for C rows and 2 W channels from c0
template <int C>
inline void accumulate_rows(const float* V, const float* p, int64_t n, int64_t D, int64_t jb, int64_t je,
                            int64_t c0, float* acc) {
  vec r[C][2];
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < 2; ++h) r[c][h] = vload(acc + c * D + c0 + W * h);
  for (int64_t j = jb; j < je; ++j) {
    const vec v0 = vload(V + j * D + c0), v1 = vload(V + j * D + c0 + W);
    for (int c = 0; c < C; ++c) {
      const vec w = vbroadcast(p + c * n + j);
      r[c][0] = vfma(w, v0, r[c][0]);
      r[c][1] = vfma(w, v1, r[c][1]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < 2; ++h) vstore(acc + c * D + c0 + W * h, r[c][h]);
}

// ``rows`` query rows (qs [rows][D], row r attending over slots below limit[r]) of one KV head over slots
// [j0, j1): per row the scores' max and the sum of their exponentials, and the exponential-weighted sum of
// the values (not yet divided by the sum). A row with no slot in the range gets max -inf and sum 0.
void slice(const Args& a, const float* qs, const int64_t* limit, int64_t rows, const float* K, const float* V,
           int64_t j0, int64_t j1, float* m_out, float* l_out, float* acc) {
  const int64_t D = a.D, n = j1 - j0;
  thread_local std::vector<float> p;  // every entry written below: reused across calls, never cleared
  if (p.size() < static_cast<size_t>(rows * n)) p.resize(static_cast<size_t>(rows * n));
  K += j0 * D, V += j0 * D;
  const bool vectors = D % (2 * W) == 0;  // (dot tiles: W channels a step; value passes: 2 W)
  if (vectors) {  // q.K in tiles of kRowTile rows x 4 slots over blocks of 16 key rows (in L1 for all the rows)
    constexpr int64_t KB = 16;
    for (int64_t jb = 0; jb < n; jb += KB) {
      const int64_t je = std::min(n, jb + KB);
      const char* next = reinterpret_cast<const char*>(K + je * D);  // the next block, while this one computes
      for (int64_t off = 0; off < (std::min(n, je + KB) - je) * D * 4; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      int64_t r = 0;
      for (; rows - r >= kRowTile; r += kRowTile)
        dot_rows<kRowTile>(qs + r * D, K, jb, je, D, p.data() + r * n, n);
      for (; rows - r >= 2; r += 2) dot_rows<2>(qs + r * D, K, jb, je, D, p.data() + r * n, n);
      for (; r < rows; ++r) dot_rows<1>(qs + r * D, K, jb, je, D, p.data() + r * n, n);
    }
  } else {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < rows; ++r) {
        float s = 0;
        for (int64_t d = 0; d < D; ++d) s += qs[r * D + d] * K[j * D + d];
        p[r * n + j] = s;
      }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = p.data() + r * n;
    const int64_t valid = std::max<int64_t>(0, std::min(n, limit[r] - j0));
    const auto [m, l] = exp_row(pr, valid);
    std::fill(pr + valid, pr + n, 0.0f);  // the slots past the row's position weigh nothing
    m_out[r] = m;
    l_out[r] = l;
  }
  std::fill(acc, acc + rows * D, 0.0f);
  if (vectors) {
    constexpr int64_t JB = 32;  // slots a block: their value rows stay in L1 for the D / 2W passes
    for (int64_t jb = 0; jb < n; jb += JB) {
      const int64_t je = std::min(n, jb + JB);
      for (int64_t c0 = 0; c0 < D; c0 += 2 * W) {
        for (int64_t j = je; j < std::min(n, je + JB); ++j)  // this column of the next block's value rows
          _mm_prefetch(reinterpret_cast<const char*>(V + j * D + c0), _MM_HINT_T0);
        int64_t r = 0;
        for (; r + 6 <= rows; r += 6) accumulate_rows<6>(V, p.data() + r * n, n, D, jb, je, c0, acc + r * D);
        for (; r + 4 <= rows; r += 4) accumulate_rows<4>(V, p.data() + r * n, n, D, jb, je, c0, acc + r * D);
        for (; r < rows; ++r) accumulate_rows<1>(V, p.data() + r * n, n, D, jb, je, c0, acc + r * D);
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] += p[r * n + j] * V[j * D + d];
  }
}

// a unit: (batch row b, KV head h, block of query tokens); its rows: token-major, then the G heads
struct Unit {
  int64_t b, h, t0, nt, past;
};

inline Unit unit_of(const Args& a, int64_t u) {
  Unit x;
  const int64_t blk = u % a.blocks;
  x.h = (u / a.blocks) % a.Hkv;
  x.b = u / (a.blocks * a.Hkv);
  x.t0 = blk * kTokens;
  x.nt = std::min(a.S - x.t0, kTokens);
  x.past = a.seqlens[x.b] + 1 - a.S;
  return x;
}

inline int64_t task_stride(const Args& a) { return std::min(a.S, kTokens) * a.G * (2 + a.D); }

void run_task(void* data, size_t t) {
  const Args& a = *static_cast<const Args*>(data);
  const int64_t part = static_cast<int64_t>(t) % a.parts;
  const Unit x = unit_of(a, static_cast<int64_t>(t) / a.parts);
  const int64_t D = a.D, G = a.G, rows = x.nt * G;
  const int64_t T = x.past + x.t0 + x.nt;  // slots the block's last token attends over
  const int64_t per = (T + a.parts - 1) / a.parts;
  const int64_t j0 = std::min(T, part * per), j1 = std::min(T, j0 + per);
  float* m = a.partial + static_cast<int64_t>(t) * task_stride(a);
  float* l = m + rows;
  float* acc = l + rows;
  thread_local std::vector<float> qs;  // scratch of this thread, reused across calls (no allocation a token)
  thread_local std::vector<int64_t> limit;
  if (qs.size() < static_cast<size_t>(rows * D)) qs.resize(static_cast<size_t>(rows * D));
  if (limit.size() < static_cast<size_t>(rows)) limit.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < x.nt; ++i) {
    const int64_t pos = x.past + x.t0 + i;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float* qin = a.q + ((x.b * a.S + x.t0 + i) * a.H + x.h * G + g) * D;
      rotate(qin, qs.data() + r * D, a.cos, a.sin, pos, a.R, D);
      for (int64_t d = 0; d < D; ++d) qs[r * D + d] *= a.scale;
      limit[r] = pos + 1;
    }
  }
  if (j0 >= j1) {  // an empty slice (the context shorter than the parts): no weight in the merge
    std::fill(m, m + rows, -INFINITY);
    std::fill(l, l + rows, 0.0f);
    std::fill(acc, acc + rows * D, 0.0f);
    return;
  }
  const int64_t head = (x.b * a.Hkv + x.h) * a.L * D;
  slice(a, qs.data(), limit.data(), rows, a.ck + head, a.cv + head, j0, j1, m, l, acc);
}

// the parts of one unit into its rows' outputs
void merge(void* data, size_t u) {
  const Args& a = *static_cast<const Args*>(data);
  const Unit x = unit_of(a, static_cast<int64_t>(u));
  const int64_t D = a.D, G = a.G, rows = x.nt * G, stride = task_stride(a);
  const float* base = a.partial + static_cast<int64_t>(u) * a.parts * stride;
  for (int64_t r = 0; r < rows; ++r) {
    float M = -INFINITY;
    for (int64_t p = 0; p < a.parts; ++p)
      if (base[p * stride + rows + r] > 0.0f) M = std::max(M, base[p * stride + r]);
    const int64_t i = r / G, g = r % G;
    float* o = a.out + ((x.b * a.S + x.t0 + i) * a.H + x.h * G + g) * D;
    std::fill(o, o + D, 0.0f);
    float L = 0;
    for (int64_t p = 0; p < a.parts; ++p) {
      const float* part = base + p * stride;
      if (!(part[rows + r] > 0.0f)) continue;
      const float w = std::exp(part[r] - M);
      L += w * part[rows + r];
      const float* acc = part + 2 * rows + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
    }
    const float inv = 1.0f / L;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

struct GroupQueryAttention {
  GroupQueryAttention(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    heads_ = attr<int64_t>(ki, "num_heads", 0);
    kv_heads_ = attr<int64_t>(ki, "kv_num_heads", 0);
    scale_ = attr<float>(ki, "scale", 0.0f);
    rotary_ = attr<int64_t>(ki, "do_rotary", 0);
    const char* unsupported = nullptr;
    if (heads_ <= 0 || kv_heads_ <= 0 || heads_ % kv_heads_ != 0)
      unsupported = "num_heads a multiple of kv_num_heads";
    else if (attr<int64_t>(ki, "rotary_interleaved", 0) != 0)
      unsupported = "rotary_interleaved";
    else if (attr<int64_t>(ki, "local_window_size", -1) != -1)
      unsupported = "local_window_size";
    else if (attr<float>(ki, "softcap", 0.0f) != 0.0f)
      unsupported = "softcap";
    else if (attr<int64_t>(ki, "smooth_softmax", 0) != 0)
      unsupported = "smooth_softmax";
    else if (attr<int64_t>(ki, "qk_output", 0) != 0)
      unsupported = "qk_output";
    else if (const std::string k = attr<std::string>(ki, "k_quant_type", ""); !k.empty() && k != "NONE")
      unsupported = "a quantized cache";
    else if (ki.GetInputCount() > 9 || ki.GetOutputCount() != 3)
      unsupported = "inputs past sin_cache (position ids, attention bias, head sink, scales) or a qk output";
    else if (rotary_ != (ki.GetInputCount() == 9 ? 1 : 0))
      unsupported = "do_rotary without cos/sin caches, or caches without do_rotary";
    if (unsupported)
      ORT_CXX_API_THROW(std::string("edgeattn GroupQueryAttention: unsupported: ") + unsupported, ORT_NOT_IMPLEMENTED);
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& k,
                      const Tensor<float>& v, const Tensor<float>& past_k, const Tensor<float>& past_v,
                      const Tensor<int32_t>& seqlens_k, const Tensor<int32_t>& total,
                      std::optional<const Tensor<float>*> cos, std::optional<const Tensor<float>*> sin,
                      Tensor<float>& out, Tensor<float>& present_k, Tensor<float>& present_v) {
    (void)total;
    const auto& qs = q.Shape();
    const auto& cs = past_k.Shape();
    if (qs.size() != 3 || cs.size() != 4 || past_v.Shape() != cs || k.Shape() != v.Shape() || k.Shape().size() != 3)
      return Ort::Status("GroupQueryAttention: q, k, v [B, S, heads x D] and caches [B, Hkv, L, D]", ORT_INVALID_ARGUMENT);
    Args a{};
    a.B = qs[0], a.S = qs[1], a.H = heads_, a.Hkv = kv_heads_, a.L = cs[2], a.D = cs[3];
    if (a.S < 1 || qs[2] != a.H * a.D || cs[0] != a.B || cs[1] != a.Hkv || k.Shape()[0] != a.B ||
        k.Shape()[1] != a.S || k.Shape()[2] != a.Hkv * a.D || seqlens_k.NumberOfElement() != a.B)
      return Ort::Status("GroupQueryAttention: shapes do not match num_heads / kv_num_heads", ORT_INVALID_ARGUMENT);
    a.R = 0;
    if (rotary_) {
      if (!cos.has_value() || !sin.has_value() || (*cos)->Shape().size() != 2 || (*sin)->Shape() != (*cos)->Shape())
        return Ort::Status("GroupQueryAttention: do_rotary needs cos and sin caches [L, R/2]", ORT_INVALID_ARGUMENT);
      a.R = 2 * (*cos)->Shape()[1];
      a.cos = (*cos)->Data(), a.sin = (*sin)->Data();
      if (a.R > a.D || a.R % 2)
        return Ort::Status("GroupQueryAttention: rotary dims past the head size", ORT_INVALID_ARGUMENT);
    }
    a.scale = scale_ != 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(a.D));
    a.q = q.Data(), a.k = k.Data(), a.v = v.Data(), a.seqlens = seqlens_k.Data();
    int64_t longest = 0;
    for (int64_t b = 0; b < a.B; ++b) {
      const int64_t past = static_cast<int64_t>(a.seqlens[b]) + 1 - a.S;
      if (past < 0 || past + a.S > a.L || (rotary_ && past + a.S > (*cos)->Shape()[0]))
        return Ort::Status("GroupQueryAttention: seqlens_k past the KV buffer or the rotary cache", ORT_INVALID_ARGUMENT);
      longest = std::max(longest, past + a.S);
    }
    a.out = out.Allocate({a.B, a.S, a.H * a.D});
    std::vector<int64_t> cshape(cs.begin(), cs.end());
    a.ck = present_k.Allocate(cshape);
    a.cv = present_v.Allocate(cshape);
    const size_t bytes = static_cast<size_t>(a.B * a.Hkv * a.L * a.D) * sizeof(float);
    if (a.ck != past_k.Data()) std::memcpy(a.ck, past_k.Data(), bytes);  // not bound in place: copy first
    if (a.cv != past_v.Data()) std::memcpy(a.cv, past_v.Data(), bytes);
    for (int64_t b = 0; b < a.B; ++b) {
      const int64_t past = static_cast<int64_t>(a.seqlens[b]) + 1 - a.S;
      for (int64_t i = 0; i < a.S; ++i)
        for (int64_t h = 0; h < a.Hkv; ++h) {
          const int64_t src = ((b * a.S + i) * a.Hkv + h) * a.D;
          const int64_t dst = ((b * a.Hkv + h) * a.L + past + i) * a.D;
          rotate(a.k + src, a.ck + dst, a.cos, a.sin, past + i, a.R, a.D);
          std::memcpy(a.cv + dst, a.v + src, static_cast<size_t>(a.D) * sizeof(float));
        }
    }
    Ort::KernelContext context(ctx);
    a.G = a.H / a.Hkv;
    a.blocks = (a.S + kTokens - 1) / kTokens;
    const int64_t units = a.B * a.Hkv * a.blocks;
    const int64_t rows = std::min(a.S, kTokens) * a.G;
    // slices of the context: enough tasks for the threads where there are few units and a long context
    // (decode), and at most kScores scores a task
    a.parts = (rows * longest + kScores - 1) / kScores;
    if (units < 8 && longest >= 2 * kSlice)
      a.parts = std::max(a.parts, std::min<int64_t>((8 + units - 1) / units, longest / kSlice));
    a.parts = std::max<int64_t>(1, a.parts);
    thread_local std::vector<float> partial;  // every entry written by run_task before merge reads it
    if (partial.size() < static_cast<size_t>(units * a.parts * task_stride(a)))
      partial.resize(static_cast<size_t>(units * a.parts * task_stride(a)));
    a.partial = partial.data();
    const size_t tasks = static_cast<size_t>(units * a.parts);
    context.ParallelFor(run_task, tasks, tasks, &a);
    context.ParallelFor(merge, static_cast<size_t>(units), static_cast<size_t>(units), &a);
    return Ort::Status{nullptr};
  }

  int64_t heads_ = 0, kv_heads_ = 0, rotary_ = 0;
  float scale_ = 0.0f;
};

std::mutex lock;
std::unique_ptr<Ort::Custom::OrtLiteCustomOp> gqa, matmul;
std::unique_ptr<Ort::CustomOpDomain> domains[4];  // by the ops they hold: 1 GroupQueryAttention, 2 MatMulNBits

}  // namespace

Ort::Custom::OrtLiteCustomOp* edgeattn_matmul_nbits();  // matmul.cc

// The ops a session gets: its config entry "edgeattn.ops" (comma-separated GroupQueryAttention, MatMulNBits),
// GroupQueryAttention alone without it.
extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    Ort::UnownedSessionOptions so(options);
    std::string ops = "GroupQueryAttention";
    if (so.HasConfigEntry("edgeattn.ops")) ops = so.GetConfigEntry("edgeattn.ops");
    int want = 0;
    size_t start = 0;
    while (start <= ops.size()) {
      const size_t end = std::min(ops.find(',', start), ops.size());
      const std::string op = ops.substr(start, end - start);
      if (op == "GroupQueryAttention")
        want |= 1;
      else if (op == "MatMulNBits")
        want |= 2;
      else if (!op.empty())
        return Ort::Status(("edgeattn kernels: no kernel for " + op).c_str(), ORT_INVALID_ARGUMENT).release();
      start = end + 1;
    }
    if (want == 0) return nullptr;
    std::lock_guard<std::mutex> guard(lock);
    if (!domains[want]) {
      auto d = std::make_unique<Ort::CustomOpDomain>("com.microsoft");
      if (want & 1) {
        using Ort::Custom::CreateLiteCustomOp;
        if (!gqa) gqa.reset(CreateLiteCustomOp<GroupQueryAttention>("GroupQueryAttention", "CPUExecutionProvider"));
        d->Add(gqa.get());
      }
      if (want & 2) {
        if (!matmul) matmul.reset(edgeattn_matmul_nbits());
        d->Add(matmul.get());
      }
      domains[want] = std::move(d);
    }
    so.Add(*domains[want]);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
