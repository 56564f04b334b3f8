// The SIMD body of the CPU kernel, written once over a vector-traits type T.
//
// Each ISA file (adamw_avx2.cpp, adamw_avx512.cpp) includes <immintrin.h>, <cstring> and adamw.h,
// then its target pragma, then defines its traits and includes this file. Everything here sits in
// an anonymous namespace, so each ISA file gets its own copy compiled under its own flags and no
// inline code is shared (and merged by the linker) across ISAs.
//
// T provides: V (the vector), M (a non-finite accumulator), W (floats per vector), U (vectors per
// unrolled iteration), kStreamAlign (bytes a streaming copy store needs), and
//   set1, loadu, storeu, load_grad<G>, store_copy<C>, stream_copy<C>, sfence,
//   mul, add, sub, div, sqrt, fma (a*b+c), m_zero, m_or, nonfinite(x), any(M).
// The per-lane arithmetic is the same IEEE sequence on every ISA, so the AVX2 and AVX-512
// kernels agree bit for bit, and both agree with ATen's vector path.
#pragma once

namespace fshard {
namespace {

template <class T>
struct VConsts {
  using V = typename T::V;
  V scale, wd_mul, wd, lerp_w, lerp_w1, beta2, sq, bc2, eps, nstep;
  explicit VConsts(const AdamConsts& c)
      : scale(T::set1(c.grad_scale)), wd_mul(T::set1(c.wd_mul)), wd(T::set1(c.wd)),
        lerp_w(T::set1(c.lerp_w)), lerp_w1(T::set1(c.lerp_w - 1.0f)), beta2(T::set1(c.beta2)),
        sq(T::set1(c.sq_coeff)), bc2(T::set1(c.bc2_sqrt)), eps(T::set1(c.eps)),
        nstep(T::set1(c.neg_step_size)) {}
};

// One vector of the update, in registers. Arithmetic order follows ATen's fused Adam.
template <class T, bool ADAMW, bool WD, bool SMALL>
inline void math(const VConsts<T>& k, typename T::V g, typename T::V& pv, typename T::V& mv,
                 typename T::V& vv) {
  g = T::mul(g, k.scale);
  if constexpr (WD) {
    if constexpr (ADAMW) pv = T::mul(pv, k.wd_mul);
    else g = T::fma(pv, k.wd, g);
  }
  const auto d = T::sub(g, mv);
  mv = SMALL ? T::fma(k.lerp_w, d, mv) : T::fma(k.lerp_w1, d, g);
  // ATen's `v * beta2 + (sq * g) * g`, contracted the way its vector build contracts it.
  vv = T::fma(T::mul(k.sq, g), g, T::mul(vv, k.beta2));
  // Two divisions, as ATen: a multiply by 1/sqrt(bc2) measured no faster (design/OPS.md).
  const auto denom = T::add(T::div(T::sqrt(vv), k.bc2), k.eps);
  pv = T::add(pv, T::div(T::mul(k.nstep, mv), denom));
}

inline int grad_bytes(int gtype) { return gtype == kGradF32 ? 4 : 2; }

template <class T, int G, int C, bool ADAMW, bool WD, bool SMALL>
void range(const AdamConsts& c, const Segment& s, int64_t begin, int64_t end) {
  using V = typename T::V;
  constexpr int W = T::W, U = T::U;
  const VConsts<T> k(c);
  int64_t i = begin;
  // U vectors per iteration, all loads first (as DeepSpeed's Step_AVX): many independent misses
  // in flight per core before the divide/sqrt chains start.
  // i advances by U*W*2 bytes of copy per iteration, so alignment at the start holds throughout.
  const bool nt = C != kCopyNone &&
                  (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(s.copy) + i) % T::kStreamAlign) == 0;
  for (; i + U * W <= end; i += U * W) {
    V g[U], p[U], m[U], v[U];
    for (int u = 0; u < U; ++u) g[u] = T::template load_grad<G>(s.g, i + u * W);
    for (int u = 0; u < U; ++u) p[u] = T::loadu(s.p + i + u * W);
    for (int u = 0; u < U; ++u) m[u] = T::loadu(s.m + i + u * W);
    for (int u = 0; u < U; ++u) v[u] = T::loadu(s.v + i + u * W);
    for (int u = 0; u < U; ++u) math<T, ADAMW, WD, SMALL>(k, g[u], p[u], m[u], v[u]);
    for (int u = 0; u < U; ++u) T::storeu(s.p + i + u * W, p[u]);
    for (int u = 0; u < U; ++u) T::storeu(s.m + i + u * W, m[u]);
    for (int u = 0; u < U; ++u) T::storeu(s.v + i + u * W, v[u]);
    if constexpr (C != kCopyNone) {
      if (nt) for (int u = 0; u < U; ++u) T::template stream_copy<C>(s.copy, i + u * W, p[u]);
      else for (int u = 0; u < U; ++u) T::template store_copy<C>(s.copy, i + u * W, p[u]);
    }
  }
  if (nt) T::sfence();  // order the streaming stores before the op returns
  // Rest: whole vectors, then a tail of < W elements run through the same vector code on
  // zero-padded stack copies, so every element gets bit-identical arithmetic whatever its position.
  alignas(64) float tp[W], tm[W], tv[W];
  alignas(64) unsigned char tg[W * 4];
  alignas(64) uint16_t tc[W];
  const int gb = grad_bytes(G);
  for (; i < end; i += W) {
    const int64_t r = end - i < W ? end - i : W;
    float *p = s.p + i, *m = s.m + i, *v = s.v + i;
    const void* g = static_cast<const unsigned char*>(s.g) + i * gb;
    if (r < W) {
      std::memset(tp, 0, sizeof tp), std::memset(tm, 0, sizeof tm), std::memset(tv, 0, sizeof tv);
      std::memset(tg, 0, sizeof tg);
      std::memcpy(tp, p, r * 4), std::memcpy(tm, m, r * 4), std::memcpy(tv, v, r * 4);
      std::memcpy(tg, g, r * gb);
      p = tp, m = tm, v = tv, g = tg;
    }
    V gv = T::template load_grad<G>(g, 0), pv = T::loadu(p), mv = T::loadu(m), vv = T::loadu(v);
    math<T, ADAMW, WD, SMALL>(k, gv, pv, mv, vv);
    T::storeu(p, pv), T::storeu(m, mv), T::storeu(v, vv);
    if constexpr (C != kCopyNone) {
      if (r == W) T::template store_copy<C>(s.copy, i, pv);
      else T::template store_copy<C>(tc, 0, pv);
    }
    if (r < W) {
      std::memcpy(s.p + i, tp, r * 4), std::memcpy(s.m + i, tm, r * 4), std::memcpy(s.v + i, tv, r * 4);
      if constexpr (C != kCopyNone) std::memcpy(static_cast<uint16_t*>(s.copy) + i, tc, r * 2);
    }
  }
}

template <class T, int G, int C, bool ADAMW>
void range_wd(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  const bool small = (c.lerp_w < 0.5f && c.lerp_w > -0.5f);
  if (c.has_wd) {
    if (small) range<T, G, C, ADAMW, true, true>(c, s, b, e);
    else range<T, G, C, ADAMW, true, false>(c, s, b, e);
  } else {
    if (small) range<T, G, C, ADAMW, false, true>(c, s, b, e);
    else range<T, G, C, ADAMW, false, false>(c, s, b, e);
  }
}

template <class T>
void update(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  with_grad_type(s.gtype, [&](auto G) {
    with_copy_type(s.ctype, [&](auto C) {
      constexpr int g = decltype(G)::value, cp = decltype(C)::value;
      if (c.adamw) range_wd<T, g, cp, true>(c, s, b, e);
      else range_wd<T, g, cp, false>(c, s, b, e);
    });
  });
}

// Any lane of |g * scale| not < inf (inf or NaN) sets the accumulator.
template <class T, int G>
bool nonfinite(const Segment& s, float scale, int64_t begin, int64_t end) {
  constexpr int W = T::W;
  const auto k = T::set1(scale);
  auto acc0 = T::m_zero(), acc1 = T::m_zero();
  const char* base = static_cast<const char*>(s.g);
  const int64_t gb = grad_bytes(G);
  int64_t i = begin;
  // A read-only stream is latency-bound per core: unroll 4 and prefetch ~2 KiB ahead.
  for (; i + 4 * W <= end; i += 4 * W) {
    _mm_prefetch(base + i * gb + 2048, _MM_HINT_T0);  // never faults, even past the end
    const auto a = T::nonfinite(T::mul(T::template load_grad<G>(s.g, i), k));
    const auto b = T::nonfinite(T::mul(T::template load_grad<G>(s.g, i + W), k));
    const auto a2 = T::nonfinite(T::mul(T::template load_grad<G>(s.g, i + 2 * W), k));
    const auto b2 = T::nonfinite(T::mul(T::template load_grad<G>(s.g, i + 3 * W), k));
    acc0 = T::m_or(acc0, T::m_or(a, a2));
    acc1 = T::m_or(acc1, T::m_or(b, b2));
  }
  alignas(64) unsigned char g[W * 4];
  for (; i < end; i += W) {
    const void* src = base + i * gb;
    if (end - i < W) std::memset(g, 0, sizeof g), std::memcpy(g, src, (end - i) * gb), src = g;
    acc0 = T::m_or(acc0, T::nonfinite(T::mul(T::template load_grad<G>(src, 0), k)));
  }
  return T::any(T::m_or(acc0, acc1));
}

template <class T>
bool nonfinite_any(const Segment& s, float scale, int64_t b, int64_t e) {
  return with_grad_type(s.gtype, [&](auto G) { return nonfinite<T, decltype(G)::value>(s, scale, b, e); });
}

}  // namespace
}  // namespace fshard
