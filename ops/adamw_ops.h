// Entry points behind the Python bindings (bindings.cpp).
#pragma once
#include <vector>
#include "adamw.h"
#include "norm.h"

namespace fshard {

// Returns true (and modifies nothing) when check_finite and any grad * scale is
// inf/NaN. Otherwise applies the update to every segment, with the kernel for `isa` (an Isa;
// capped at best_cpu_isa()).
bool adamw_cpu(const std::vector<Segment>& segs, const AdamConsts& c, bool check_finite, int isa);
int best_cpu_isa();
const char* isa_name(int isa);

// The sum of x*x over every element of every segment, accumulated in double (norm_cpu.cpp); bit-identical
// for every isa and any number of threads. inf/NaN in any element makes it inf/NaN.
double sq_norm_cpu(const std::vector<SqSegment>& segs, int isa);

#ifdef FSHARD_WITH_CUDA
// Same contract; segment pointers are device pointers on the current device.
bool adamw_cuda(const std::vector<Segment>& segs, const AdamConsts& c, bool check_finite,
                int device);
#endif

}  // namespace fshard
