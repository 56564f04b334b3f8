// CPU driver: splits the concatenation of all segments into fixed-size chunks,
// hands the chunks out dynamically to torch's OpenMP pool, and picks the AVX2 or scalar
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

constexpr int64_t kChunk = 1 << 17;  // elements per scheduling chunk (512 KiB of each fp32 stream)

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
  const int64_t nchunks = (total + kChunk - 1) / kChunk;
  // Dynamic scheduling: each thread of torch's pool takes the next chunk from a shared
  // counter. On a shared machine one slow core then costs its share, not the whole step.
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), nchunks);
  auto run = [&](bool reverse, auto&& body) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) {
        const int64_t k = reverse ? nchunks - 1 - i : i;
        if (!body(k * kChunk, std::min((k + 1) * kChunk, total))) return;
      }
    });
  };

  if (check_finite) {
    std::atomic<bool> found{false};
    run(false, [&](int64_t b, int64_t e) {
      for_pieces(segs, off, b, e, [&](const Segment& s, int64_t lo, int64_t hi) {
        const bool bad = avx2 ? nonfinite_range_avx2(s, c.grad_scale, lo, hi)
                              : nonfinite_range_scalar(s, c.grad_scale, lo, hi);
        if (bad) found.store(true, std::memory_order_relaxed);
        return !bad;
      });
      return !found.load(std::memory_order_relaxed);
    });
    if (found.load()) return true;
  }

  // After a check, walk the chunks backwards: the grads the check read last are still in
  // the L3 cache (all of them, for updates under ~L3 size, such as offload chunks).
  run(check_finite, [&](int64_t b, int64_t e) {
    for_pieces(segs, off, b, e, [&](const Segment& s, int64_t lo, int64_t hi) {
      if (avx2) adamw_range_avx2(c, s, lo, hi);
      else adamw_range_scalar(c, s, lo, hi);
      return true;
    });
    return true;
  });
  return false;
}

}  // namespace fshard
