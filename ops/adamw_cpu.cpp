// CPU driver: splits the concatenation of all segments into fixed-size blocks,
// spreads the blocks over torch's OpenMP pool, and picks the AVX2 or scalar
// kernel at runtime. Two passes: a read-only non-finite check over the grads,
// then the fused update (see design/OPS.md for why not one).
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <vector>
#include "adamw.h"
#include "adamw_ops.h"

namespace fshard {
namespace {

constexpr int64_t kBlock = 2048;  // elements per scheduling block (8 KiB of fp32)

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// Calls f(segment, lo, hi) for each piece of the global element range [b, e).
template <typename F>
void for_pieces(const std::vector<Segment>& segs, const std::vector<int64_t>& off, int64_t b,
                int64_t e, F&& f) {
  size_t k = std::upper_bound(off.begin(), off.end(), b) - off.begin() - 1;
  while (b < e && k < segs.size()) {
    const int64_t lo = b - off[k];
    const int64_t hi = std::min(e, off[k + 1]) - off[k];
    if (!f(segs[k], lo, hi)) return;
    b = off[k] + hi;
    ++k;
  }
}

}  // namespace

const char* cpu_isa() { return cpu_has_avx2() ? "avx2" : "scalar"; }

bool adamw_cpu(const std::vector<Segment>& segs, const AdamConsts& c, bool check_finite,
               bool force_scalar) {
  std::vector<int64_t> off(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) off[i + 1] = off[i] + segs[i].n;
  const int64_t total = off.back();
  if (total == 0) return false;
  const bool avx2 = !force_scalar && cpu_has_avx2();
  const int64_t nblocks = (total + kBlock - 1) / kBlock;
  // at::parallel_for hands each thread one contiguous run of blocks; a grain of
  // 16 blocks keeps small updates on one thread.
  const int64_t grain = 16;

  if (check_finite) {
    std::atomic<bool> found{false};
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1 && !found.load(std::memory_order_relaxed); blk += 64) {
        const int64_t e = std::min(std::min(b1, blk + 64) * kBlock, total);
        for_pieces(segs, off, blk * kBlock, e, [&](const Segment& s, int64_t lo, int64_t hi) {
          const bool bad = avx2 ? nonfinite_range_avx2(s, c.grad_scale, lo, hi)
                                : nonfinite_range_scalar(s, c.grad_scale, lo, hi);
          if (bad) found.store(true, std::memory_order_relaxed);
          return !bad;
        });
      }
    });
    if (found.load()) return true;
  }

  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t e = std::min(b1 * kBlock, total);
    for_pieces(segs, off, b0 * kBlock, e, [&](const Segment& s, int64_t lo, int64_t hi) {
      if (avx2) adamw_range_avx2(c, s, lo, hi);
      else adamw_range_scalar(c, s, lo, hi);
      return true;
    });
  });
  return false;
}

}  // namespace fshard
