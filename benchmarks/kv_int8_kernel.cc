// A PROTOTYPE, not used by edgeattn's runtimes: benchmarks/kv_int8_kernel.py builds it as an ONNX Runtime
// custom-op library and races it against ONNX Runtime's own CPU GroupQueryAttention (issue 25, decode at
// 16384 tokens). edgeattn.GroupQueryAttentionInt8 takes GroupQueryAttention's inputs 0-8 and its k_scale /
// v_scale (int8 cache PER_CHANNEL, kv_cache_bit_width 8, do_rotary 1, rotary_interleaved 0, the cache
// bound as both past and present) and computes the same: the new tokens rotated, quantized (round half to
// even, clipped) and written at slots seqlens_k + 1 - S .. seqlens_k, then each query head attends over the
// dequantized slots 0 .. its position. Unlike ONNX Runtime's kernel it reads each KV head once for its
// group of query heads (4 here) and dequantizes as it reads: AVX-512 for a group of 4 and head dims that
// are multiples of 64, plain loops otherwise.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <chrono>
#include <thread>
#include <vector>

namespace {

using Ort::Custom::Tensor;

struct Args {
  const float *q, *k, *v, *cos, *sin, *ks, *vs;
  const int32_t* seqlens;
  int8_t *ck, *cv;
  float* out;
  int64_t B, S, H, Hkv, D, L, R;  // R: rotary dims (2 x cos columns)
  float scale;
};

// rotate-half over the first R dims of x [D] at position pos (rotary_interleaved = 0)
inline void rotate(const float* x, float* y, const float* cos, const float* sin, int64_t pos, int64_t R, int64_t D) {
  const int64_t h = R / 2;
  const float* c = cos + pos * h;
  const float* s = sin + pos * h;
  for (int64_t i = 0; i < h; ++i) {
    y[i] = x[i] * c[i] - x[i + h] * s[i];
    y[i + h] = x[i + h] * c[i] + x[i] * s[i];
  }
  for (int64_t i = R; i < D; ++i) y[i] = x[i];
}

inline int8_t quantize(float x, float scale) {
  float r = std::nearbyint(x / scale);
  return static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, r)));
}

// One (batch row, KV head, query token): its G query heads against slots 0 .. T-1.
template <int G>
void attend(const Args& a, int64_t b, int64_t h, int64_t i, int64_t T, int64_t pos, int g_runtime) {
  const int g_n = G > 0 ? G : g_runtime;
  const int64_t D = a.D;
  std::vector<float> qs(static_cast<size_t>(g_n * D)), p(static_cast<size_t>(g_n * T)), acc(static_cast<size_t>(g_n * D), 0.0f);
  const float* ks = a.ks + h * D;
  const float* vs = a.vs + h * D;
  for (int g = 0; g < g_n; ++g) {
    const float* qin = a.q + ((b * a.S + i) * a.H + h * g_n + g) * D;
    float* qg = qs.data() + g * D;
    rotate(qin, qg, a.cos, a.sin, pos, a.R, D);
    for (int64_t d = 0; d < D; ++d) qg[d] *= ks[d] * a.scale;
  }
  const int8_t* K = a.ck + (b * a.Hkv + h) * a.L * D;
  const int8_t* V = a.cv + (b * a.Hkv + h) * a.L * D;
#ifdef __AVX512F__
  if (G == 4 && D % 16 == 0) {
    const float *q0 = qs.data(), *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
    float *p0 = p.data(), *p1 = p0 + T, *p2 = p1 + T, *p3 = p2 + T;
    for (int64_t j = 0; j < T; ++j) {
      const int8_t* kj = K + j * D;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 kf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kj + d))));
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), kf, s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + d), kf, s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(q2 + d), kf, s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(q3 + d), kf, s3);
      }
      p0[j] = _mm512_reduce_add_ps(s0), p1[j] = _mm512_reduce_add_ps(s1);
      p2[j] = _mm512_reduce_add_ps(s2), p3[j] = _mm512_reduce_add_ps(s3);
    }
  } else
#endif
  {
    for (int g = 0; g < g_n; ++g)
      for (int64_t j = 0; j < T; ++j) {
        const int8_t* kj = K + j * D;
        const float* qg = qs.data() + g * D;
        float s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(kj[d]);
        p[g * T + j] = s;
      }
  }
  for (int g = 0; g < g_n; ++g) {
    float* pg = p.data() + g * T;
    float m = pg[0];
    for (int64_t j = 1; j < T; ++j) m = std::max(m, pg[j]);
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < T; ++j) {
      pg[j] = std::exp(pg[j] - m);
      sum += pg[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < T; ++j) pg[j] *= inv;
  }
#ifdef __AVX512F__
  if (G == 4 && D % 64 == 0) {
    const float *p0 = p.data(), *p1 = p0 + T, *p2 = p1 + T, *p3 = p2 + T;
    constexpr int64_t JB = 32;  // tokens a block: 32 rows of V stay in L1 for the D / 64 channel passes
    for (int64_t j0 = 0; j0 < T; j0 += JB) {
      const int64_t j1 = std::min(T, j0 + JB);
      for (int64_t c0 = 0; c0 < D; c0 += 64) {  // 64 channels: 4 x 4 accumulators in registers
        float* base = acc.data() + c0;
        __m512 r[4][4];
        for (int g = 0; g < 4; ++g)
          for (int c = 0; c < 4; ++c) r[g][c] = _mm512_loadu_ps(base + g * D + 16 * c);
        for (int64_t j = j0; j < j1; ++j) {
          const int8_t* row = V + j * D + c0;
          __m512 vf[4];
          for (int c = 0; c < 4; ++c)
            vf[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c))));
          const __m512 w[4] = {_mm512_set1_ps(p0[j]), _mm512_set1_ps(p1[j]), _mm512_set1_ps(p2[j]), _mm512_set1_ps(p3[j])};
          for (int g = 0; g < 4; ++g)
            for (int c = 0; c < 4; ++c) r[g][c] = _mm512_fmadd_ps(w[g], vf[c], r[g][c]);
        }
        for (int g = 0; g < 4; ++g)
          for (int c = 0; c < 4; ++c) _mm512_storeu_ps(base + g * D + 16 * c, r[g][c]);
      }
    }
  } else
#endif
  {
    for (int g = 0; g < g_n; ++g)
      for (int64_t j = 0; j < T; ++j) {
        const int8_t* vj = V + j * D;
        const float w = p[g * T + j];
        float* ag = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += w * static_cast<float>(vj[d]);
      }
  }
  for (int g = 0; g < g_n; ++g) {
    float* o = a.out + ((b * a.S + i) * a.H + h * g_n + g) * D;
    const float* ag = acc.data() + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ag[d] * vs[d];
  }
}

void run_task(void* data, size_t t) {
  const Args& a = *static_cast<const Args*>(data);
  const int64_t i = static_cast<int64_t>(t) % a.S;
  const int64_t h = (static_cast<int64_t>(t) / a.S) % a.Hkv;
  const int64_t b = static_cast<int64_t>(t) / (a.S * a.Hkv);
  const int64_t past = a.seqlens[b] + 1 - a.S;
  const int64_t pos = past + i;
  const int G = static_cast<int>(a.H / a.Hkv);
  if (G == 4)
    attend<4>(a, b, h, i, pos + 1, pos, G);
  else
    attend<0>(a, b, h, i, pos + 1, pos, G);
}

struct GroupQueryAttentionInt8 {
  GroupQueryAttentionInt8(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    heads_ = ki.GetAttribute<int64_t>("num_heads");
    kv_heads_ = ki.GetAttribute<int64_t>("kv_num_heads");
    scale_ = ki.GetAttribute<float>("scale");
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
                      const Tensor<int8_t>& past_k, const Tensor<int8_t>& past_v, const Tensor<int32_t>& seqlens_k,
                      const Tensor<int32_t>& total, const Tensor<float>& cos, const Tensor<float>& sin,
                      const Tensor<float>& k_scale, const Tensor<float>& v_scale, Tensor<float>& out,
                      Tensor<int8_t>& present_k, Tensor<int8_t>& present_v) {
    (void)total;
    const auto& qs = q.Shape();
    const auto& cs = past_k.Shape();
    if (qs.size() != 3 || cs.size() != 4 || cos.Shape().size() != 2)
      return Ort::Status("GroupQueryAttentionInt8: q [B, S, H*D], caches [B, Hkv, L, D], cos [L, R/2]", ORT_INVALID_ARGUMENT);
    Args a{};
    a.B = qs[0], a.S = qs[1], a.H = heads_, a.Hkv = kv_heads_, a.L = cs[2], a.D = cs[3];
    a.R = 2 * cos.Shape()[1];
    a.scale = scale_ != 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(a.D));
    if (qs[2] != a.H * a.D || cs[1] != a.Hkv || a.H % a.Hkv != 0 || a.R > a.D)
      return Ort::Status("GroupQueryAttentionInt8: shapes do not match num_heads / kv_num_heads", ORT_INVALID_ARGUMENT);
    a.q = q.Data(), a.k = k.Data(), a.v = v.Data(), a.cos = cos.Data(), a.sin = sin.Data();
    a.ks = k_scale.Data(), a.vs = v_scale.Data(), a.seqlens = seqlens_k.Data();
    a.out = out.Allocate({a.B, a.S, a.H * a.D});
    std::vector<int64_t> cshape(cs.begin(), cs.end());
    a.ck = present_k.Allocate(cshape);
    a.cv = present_v.Allocate(cshape);
    const size_t bytes = static_cast<size_t>(a.B * a.Hkv * a.L * a.D);
    if (a.ck != past_k.Data()) std::memcpy(a.ck, past_k.Data(), bytes);  // not bound in place: copy first
    if (a.cv != past_v.Data()) std::memcpy(a.cv, past_v.Data(), bytes);
    for (int64_t b = 0; b < a.B; ++b) {
      const int64_t past = static_cast<int64_t>(a.seqlens[b]) + 1 - a.S;
      if (past < 0 || past + a.S > a.L || past + a.S > cos.Shape()[0])
        return Ort::Status("GroupQueryAttentionInt8: seqlens_k past the KV buffer or the rotary cache", ORT_INVALID_ARGUMENT);
      std::vector<float> rk(static_cast<size_t>(a.D));
      for (int64_t i = 0; i < a.S; ++i)
        for (int64_t h = 0; h < a.Hkv; ++h) {
          const int64_t src = ((b * a.S + i) * a.Hkv + h) * a.D;
          const int64_t dst = ((b * a.Hkv + h) * a.L + past + i) * a.D;
          rotate(a.k + src, rk.data(), a.cos, a.sin, past + i, a.R, a.D);
          for (int64_t d = 0; d < a.D; ++d) {
            a.ck[dst + d] = quantize(rk[d], a.ks[h * a.D + d]);
            a.cv[dst + d] = quantize(a.v[src + d], a.vs[h * a.D + d]);
          }
        }
    }
    const size_t tasks = static_cast<size_t>(a.B * a.Hkv * a.S);
    Ort::KernelContext context(ctx);
    context.ParallelFor(run_task, tasks, tasks, &a);  // one task per (row, KV head, query token)
    return Ort::Status{nullptr};
  }

  int64_t heads_ = 0, kv_heads_ = 0;
  float scale_ = 0.0f;
};

std::once_flag once;
std::unique_ptr<Ort::CustomOpDomain> domain;
std::unique_ptr<Ort::Custom::OrtLiteCustomOp> gqa;

}  // namespace

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    std::call_once(once, [] {
      domain = std::make_unique<Ort::CustomOpDomain>("edgeattn");
      gqa.reset(Ort::Custom::CreateLiteCustomOp<GroupQueryAttentionInt8>("GroupQueryAttentionInt8", "CPUExecutionProvider"));
      domain->Add(gqa.get());
    });
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}

// The floor: ``n_bufs`` buffers of ``n`` int8 bytes each read once (widened to float and summed, as the kernel
// widens them), split between ``threads`` threads buffer by buffer; returns milliseconds.
extern "C" double edgeattn_read_ms(const int8_t* const* bufs, int n_bufs, int64_t n, int threads) {
  std::vector<double> sums(static_cast<size_t>(threads), 0.0);
  auto read = [&](int t) {
    for (int b = t; b < n_bufs; b += threads) {
      const int8_t* x = bufs[b];
      int64_t i = 0;
#ifdef __AVX512F__
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (; i + 64 <= n; i += 64) {
        const __m512i raw = _mm512_loadu_si512(x + i);
        a0 = _mm512_add_ps(a0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(raw))));
        a1 = _mm512_add_ps(a1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 1))));
        a2 = _mm512_add_ps(a2, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 2))));
        a3 = _mm512_add_ps(a3, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(raw, 3))));
      }
      double s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
      double s = 0.0;
#endif
      for (; i < n; ++i) s += x[i];
      sums[static_cast<size_t>(t)] += s;
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(read, t);
  read(0);
  for (auto& th : pool) th.join();
  const auto t1 = std::chrono::steady_clock::now();
  volatile double keep = 0;
  for (double x : sums) keep = keep + x;
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}
