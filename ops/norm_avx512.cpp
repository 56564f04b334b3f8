// AVX-512 (F, BW, VL) traits for the sum-of-squares body (norm_simd.h): 8 doubles per vector, 4 accumulators.
//
// Same rules as adamw_avx512.cpp: plain includes first, then the target pragma. norm_cpu.cpp calls into this
// file only when best_cpu_isa() says AVX-512 F, BW and VL (and AVX2, FMA, F16C) are present.
#include <immintrin.h>
#include <cstring>
#include "norm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace fshard {
namespace {

struct Avx512 {
  using D = __m512d;
  static constexpr int DW = 8;

  static D zero() { return _mm512_setzero_pd(); }
  static D add(D a, D b) { return _mm512_add_pd(a, b); }
  static D mul(D a, D b) { return _mm512_mul_pd(a, b); }
  static void storeu(double* p, D x) { _mm512_storeu_pd(p, x); }

  template <int G>
  static D load(const void* x, int64_t i) {
    if constexpr (G == kGradF32) {
      return _mm512_cvtps_pd(_mm256_loadu_ps(static_cast<const float*>(x) + i));
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
      if constexpr (G == kGradBF16) {
        return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      } else {
        return _mm512_cvtps_pd(_mm256_cvtph_ps(h));
      }
    }
  }
};

}  // namespace
}  // namespace fshard

#include "norm_simd.h"

namespace fshard {

void sq_lanes_avx512(const void* x, int xtype, int64_t begin, int64_t end, double* lanes) {
  sq_lanes_any<Avx512>(x, xtype, begin, end, lanes);
}

}  // namespace fshard

#pragma GCC pop_options
