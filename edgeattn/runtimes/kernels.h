// What edgeattn's CPU kernels (attention.cc, matmul.cc: one custom-op library) share: ONNX Runtime's custom-op
// headers (the API initialized by RegisterCustomOps), a vector sum, and node attributes read with a fallback where
// the node does not set them.
#pragma once

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace edgeattn_kernels {

inline float hsum(__m256 v) {  // the sum of 8 floats
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

template <typename T>
T attr(const Ort::ConstKernelInfo& ki, const char* name, T fallback) {
  try {
    return ki.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

}  // namespace edgeattn_kernels
