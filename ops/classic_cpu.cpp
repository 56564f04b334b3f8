// CPU driver of the single-tensor kernels (classic.h): the run in blocks of kClassicBlock elements on torch's
// thread pool, each block through the kernel of the chosen ISA, with torch's own float sqrt.
//
// torch's CPU sqrt for float tensors is not IEEE's where torch is built with MKL: ATen's unary kernel calls
// MKL's vmsSqrt (at::vml::vsqrt, ATen/cpu/vml.h) in its high-accuracy mode, which is within 1 ulp and differs
// from the correctly rounded sqrt in ~18% of elements. The kernels call the same function with the same mode
// (found in libtorch_cpu, which links MKL in), so their bits are torch's; a torch without MKL uses IEEE's sqrt,
// and so do they.
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include "adamw_ops.h"
#include "classic.h"

#if AT_MKL_ENABLED() && !defined(__APPLE__)
#define FSHARD_TORCH_SQRT_MKL 1
// MKL's VML (LP64: MKL_INT is int; the mode an MKL_INT64), weak: resolved from libtorch_cpu when it exports it.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
#endif

namespace fshard {
namespace {

#ifdef FSHARD_TORCH_SQRT_MKL
// VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as ATen passes them (mkl_vml_defines.h).
constexpr long long kVmlMode = 0x00000002 | 0x00140000 | 0x00000100;

void sqrt_mkl(const float* in, float* out, int64_t n) { vmsSqrt(static_cast<int>(n), in, out, kVmlMode); }
#endif

void sqrt_ieee(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(in[i]);
}

SqrtFn torch_sqrt() {
#ifdef FSHARD_TORCH_SQRT_MKL
  if (vmsSqrt != nullptr) return sqrt_mkl;
#endif
  return sqrt_ieee;
}

}  // namespace

bool classic_sqrt_is_mkl() { return torch_sqrt() != sqrt_ieee; }

void classic_cpu(const ClassicConsts& c, const ClassicSeg& s, int isa) {
  if (s.n == 0) return;
  isa = std::min(isa, best_cpu_isa());
  const auto block = isa == kIsaAvx512 ? classic_block_avx512 : isa == kIsaAvx2 ? classic_block_avx2
                                                                                 : classic_block_scalar;
  const SqrtFn sq = torch_sqrt();
  const int64_t nblocks = (s.n + kClassicBlock - 1) / kClassicBlock;
  // 32 blocks (32K elements, ATen's grain size) per task at least: shorter runs stay on the calling thread.
  at::parallel_for(0, nblocks, 32, [&](int64_t b0, int64_t b1) {
    alignas(64) float s_buf[kClassicBlock];
    alignas(64) float g_buf[kClassicBlock];
    if (c.kind == kClassicSgd) {  // no sqrt and no scratch: one loop over the task's whole range, as a fused kernel
      block(c, s, b0 * kClassicBlock, std::min(s.n, b1 * kClassicBlock), sq, s_buf, g_buf);
      return;
    }
    for (int64_t k = b0; k < b1; ++k) {
      const int64_t lo = k * kClassicBlock;
      block(c, s, lo, std::min(s.n, lo + kClassicBlock), sq, s_buf, g_buf);
    }
  });
}

}  // namespace fshard
