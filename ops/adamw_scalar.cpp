// Portable scalar AdamW kernel: the fallback when the CPU lacks AVX2/FMA/F16C.
// Same arithmetic order as the AVX2 kernel and as ATen's fused Adam.
#include <cmath>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include "adamw.h"

namespace fshard {
namespace {

template <int G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == kGradF32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (G == kGradBF16) {
    return c10::detail::f32_from_bits(static_cast<const uint16_t*>(g)[i]);
  } else {
    return c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(g)[i]);
  }
}

template <int C>
inline void store_copy(void* out, int64_t i, float x) {
  if constexpr (C == kCopyBF16) {
    static_cast<uint16_t*>(out)[i] = c10::detail::round_to_nearest_even(x);
  } else if constexpr (C == kCopyF16) {
    static_cast<uint16_t*>(out)[i] = c10::detail::fp16_ieee_from_fp32_value(x);
  }
}

template <int G, int C, bool ADAMW>
void range(const AdamConsts& c, const Segment& s, int64_t begin, int64_t end) {
  float* p = s.p;
  float* m = s.m;
  float* v = s.v;
  const bool small = std::fabs(c.lerp_w) < 0.5f;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad<G>(s.g, i) * c.grad_scale;
    float pv = p[i];
    if (c.has_wd) {
      if constexpr (ADAMW) pv = pv * c.wd_mul;
      else g = std::fma(pv, c.wd, g);
    }
    // exp_avg.lerp_(g, w), as ATen computes it.
    float mv = small ? std::fma(c.lerp_w, g - m[i], m[i])
                     : std::fma(c.lerp_w - 1.0f, g - m[i], g);
    float vv = std::fma(c.sq_coeff * g, g, v[i] * c.beta2);
    float denom = std::sqrt(vv) / c.bc2_sqrt + c.eps;
    pv = pv + c.neg_step_size * mv / denom;
    m[i] = mv;
    v[i] = vv;
    p[i] = pv;
    if constexpr (C != kCopyNone) store_copy<C>(s.copy, i, pv);
  }
}

template <int G, int C>
void range_mode(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  if (c.adamw) range<G, C, true>(c, s, b, e);
  else range<G, C, false>(c, s, b, e);
}

template <int G>
void range_copy(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  with_copy_type(s.ctype, [&](auto C) { range_mode<G, decltype(C)::value>(c, s, b, e); });
}

template <int G>
bool nonfinite(const Segment& s, float scale, int64_t b, int64_t e) {
  bool bad = false;
  for (int64_t i = b; i < e; ++i) bad |= !std::isfinite(load_grad<G>(s.g, i) * scale);
  return bad;
}

}  // namespace

void adamw_range_scalar(const AdamConsts& c, const Segment& s, int64_t b, int64_t e) {
  with_grad_type(s.gtype, [&](auto G) { range_copy<decltype(G)::value>(c, s, b, e); });
}

bool nonfinite_range_scalar(const Segment& s, float scale, int64_t b, int64_t e) {
  return with_grad_type(s.gtype, [&](auto G) { return nonfinite<decltype(G)::value>(s, scale, b, e); });
}

}  // namespace fshard
