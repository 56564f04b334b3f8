// The sum-of-squares kernels (fshard.ops.sq_norm): declarations shared by the driver (norm_cpu.cpp) and the
// ISA files (norm_avx2.cpp, norm_avx512.cpp). Plain C++ only, as adamw.h, for the same reason: the ISA
// files include this header ahead of their target pragmas.
#pragma once
#include <cstdint>
#include "adamw.h"  // GradType tags (the element dtype: fp32, bf16, fp16), with_grad_type, Isa

namespace fshard {

// Double accumulator lanes per task: element begin + j goes to lane j % kSqLanes, added in order of j. Every
// kernel (scalar, AVX2 as 8 x 4 doubles, AVX-512 as 4 x 8 doubles) keeps exactly these lanes, so all of them
// round identically. 32 lanes also give the SIMD kernels 4-8 independent add chains.
constexpr int kSqLanes = 32;

// lanes[l] = the sum, in order, of x[i]^2 over i in [begin, end) with (i - begin) % kSqLanes == l; each
// x[i] of dtype `xtype` (a GradType) is widened exactly to double and squared (exact in double, as the
// product of two 24-bit significands fits in 53 bits), then added: one rounding per element, on every ISA.
// One tensor of a sq_norm call: contiguous elements of one dtype.
struct SqSegment {
  const void* x;
  int64_t n;
  int xtype;  // GradType
};

void sq_lanes_scalar(const void* x, int xtype, int64_t begin, int64_t end, double* lanes);
void sq_lanes_avx2(const void* x, int xtype, int64_t begin, int64_t end, double* lanes);
void sq_lanes_avx512(const void* x, int xtype, int64_t begin, int64_t end, double* lanes);

}  // namespace fshard

namespace fshard {

// Continue torch's CPU fp32 2-norm of a parameter of `total` elements over its elements [start, start + len),
// given as x[0..len). state[0..8) carries the 8 lane sums in, and out (after the fold, state[0] holds the one sum;
// once start + len == total, the norm). Start from zeros; feed the parts in element order (torch_norm.cpp).
void norm_continue(const float* x, int64_t start, int64_t len, int64_t total, float* state);

}  // namespace fshard
