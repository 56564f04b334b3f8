// CPU driver: splits the concatenation of all segments into chunks of shrinking size, hands
// them out on demand to torch's OpenMP pool (guided scheduling), and runs the AVX-512, AVX2 or
// scalar kernel (the best the CPU has, or a lower one the caller asks for). Two passes: a
// read-only non-finite check over the grads, then the fused update (design/OPS.md says why).
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <vector>
#include "adamw.h"
#include "adamw_ops.h"

namespace fshard {
namespace {

constexpr int64_t kMinChunk = 1 << 17;  // smallest scheduling chunk, elements (512 KiB of each fp32 stream)

int detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
    return kIsaScalar;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return kIsaAvx512;
  return kIsaAvx2;
#else
  return kIsaScalar;
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

int best_cpu_isa() {
  static const int isa = detect_isa();
  return isa;
}

const char* isa_name(int isa) {
  return isa == kIsaAvx512 ? "avx512" : isa == kIsaAvx2 ? "avx2" : "scalar";
}

bool adamw_cpu(const std::vector<Segment>& segs, const AdamConsts& c, bool check_finite, int isa) {
  std::vector<int64_t> off(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) off[i + 1] = off[i] + segs[i].n;
  const int64_t total = off.back();
  if (total == 0) return false;
  isa = std::min(isa, best_cpu_isa());
  const auto update = isa == kIsaAvx512 ? adamw_range_avx512 : isa == kIsaAvx2 ? adamw_range_avx2
                                                                                : adamw_range_scalar;
  const auto nonfinite = isa == kIsaAvx512 ? nonfinite_range_avx512
                         : isa == kIsaAvx2 ? nonfinite_range_avx2 : nonfinite_range_scalar;
  // Guided scheduling: each thread of torch's pool claims the next chunk from a shared cursor,
  // sized (what is left) / (2 * threads) but at least kMinChunk. Early chunks are long, so each
  // core streams far with its hardware prefetchers (fixed 128K chunks were 3% slower against
  // DeepSpeed's static split when DRAM is fast); late chunks are short, so one core slowed by
  // another process on a shared machine costs its share, not the whole step (a static split
  // took 2x as long under such contention).
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), (total + kMinChunk - 1) / kMinChunk);
  auto run = [&](bool reverse, auto&& body) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      int64_t pos = next.load(std::memory_order_relaxed), size;
      for (;;) {
        do {
          if (pos >= total) return;
          size = std::min(total - pos, std::max(kMinChunk, ((total - pos) / (2 * nthreads)) & ~int64_t(63)));
        } while (!next.compare_exchange_weak(pos, pos + size, std::memory_order_relaxed));
        const int64_t b = reverse ? total - pos - size : pos;  // reverse: the same chunks from the end
        if (!body(b, b + size)) return;
        pos = next.load(std::memory_order_relaxed);
      }
    });
  };

  if (check_finite) {
    std::atomic<bool> found{false};
    run(false, [&](int64_t b, int64_t e) {
      for_pieces(segs, off, b, e, [&](const Segment& s, int64_t lo, int64_t hi) {
        const bool bad = nonfinite(s, c.grad_scale, lo, hi);
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
      update(c, s, lo, hi);
      return true;
    });
    return true;
  });
  return false;
}

}  // namespace fshard
