// The math of the ai.onnxcnn operators, shared by the ONNX Runtime glue (onnxcnn_ops.cc), the CUDA kernels
// (*.cu) and the CPU kernels (cpu_kernels.cc). Nothing here includes ONNX Runtime or CUDA headers, so the
// CPU-only build needs neither nvcc nor the CUDA toolkit.
//
// Layout: NCHW, float32, contiguous. Every size below has been checked by the glue before a kernel runs
// (positive, within the limits named in check_* below), so kernels never see a shape they cannot handle.
#pragma once

#include <cstddef>
#include <cstdint>

namespace onnxcnn {

enum class Activation : int { kNone = 0, kRelu = 1, kHardSwish = 2 };

// DepthwiseConvAct: y[n, c] = act(b[c] + sum_{ky,kx} w[c, 0, ky, kx] * x_padded[n, c, oy*s + ky, ox*s + kx]).
struct DwConvParams {
  int64_t n = 0, c = 0, h = 0, w = 0;  // input shape
  int64_t kernel = 0;                  // square kernel: 3 or 5
  int64_t stride = 1;                  // both axes: 1 or 2
  int64_t pad_h = 0, pad_w = 0;        // symmetric: the same at the start and the end of an axis
  int64_t out_h = 0, out_w = 0;
  Activation activation = Activation::kNone;
};

// SqueezeExcite: m = mean_hw(x[n, :]); h = relu(W1 m + b1); s = clamp(alpha * (W2 h + b2) + beta, 0, 1);
// y[n, c, :] = x[n, c, :] * s[c]. W1 is [reduced, c] and W2 is [c, reduced] (1x1 conv weights read flat).
struct SeParams {
  int64_t n = 0, c = 0, hw = 0, reduced = 0;
  float alpha = 0.2f, beta = 0.5f;
};

// How the CUDA SE kernels split the work; pure host arithmetic, also used to size the scratch buffer.
// Kernel 1 (squeeze): one block per (slice of channels_per_squeeze channels, sample) writes the channel
// means of its slice and their partial FC1 sums. Kernel 2 (excite): one block per (slice of
// channels_per_excite channels, sample) adds the partial sums, applies FC2 + HardSigmoid to its channels
// and scales them.
struct SePlan {
  int64_t channels_per_squeeze = 0, squeeze_slices = 0;
  int64_t channels_per_excite = 0, excite_slices = 0;
  int64_t scratch_floats = 0;  // partial FC1 sums: n * squeeze_slices * reduced
};

constexpr int64_t kMaxSqueezeSlices = 32;
constexpr int64_t kExciteElements = 2048;   // target elements scaled per excite block
constexpr int64_t kExciteWeights = 4096;    // target FC2 weights read per excite block
constexpr int64_t kMaxReduced = 8192;       // hidden width kept in shared memory by the excite kernel
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxElements = (int64_t{1} << 31) - 1;  // kernels index with 32-bit offsets per tensor

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline SePlan se_plan(const SeParams& p) {
  SePlan plan;
  plan.channels_per_squeeze = ceil_div(p.c, kMaxSqueezeSlices);
  if (plan.channels_per_squeeze < 8) plan.channels_per_squeeze = p.c < 8 ? p.c : 8;
  plan.squeeze_slices = ceil_div(p.c, plan.channels_per_squeeze);
  int64_t per_block = kExciteElements / (p.hw > 0 ? p.hw : 1);
  const int64_t by_weights = kExciteWeights / (p.reduced > 0 ? p.reduced : 1);
  if (by_weights < per_block) per_block = by_weights;
  if (per_block < 1) per_block = 1;
  if (per_block > p.c) per_block = p.c;
  plan.channels_per_excite = per_block;
  plan.excite_slices = ceil_div(p.c, per_block);
  plan.scratch_floats = p.n * plan.squeeze_slices * p.reduced;
  return plan;
}

// Output size of a convolution axis; < 1 means the kernel does not fit the padded input.
inline int64_t conv_out(int64_t size, int64_t kernel, int64_t stride, int64_t pad) {
  return (size + 2 * pad - kernel) / stride + 1;
}

// CPU kernels (cpu_kernels.cc): the same math, plain loops, for the CPU provider and for tests.
void dwconv_act_cpu(const DwConvParams& p, const float* x, const float* w, const float* b, float* y);
void se_block_cpu(const SeParams& p, const float* x, const float* w1, const float* b1, const float* w2,
                  const float* b2, float* y);

#ifdef ONNXCNN_WITH_CUDA
// CUDA launchers (*.cu). ``stream`` is a cudaStream_t. They only enqueue work (capturable in a CUDA graph)
// and return nullptr, or a static error text when a launch failed.
const char* dwconv_act_cuda(const DwConvParams& p, const float* x, const float* w, const float* b, float* y,
                            void* stream);
const char* se_block_cuda(const SeParams& p, const SePlan& plan, const float* x, const float* w1, const float* b1,
                          const float* w2, const float* b2, float* y, float* scratch, void* stream);
// "13.0" style version of the CUDA runtime the library was built with.
const char* cuda_build_version();
#endif

}  // namespace onnxcnn
