// Plain data of the single-tensor kernels for fs.optim.adam, sgd and adagrad (classic_*.cpp): torch's
// single-tensor CPU arithmetic (torch.optim.adam._single_tensor_adam etc.) op for op, in one pass over memory.
// No torch headers here, for the same reason as adamw.h: the ISA files include this file ahead of their target
// pragmas.
#pragma once
#include <cstdint>
#include <type_traits>  // (classic_simd.h dispatches on std::true_type: included here, ahead of the ISA pragmas)

namespace fshard {

enum ClassicKind : int { kClassicAdam = 0, kClassicSgd = 1, kClassicAdagrad = 2 };

// Hyper-parameters, folded in double by the caller exactly as torch's Python code folds them, and cast to float
// once (as ATen casts a Python scalar for a float tensor).
struct ClassicConsts {
  int kind;          // ClassicKind
  float wd;          // grad = grad.add(param, alpha=wd)
  bool has_wd;
  bool maximize;     // grad = -grad (sgd, adagrad)
  // adam
  float lerp_w;      // exp_avg.lerp_(grad, 1 - beta1)
  bool lerp_small;   // |lerp_w| < 0.5: ATen's lerp formula for small weights
  float beta2;       // exp_avg_sq.mul_(beta2)
  float sq_coeff;    // .addcmul_(grad, grad, value=1 - beta2)
  float bc2_sqrt;    // (1 - beta2**step) ** 0.5
  float eps;         // adam, adagrad
  float neg_step;    // adam: -(lr / (1 - beta1**step)); adagrad: -clr
  bool amsgrad;
  // sgd
  float momentum;
  float damp1;       // 1 - dampening
  float neg_lr;
  bool has_momentum;
  bool nesterov;
  bool first;        // the momentum buffer starts as a copy of the gradient
};

// One run: fp32, contiguous. Rows: adam (exp_avg, exp_avg_sq[, max_exp_avg_sq]), sgd (momentum_buffer, when
// momentum), adagrad (sum).
struct ClassicSeg {
  float* p;
  const float* g;
  float* r0;
  float* r1;
  float* r2;
  int64_t n;
};

// torch's float sqrt on the CPU: out[i] = sqrt(in[i]) for i < n (MKL's vmsSqrt where torch calls it).
using SqrtFn = void (*)(const float* in, float* out, int64_t n);

// Update elements [begin, end) of s; end - begin <= kClassicBlock (any length for SGD, which uses no scratch). `s_buf` and `g_buf`: scratch of
// kClassicBlock floats.
constexpr int64_t kClassicBlock = 1024;
void classic_block_scalar(const ClassicConsts& c, const ClassicSeg& s, int64_t begin, int64_t end, SqrtFn sq,
                          float* s_buf, float* g_buf);
void classic_block_avx2(const ClassicConsts& c, const ClassicSeg& s, int64_t begin, int64_t end, SqrtFn sq,
                        float* s_buf, float* g_buf);
void classic_block_avx512(const ClassicConsts& c, const ClassicSeg& s, int64_t begin, int64_t end, SqrtFn sq,
                          float* s_buf, float* g_buf);

// The whole run, in blocks on torch's thread pool, with the kernel for `isa` (capped at best_cpu_isa()).
void classic_cpu(const ClassicConsts& c, const ClassicSeg& s, int isa);
// Whether sqrt is MKL's (as torch's CPU sqrt for float is in an MKL build) or IEEE's.
bool classic_sqrt_is_mkl();

}  // namespace fshard
