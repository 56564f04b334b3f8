// AVX2 + FMA + F16C AdamW kernel, 8 floats per step, any length and alignment.
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

constexpr int W = 8;  // floats per __m256

template <int G>
inline __m256 load_grad(const void* g, int64_t i) {
  if constexpr (G == kGradF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else if constexpr (G == kGradBF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_cvtph_ps(h);
  }
}

// float -> bf16, round to nearest even, NaN -> 0x7fc0 (c10::detail::round_to_nearest_even).
inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_srli_epi32(r, 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  r = _mm256_packus_epi32(r, r);                       // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(r, 0x08));
}

template <int C>
inline __m128i to_copy(__m256 x) {
  if constexpr (C == kCopyBF16) return to_bf16(x);
  else return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <int C>
inline void store_copy(void* out, int64_t i, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to_copy<C>(x));
}

// The copy is write-only: a streaming store skips the read-for-ownership of its cache line
// (2 of the 30 bytes per element). Needs 16-byte alignment.
template <int C>
inline void stream_copy(void* out, int64_t i, __m256 x) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to_copy<C>(x));
}

struct VConsts {
  __m256 scale, wd_mul, wd, lerp_w, lerp_w1, beta2, sq, bc2, eps, nstep;
  explicit VConsts(const AdamConsts& c)
      : scale(_mm256_set1_ps(c.grad_scale)), wd_mul(_mm256_set1_ps(c.wd_mul)),
        wd(_mm256_set1_ps(c.wd)), lerp_w(_mm256_set1_ps(c.lerp_w)),
        lerp_w1(_mm256_set1_ps(c.lerp_w - 1.0f)), beta2(_mm256_set1_ps(c.beta2)),
        sq(_mm256_set1_ps(c.sq_coeff)), bc2(_mm256_set1_ps(c.bc2_sqrt)),
        eps(_mm256_set1_ps(c.eps)), nstep(_mm256_set1_ps(c.neg_step_size)) {}
};

// One vector of the update, in registers. Arithmetic order follows ATen's fused Adam.
template <bool ADAMW, bool WD, bool SMALL>
inline void math8(const VConsts& k, __m256 g, __m256& pv, __m256& mv, __m256& vv) {
  g = _mm256_mul_ps(g, k.scale);
  if constexpr (WD) {
    if constexpr (ADAMW) pv = _mm256_mul_ps(pv, k.wd_mul);
    else g = _mm256_fmadd_ps(pv, k.wd, g);
  }
  const __m256 d = _mm256_sub_ps(g, mv);
  mv = SMALL ? _mm256_fmadd_ps(k.lerp_w, d, mv) : _mm256_fmadd_ps(k.lerp_w1, d, g);
  // ATen's `v * beta2 + (sq * g) * g`, contracted the way its AVX2 build contracts it.
  vv = _mm256_fmadd_ps(_mm256_mul_ps(k.sq, g), g, _mm256_mul_ps(vv, k.beta2));
  // Two divisions, as ATen: a multiply by 1/sqrt(bc2) measured no faster (design/OPS.md).
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), k.bc2), k.eps);
  pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(k.nstep, mv), denom));
}

template <bool ADAMW, bool WD, bool SMALL>
inline void step8(const VConsts& k, __m256 g, float* p, float* m, float* v, __m256* pout) {
  __m256 pv = _mm256_loadu_ps(p), mv = _mm256_loadu_ps(m), vv = _mm256_loadu_ps(v);
  math8<ADAMW, WD, SMALL>(k, g, pv, mv, vv);
  _mm256_storeu_ps(m, mv);
  _mm256_storeu_ps(v, vv);
  _mm256_storeu_ps(p, pv);
  *pout = pv;
}

inline int grad_bytes(int gtype) { return gtype == kGradF32 ? 4 : 2; }


template <int G, int C, bool ADAMW, bool WD, bool SMALL>
void range(const AdamConsts& c, const Segment& s, int64_t begin, int64_t end) {
  const VConsts k(c);
  __m256 pv;
  int64_t i = begin;
  // U vectors per iteration, all loads first (as DeepSpeed's Step_AVX<8>): many
  // independent misses in flight per core before the divide/sqrt chains start.
  constexpr int U = 8;
  // i advances by 128 bytes of copy per iteration, so alignment at the start holds throughout.
  const bool nt = C != kCopyNone && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(s.copy) + i) & 15) == 0;
  for (; i + U * W <= end; i += U * W) {
    __m256 g[U], p[U], m[U], v[U];
    for (int u = 0; u < U; ++u) g[u] = load_grad<G>(s.g, i + u * W);
    for (int u = 0; u < U; ++u) p[u] = _mm256_loadu_ps(s.p + i + u * W);
    for (int u = 0; u < U; ++u) m[u] = _mm256_loadu_ps(s.m + i + u * W);
    for (int u = 0; u < U; ++u) v[u] = _mm256_loadu_ps(s.v + i + u * W);
    for (int u = 0; u < U; ++u) math8<ADAMW, WD, SMALL>(k, g[u], p[u], m[u], v[u]);
    for (int u = 0; u < U; ++u) _mm256_storeu_ps(s.p + i + u * W, p[u]);
    for (int u = 0; u < U; ++u) _mm256_storeu_ps(s.m + i + u * W, m[u]);
    for (int u = 0; u < U; ++u) _mm256_storeu_ps(s.v + i + u * W, v[u]);
    if constexpr (C != kCopyNone) {
      if (nt) for (int u = 0; u < U; ++u) stream_copy<C>(s.copy, i + u * W, p[u]);
      else for (int u = 0; u < U; ++u) store_copy<C>(s.copy, i + u * W, p[u]);
    }
  }
  if (nt) _mm_sfence();  // order the streaming stores before the op returns
  for (; i + W <= end; i += W) {
    step8<ADAMW, WD, SMALL>(k, load_grad<G>(s.g, i), s.p + i, s.m + i, s.v + i, &pv);
    if constexpr (C != kCopyNone) store_copy<C>(s.copy, i, pv);
  }
  const int64_t r = end - i;
  if (r == 0) return;
  // Tail: run the same vector code on zero-padded stack copies, so every
  // element gets bit-identical arithmetic whatever its position.
  alignas(32) float p[W] = {0}, m[W] = {0}, v[W] = {0};
  alignas(32) unsigned char g[W * 4] = {0};
  alignas(16) uint16_t out[W] = {0};
  const int gb = grad_bytes(G);
  std::memcpy(p, s.p + i, r * 4);
  std::memcpy(m, s.m + i, r * 4);
  std::memcpy(v, s.v + i, r * 4);
  std::memcpy(g, static_cast<const unsigned char*>(s.g) + i * gb, r * gb);
  step8<ADAMW, WD, SMALL>(k, load_grad<G>(g, 0), p, m, v, &pv);
  std::memcpy(s.p + i, p, r * 4);
  std::memcpy(s.m + i, m, r * 4);
  std::memcpy(s.v + i, v, r * 4);
  if constexpr (C != kCopyNone) {
    store_copy<C>(out, 0, pv);
    std::memcpy(static_cast<uint16_t*>(s.copy) + i, out, r * 2);
  }
}

template <int G, int C, bool ADAMW>
void range_wd(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  const bool small = (c.lerp_w < 0.5f && c.lerp_w > -0.5f);
  if (c.has_wd) {
    if (small) range<G, C, ADAMW, true, true>(c, s, b, e);
    else range<G, C, ADAMW, true, false>(c, s, b, e);
  } else {
    if (small) range<G, C, ADAMW, false, true>(c, s, b, e);
    else range<G, C, ADAMW, false, false>(c, s, b, e);
  }
}

template <int G, int C>
void range_mode(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  if (c.adamw) range_wd<G, C, true>(c, s, b, e);
  else range_wd<G, C, false>(c, s, b, e);
}

template <int G>
void range_copy(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  with_copy_type(s.ctype, [&](auto C) { range_mode<G, decltype(C)::value>(c, s, b, e); });
}

// Any lane of |g * scale| not < inf (inf or NaN) sets the mask.
template <int G>
bool nonfinite(const Segment& s, float scale, int64_t begin, int64_t end) {
  const __m256 k = _mm256_set1_ps(scale);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const char* base = static_cast<const char*>(s.g);
  const int64_t gb = grad_bytes(G);
  int64_t i = begin;
  // A read-only stream is latency-bound per core: unroll 4 and prefetch ~2 KiB ahead.
  for (; i + 4 * W <= end; i += 4 * W) {
    _mm_prefetch(base + i * gb + 2048, _MM_HINT_T0);  // never faults, even past the end
    __m256 a = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(s.g, i), k), absmask);
    __m256 b = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(s.g, i + W), k), absmask);
    __m256 a2 = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(s.g, i + 2 * W), k), absmask);
    __m256 b2 = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(s.g, i + 3 * W), k), absmask);
    acc0 = _mm256_or_ps(acc0, _mm256_or_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ), _mm256_cmp_ps(a2, inf, _CMP_NLT_UQ)));
    acc1 = _mm256_or_ps(acc1, _mm256_or_ps(_mm256_cmp_ps(b, inf, _CMP_NLT_UQ), _mm256_cmp_ps(b2, inf, _CMP_NLT_UQ)));
  }
  for (; i + 2 * W <= end; i += 2 * W) {
    __m256 a = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(s.g, i), k), absmask);
    __m256 b = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(s.g, i + W), k), absmask);
    acc0 = _mm256_or_ps(acc0, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
    acc1 = _mm256_or_ps(acc1, _mm256_cmp_ps(b, inf, _CMP_NLT_UQ));
  }
  if (i < end) {
    alignas(32) unsigned char g[2 * W * 4] = {0};
    std::memcpy(g, static_cast<const unsigned char*>(s.g) + i * gb, (end - i) * gb);
    __m256 a = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(g, 0), k), absmask);
    __m256 b = _mm256_and_ps(_mm256_mul_ps(load_grad<G>(g, W), k), absmask);
    acc0 = _mm256_or_ps(acc0, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
    acc1 = _mm256_or_ps(acc1, _mm256_cmp_ps(b, inf, _CMP_NLT_UQ));
  }
  return _mm256_movemask_ps(_mm256_or_ps(acc0, acc1)) != 0;
}

}  // namespace

void adamw_range_avx2(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  with_grad_type(s.gtype, [&](auto G) { range_copy<decltype(G)::value>(c, s, b, e); });
}

bool nonfinite_range_avx2(const Segment& s, float scale, int64_t b, int64_t e) {
  return with_grad_type(s.gtype, [&](auto G) { return nonfinite<decltype(G)::value>(s, scale, b, e); });
}

}  // namespace fshard

#pragma GCC pop_options
