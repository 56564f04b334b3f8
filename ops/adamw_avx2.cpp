// AVX2 + FMA + F16C traits for the SIMD kernel body (adamw_simd.h): 8 floats per vector.
//
// Only <immintrin.h>, <cstring> and the plain header are included, and the
// target pragma comes after them: nothing inline that other translation units
// share is compiled for AVX2 here, so the .so still loads and runs (through the
// scalar kernel) on a CPU without AVX2. adamw_cpu.cpp calls into this file only
// after __builtin_cpu_supports says AVX2, FMA and F16C are present.
#include <immintrin.h>
#include <cstring>
#include "adamw.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace fshard {
namespace {

struct Avx2 {
  using V = __m256;
  using M = __m256;  // lanes of all ones where a grad was not finite
  static constexpr int W = 8;
  static constexpr int U = 8;  // vectors per unrolled iteration (4 measured the same)
  static constexpr int kStreamAlign = 16;

  static V set1(float x) { return _mm256_set1_ps(x); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

  template <int G>
  static V load_grad(const void* g, int64_t i) {
    if constexpr (G == kGradF32) {
      return _mm256_loadu_ps(static_cast<const float*>(g) + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
      if constexpr (G == kGradBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      else return _mm256_cvtph_ps(h);
    }
  }

  // float -> bf16, round to nearest even, NaN -> 0x7fc0 (c10::detail::round_to_nearest_even).
  static __m128i to_bf16(V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    r = _mm256_packus_epi32(r, r);  // per 128-bit lane
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(r, 0x08));
  }

  template <int C>
  static __m128i to_copy(V x) {
    if constexpr (C == kCopyBF16) return to_bf16(x);
    else return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }

  template <int C>
  static void store_copy(void* out, int64_t i, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to_copy<C>(x));
  }

  // The copy is write-only: a streaming store skips the read-for-ownership of its cache line
  // (2 of the 30 bytes per element).
  template <int C>
  static void stream_copy(void* out, int64_t i, V x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to_copy<C>(x));
  }
  static void sfence() { _mm_sfence(); }

  static M m_zero() { return _mm256_setzero_ps(); }
  static M m_or(M a, M b) { return _mm256_or_ps(a, b); }
  static M nonfinite(V x) {  // |x| not < inf: inf or NaN
    const V abs = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    return _mm256_cmp_ps(abs, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)), _CMP_NLT_UQ);
  }
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
};

}  // namespace
}  // namespace fshard

#include "adamw_simd.h"

namespace fshard {

void adamw_range_avx2(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  update<Avx2>(c, s, b, e);
}

bool nonfinite_range_avx2(const Segment& s, float scale, int64_t b, int64_t e) {
  return nonfinite_any<Avx2>(s, scale, b, e);
}

}  // namespace fshard

#pragma GCC pop_options
