// onnxcnn_selftest: the CUDA kernels alone (no ONNX Runtime) against the CPU kernels, in a CUDA graph, timed.
//
//   onnxcnn_selftest [--quick]        exit 0: every case matched; 1: a mismatch or a CUDA error
//
// Each case runs on exactly-sized cudaMalloc buffers (the SE scratch too), so compute-sanitizer sees any
// access outside them: memcheck, racecheck and initcheck run on this binary in bench/fused_ops.py. Per case:
// a plain launch, then the launch captured in a CUDA graph, replayed, and replayed again after new input;
// each result against the CPU kernel (|diff| <= 1e-5 + 1e-4 |cpu|, both float32). Every copy and memset a
// case makes is enqueued on the case's stream: that stream is non-blocking, so it is not ordered after the
// legacy stream's cudaMemcpy/cudaMemset (a pageable cudaMemcpy may return before its DMA lands), and a
// kernel could read stale input. Then the time of one
// op inside a CUDA graph of 20 copies (CUDA events over 50 graph launches), i.e. what ORT's graph replays
// pay per op, without ORT. Output: one line per case, "name batch ratio ok us_per_op".
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "onnxcnn_ops.h"

using onnxcnn::Activation;
using onnxcnn::DwConvParams;
using onnxcnn::SeParams;

namespace {

constexpr int kCopies = 20;
constexpr int kGraphLaunches = 50;

#define CHECK(call)                                                                                 \
  do {                                                                                              \
    cudaError_t status_ = (call);                                                                   \
    if (status_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(status_), __FILE__, \
                   __LINE__, cudaGetErrorString(status_));                                          \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

std::vector<float> random_vector(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

float* device_copy(const std::vector<float>& host) {
  float* p = nullptr;
  CHECK(cudaMalloc(&p, host.size() * sizeof(float)));
  CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

std::vector<float> host_copy(const float* device, size_t n) {
  std::vector<float> host(n);
  CHECK(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

double tolerance_ratio(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double ratio = std::isfinite(diff) ? diff / (1e-5 + 1e-4 * std::fabs(want[i])) : INFINITY;
    if (!(ratio <= worst)) worst = ratio;
  }
  return worst;
}

// A case: enqueue(stream, x, y) launches the op once; cpu(x, y) computes it on the host.
struct Case {
  std::string name;
  int64_t batch;
  size_t x_size, y_size;
  std::function<void(cudaStream_t, const float*, float*)> enqueue;
  std::function<void(const float*, float*)> cpu;
};

// Runs a case: plain, in a graph, after new input in the graph, and timed; prints one line; true if it matched.
bool run_case(const Case& c, std::mt19937& rng, bool time_it) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<float> x = random_vector(c.x_size, 2.f, rng), want(c.y_size);
  float* dx = device_copy(x);
  float* dy = nullptr;
  CHECK(cudaMalloc(&dy, c.y_size * sizeof(float)));
  CHECK(cudaDeviceSynchronize());  // device_copy's DMA (legacy stream) before the case's stream reads it
  c.cpu(x.data(), want.data());
  c.enqueue(stream, dx, dy);
  CHECK(cudaGetLastError());
  CHECK(cudaStreamSynchronize(stream));
  double worst = tolerance_ratio(host_copy(dy, c.y_size), want);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaMemsetAsync(dy, 0, c.y_size * sizeof(float), stream));
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  c.enqueue(stream, dx, dy);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  const double graph_first = tolerance_ratio(host_copy(dy, c.y_size), want);
  for (auto& v : x) v = v * 0.5f + 0.25f;
  c.cpu(x.data(), want.data());
  CHECK(cudaMemcpyAsync(dx, x.data(), c.x_size * sizeof(float), cudaMemcpyHostToDevice, stream));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  const double graph_fresh = tolerance_ratio(host_copy(dy, c.y_size), want);
  worst = std::fmax(worst, std::fmax(graph_first, graph_fresh));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));

  double us = NAN;
  if (time_it) {
    std::vector<float*> outputs(kCopies);
    for (auto& p : outputs) CHECK(cudaMalloc(&p, c.y_size * sizeof(float)));
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (auto* p : outputs) c.enqueue(stream, dx, p);
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(exec, stream));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < kGraphLaunches; ++i) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    us = 1e3 * ms / (kGraphLaunches * kCopies);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    for (auto* p : outputs) CHECK(cudaFree(p));
  }
  const bool ok = worst <= 1.0;
  std::printf("%-32s b%-3lld ratio %-10.4g %-4s %.3f us\n", c.name.c_str(), static_cast<long long>(c.batch), worst,
              ok ? "ok" : "FAIL", us);
  CHECK(cudaFree(dx));
  CHECK(cudaFree(dy));
  CHECK(cudaStreamDestroy(stream));
  return ok;
}

const char* activation_name(Activation a) {
  return a == Activation::kRelu ? "Relu" : a == Activation::kHardSwish ? "HardSwish" : "None";
}

Case dw_case(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, int64_t s, int64_t pad, Activation a,
             std::mt19937& rng, std::vector<float*>& keep) {
  DwConvParams p;
  p.n = n, p.c = c, p.h = h, p.w = w, p.kernel = k, p.stride = s, p.pad_h = pad, p.pad_w = pad, p.activation = a;
  p.out_h = onnxcnn::conv_out(h, k, s, pad);
  p.out_w = onnxcnn::conv_out(w, k, s, pad);
  auto weights = std::make_shared<std::vector<float>>(random_vector(c * k * k, 1.5f / k, rng));
  auto bias = std::make_shared<std::vector<float>>(random_vector(c, 0.5f, rng));
  float* dw = device_copy(*weights);
  float* db = device_copy(*bias);
  keep.push_back(dw);
  keep.push_back(db);
  char name[96];
  std::snprintf(name, sizeof(name), "dw c%lld %lldx%lld k%lld s%lld p%lld %s", static_cast<long long>(c),
                static_cast<long long>(h), static_cast<long long>(w), static_cast<long long>(k),
                static_cast<long long>(s), static_cast<long long>(pad), activation_name(a));
  return Case{name, n, static_cast<size_t>(n * c * h * w), static_cast<size_t>(n * c * p.out_h * p.out_w),
              [p, dw, db](cudaStream_t stream, const float* x, float* y) {
                if (const char* e = onnxcnn::dwconv_act_cuda(p, x, dw, db, y, stream)) {
                  std::fprintf(stderr, "launch failed: %s\n", e);
                  std::exit(1);
                }
              },
              [p, weights, bias](const float* x, float* y) {
                onnxcnn::dwconv_act_cpu(p, x, weights->data(), bias->data(), y);
              }};
}

Case se_case(int64_t n, int64_t c, int64_t h, int64_t w, int64_t r, std::mt19937& rng, std::vector<float*>& keep) {
  SeParams p;
  p.n = n, p.c = c, p.hw = h * w, p.reduced = r, p.alpha = 1.f / 6.f, p.beta = 0.5f;
  const onnxcnn::SePlan plan = onnxcnn::se_plan(p);
  auto w1 = std::make_shared<std::vector<float>>(random_vector(r * c, 2.f / std::sqrt(float(c)), rng));
  auto b1 = std::make_shared<std::vector<float>>(random_vector(r, 0.2f, rng));
  auto w2 = std::make_shared<std::vector<float>>(random_vector(c * r, 6.f / std::sqrt(float(r)), rng));
  auto b2 = std::make_shared<std::vector<float>>(random_vector(c, 0.5f, rng));
  float *d1 = device_copy(*w1), *e1 = device_copy(*b1), *d2 = device_copy(*w2), *e2 = device_copy(*b2);
  float* scratch = nullptr;
  CHECK(cudaMalloc(&scratch, plan.scratch_floats * sizeof(float)));
  keep.insert(keep.end(), {d1, e1, d2, e2, scratch});
  char name[96];
  std::snprintf(name, sizeof(name), "se c%lld %lldx%lld r%lld", static_cast<long long>(c), static_cast<long long>(h),
                static_cast<long long>(w), static_cast<long long>(r));
  const size_t size = static_cast<size_t>(n * c * h * w);
  return Case{name, n, size, size,
              [p, plan, d1, e1, d2, e2, scratch](cudaStream_t stream, const float* x, float* y) {
                if (const char* e = onnxcnn::se_block_cuda(p, plan, x, d1, e1, d2, e2, y, scratch, stream)) {
                  std::fprintf(stderr, "launch failed: %s\n", e);
                  std::exit(1);
                }
              },
              [p, w1, b1, w2, b2](const float* x, float* y) {
                onnxcnn::se_block_cpu(p, x, w1->data(), b1->data(), w2->data(), b2->data(), y);
              }};
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::mt19937 rng(1234);
  std::vector<float*> keep;
  std::vector<Case> cases;
  const Activation R = Activation::kRelu, HS = Activation::kHardSwish, NO = Activation::kNone;
  // odd shapes (not timed): partial tiles, 1x1 images, wide rows, scalar paths, many slices
  cases.push_back(dw_case(3, 13, 17, 19, 3, 1, 1, R, rng, keep));
  cases.push_back(dw_case(2, 13, 17, 19, 3, 2, 1, HS, rng, keep));
  cases.push_back(dw_case(3, 7, 9, 33, 5, 2, 2, NO, rng, keep));
  cases.push_back(dw_case(1, 5, 6, 70, 5, 1, 1, HS, rng, keep));
  cases.push_back(dw_case(2, 3, 1, 1, 3, 1, 1, R, rng, keep));
  cases.push_back(se_case(2, 13, 5, 7, 5, rng, keep));
  cases.push_back(se_case(3, 8, 1, 1, 3, rng, keep));
  cases.push_back(se_case(1, 100, 9, 9, 37, rng, keep));
  cases.push_back(se_case(2, 2000, 2, 2, 100, rng, keep));
  const size_t odd = cases.size();
  // MobileNetV3-Large's shapes (timed)
  for (int64_t n : quick ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 8}) {
    cases.push_back(dw_case(n, 16, 112, 112, 3, 1, 1, R, rng, keep));
    cases.push_back(dw_case(n, 64, 112, 112, 3, 2, 1, R, rng, keep));
    cases.push_back(dw_case(n, 72, 56, 56, 3, 1, 1, R, rng, keep));
    cases.push_back(dw_case(n, 72, 56, 56, 5, 2, 2, R, rng, keep));
    cases.push_back(dw_case(n, 120, 28, 28, 5, 1, 2, R, rng, keep));
    cases.push_back(dw_case(n, 240, 28, 28, 3, 2, 1, HS, rng, keep));
    cases.push_back(dw_case(n, 200, 14, 14, 3, 1, 1, HS, rng, keep));
    cases.push_back(dw_case(n, 184, 14, 14, 3, 1, 1, HS, rng, keep));
    cases.push_back(dw_case(n, 480, 14, 14, 3, 1, 1, HS, rng, keep));
    cases.push_back(dw_case(n, 672, 14, 14, 3, 1, 1, HS, rng, keep));
    cases.push_back(dw_case(n, 672, 14, 14, 5, 2, 2, HS, rng, keep));
    cases.push_back(dw_case(n, 960, 7, 7, 5, 1, 2, HS, rng, keep));
    cases.push_back(se_case(n, 72, 28, 28, 24, rng, keep));
    cases.push_back(se_case(n, 120, 28, 28, 32, rng, keep));
    cases.push_back(se_case(n, 480, 14, 14, 120, rng, keep));
    cases.push_back(se_case(n, 672, 14, 14, 168, rng, keep));
    cases.push_back(se_case(n, 672, 7, 7, 168, rng, keep));
    cases.push_back(se_case(n, 960, 7, 7, 240, rng, keep));
  }
  int failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) failed += run_case(cases[i], rng, i >= odd && !quick) ? 0 : 1;
  for (float* p : keep) CHECK(cudaFree(p));
  std::printf("selftest: %zu cases, %d failed\n", cases.size(), failed);
  return failed == 0 ? 0 : 1;
}
