// DepthwiseConvAct on CUDA: depthwise conv (k 3 or 5, stride 1 or 2) + bias + activation in one kernel.
//
// One block computes a tile of up to kTileOutputs outputs (kTileW columns at most, so that a warp writes a
// contiguous row) of one (n, c) plane. It first stages the input window of the tile, zero-padded, in shared
// memory (coalesced row reads), then each thread computes outputs from it with the k*k weights of the
// channel held in registers. Worst-case shared memory (k 5, stride 2, a 1-wide tile of 512 rows) is about
// 20 KB, under the 48 KB every block may use without opting in.
#include <cuda_runtime.h>

#include "onnxcnn_ops.h"

namespace onnxcnn {
namespace {

constexpr int kTileW = 32;
constexpr int kTileOutputs = 512;
constexpr int kMaxThreads = 256;

template <Activation A>
__device__ __forceinline__ float activate(float v) {
  if constexpr (A == Activation::kRelu) {
    return fmaxf(v, 0.f);
  } else if constexpr (A == Activation::kHardSwish) {
    return v * fminf(fmaxf(v * (1.f / 6.f) + 0.5f, 0.f), 1.f);
  } else {
    return v;
  }
}

template <int K, int S, Activation A>
__global__ void __launch_bounds__(kMaxThreads)
    onnxcnn_dwconv_act_kernel(const float* __restrict__ x, const float* __restrict__ w,
                              const float* __restrict__ b, float* __restrict__ y, int channels, int height,
                              int width, int out_h, int out_w, int pad_h, int pad_w, int tile_h, int tile_w,
                              int tiles_x) {
  extern __shared__ float window[];
  const int plane = blockIdx.x;  // n * channels + c
  const int c = plane % channels;
  const int oy0 = (blockIdx.y / tiles_x) * tile_h;
  const int ox0 = (blockIdx.y % tiles_x) * tile_w;
  const int th = min(tile_h, out_h - oy0);
  const int tw = min(tile_w, out_w - ox0);
  const int in_h = (th - 1) * S + K;
  const int in_w = (tw - 1) * S + K;
  const int iy0 = oy0 * S - pad_h;
  const int ix0 = ox0 * S - pad_w;

  const float* xp = x + static_cast<size_t>(plane) * height * width;
  for (int i = threadIdx.x; i < in_h * in_w; i += blockDim.x) {
    const int r = i / in_w;
    const int col = i - r * in_w;
    const int iy = iy0 + r;
    const int ix = ix0 + col;
    const bool inside = iy >= 0 && iy < height && ix >= 0 && ix < width;
    window[i] = inside ? __ldg(xp + static_cast<size_t>(iy) * width + ix) : 0.f;
  }
  float weights[K * K];
#pragma unroll
  for (int i = 0; i < K * K; ++i) weights[i] = __ldg(w + c * K * K + i);
  const float bias = __ldg(b + c);
  __syncthreads();

  float* yp = y + static_cast<size_t>(plane) * out_h * out_w;
  for (int i = threadIdx.x; i < th * tw; i += blockDim.x) {
    const int r = i / tw;
    const int col = i - r * tw;
    const float* tap = window + r * S * in_w + col * S;
    float acc = bias;
#pragma unroll
    for (int ky = 0; ky < K; ++ky) {
#pragma unroll
      for (int kx = 0; kx < K; ++kx) acc = fmaf(tap[ky * in_w + kx], weights[ky * K + kx], acc);
    }
    yp[static_cast<size_t>(oy0 + r) * out_w + ox0 + col] = activate<A>(acc);
  }
}

struct Launch {
  dim3 grid, block;
  size_t shared_bytes;
  int tile_h, tile_w, tiles_x;
};

template <int K, int S, Activation A>
cudaError_t launch(const DwConvParams& p, const Launch& l, const float* x, const float* w, const float* b,
                   float* y, cudaStream_t stream) {
  onnxcnn_dwconv_act_kernel<K, S, A><<<l.grid, l.block, l.shared_bytes, stream>>>(
      x, w, b, y, static_cast<int>(p.c), static_cast<int>(p.h), static_cast<int>(p.w), static_cast<int>(p.out_h),
      static_cast<int>(p.out_w), static_cast<int>(p.pad_h), static_cast<int>(p.pad_w), l.tile_h, l.tile_w,
      l.tiles_x);
  return cudaGetLastError();
}

template <int K, int S>
cudaError_t dispatch_activation(const DwConvParams& p, const Launch& l, const float* x, const float* w,
                                const float* b, float* y, cudaStream_t stream) {
  switch (p.activation) {
    case Activation::kRelu:
      return launch<K, S, Activation::kRelu>(p, l, x, w, b, y, stream);
    case Activation::kHardSwish:
      return launch<K, S, Activation::kHardSwish>(p, l, x, w, b, y, stream);
    case Activation::kNone:
      break;
  }
  return launch<K, S, Activation::kNone>(p, l, x, w, b, y, stream);
}

}  // namespace

const char* dwconv_act_cuda(const DwConvParams& p, const float* x, const float* w, const float* b, float* y,
                            void* stream_handle) {
  Launch l{};
  l.tile_w = static_cast<int>(p.out_w < kTileW ? p.out_w : kTileW);
  const int64_t rows = kTileOutputs / l.tile_w;
  l.tile_h = static_cast<int>(p.out_h < rows ? p.out_h : rows);
  l.tiles_x = static_cast<int>(ceil_div(p.out_w, l.tile_w));
  const int64_t tiles = l.tiles_x * ceil_div(p.out_h, l.tile_h);
  if (tiles > kMaxGridY) return "DepthwiseConvAct: output plane too large for the CUDA kernel's grid";
  const int64_t outputs = int64_t{l.tile_h} * l.tile_w;
  const int64_t threads = ceil_div(outputs, 32) * 32;
  l.block = dim3(static_cast<unsigned>(threads < kMaxThreads ? threads : kMaxThreads));
  l.grid = dim3(static_cast<unsigned>(p.n * p.c), static_cast<unsigned>(tiles));
  const int64_t in_h = (l.tile_h - 1) * p.stride + p.kernel;
  const int64_t in_w = (l.tile_w - 1) * p.stride + p.kernel;
  l.shared_bytes = static_cast<size_t>(in_h * in_w) * sizeof(float);

  auto stream = static_cast<cudaStream_t>(stream_handle);
  cudaError_t status = cudaErrorInvalidValue;
  if (p.kernel == 3 && p.stride == 1) status = dispatch_activation<3, 1>(p, l, x, w, b, y, stream);
  if (p.kernel == 3 && p.stride == 2) status = dispatch_activation<3, 2>(p, l, x, w, b, y, stream);
  if (p.kernel == 5 && p.stride == 1) status = dispatch_activation<5, 1>(p, l, x, w, b, y, stream);
  if (p.kernel == 5 && p.stride == 2) status = dispatch_activation<5, 2>(p, l, x, w, b, y, stream);
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

const char* cuda_build_version() {
#define ONNXCNN_STR2(x) #x
#define ONNXCNN_STR(x) ONNXCNN_STR2(x)
  return ONNXCNN_STR(__CUDACC_VER_MAJOR__) "." ONNXCNN_STR(__CUDACC_VER_MINOR__);
}

}  // namespace onnxcnn
