// Sum of squares over gradient shards (fshard.ops.sq_norm): the driver and the scalar kernel.
//
// Determinism: each segment is cut into tasks of kTask elements (the last one shorter) at fixed offsets,
// whatever the thread count. A task sums into kSqLanes double lanes in element order (norm.h), with the same
// lane layout and the same IEEE additions in the scalar, AVX2 and AVX-512 kernels; its lanes are combined by a
// fixed pairwise tree, and the task sums by another, in task order. Threads only decide who computes which
// task, never what is added to what, so the result is bit-identical for every ISA and any number of threads.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <vector>
#include "adamw_ops.h"
#include "norm.h"

namespace fshard {
namespace {

constexpr int64_t kTask = 1 << 16;  // elements per partial sum (256 KiB of fp32): fixed, so never thread-dependent

template <int G>
inline double load(const void* x, int64_t i) {
  if constexpr (G == kGradF32) {
    return static_cast<const float*>(x)[i];
  } else if constexpr (G == kGradBF16) {
    return c10::detail::f32_from_bits(static_cast<const uint16_t*>(x)[i]);
  } else {
    return c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(x)[i]);
  }
}

template <int G>
void sq_lanes(const void* x, int64_t begin, int64_t end, double* lanes) {
  double acc[kSqLanes] = {};
  int64_t i = begin;
  for (; i + kSqLanes <= end; i += kSqLanes) {
    for (int l = 0; l < kSqLanes; ++l) {
      const double v = load<G>(x, i + l);
      acc[l] += v * v;  // -ffp-contract=off: a multiply (exact) and an add, as the SIMD kernels
    }
  }
  for (int l = 0; i < end; ++i, ++l) {
    const double v = load<G>(x, i);
    acc[l] += v * v;
  }
  std::copy(acc, acc + kSqLanes, lanes);
}

// Pairwise sum of v[0..n) in a fixed order (v is overwritten): bits depend only on n and the values.
double tree_sum(double* v, int64_t n) {
  if (n == 0) return 0.0;
  for (; n > 1; n = (n + 1) / 2) {
    for (int64_t k = 0; k < n / 2; ++k) v[k] = v[2 * k] + v[2 * k + 1];
    if (n % 2) v[n / 2] = v[n - 1];
  }
  return v[0];
}

struct Task {
  const SqSegment* seg;
  int64_t begin, end;
};

}  // namespace

void sq_lanes_scalar(const void* x, int xtype, int64_t begin, int64_t end, double* lanes) {
  with_grad_type(xtype, [&](auto G) { sq_lanes<decltype(G)::value>(x, begin, end, lanes); });
}

double sq_norm_cpu(const std::vector<SqSegment>& segs, int isa) {
  std::vector<Task> tasks;
  for (const SqSegment& s : segs)
    for (int64_t b = 0; b < s.n; b += kTask) tasks.push_back({&s, b, std::min(s.n, b + kTask)});
  const int64_t n = static_cast<int64_t>(tasks.size());
  if (n == 0) return 0.0;
  isa = std::min(isa, best_cpu_isa());
  const auto kernel = isa == kIsaAvx512 ? sq_lanes_avx512 : isa == kIsaAvx2 ? sq_lanes_avx2 : sq_lanes_scalar;
  std::vector<double> sums(n);
  auto run = [&](int64_t lo, int64_t hi) {
    alignas(64) double lanes[kSqLanes];
    for (int64_t t = lo; t < hi; ++t) {
      kernel(tasks[t].seg->x, tasks[t].seg->xtype, tasks[t].begin, tasks[t].end, lanes);
      sums[t] = tree_sum(lanes, kSqLanes);
    }
  };
  // Guided scheduling over the tasks, as adamw_cpu: each thread claims (tasks left) / (2 * threads), at least
  // one, from a shared cursor, so early runs stream far and a core slowed by another process costs its share.
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), n);
  if (nthreads <= 1) {
    run(0, n);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      int64_t pos = next.load(std::memory_order_relaxed), size;
      for (;;) {
        do {
          if (pos >= n) return;
          size = std::max<int64_t>(1, (n - pos) / (2 * nthreads));
        } while (!next.compare_exchange_weak(pos, pos + size, std::memory_order_relaxed));
        run(pos, pos + size);
        pos = next.load(std::memory_order_relaxed);
      }
    });
  }
  return tree_sum(sums.data(), n);
}

}  // namespace fshard
