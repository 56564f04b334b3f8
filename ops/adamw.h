// Plain data shared by the CPU kernels (scalar, AVX2, AVX-512) and the CUDA launcher.
// No torch headers here: the ISA files include this file ahead of their target
// pragmas, and nothing inline from torch may be compiled for AVX2/AVX-512 there.
#pragma once
#include <cstdint>
#include <type_traits>

namespace fshard {

enum GradType : int { kGradF32 = 0, kGradBF16 = 1, kGradF16 = 2 };
enum CopyType : int { kCopyNone = 0, kCopyBF16 = 1, kCopyF16 = 2 };
enum Isa : int { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };  // ordered: each level implies the ones below

// A runtime dtype tag -> f(std::integral_constant<int, tag>). The switch is written once here; each ISA file
// passes lambdas over its own templates, so every kernel is still instantiated in that file's translation unit,
// under its own target flags.
template <class F>
inline decltype(auto) with_grad_type(int t, F&& f) {
  switch (t) {
    case kGradBF16: return f(std::integral_constant<int, kGradBF16>{});
    case kGradF16: return f(std::integral_constant<int, kGradF16>{});
    default: return f(std::integral_constant<int, kGradF32>{});
  }
}

template <class F>
inline decltype(auto) with_copy_type(int t, F&& f) {
  switch (t) {
    case kCopyBF16: return f(std::integral_constant<int, kCopyBF16>{});
    case kCopyF16: return f(std::integral_constant<int, kCopyF16>{});
    default: return f(std::integral_constant<int, kCopyNone>{});
  }
}

// Hyper-parameters, folded the way ATen's fused Adam folds them: computed in
// double, then cast to float once (results match torch._fused_adamw_ bit for bit in its vector path).
struct AdamConsts {
  float grad_scale;     // g = grad * grad_scale (unscale / clip coefficient)
  float wd_mul;         // AdamW: p *= 1 - lr * wd
  float wd;             // Adam-L2: g += wd * p
  float lerp_w;         // 1 - beta1 (exp_avg.lerp_(g, 1 - beta1))
  float beta2;
  float sq_coeff;       // 1 - beta2
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  bool adamw;           // true: decoupled decay; false: L2 added to the grad
  bool has_wd;
};

// One tensor (or flat shard) of the multi-tensor update.
struct Segment {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* copy;     // bf16/fp16 copy of the updated param, or nullptr
  int64_t n;
  int gtype;      // GradType
  int ctype;      // CopyType
};

// Update elements [begin, end) of one segment.
void adamw_range_scalar(const AdamConsts& c, const Segment& s, int64_t begin, int64_t end);
void adamw_range_avx2(const AdamConsts& c, const Segment& s, int64_t begin, int64_t end);
void adamw_range_avx512(const AdamConsts& c, const Segment& s, int64_t begin, int64_t end);

// True when any grad[i] * scale in [begin, end) is inf or NaN.
bool nonfinite_range_scalar(const Segment& s, float scale, int64_t begin, int64_t end);
bool nonfinite_range_avx2(const Segment& s, float scale, int64_t begin, int64_t end);
bool nonfinite_range_avx512(const Segment& s, float scale, int64_t begin, int64_t end);

}  // namespace fshard
