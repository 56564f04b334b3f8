// CUDA AdamW: the same contract and arithmetic as the CPU kernels, for many tensors in one
// launch. The host packs the segment table and a list of fixed-size tasks (segment, start)
// into one pinned buffer and copies it with one async H2D transfer; a grid-stride loop over
// the tasks balances 4 huge tensors and 180 small ones alike.
//
// Non-finite handling: a read-only check kernel over the grads sets a device flag, and the
// update kernel (same stream) returns at once when the flag is set, so a bad step modifies
// nothing. Returning the flag as a bool costs one device sync (flag.item()).
//
// Arithmetic uses the explicitly rounded intrinsics (__fmul_rn, __fadd_rn, __fmaf_rn, ...)
// so nvcc's default FMA contraction cannot change results: the FMAs are exactly where the
// CPU kernel and ATen's fused Adam have them.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>
#include "adamw.h"
#include "adamw_ops.h"

namespace fshard {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per task
constexpr int kThreads = 256;

struct Task {
  int64_t seg;
  int64_t start;
};

__device__ __forceinline__ float load_grad(const void* g, int gtype, int64_t i) {
  if (gtype == kGradF32) return static_cast<const float*>(g)[i];
  const unsigned short u = static_cast<const unsigned short*>(g)[i];
  if (gtype == kGradBF16) return __uint_as_float(static_cast<unsigned int>(u) << 16);
  return __half2float(__ushort_as_half(u));
}

__device__ __forceinline__ unsigned short to_bf16_bits(float x) {
  // Round to nearest even, NaN -> 0x7fc0, as c10::detail::round_to_nearest_even.
  if (isnan(x)) return 0x7fc0;
  const unsigned int u = __float_as_uint(x);
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__global__ void nonfinite_kernel(const Segment* segs, const Task* tasks, int64_t ntasks, float scale,
                                 int* found) {
  for (int64_t t = blockIdx.x; t < ntasks; t += gridDim.x) {
    const Segment s = segs[tasks[t].seg];
    const int64_t end = min(tasks[t].start + kChunk, s.n);
    int bad = 0;
    for (int64_t i = tasks[t].start + threadIdx.x; i < end; i += blockDim.x)
      bad |= !isfinite(__fmul_rn(load_grad(s.g, s.gtype, i), scale));
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicExch(found, 1);
  }
}

// One element's update: the arithmetic the CPU kernels and ATen's fused Adam do, FMAs where they have them.
__device__ __forceinline__ void update(const AdamConsts& c, bool small, float g, float& p, float& m, float& v) {
  g = __fmul_rn(g, c.grad_scale);
  if (c.has_wd) {
    if (c.adamw) p = __fmul_rn(p, c.wd_mul);
    else g = __fmaf_rn(p, c.wd, g);
  }
  const float d = __fsub_rn(g, m);
  m = small ? __fmaf_rn(c.lerp_w, d, m) : __fmaf_rn(c.lerp_w - 1.0f, d, g);
  v = __fmaf_rn(__fmul_rn(c.sq_coeff, g), g, __fmul_rn(v, c.beta2));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), denom));
}

__device__ __forceinline__ void store_copy(const Segment& s, int64_t i, float p) {
  if (s.ctype == kCopyBF16) static_cast<unsigned short*>(s.copy)[i] = to_bf16_bits(p);
  else if (s.ctype == kCopyF16) static_cast<__half*>(s.copy)[i] = __float2half_rn(p);
}

// Four elements per thread with 16-byte loads and stores of p, m, v (and of an fp32 grad; 8 bytes of a 16-bit
// grad or copy): the scalar loop issues four times the memory instructions, which kept it under the copy roof.
__device__ __forceinline__ void update4(const AdamConsts& c, bool small, const Segment& s, int64_t i) {
  float4 p = *reinterpret_cast<const float4*>(s.p + i);
  float4 m = *reinterpret_cast<const float4*>(s.m + i);
  float4 v = *reinterpret_cast<const float4*>(s.v + i);
  float g[4];
  if (s.gtype == kGradF32) {
    const float4 g4 = *reinterpret_cast<const float4*>(static_cast<const float*>(s.g) + i);
    g[0] = g4.x; g[1] = g4.y; g[2] = g4.z; g[3] = g4.w;
  } else {
    const ushort4 u = *reinterpret_cast<const ushort4*>(static_cast<const unsigned short*>(s.g) + i);
    const unsigned short us[4] = {u.x, u.y, u.z, u.w};
    for (int k = 0; k < 4; ++k)
      g[k] = s.gtype == kGradBF16 ? __uint_as_float(static_cast<unsigned int>(us[k]) << 16)
                                  : __half2float(__ushort_as_half(us[k]));
  }
  update(c, small, g[0], p.x, m.x, v.x);
  update(c, small, g[1], p.y, m.y, v.y);
  update(c, small, g[2], p.z, m.z, v.z);
  update(c, small, g[3], p.w, m.w, v.w);
  *reinterpret_cast<float4*>(s.m + i) = m;
  *reinterpret_cast<float4*>(s.v + i) = v;
  *reinterpret_cast<float4*>(s.p + i) = p;
  if (s.ctype == kCopyBF16) {
    *reinterpret_cast<ushort4*>(static_cast<unsigned short*>(s.copy) + i) =
        make_ushort4(to_bf16_bits(p.x), to_bf16_bits(p.y), to_bf16_bits(p.z), to_bf16_bits(p.w));
  } else if (s.ctype == kCopyF16) {
    __half* h = static_cast<__half*>(s.copy) + i;
    *reinterpret_cast<__half2*>(h) = __halves2half2(__float2half_rn(p.x), __float2half_rn(p.y));
    *reinterpret_cast<__half2*>(h + 2) = __halves2half2(__float2half_rn(p.z), __float2half_rn(p.w));
  }
}

__device__ __forceinline__ bool aligned(const void* ptr, uintptr_t bytes) {
  return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0;
}

__global__ void adamw_kernel(const Segment* segs, const Task* tasks, int64_t ntasks, AdamConsts c,
                             const int* found) {
  if (found != nullptr && *found) return;  // whole update skipped: nothing is modified
  const bool small = fabsf(c.lerp_w) < 0.5f;
  for (int64_t t = blockIdx.x; t < ntasks; t += gridDim.x) {
    const Segment s = segs[tasks[t].seg];
    const int64_t start = tasks[t].start, end = min(start + kChunk, s.n);
    // A task starts at a multiple of kChunk (of 4): the vector body runs where every pointer allows 16-byte
    // (fp32) and 8-byte (16-bit) accesses, e.g. not on a shard slice at an odd offset, which takes the scalar loop.
    const bool vec = aligned(s.p, 16) && aligned(s.m, 16) && aligned(s.v, 16) &&
                     aligned(s.g, s.gtype == kGradF32 ? 16 : 8) && aligned(s.copy, 8);
    const int64_t body = vec ? start + (end - start) / 4 * 4 : start;
    for (int64_t i = start + 4 * int64_t(threadIdx.x); i < body; i += 4 * int64_t(blockDim.x)) update4(c, small, s, i);
    for (int64_t i = body + threadIdx.x; i < end; i += blockDim.x) {
      float p = s.p[i], m = s.m[i], v = s.v[i];
      update(c, small, load_grad(s.g, s.gtype, i), p, m, v);
      s.m[i] = m;
      s.v[i] = v;
      s.p[i] = p;
      store_copy(s, i, p);
    }
  }
}

}  // namespace

bool adamw_cuda(const std::vector<Segment>& segs, const AdamConsts& c, bool check_finite, int device) {
  if (segs.empty()) return false;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();

  std::vector<Task> tasks;
  for (size_t k = 0; k < segs.size(); ++k)
    for (int64_t start = 0; start < segs[k].n; start += kChunk) tasks.push_back({int64_t(k), start});
  const int64_t ntasks = static_cast<int64_t>(tasks.size());

  // One pinned buffer, one async copy: [segments | tasks].
  const size_t seg_bytes = (segs.size() * sizeof(Segment) + 15) / 16 * 16;
  const size_t bytes = seg_bytes + tasks.size() * sizeof(Task);
  at::Tensor host = at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), segs.data(), segs.size() * sizeof(Segment));
  std::memcpy(static_cast<char*>(host.data_ptr()) + seg_bytes, tasks.data(), tasks.size() * sizeof(Task));
  at::Tensor meta = at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
  meta.copy_(host, /*non_blocking=*/true);  // the host allocator keeps `host` alive until the copy ends
  const auto* d_segs = reinterpret_cast<const Segment*>(meta.data_ptr());
  const auto* d_tasks = reinterpret_cast<const Task*>(static_cast<char*>(meta.data_ptr()) + seg_bytes);

  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int blocks = static_cast<int>(std::min<int64_t>(ntasks, int64_t(sms) * 8));
  at::Tensor flag;
  int* d_flag = nullptr;
  if (check_finite) {
    flag = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
    d_flag = flag.data_ptr<int>();
    nonfinite_kernel<<<blocks, kThreads, 0, stream>>>(d_segs, d_tasks, ntasks, c.grad_scale, d_flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  adamw_kernel<<<blocks, kThreads, 0, stream>>>(d_segs, d_tasks, ntasks, c, d_flag);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return check_finite && flag.item<int>() != 0;
}

}  // namespace fshard
