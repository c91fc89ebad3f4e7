// gelu_mlp's GELU inside cuBLASLt's products ('cuda'). The first product's epilogue adds the
// bias and applies the GELU, writing the activation and, in training, its input (the
// pre-activation, which the backward reads); the backward's product dy w2^T applies the GELU's
// derivative at that input in its epilogue. The bias gradient is left to XLA: cuBLASLt's
// DGELU_BGRAD sums it in a pass of its own (benchmarks/PERFORMANCE.md, session 45).
//
// Row-major arrays are cuBLASLt's column-major transposes: a row-major (M, N) result is the
// column-major N x M matrix D = op(A) B with A the weight (row-major (K, N) is column-major
// N x K) and B the rows (row-major (M, K) is column-major K x M). The bias runs along D's rows,
// the features.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "vendor.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {
namespace {

namespace ffi = xla::ffi;

ffi::Error invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("gelu_gemm: " + message);
}

ffi::Error internal(const char* function, const std::string& reason) {
  return ffi::Error::Internal(std::string("gelu_gemm: ") + function + ": " + reason);
}

// Returns from the enclosing function with an Internal error naming `fn` if the call fails.
#define JAXFUSE_CUBLASLT(fn, ...)                                                  \
  do {                                                                             \
    const cublasStatus_t status_ = fn(__VA_ARGS__);                                \
    if (status_ != CUBLAS_STATUS_SUCCESS)                                          \
      return ::jaxfuse::internal(#fn, "cublasStatus_t " + std::to_string(status_)); \
  } while (0)

// What a call computes, indexed by the `mode` attribute.
enum Mode : int64_t {
  kForward = 0,   // D = gelu(A B + bias)
  kTraining = 1,  // the same, and aux = A B + bias
  kBackward = 2,  // D = (op(A) B) * gelu'(aux)
};

// The product: D (m x n, column-major) = op(A) (m x k) B (k x n); `dtype` 0 float16,
// 1 bfloat16, for A, B, D, the bias and aux alike.
struct Problem {
  int64_t mode, dtype, m, n, k;

  bool operator<(const Problem& o) const {
    return std::tie(mode, dtype, m, n, k) < std::tie(o.mode, o.dtype, o.m, o.n, o.k);
  }
  cudaDataType_t type() const { return dtype == 0 ? CUDA_R_16F : CUDA_R_16BF; }
  ffi::DataType ffi_type() const { return dtype == 0 ? ffi::DataType::F16 : ffi::DataType::BF16; }
  cublasLtEpilogue_t epilogue() const {
    return mode == kForward    ? CUBLASLT_EPILOGUE_GELU_BIAS
           : mode == kTraining ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                               : CUBLASLT_EPILOGUE_DGELU;
  }
  // The weight is A: (K, N) row-major as is for the forward; (F, E) row-major, transposed, for
  // the backward's dy w2^T.
  cublasOperation_t transa() const { return mode == kBackward ? CUBLAS_OP_T : CUBLAS_OP_N; }
};

ffi::Error validate(const Problem& p) {
  if (p.mode < kForward || p.mode > kBackward)
    return invalid("mode=" + std::to_string(p.mode) + " is outside [0, 2]");
  if (p.dtype < 0 || p.dtype > 1)
    return invalid("dtype=" + std::to_string(p.dtype) + " is outside [0, 1] (float16, bfloat16)");
  // 16-byte rows for every operand, and aux's leading dimension a multiple of 8 elements.
  if (p.m < 8 || p.k < 8 || p.n < 1 || p.m % 8 || p.k % 8)
    return invalid("m=" + std::to_string(p.m) + " and k=" + std::to_string(p.k) +
                   " must be positive multiples of 8, n=" + std::to_string(p.n) + " positive");
  return ffi::Error::Success();
}

struct Descriptors {
  Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> matmul;
  Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> a, b, d;
};

// The descriptors of `p` with its operands at `bias` (forward modes) and `aux` (training and
// backward); the heuristic reads their alignment from the pointers, the product their data.
ffi::Error describe(const Problem& p, void* bias, void* aux, Descriptors& out) {
  JAXFUSE_CUBLASLT(cublasLtMatmulDescCreate, &out.matmul.raw, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t transa = p.transa(), transb = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = p.epilogue();
  const int64_t aux_ld = p.m;
  const cudaDataType_t type = p.type();
  const std::tuple<cublasLtMatmulDescAttributes_t, const void*, size_t> attributes[] = {
      {CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)},
      {CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)},
      {CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)}};
  for (const auto& [attribute, value, size] : attributes)
    JAXFUSE_CUBLASLT(cublasLtMatmulDescSetAttribute, out.matmul.raw, attribute, value, size);
  if (p.mode != kBackward) {
    JAXFUSE_CUBLASLT(cublasLtMatmulDescSetAttribute, out.matmul.raw,
                     CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    JAXFUSE_CUBLASLT(cublasLtMatmulDescSetAttribute, out.matmul.raw,
                     CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type));
  }
  if (p.mode != kForward) {
    JAXFUSE_CUBLASLT(cublasLtMatmulDescSetAttribute, out.matmul.raw,
                     CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux));
    JAXFUSE_CUBLASLT(cublasLtMatmulDescSetAttribute, out.matmul.raw,
                     CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld));
  }
  // A as stored: m x k, or k x m to be transposed; each column-major with its rows contiguous.
  const bool transposed = transa == CUBLAS_OP_T;
  JAXFUSE_CUBLASLT(cublasLtMatrixLayoutCreate, &out.a.raw, type, transposed ? p.k : p.m,
                   transposed ? p.m : p.k, transposed ? p.k : p.m);
  JAXFUSE_CUBLASLT(cublasLtMatrixLayoutCreate, &out.b.raw, type, p.k, p.n, p.k);
  JAXFUSE_CUBLASLT(cublasLtMatrixLayoutCreate, &out.d.raw, type, p.m, p.n, p.m);
  return ffi::Error::Success();
}

// One handle per device, made before any handler runs (a handler may first run while XLA
// captures a CUDA graph), and the algorithm chosen for each problem on it. cuBLASLt's handle
// may serve concurrent calls; the mutex guards the maps.
struct Registry {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, Problem>, std::pair<cublasLtMatmulAlgo_t, size_t>> algorithms;
};

Registry& registry() {
  static Registry* const instance = new Registry();  // never destroyed: no race at exit
  return *instance;
}

// Workspace cuBLASLt may use: what its Hopper kernels are tuned with.
constexpr size_t kMaxWorkspace = size_t{32} << 20;
// The alignment algorithms may assume of every operand: what 16-byte vector loads and bulk
// copies need. cuBLASLt's default, 256 bytes, would let it pick algorithms that assume more
// than XLA's buffers promise.
constexpr uint32_t kAlignment = 16;

// The current device's handle and the algorithm and workspace bytes of `p` on it, chosen once
// by cuBLASLt's heuristic for operands aligned to kAlignment bytes.
ffi::Error plan(const Problem& p, cublasLtHandle_t* handle, cublasLtMatmulAlgo_t* algo,
                size_t* workspace) {
  JAXFUSE_TRY(validate(p));
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return internal("cudaGetDevice", cudaGetErrorString(err));
  Registry& r = registry();
  const std::lock_guard<std::mutex> guard(r.mutex);
  cublasLtHandle_t& made = r.handles[device];
  if (made == nullptr) JAXFUSE_CUBLASLT(cublasLtCreate, &made);
  *handle = made;
  const auto found = r.algorithms.find({device, p});
  if (found != r.algorithms.end()) {
    std::tie(*algo, *workspace) = found->second;
    return ffi::Error::Success();
  }
  Descriptors d;
  void* const aligned = reinterpret_cast<void*>(uintptr_t{kAlignment});
  JAXFUSE_TRY(describe(p, aligned, aligned, d));
  Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> preference;
  JAXFUSE_CUBLASLT(cublasLtMatmulPreferenceCreate, &preference.raw);
  JAXFUSE_CUBLASLT(cublasLtMatmulPreferenceSetAttribute, preference.raw,
                   CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kMaxWorkspace,
                   sizeof(kMaxWorkspace));
  for (const cublasLtMatmulPreferenceAttributes_t operand :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    JAXFUSE_CUBLASLT(cublasLtMatmulPreferenceSetAttribute, preference.raw, operand, &kAlignment,
                     sizeof(kAlignment));
  }
  cublasLtMatmulHeuristicResult_t result = {};
  int count = 0;
  JAXFUSE_CUBLASLT(cublasLtMatmulAlgoGetHeuristic, made, d.matmul.raw, d.a.raw, d.b.raw, d.d.raw,
                   d.d.raw, preference.raw, 1, &result, &count);
  if (count == 0) return invalid("cuBLASLt has no algorithm for this product and epilogue");
  r.algorithms[{device, p}] = {result.algo, result.workspaceSize};
  *algo = result.algo;
  *workspace = result.workspaceSize;
  return ffi::Error::Success();
}

ffi::Error check(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                 int64_t count) {
  if (buffer.element_type() != type)
    return invalid(std::string(name) + " has XLA dtype " +
                   std::to_string(static_cast<int>(buffer.element_type())) + ", not " +
                   std::to_string(static_cast<int>(type)) + " as the other operands");
  if (static_cast<int64_t>(buffer.element_count()) != count)
    return invalid(std::string(name) + " has " + std::to_string(buffer.element_count()) +
                   " elements where the product implies " + std::to_string(count));
  return ffi::Error::Success();
}

// a: the weight; b: the rows; bias: the bias (forward modes; else null); aux: the
// pre-activation, written in training and read by the backward (null for kForward).
ffi::Error run(cudaStream_t stream, const Problem& p, const ffi::AnyBuffer& a,
               const ffi::AnyBuffer& b, const ffi::AnyBuffer* bias, const ffi::AnyBuffer* aux,
               ffi::AnyBuffer& d, ffi::AnyBuffer& workspace) {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes = 0;
  JAXFUSE_TRY(plan(p, &handle, &algo, &workspace_bytes));
  const ffi::DataType type = p.ffi_type();
  JAXFUSE_TRY(check("weight", a, type, p.m * p.k));
  JAXFUSE_TRY(check("rows", b, type, p.k * p.n));
  JAXFUSE_TRY(check("output", d, type, p.m * p.n));
  if (bias != nullptr) JAXFUSE_TRY(check("bias", *bias, type, p.m));
  if (aux != nullptr) JAXFUSE_TRY(check("pre-activation", *aux, type, p.m * p.n));
  void* const bias_data = bias == nullptr ? nullptr : bias->untyped_data();
  void* const aux_data = aux == nullptr ? nullptr : aux->untyped_data();
  for (const void* operand : std::initializer_list<const void*>{
           a.untyped_data(), b.untyped_data(), d.untyped_data(), bias_data, aux_data}) {
    if (reinterpret_cast<uintptr_t>(operand) % kAlignment)
      return invalid("an operand is not " + std::to_string(kAlignment) + "-byte aligned");
  }
  if (workspace.size_bytes() < workspace_bytes)
    return invalid("workspace holds " + std::to_string(workspace.size_bytes()) +
                   " bytes; cuBLASLt asked for " + std::to_string(workspace_bytes));
  Descriptors desc;
  JAXFUSE_TRY(describe(p, bias_data, aux_data, desc));
  const float one = 1.f, zero = 0.f;
  JAXFUSE_CUBLASLT(cublasLtMatmul, handle, desc.matmul.raw, &one, a.untyped_data(), desc.a.raw,
                   b.untyped_data(), desc.b.raw, &zero, d.untyped_data(), desc.d.raw,
                   d.untyped_data(), desc.d.raw, &algo, workspace.untyped_data(),
                   workspace_bytes, stream);
  return ffi::Error::Success();
}

// x (M, K) rows, w (K, N), b (N,) -> y = gelu(x w + b) (M, N); in training also the
// pre-activation (M, N). `mode` kForward or kTraining.
ffi::Error ForwardImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer b,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> pre,
                       ffi::Result<ffi::AnyBuffer> workspace, int64_t mode, int64_t dtype,
                       int64_t rows, int64_t inner, int64_t features) {
  if (mode == kBackward) return invalid("the forward takes mode 0 or 1");
  const Problem p{mode, dtype, features, rows, inner};
  return run(stream, p, w, x, &b, mode == kTraining ? &*pre : nullptr, *y, *workspace);
}

// dy (M, E), w2 (F, E), pre (M, F) -> dh = (dy w2^T) * gelu'(pre) (M, F).
ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w2,
                        ffi::AnyBuffer pre, ffi::Result<ffi::AnyBuffer> dh,
                        ffi::Result<ffi::AnyBuffer> workspace,
                        int64_t dtype, int64_t rows, int64_t inner, int64_t features) {
  const Problem p{kBackward, dtype, features, rows, inner};
  return run(stream, p, w2, dy, nullptr, &pre, *dh, *workspace);
}

}  // namespace
}  // namespace jaxfuse

// Neither handler syncs with the host or allocates, so XLA may capture them into CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGeluGemmForward, jaxfuse::ForwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // w
                                  .Arg<xla::ffi::AnyBuffer>()  // b
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::AnyBuffer>()  // pre (training; else unused)
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("inner")
                                  .Attr<int64_t>("features"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGeluGemmBackward, jaxfuse::BackwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // dy
                                  .Arg<xla::ffi::AnyBuffer>()  // w2
                                  .Arg<xla::ffi::AnyBuffer>()  // pre
                                  .Ret<xla::ffi::AnyBuffer>()  // dh
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("inner")
                                  .Attr<int64_t>("features"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

// For the Python side, at trace time: the workspace bytes of one product, the most any of the
// `count` devices in `devices` asks (choosing its algorithm on each and making each device's
// handle before any handler runs). Returns 0, or nonzero with a NUL-terminated message in
// `error`. The calling thread's current device is restored.
extern "C" int jaxfuse_gelu_gemm_workspace(int64_t mode, int64_t dtype, int64_t rows,
                                           int64_t inner, int64_t features,
                                           const int64_t* devices, int64_t count,
                                           uint64_t* bytes, char* error, int64_t error_size) {
  const jaxfuse::Problem p{mode, dtype, features, rows, inner};
  int current = 0;
  xla::ffi::Error status = xla::ffi::Error::Success();
  const cudaError_t got = cudaGetDevice(&current);
  if (got != cudaSuccess) status = jaxfuse::internal("cudaGetDevice", cudaGetErrorString(got));
  *bytes = 0;
  for (int64_t i = 0; i < count && status.success(); ++i) {
    if (const cudaError_t err = cudaSetDevice(static_cast<int>(devices[i])); err != cudaSuccess) {
      status = jaxfuse::internal("cudaSetDevice", cudaGetErrorString(err));
      break;
    }
    cublasLtHandle_t handle = nullptr;
    cublasLtMatmulAlgo_t algo;
    size_t workspace = 0;
    status = jaxfuse::plan(p, &handle, &algo, &workspace);
    *bytes = std::max<uint64_t>(*bytes, workspace);
  }
  if (got == cudaSuccess) cudaSetDevice(current);
  if (status.success()) return 0;
  if (error != nullptr && error_size > 0)
    std::snprintf(error, static_cast<size_t>(error_size), "%s", status.message().c_str());
  return 1;
}
