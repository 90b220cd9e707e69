// ONNX Runtime glue of the ai.onnxcnn custom-operator library: operator definitions, attribute and shape
// checks, and the entry point RegisterCustomOps that onnxruntime.SessionOptions.register_custom_ops_library
// calls.
//
// Every operator is registered twice under one name: for the CUDA execution provider (built with
// ONNXCNN_WITH_CUDA; it launches on the provider's compute stream, so it is captured in ORT's CUDA graphs,
// and it never allocates device memory itself, synchronizes or copies to the host) and for the CPU
// provider (plain loops). A check that fails returns an ORT status naming the operator and the problem;
// nothing throws across the C boundary.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "onnxcnn_ops.h"

#if !defined(ORT_API_VERSION) || ORT_API_VERSION < 18
#error "the ONNX Runtime headers must declare ORT_API_VERSION >= 18 (KernelContext_GetScratchBuffer)"
#endif

namespace onnxcnn {
namespace {

constexpr const char* kDomain = "ai.onnxcnn";
constexpr const char* kCudaProvider = "CUDAExecutionProvider";
constexpr int64_t kMaxSeChannels = 65536;

// An error that becomes an ORT status (ORT_INVALID_ARGUMENT unless said otherwise).
struct OpError {
  std::string message;
  OrtErrorCode code = ORT_INVALID_ARGUMENT;
};

std::string dims_text(const std::vector<int64_t>& dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

template <typename Fn>
OrtStatusPtr guarded(Fn&& fn) {
  try {
    fn();
    return nullptr;
  } catch (const OpError& e) {
    return Ort::GetApi().CreateStatus(e.code, e.message.c_str());
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_RUNTIME_EXCEPTION, e.what());
  }
}

// True when the node has the ints attribute ``name`` (asking for the size of a missing one fails).
bool has_ints_attribute(const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (status == nullptr) return true;
  Ort::GetApi().ReleaseStatus(status);
  return false;
}

std::vector<int64_t> ints_attr(const OrtKernelInfo* info, const char* name, std::vector<int64_t> fallback) {
  if (!has_ints_attribute(info, name)) return fallback;
  return Ort::ConstKernelInfo(info).GetAttributes<int64_t>(name);
}

float float_attr(const OrtKernelInfo* info, const char* name, float fallback) {
  float value = 0.f;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &value);
  if (status == nullptr) return value;
  Ort::GetApi().ReleaseStatus(status);
  return fallback;
}

std::string string_attr(const OrtKernelInfo* info, const char* name, const std::string& fallback) {
  size_t length = 0;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &length);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return fallback;
  }
  return Ort::ConstKernelInfo(info).GetAttribute<std::string>(name);
}

struct Input {
  const float* data;
  std::vector<int64_t> dims;
};

Input float_input(const Ort::KernelContext& ctx, size_t index, const char* op, const char* name) {
  Ort::ConstValue value = ctx.GetInput(index);
  auto info = value.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
    throw OpError{std::string(op) + ": input " + name + " must be float32"};
  }
  return Input{value.GetTensorData<float>(), info.GetShape()};
}

int64_t element_count(const std::vector<int64_t>& dims) {
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  return count;
}

void check_size(const char* op, const char* name, const std::vector<int64_t>& dims) {
  for (int64_t d : dims) {
    if (d < 0) throw OpError{std::string(op) + ": " + name + " has a negative dimension " + dims_text(dims)};
  }
  if (element_count(dims) > kMaxElements) {
    throw OpError{std::string(op) + ": " + name + " " + dims_text(dims) + " has more than 2^31-1 elements"};
  }
}

#ifdef ONNXCNN_WITH_CUDA
void* cuda_stream(const Ort::KernelContext& ctx, const char* op) {
  void* stream = ctx.GetGPUComputeStream();
  if (stream == nullptr) {
    throw OpError{std::string(op) + ": no CUDA compute stream (the node is not on the CUDA provider)",
                  ORT_RUNTIME_EXCEPTION};
  }
  return stream;
}
#endif

// ------------------------------------------------------------------------------------ DepthwiseConvAct

constexpr const char* kDwName = "DepthwiseConvAct";

struct DwAttributes {
  int64_t stride = 1, pad_h = 0, pad_w = 0;
  Activation activation = Activation::kNone;
};

Activation parse_activation(const std::string& name) {
  if (name == "None" || name.empty()) return Activation::kNone;
  if (name == "Relu") return Activation::kRelu;
  if (name == "HardSwish") return Activation::kHardSwish;
  throw OpError{std::string(kDwName) + ": activation must be None, Relu or HardSwish, not '" + name + "'"};
}

DwAttributes dw_attributes(const OrtKernelInfo* info) {
  DwAttributes a;
  const auto strides = ints_attr(info, "strides", {1, 1});
  const auto pads = ints_attr(info, "pads", {0, 0, 0, 0});
  if (strides.size() != 2 || strides[0] != strides[1] || (strides[0] != 1 && strides[0] != 2)) {
    throw OpError{std::string(kDwName) + ": strides must be [1, 1] or [2, 2], not " + dims_text(strides)};
  }
  if (pads.size() != 4 || pads[0] != pads[2] || pads[1] != pads[3] || pads[0] < 0 || pads[1] < 0) {
    throw OpError{std::string(kDwName) + ": pads must be symmetric [ph, pw, ph, pw] >= 0, not " + dims_text(pads)};
  }
  a.stride = strides[0];
  a.pad_h = pads[0];
  a.pad_w = pads[1];
  a.activation = parse_activation(string_attr(info, "activation", "None"));
  return a;
}

DwConvParams dw_params(const DwAttributes& a, const Input& x, const Input& w, const Input& b) {
  if (x.dims.size() != 4) throw OpError{std::string(kDwName) + ": X must be 4-D NCHW, not " + dims_text(x.dims)};
  check_size(kDwName, "X", x.dims);
  DwConvParams p;
  p.n = x.dims[0];
  p.c = x.dims[1];
  p.h = x.dims[2];
  p.w = x.dims[3];
  const auto& wd = w.dims;
  if (wd.size() != 4 || wd[0] != p.c || wd[1] != 1 || wd[2] != wd[3] || (wd[2] != 3 && wd[2] != 5)) {
    throw OpError{std::string(kDwName) + ": W must be [C, 1, k, k] with C = " + std::to_string(p.c) +
                  " and k 3 or 5, not " + dims_text(wd)};
  }
  if (b.dims.size() != 1 || b.dims[0] != p.c) {
    throw OpError{std::string(kDwName) + ": B must be [" + std::to_string(p.c) + "], not " + dims_text(b.dims)};
  }
  p.kernel = wd[2];
  p.stride = a.stride;
  p.pad_h = a.pad_h;
  p.pad_w = a.pad_w;
  if (p.pad_h >= p.kernel || p.pad_w >= p.kernel) {
    throw OpError{std::string(kDwName) + ": pads must be smaller than the kernel size " + std::to_string(p.kernel)};
  }
  p.activation = a.activation;
  p.out_h = conv_out(p.h, p.kernel, p.stride, p.pad_h);
  p.out_w = conv_out(p.w, p.kernel, p.stride, p.pad_w);
  if (p.out_h < 1 || p.out_w < 1) {
    throw OpError{std::string(kDwName) + ": the " + std::to_string(p.kernel) + "x" + std::to_string(p.kernel) +
                  " kernel does not fit the padded input " + dims_text(x.dims)};
  }
  return p;
}

template <bool kCuda>
struct DwConvActKernel {
  explicit DwConvActKernel(const DwAttributes& a) : attributes(a) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded([&] {
      Ort::KernelContext ctx(context);
      const Input x = float_input(ctx, 0, kDwName, "X");
      const Input w = float_input(ctx, 1, kDwName, "W");
      const Input b = float_input(ctx, 2, kDwName, "B");
      const DwConvParams p = dw_params(attributes, x, w, b);
      const std::vector<int64_t> out_dims{p.n, p.c, p.out_h, p.out_w};
      check_size(kDwName, "Y", out_dims);
      float* y = ctx.GetOutput(0, out_dims).GetTensorMutableData<float>();
      if (p.n == 0 || p.c == 0) return;
      if constexpr (kCuda) {
#ifdef ONNXCNN_WITH_CUDA
        if (const char* error = dwconv_act_cuda(p, x.data, w.data, b.data, y, cuda_stream(ctx, kDwName))) {
          throw OpError{std::string(kDwName) + ": CUDA launch failed: " + error, ORT_RUNTIME_EXCEPTION};
        }
#endif
      } else {
        dwconv_act_cpu(p, x.data, w.data, b.data, y);
      }
    });
  }

  DwAttributes attributes;
};

template <bool kCuda>
struct DwConvActOp : Ort::CustomOpBase<DwConvActOp<kCuda>, DwConvActKernel<kCuda>, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info, void** kernel) const {
    return guarded([&] { *kernel = new DwConvActKernel<kCuda>(dw_attributes(info)); });
  }
  const char* GetName() const { return kDwName; }
  const char* GetExecutionProviderType() const { return kCuda ? kCudaProvider : nullptr; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

  // [N, C, H, W] -> [N, C, OH, OW] where H and W are known; otherwise the output keeps no shape.
  static Ort::Status InferOutputShape(Ort::ShapeInferContext& ctx) {
    try {
      infer_output_shape(ctx);
    } catch (const std::exception&) {  // a shape we cannot infer is left unknown; Compute checks it
    }
    return Ort::Status{nullptr};  // never an error: ORT ignores it and Ort::Status would not outlive the call
  }

  static void infer_output_shape(Ort::ShapeInferContext& ctx) {
    if (ctx.GetInputCount() < 2) return;
    const auto& x = ctx.GetInputShape(0);
    const auto& w = ctx.GetInputShape(1);
    if (x.size() != 4 || w.size() != 4 || !w[2].IsInt() || !x[2].IsInt() || !x[3].IsInt()) return;
    const auto strides = ctx.GetAttrInts("strides");
    const auto pads = ctx.GetAttrInts("pads");
    if (strides.size() != 2 || pads.size() != 4) return;
    const int64_t k = w[2].AsInt();
    const int64_t oh = conv_out(x[2].AsInt(), k, strides[0], pads[0]);
    const int64_t ow = conv_out(x[3].AsInt(), k, strides[1], pads[1]);
    if (x[2].AsInt() < 0 || x[3].AsInt() < 0 || oh < 1 || ow < 1) return;
    Ort::ShapeInferContext::Shape out{x[0], x[1], Ort::ShapeInferContext::SymbolicInteger(oh),
                                      Ort::ShapeInferContext::SymbolicInteger(ow)};
    Ort::Status ignored = ctx.SetOutputShape(0, out);
  }
};

// ------------------------------------------------------------------------------------ SqueezeExcite

constexpr const char* kSeName = "SqueezeExcite";

struct SeAttributes {
  float alpha = 0.2f, beta = 0.5f;
};

// A 1x1 conv weight [rows, cols, 1, 1] or a matrix [rows, cols].
bool is_matrix(const std::vector<int64_t>& d, int64_t rows, int64_t cols) {
  const bool head = d.size() >= 2 && d[0] == rows && d[1] == cols;
  return head && (d.size() == 2 || (d.size() == 4 && d[2] == 1 && d[3] == 1));
}

SeParams se_params(const SeAttributes& a, const Input& x, const Input& w1, const Input& b1, const Input& w2,
                   const Input& b2) {
  if (x.dims.size() != 4) throw OpError{std::string(kSeName) + ": X must be 4-D NCHW, not " + dims_text(x.dims)};
  check_size(kSeName, "X", x.dims);
  SeParams p;
  p.n = x.dims[0];
  p.c = x.dims[1];
  p.hw = x.dims[2] * x.dims[3];
  p.reduced = w1.dims.empty() ? 0 : w1.dims[0];
  p.alpha = a.alpha;
  p.beta = a.beta;
  const std::string c = std::to_string(p.c), r = std::to_string(p.reduced);
  if (p.c > kMaxSeChannels) throw OpError{std::string(kSeName) + ": more than 65536 channels"};
  if (p.reduced < 1 || p.reduced > kMaxReduced || !is_matrix(w1.dims, p.reduced, p.c)) {
    throw OpError{std::string(kSeName) + ": W1 must be [R, " + c + "(, 1, 1)] with 1 <= R <= 8192, not " +
                  dims_text(w1.dims)};
  }
  if (!is_matrix(w2.dims, p.c, p.reduced)) {
    throw OpError{std::string(kSeName) + ": W2 must be [" + c + ", " + r + "(, 1, 1)], not " + dims_text(w2.dims)};
  }
  if (b1.dims.size() != 1 || b1.dims[0] != p.reduced) {
    throw OpError{std::string(kSeName) + ": B1 must be [" + r + "], not " + dims_text(b1.dims)};
  }
  if (b2.dims.size() != 1 || b2.dims[0] != p.c) {
    throw OpError{std::string(kSeName) + ": B2 must be [" + c + "], not " + dims_text(b2.dims)};
  }
  if (p.n > kMaxGridY) throw OpError{std::string(kSeName) + ": batch larger than 65535"};
  return p;
}

#ifdef ONNXCNN_WITH_CUDA
// Device scratch from ORT's allocator for X's device, freed when the kernel call ends (the work it feeds
// is ordered on the same stream, like every ORT kernel's scratch buffer).
class Scratch {
 public:
  Scratch(const Ort::KernelContext& ctx, const OrtMemoryInfo* memory, size_t bytes) {
    Ort::ThrowOnError(Ort::GetApi().KernelContext_GetAllocator(ctx.GetOrtKernelContext(), memory, &allocator_));
    Ort::ThrowOnError(
        Ort::GetApi().KernelContext_GetScratchBuffer(ctx.GetOrtKernelContext(), memory, bytes, &data_));
    if (data_ == nullptr) throw OpError{std::string(kSeName) + ": no scratch buffer", ORT_FAIL};
  }
  ~Scratch() {
    if (allocator_ != nullptr && data_ != nullptr) allocator_->Free(allocator_, data_);
    if (allocator_ != nullptr) Ort::GetApi().ReleaseAllocator(allocator_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* data() const { return static_cast<float*>(data_); }

 private:
  OrtAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
};
#endif

template <bool kCuda>
struct SqueezeExciteKernel {
  explicit SqueezeExciteKernel(const SeAttributes& a) : attributes(a) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded([&] {
      Ort::KernelContext ctx(context);
      const Input x = float_input(ctx, 0, kSeName, "X");
      const Input w1 = float_input(ctx, 1, kSeName, "W1");
      const Input b1 = float_input(ctx, 2, kSeName, "B1");
      const Input w2 = float_input(ctx, 3, kSeName, "W2");
      const Input b2 = float_input(ctx, 4, kSeName, "B2");
      const SeParams p = se_params(attributes, x, w1, b1, w2, b2);
      float* y = ctx.GetOutput(0, x.dims).GetTensorMutableData<float>();
      if (p.n == 0 || p.c == 0) return;
      if (p.hw == 0) throw OpError{std::string(kSeName) + ": X has an empty image " + dims_text(x.dims)};
      if constexpr (kCuda) {
#ifdef ONNXCNN_WITH_CUDA
        void* stream = cuda_stream(ctx, kSeName);
        const SePlan plan = se_plan(p);
        const OrtMemoryInfo* memory = ctx.GetInput(0).GetTensorMemoryInfo();
        Scratch scratch(ctx, memory, static_cast<size_t>(plan.scratch_floats) * sizeof(float));
        if (const char* error =
                se_block_cuda(p, plan, x.data, w1.data, b1.data, w2.data, b2.data, y, scratch.data(), stream)) {
          throw OpError{std::string(kSeName) + ": CUDA launch failed: " + error, ORT_RUNTIME_EXCEPTION};
        }
#endif
      } else {
        se_block_cpu(p, x.data, w1.data, b1.data, w2.data, b2.data, y);
      }
    });
  }

  SeAttributes attributes;
};

template <bool kCuda>
struct SqueezeExciteOp : Ort::CustomOpBase<SqueezeExciteOp<kCuda>, SqueezeExciteKernel<kCuda>, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info, void** kernel) const {
    return guarded([&] {
      SeAttributes a;
      a.alpha = float_attr(info, "alpha", 0.2f);
      a.beta = float_attr(info, "beta", 0.5f);
      *kernel = new SqueezeExciteKernel<kCuda>(a);
    });
  }
  const char* GetName() const { return kSeName; }
  const char* GetExecutionProviderType() const { return kCuda ? kCudaProvider : nullptr; }
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

  // Y has X's shape.
  static Ort::Status InferOutputShape(Ort::ShapeInferContext& ctx) {
    try {
      if (ctx.GetInputCount() >= 1 && !ctx.GetInputShape(0).empty()) {
        Ort::Status ignored = ctx.SetOutputShape(0, ctx.GetInputShape(0));
      }
    } catch (const std::exception&) {
    }
    return Ort::Status{nullptr};
  }
};

// ------------------------------------------------------------------------------------ registration

std::mutex domains_mutex;
std::vector<Ort::CustomOpDomain>& domains() {
  static std::vector<Ort::CustomOpDomain> kept;  // must outlive every session that uses the ops
  return kept;
}

}  // namespace
}  // namespace onnxcnn

extern "C" {

// The library's build, for logs: "onnxcnn_ops 1 (ORT API 21, CUDA 13.0)" or "... CPU only)".
__attribute__((visibility("default"))) const char* OnnxcnnOpsBuildInfo() {
#define ONNXCNN_STR2(x) #x
#define ONNXCNN_STR(x) ONNXCNN_STR2(x)
#ifdef ONNXCNN_WITH_CUDA
  static const std::string info = std::string("onnxcnn_ops 1 (ORT API " ONNXCNN_STR(ORT_API_VERSION) ", CUDA ") +
                                  onnxcnn::cuda_build_version() + ")";
#else
  static const std::string info = "onnxcnn_ops 1 (ORT API " ONNXCNN_STR(ORT_API_VERSION) ", CPU only)";
#endif
  return info.c_str();
}

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                 const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const OrtApi* oldest = api_base->GetApi(1);
    return oldest->CreateStatus(ORT_FAIL, "onnxcnn_ops needs an onnxruntime that serves its C API version");
  }
  Ort::InitApi(api);
  return onnxcnn::guarded([&] {
    static onnxcnn::DwConvActOp<false> dw_cpu;
    static onnxcnn::SqueezeExciteOp<false> se_cpu;
#ifdef ONNXCNN_WITH_CUDA
    static onnxcnn::DwConvActOp<true> dw_cuda;
    static onnxcnn::SqueezeExciteOp<true> se_cuda;
#endif
    Ort::CustomOpDomain domain{onnxcnn::kDomain};
    domain.Add(&dw_cpu);
    domain.Add(&se_cpu);
#ifdef ONNXCNN_WITH_CUDA
    domain.Add(&dw_cuda);
    domain.Add(&se_cuda);
#endif
    Ort::UnownedSessionOptions session_options(options);
    session_options.Add(domain);
    std::lock_guard<std::mutex> lock(onnxcnn::domains_mutex);
    onnxcnn::domains().push_back(std::move(domain));
  });
}

}  // extern "C"
