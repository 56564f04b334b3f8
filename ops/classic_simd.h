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

// g_buf <- the gradient after maximize and L2 decay; returns where it is (g itself when neither applies).
inline const float* grad_in(const ClassicConsts& c, const float* __restrict g, const float* __restrict p,
                            float* __restrict out, int64_t n) {
  if (!c.maximize && !c.has_wd) return g;
  const float wd = c.wd;
  if (c.maximize && c.has_wd) {
    for (int64_t i = 0; i < n; ++i) out[i] = c_fma(p[i], wd, -g[i]);
  } else if (c.maximize) {
    for (int64_t i = 0; i < n; ++i) out[i] = -g[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = c_fma(p[i], wd, g[i]);
  }
  return out;
}

inline void adam_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t n, SqrtFn sq,
                       float* __restrict s_buf, float* __restrict g_buf) {
  float* __restrict p = s.p + b;
  float* __restrict m = s.r0 + b;
  float* __restrict v = s.r1 + b;
  const float* __restrict g = grad_in(c, s.g + b, p, g_buf, n);
  const float w = c.lerp_w, w1 = c.lerp_w - 1.0f, b2 = c.beta2, sqc = c.sq_coeff;
  if (c.lerp_small) {
    for (int64_t i = 0; i < n; ++i) m[i] = c_fma(w, g[i] - m[i], m[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) m[i] = c_fma(w1, g[i] - m[i], g[i]);
  }
  for (int64_t i = 0; i < n; ++i) v[i] = c_fma(sqc * g[i], g[i], v[i] * b2);
  const float* den = v;
  if (c.amsgrad) {  // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq): NaN propagates
    float* __restrict vmax = s.r2 + b;
    for (int64_t i = 0; i < n; ++i) {
      const float a = vmax[i], x = v[i];
      vmax[i] = (a != a || x != x) ? a + x : (a > x ? a : x);
    }
    den = vmax;
  }
  sq(den, s_buf, n);
  const float bc2 = c.bc2_sqrt, eps = c.eps, ns = c.neg_step;
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] + (ns * m[i]) / (s_buf[i] / bc2 + eps);
}

inline void sgd_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t n, float* __restrict g_buf) {
  float* __restrict p = s.p + b;
  const float* __restrict g = grad_in(c, s.g + b, p, g_buf, n);
  const float nlr = c.neg_lr;
  if (!c.has_momentum) {
    for (int64_t i = 0; i < n; ++i) p[i] = c_fma(g[i], nlr, p[i]);
    return;
  }
  float* __restrict buf = s.r0 + b;
  const float mom = c.momentum, d1 = c.damp1;
  if (c.first) {
    for (int64_t i = 0; i < n; ++i) buf[i] = g[i];
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = c_fma(g[i], d1, buf[i] * mom);
  }
  if (c.nesterov) {
    for (int64_t i = 0; i < n; ++i) p[i] = c_fma(c_fma(buf[i], mom, g[i]), nlr, p[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) p[i] = c_fma(buf[i], nlr, p[i]);
  }
}

inline void adagrad_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t n, SqrtFn sq,
                          float* __restrict s_buf, float* __restrict g_buf) {
  float* __restrict p = s.p + b;
  float* __restrict sum = s.r0 + b;
  const float* __restrict g = grad_in(c, s.g + b, p, g_buf, n);
  for (int64_t i = 0; i < n; ++i) sum[i] = c_fma(g[i], g[i], sum[i]);  // addcmul_(g, g, value=1): 1 * g is g
  sq(sum, s_buf, n);
  const float eps = c.eps, ns = c.neg_step;
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] + (ns * g[i]) / (s_buf[i] + eps);
}

inline void classic_block(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t e, SqrtFn sq,
                          float* s_buf, float* g_buf) {
  if (c.kind == kClassicAdam) adam_block(c, s, b, e - b, sq, s_buf, g_buf);
  else if (c.kind == kClassicSgd) sgd_block(c, s, b, e - b, g_buf);
  else adagrad_block(c, s, b, e - b, sq, s_buf, g_buf);
}

}  // namespace
}  // namespace fshard
