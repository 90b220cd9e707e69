// SqueezeExcite on CUDA in two kernels (see SePlan in onnxcnn_ops.h for the split).
//
// Why two: FC1 needs the means of all channels and FC2 all hidden units, and a kernel cannot wait for
// its other blocks without a cooperative launch. Kernel 1 spreads the reading of x (the bulk of the
// bytes) and of W1 over many blocks, each leaving the partial FC1 sums of its channel slice in a scratch
// buffer; kernel 2 adds those partial sums (a few KB, redundantly per block), and each block applies
// FC2 + HardSigmoid for its own channels only (so W2 is read once in all) and scales them. The scratch
// buffer comes from ONNX Runtime's allocator on the compute stream, like any kernel's scratch buffer.
#include <cuda_runtime.h>

#include <cstdint>

#include "onnxcnn_ops.h"

namespace onnxcnn {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Sum of hw floats at p by one warp.
__device__ __forceinline__ float warp_plane_sum(const float* __restrict__ p, int hw, int lane) {
  float acc = 0.f;
  if ((hw & 3) == 0 && aligned16(p)) {
    const float4* v = reinterpret_cast<const float4*>(p);
    const int n4 = hw >> 2;
#pragma unroll 4
    for (int i = lane; i < n4; i += 32) {
      const float4 q = __ldg(v + i);
      acc += (q.x + q.y) + (q.z + q.w);
    }
  } else {
#pragma unroll 4
    for (int i = lane; i < hw; i += 32) acc += __ldg(p + i);
  }
  return warp_sum(acc);
}

// Floats of the squeeze kernel's shared means: per_slice rounded up to whole float4s. The compiler may read
// the means of the FC1 loop four at a time past `count`; the rounding keeps those reads inside the array
// (compute-sanitizer's memcheck flagged a 12-byte read past an exact-size array when count % 4 == 1), and
// the padding holds zeros.
__host__ __device__ __forceinline__ int padded_means(int per_slice) { return (per_slice + 3) & ~3; }

// grid (squeeze_slices, n): means of the slice's channels, then partial[n, slice, j] = sum_c W1[j, c] m[c].
__global__ void __launch_bounds__(kThreads)
    onnxcnn_se_squeeze_kernel(const float* __restrict__ x, const float* __restrict__ w1,
                              float* __restrict__ partial, int channels, int hw, int reduced, int per_slice,
                              int slices) {
  extern __shared__ float mean[];  // padded_means(per_slice)
  const int n = blockIdx.y;
  const int c0 = blockIdx.x * per_slice;
  const int count = min(per_slice, channels - c0);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  for (int i = warp; i < count; i += kWarps) {
    const float* plane = x + (static_cast<size_t>(n) * channels + c0 + i) * hw;
    const float sum = warp_plane_sum(plane, hw, lane);
    if (lane == 0) mean[i] = sum / static_cast<float>(hw);
  }
  for (int i = max(count, 0) + threadIdx.x; i < padded_means(per_slice); i += kThreads) mean[i] = 0.f;
  __syncthreads();
  float* out = partial + (static_cast<size_t>(n) * slices + blockIdx.x) * reduced;
  for (int j = threadIdx.x; j < reduced; j += kThreads) {
    const float* row = w1 + static_cast<size_t>(j) * channels + c0;
    float acc = 0.f;
    for (int i = 0; i < count; ++i) acc = fmaf(__ldg(row + i), mean[i], acc);
    out[j] = acc;
  }
}

// grid (excite_slices, n): hidden = relu(b1 + sum of partials); scale = hardsigmoid(W2 hidden + b2) for the
// slice's channels; y = x * scale on those channels.
__global__ void __launch_bounds__(kThreads)
    onnxcnn_se_excite_kernel(const float* __restrict__ x, const float* __restrict__ partial,
                             const float* __restrict__ b1, const float* __restrict__ w2,
                             const float* __restrict__ b2, float* __restrict__ y, int channels, int hw,
                             int reduced, int squeeze_slices, int per_slice, float alpha, float beta) {
  extern __shared__ float shared[];  // reduced hidden units, then per_slice scales
  float* hidden = shared;
  float* scale = shared + reduced;
  const int n = blockIdx.y;
  const int c0 = blockIdx.x * per_slice;
  const int count = min(per_slice, channels - c0);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  const float* parts = partial + static_cast<size_t>(n) * squeeze_slices * reduced;
  for (int j = threadIdx.x; j < reduced; j += kThreads) {
    float acc = __ldg(b1 + j);
    for (int s = 0; s < squeeze_slices; ++s) acc += parts[static_cast<size_t>(s) * reduced + j];
    hidden[j] = fmaxf(acc, 0.f);
  }
  __syncthreads();
  for (int i = warp; i < count; i += kWarps) {
    const float* row = w2 + static_cast<size_t>(c0 + i) * reduced;
    float acc = 0.f;
    for (int j = lane; j < reduced; j += 32) acc = fmaf(__ldg(row + j), hidden[j], acc);
    acc = warp_sum(acc);
    if (lane == 0) scale[i] = fminf(fmaxf(alpha * (acc + __ldg(b2 + c0 + i)) + beta, 0.f), 1.f);
  }
  __syncthreads();

  const size_t base = (static_cast<size_t>(n) * channels + c0) * hw;
  const int total = count * hw;
  if ((hw & 3) == 0 && aligned16(x + base) && aligned16(y + base)) {
    const float4* xv = reinterpret_cast<const float4*>(x + base);
    float4* yv = reinterpret_cast<float4*>(y + base);
    const int hw4 = hw >> 2;
    for (int v = threadIdx.x; v < (total >> 2); v += kThreads) {
      const float s = scale[v / hw4];
      float4 q = __ldg(xv + v);
      q.x *= s;
      q.y *= s;
      q.z *= s;
      q.w *= s;
      yv[v] = q;
    }
  } else {
    for (int e = threadIdx.x; e < total; e += kThreads) y[base + e] = __ldg(x + base + e) * scale[e / hw];
  }
}

}  // namespace

const char* se_block_cuda(const SeParams& p, const SePlan& plan, const float* x, const float* w1, const float* b1,
                          const float* w2, const float* b2, float* y, float* scratch, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const dim3 block(kThreads);
  const dim3 squeeze_grid(static_cast<unsigned>(plan.squeeze_slices), static_cast<unsigned>(p.n));
  const size_t squeeze_shared =
      static_cast<size_t>(padded_means(static_cast<int>(plan.channels_per_squeeze))) * sizeof(float);
  onnxcnn_se_squeeze_kernel<<<squeeze_grid, block, squeeze_shared, stream>>>(
      x, w1, scratch, static_cast<int>(p.c), static_cast<int>(p.hw), static_cast<int>(p.reduced),
      static_cast<int>(plan.channels_per_squeeze), static_cast<int>(plan.squeeze_slices));
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return cudaGetErrorString(status);

  const dim3 excite_grid(static_cast<unsigned>(plan.excite_slices), static_cast<unsigned>(p.n));
  const size_t excite_shared = static_cast<size_t>(p.reduced + plan.channels_per_excite) * sizeof(float);
  onnxcnn_se_excite_kernel<<<excite_grid, block, excite_shared, stream>>>(
      x, scratch, b1, w2, b2, y, static_cast<int>(p.c), static_cast<int>(p.hw), static_cast<int>(p.reduced),
      static_cast<int>(plan.squeeze_slices), static_cast<int>(plan.channels_per_excite), p.alpha, p.beta);
  status = cudaGetLastError();
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

}  // namespace onnxcnn
