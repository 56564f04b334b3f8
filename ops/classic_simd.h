// The block body of the single-tensor kernels (classic.h), written once as plain loops. Each ISA file includes
// classic.h, then its target pragma, then this file: the compiler vectorizes the loops for that ISA. The
// arithmetic is fixed per element (every product-sum torch's vector build contracts is an explicit
// __builtin_fmaf, and -ffp-contract=off forbids any other), so every ISA and every position in a run give the
// same bits, and they are the bits of ATen's kernels:
//   grad.add(param, alpha=a)        fma(param, a, grad)
//   exp_avg.lerp_(grad, w)          fma(w, grad - m, m) (|w| < 0.5), else fma(w - 1, grad - m, grad)
//   v.mul_(b2).addcmul_(g, g, value=c)  fma(c * g, g, v * b2)
//   buf.mul_(mom).add_(grad, alpha=a)   fma(grad, a, buf * mom)
//   param.addcdiv_(t1, t2, value=a) param + (a * t1) / t2
//   x.sqrt()                        the SqrtFn (MKL's vmsSqrt in an MKL build of torch: not IEEE's sqrt)
// Anonymous namespace: each ISA file gets its own copy, compiled under its own flags.
#pragma once

namespace fshard {
namespace {

inline float c_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// Every loop touches all the streams of its element at once (the hardware prefetchers then stream them as they
// stream a fused kernel's); the flags are template parameters, so each loop body is branch-free and vectorizes.

// The gradient after maximize (grad = -grad) and L2 decay (grad.add(param, alpha=wd)).
template <bool MAXI, bool WD>
inline float grad_at(const float* __restrict g, const float* __restrict p, float wd, int64_t i) {
  const float x = MAXI ? -g[i] : g[i];
  return WD ? c_fma(p[i], wd, x) : x;
}

template <class F>
inline void with_flags(bool a, bool b, F&& f) {
  if (a) {
    if (b) f(std::true_type{}, std::true_type{});
    else f(std::true_type{}, std::false_type{});
  } else {
    if (b) f(std::false_type{}, std::true_type{});
    else f(std::false_type{}, std::false_type{});
  }
}

template <bool WD, bool SMALL, bool AMS>
inline void adam_moments(const ClassicConsts& c, const float* __restrict g, const float* __restrict p,
                         float* __restrict m, float* __restrict v, float* __restrict vmax, int64_t n) {
  const float wd = c.wd, w = SMALL ? c.lerp_w : c.lerp_w - 1.0f, b2 = c.beta2, sqc = c.sq_coeff;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = grad_at<false, WD>(g, p, wd, i);
    const float d = gi - m[i];
    m[i] = SMALL ? c_fma(w, d, m[i]) : c_fma(w, d, gi);
    const float vi = c_fma(sqc * gi, gi, v[i] * b2);
    v[i] = vi;
    if (AMS) {  // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq): NaN propagates
      const float a = vmax[i];
      vmax[i] = (a != a || vi != vi) ? a + vi : (a > vi ? a : vi);
    }
  }
}

inline void adam_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t n, SqrtFn sq,
                       float* __restrict s_buf) {
  float* __restrict p = s.p + b;
  float* __restrict m = s.r0 + b;
  float* v = s.r1 + b;
  float* vmax = c.amsgrad ? s.r2 + b : nullptr;
  with_flags(c.has_wd, c.lerp_small, [&](auto wd, auto small) {
    if (c.amsgrad) adam_moments<decltype(wd)::value, decltype(small)::value, true>(c, s.g + b, p, m, v, vmax, n);
    else adam_moments<decltype(wd)::value, decltype(small)::value, false>(c, s.g + b, p, m, v, nullptr, n);
  });
  sq(c.amsgrad ? vmax : v, s_buf, n);
  const float bc2 = c.bc2_sqrt, eps = c.eps, ns = c.neg_step;
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] + (ns * m[i]) / (s_buf[i] / bc2 + eps);
}

// Momentum modes: none, the first step (the buffer becomes the gradient), later steps; each with or without Nesterov.
enum SgdMode : int { kSgdPlain = 0, kSgdFirst = 1, kSgdLater = 2 };

template <bool MAXI, bool WD, int MODE, bool NEST>
inline void sgd_loop(const ClassicConsts& c, const float* __restrict g, float* __restrict p, float* __restrict buf,
                     int64_t n) {
  const float wd = c.wd, nlr = c.neg_lr, mom = c.momentum, d1 = c.damp1;
#pragma GCC unroll 4
  for (int64_t i = 0; i < n; ++i) {
    const float gi = grad_at<MAXI, WD>(g, p, wd, i);
    float u = gi;
    if (MODE != kSgdPlain) {
      const float bi = MODE == kSgdFirst ? gi : c_fma(gi, d1, buf[i] * mom);
      buf[i] = bi;
      u = NEST ? c_fma(bi, mom, gi) : bi;
    }
    p[i] = c_fma(u, nlr, p[i]);
  }
}

inline void sgd_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t n) {
  float* p = s.p + b;
  float* buf = c.has_momentum ? s.r0 + b : nullptr;
  const float* g = s.g + b;
  with_flags(c.maximize, c.has_wd, [&](auto mx, auto wd) {
    constexpr bool MX = decltype(mx)::value, WD = decltype(wd)::value;
    if (!c.has_momentum) sgd_loop<MX, WD, kSgdPlain, false>(c, g, p, buf, n);
    else if (c.first && c.nesterov) sgd_loop<MX, WD, kSgdFirst, true>(c, g, p, buf, n);
    else if (c.first) sgd_loop<MX, WD, kSgdFirst, false>(c, g, p, buf, n);
    else if (c.nesterov) sgd_loop<MX, WD, kSgdLater, true>(c, g, p, buf, n);
    else sgd_loop<MX, WD, kSgdLater, false>(c, g, p, buf, n);
  });
}

template <bool MAXI, bool WD>
inline void adagrad_sums(const ClassicConsts& c, const float* __restrict g, const float* __restrict p,
                         float* __restrict sum, float* __restrict g_out, int64_t n) {
  const float wd = c.wd;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = grad_at<MAXI, WD>(g, p, wd, i);
    g_out[i] = gi;
    sum[i] = c_fma(gi, gi, sum[i]);  // addcmul_(g, g, value=1): 1 * g is g
  }
}

inline void adagrad_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t n, SqrtFn sq,
                          float* __restrict s_buf, float* __restrict g_buf) {
  float* __restrict p = s.p + b;
  float* sum = s.r0 + b;
  with_flags(c.maximize, c.has_wd, [&](auto mx, auto wd) {
    adagrad_sums<decltype(mx)::value, decltype(wd)::value>(c, s.g + b, p, sum, g_buf, n);
  });
  sq(sum, s_buf, n);
  const float eps = c.eps, ns = c.neg_step;
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] + (ns * g_buf[i]) / (s_buf[i] + eps);
}

inline void classic_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t e, SqrtFn sq,
                          float* s_buf, float* g_buf) {
  if (c.kind == kClassicAdam) adam_block(c, s, b, e - b, sq, s_buf);
  else if (c.kind == kClassicSgd) sgd_block(c, s, b, e - b);
  else adagrad_block(c, s, b, e - b, sq, s_buf, g_buf);
}

}  // namespace
}  // namespace fshard
