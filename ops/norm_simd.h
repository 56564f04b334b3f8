// The SIMD body of the sum-of-squares kernel, written once over a vector-traits type T (as adamw_simd.h).
//
// Each ISA file (norm_avx2.cpp, norm_avx512.cpp) includes <immintrin.h>, <cstring> and norm.h, then its
// target pragma, then defines its traits and includes this file; the anonymous namespace gives each ISA
// file its own copy, compiled under its own flags.
//
// T provides: D (a vector of doubles), DW (doubles per vector), zero(), add, mul, storeu(double*, D), and
// load<G>(x, i): elements i .. i+DW-1 of dtype G, widened exactly to double.
#pragma once

namespace fshard {
namespace {

template <class T, int G>
void sq_lanes(const void* x, int64_t begin, int64_t end, double* lanes) {
  using D = typename T::D;
  constexpr int DW = T::DW, A = kSqLanes / DW;  // A accumulators of DW lanes: lane l lives in acc[l / DW]
  static_assert(kSqLanes % DW == 0, "the lanes must split into whole vectors");
  D acc[A];
  for (int a = 0; a < A; ++a) acc[a] = T::zero();
  const int64_t eb = G == kGradF32 ? 4 : 2;
  const char* base = static_cast<const char*>(x);
  int64_t i = begin;
  for (; i + kSqLanes <= end; i += kSqLanes) {
    // One read-only stream per core is latency-bound (adamw_simd.h's check): prefetch 2 KiB ahead, every line
    // of the iteration (2 for fp32, 1 for bf16/fp16). A prefetch never faults, even past the end.
    for (int64_t b = 0; b < kSqLanes * eb; b += 64) _mm_prefetch(base + i * eb + b + 2048, _MM_HINT_T0);
    for (int a = 0; a < A; ++a) {
      const D v = T::template load<G>(x, i + a * DW);
      acc[a] = T::add(acc[a], T::mul(v, v));  // v*v is exact; no FMA, so the scalar kernel needs none either
    }
  }
  if (i < end) {  // a tail of < kSqLanes elements, zero-padded: the padding adds +0.0, which changes no lane
    alignas(64) unsigned char tail[kSqLanes * 4] = {};
    std::memcpy(tail, base + i * eb, (end - i) * eb);
    for (int a = 0; a < A; ++a) {
      const D v = T::template load<G>(tail, a * DW);
      acc[a] = T::add(acc[a], T::mul(v, v));
    }
  }
  for (int a = 0; a < A; ++a) T::storeu(lanes + a * DW, acc[a]);
}

template <class T>
void sq_lanes_any(const void* x, int xtype, int64_t begin, int64_t end, double* lanes) {
  with_grad_type(xtype, [&](auto G) { sq_lanes<T, decltype(G)::value>(x, begin, end, lanes); });
}

}  // namespace
}  // namespace fshard
