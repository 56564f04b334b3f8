// torch's fp32 2-norm, continued across the ranks that each hold part of a parameter (fshard.ops.norm_continue_).
//
// clip_grad_norm_ on CPU fp32 gradients runs ATen's norm kernel (ReduceOpsKernel.cpp, the last-dim fast path;
// the AVX2 build on AVX2 and AVX-512 machines, which register no AVX-512 variant): 8 fp32 lanes, element d into
// lane d % 8, each lane a multiply then an add, in order, over the first n - n % 8 elements; the lanes folded left
// into lane 0; the last n % 8 elements added to it, the first 4 * (r / 4) of them as a multiply and an add and the
// rest as fused multiply-adds (how the compiler built that loop: tests/test_clip.py checks every tail length
// against torch); sqrt. The fp32 sum rounds as it goes, so its bits depend on that order and on nothing else:
// repeating the order from any split of the elements gives torch's bits. This file is compiled with
// -ffp-contract=off, so the FMAs are the fmaf calls and nothing else.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "norm.h"

namespace fshard {

void norm_continue(const float* x, int64_t start, int64_t len, int64_t total, float* state) {
  const int64_t main_end = total - total % 8, fma_from = main_end + (total % 8) / 4 * 4, end = start + len;
  int64_t i = start;
  const int64_t stop = std::min(end, main_end);
  float acc[8];
  for (int l = 0; l < 8; ++l) acc[l] = state[l];
  for (; i < stop && i % 8 != 0; ++i) acc[i % 8] += x[i - start] * x[i - start];
  for (; i + 8 <= stop; i += 8) {
    const float* v = x + (i - start);
    for (int l = 0; l < 8; ++l) acc[l] += v[l] * v[l];  // independent lanes: vectorisable, in order per lane
  }
  for (; i < stop; ++i) acc[i % 8] += x[i - start] * x[i - start];
  if (start <= main_end && i == main_end && (end > main_end || end == total)) {  // fold, once
    for (int l = 1; l < 8; ++l) acc[0] = acc[0] + acc[l];
    for (int l = 1; l < 8; ++l) acc[l] = 0.0f;
  }
  for (i = std::max(i, start); i < end; ++i) {  // the tail, in lane 0
    const float v = x[i - start];
    acc[0] = i < fma_from ? acc[0] + v * v : std::fmaf(v, v, acc[0]);
  }
  if (end == total) acc[0] = std::sqrt(acc[0]);
  for (int l = 0; l < 8; ++l) state[l] = acc[l];
}

}  // namespace fshard
