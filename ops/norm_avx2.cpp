// AVX2 + F16C traits for the sum-of-squares body (norm_simd.h): 4 doubles per vector, 8 accumulators.
//
// Same rules as adamw_avx2.cpp: plain includes first, then the target pragma, so nothing inline that other
// translation units share is compiled for AVX2 here. norm_cpu.cpp calls into this file only when
// best_cpu_isa() says AVX2, FMA and F16C are present.
#include <immintrin.h>
#include <cstring>
#include "norm.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace fshard {
namespace {

struct Avx2 {
  using D = __m256d;
  static constexpr int DW = 4;

  static D zero() { return _mm256_setzero_pd(); }
  static D add(D a, D b) { return _mm256_add_pd(a, b); }
  static D mul(D a, D b) { return _mm256_mul_pd(a, b); }
  static void storeu(double* p, D x) { _mm256_storeu_pd(p, x); }

  template <int G>
  static D load(const void* x, int64_t i) {
    if constexpr (G == kGradF32) {
      return _mm256_cvtps_pd(_mm_loadu_ps(static_cast<const float*>(x) + i));
    } else {
      const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
      if constexpr (G == kGradBF16) return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)));
      else return _mm256_cvtps_pd(_mm_cvtph_ps(h));
    }
  }
};

}  // namespace
}  // namespace fshard

#include "norm_simd.h"

namespace fshard {

void sq_lanes_avx2(const void* x, int xtype, int64_t begin, int64_t end, double* lanes) {
  sq_lanes_any<Avx2>(x, xtype, begin, end, lanes);
}

}  // namespace fshard

#pragma GCC pop_options
