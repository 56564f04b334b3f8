// The single-tensor kernels' block body (classic_simd.h) for the avx512 kernel. Plain includes first, then the
// target pragma (the rule of adamw_avx2.cpp); classic_cpu.cpp calls in only where the CPU runs it.
#include "classic.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
#include "classic_simd.h"

namespace fshard {

void classic_block_avx512(const ClassicConsts& c, const ClassicSeg& s, int64_t b, int64_t e, SqrtFn sq,
                        float* s_buf, float* g_buf) {
  classic_block(c, s, b, e, sq, s_buf, g_buf);
}

}  // namespace fshard

#pragma GCC pop_options
