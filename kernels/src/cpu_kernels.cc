// CPU implementations of the ai.onnxcnn operators: plain loops in float32 (accumulating in float32 like
// the CUDA kernels), for ONNX Runtime's CPU provider. They exist so that a model holding these operators
// still runs where no GPU is, and so that the library's ONNX Runtime glue is tested on machines without one.
#include <algorithm>
#include <vector>

#include "onnxcnn_ops.h"

namespace onnxcnn {
namespace {

float activate(Activation activation, float v) {
  switch (activation) {
    case Activation::kRelu:
      return v > 0.f ? v : 0.f;
    case Activation::kHardSwish:
      return v * std::min(std::max(v * (1.f / 6.f) + 0.5f, 0.f), 1.f);
    case Activation::kNone:
      break;
  }
  return v;
}

}  // namespace

void dwconv_act_cpu(const DwConvParams& p, const float* x, const float* w, const float* b, float* y) {
  const int64_t k = p.kernel;
  for (int64_t plane = 0; plane < p.n * p.c; ++plane) {
    const int64_t c = plane % p.c;
    const float* xp = x + plane * p.h * p.w;
    const float* wp = w + c * k * k;
    float* yp = y + plane * p.out_h * p.out_w;
    for (int64_t oy = 0; oy < p.out_h; ++oy) {
      for (int64_t ox = 0; ox < p.out_w; ++ox) {
        float acc = b[c];
        for (int64_t ky = 0; ky < k; ++ky) {
          const int64_t iy = oy * p.stride - p.pad_h + ky;
          if (iy < 0 || iy >= p.h) continue;
          for (int64_t kx = 0; kx < k; ++kx) {
            const int64_t ix = ox * p.stride - p.pad_w + kx;
            if (ix < 0 || ix >= p.w) continue;
            acc += xp[iy * p.w + ix] * wp[ky * k + kx];
          }
        }
        yp[oy * p.out_w + ox] = activate(p.activation, acc);
      }
    }
  }
}

void se_block_cpu(const SeParams& p, const float* x, const float* w1, const float* b1, const float* w2,
                  const float* b2, float* y) {
  std::vector<float> mean(static_cast<size_t>(p.c)), hidden(static_cast<size_t>(p.reduced));
  for (int64_t n = 0; n < p.n; ++n) {
    const float* xs = x + n * p.c * p.hw;
    float* ys = y + n * p.c * p.hw;
    for (int64_t c = 0; c < p.c; ++c) {
      float sum = 0.f;
      for (int64_t i = 0; i < p.hw; ++i) sum += xs[c * p.hw + i];
      mean[c] = sum / static_cast<float>(p.hw);
    }
    for (int64_t j = 0; j < p.reduced; ++j) {
      float acc = b1[j];
      for (int64_t c = 0; c < p.c; ++c) acc += w1[j * p.c + c] * mean[c];
      hidden[j] = acc > 0.f ? acc : 0.f;
    }
    for (int64_t c = 0; c < p.c; ++c) {
      float acc = b2[c];
      for (int64_t j = 0; j < p.reduced; ++j) acc += w2[c * p.reduced + j] * hidden[j];
      const float scale = std::min(std::max(p.alpha * acc + p.beta, 0.f), 1.f);
      for (int64_t i = 0; i < p.hw; ++i) ys[c * p.hw + i] = xs[c * p.hw + i] * scale;
    }
  }
}

}  // namespace onnxcnn
