// AVX-512 (F, BW, VL) traits for the SIMD kernel body (adamw_simd.h): 16 floats per vector.
//
// Same rules as adamw_avx2.cpp: plain includes first, then the target pragma, so no inline
// code shared with other translation units is compiled for AVX-512. adamw_cpu.cpp calls into
// this file only after __builtin_cpu_supports says AVX-512 F, BW and VL (and AVX2, FMA, F16C)
// are present. Half the instructions of the AVX2 kernel for the same arithmetic: that matters
// where memory is fast enough for the core to become the limit (benchmarks/RESULTS.md).
#include <immintrin.h>
#include <cstring>
#include "adamw.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace fshard {
namespace {

struct Avx512 {
  using V = __m512;
  using M = __mmask16;  // bit set where a grad was not finite
  static constexpr int W = 16;
  static constexpr int U = 2;  // 2 measured ahead of 1, 4 and 8 on L3-resident state (design/OPS.md)
  static constexpr int kStreamAlign = 32;

  static V set1(float x) { return _mm512_set1_ps(x); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }

  template <int G>
  static V load_grad(const void* g, int64_t i) {
    if constexpr (G == kGradF32) {
      return _mm512_loadu_ps(static_cast<const float*>(g) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
      if constexpr (G == kGradBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      else return _mm512_cvtph_ps(h);
    }
  }

  // float -> bf16, round to nearest even, NaN -> 0x7fc0 (c10::detail::round_to_nearest_even).
  // Integer rounding rather than AVX512-BF16's vcvtneps2bf16, which flushes denormal inputs to
  // zero and keeps NaN payloads, so it would not equal param.to(torch.bfloat16).
  static __m256i to_bf16(V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);  // every lane is < 0x10000, so truncation is exact
  }

  template <int C>
  static __m256i to_copy(V x) {
    if constexpr (C == kCopyBF16) return to_bf16(x);
    else return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }

  template <int C>
  static void store_copy(void* out, int64_t i, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), to_copy<C>(x));
  }

  // Write-only copy: a streaming store skips the read-for-ownership of its cache line.
  template <int C>
  static void stream_copy(void* out, int64_t i, V x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), to_copy<C>(x));
  }
  static void sfence() { _mm_sfence(); }

  static M m_zero() { return 0; }
  static M m_or(M a, M b) { return a | b; }
  static M nonfinite(V x) {  // |x| not < inf: inf or NaN
    return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000)), _CMP_NLT_UQ);
  }
  static bool any(M m) { return m != 0; }
};

}  // namespace
}  // namespace fshard

#include "adamw_simd.h"

namespace fshard {

void adamw_range_avx512(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  update<Avx512>(c, s, b, e);
}

bool nonfinite_range_avx512(const Segment& s, float scale, int64_t b, int64_t e) {
  return nonfinite_any<Avx512>(s, scale, b, e);
}

}  // namespace fshard

#pragma GCC pop_options
