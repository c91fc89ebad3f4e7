// cuDNN 9's RNN (LSTM and GRU) behind XLA FFI handlers, and a size query for ctypes.
//
// Python owns all memory: it asks jaxfuse_cudnn_rnn_sizes for the workspace, reserve and weight
// bytes, then hands the handlers buffers of those sizes. The flat weight vector is laid out as
// cuDNN's weight space (per pseudo-layer its input then recurrent matrices, then every bias), so
// it is passed as it is.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "vendor.cuh"
#include "xla/ffi/api/ffi.h"

// Returns from the enclosing function with an Internal error naming `fn` if the call fails.
#define JAXFUSE_CUDNN(fn, ...)                                       \
  do {                                                               \
    const cudnnStatus_t status_ = fn(__VA_ARGS__);                   \
    if (status_ != CUDNN_STATUS_SUCCESS)                             \
      return ::jaxfuse::internal(#fn, cudnnGetErrorString(status_)); \
  } while (0)

namespace jaxfuse {
namespace {

namespace ffi = xla::ffi;

ffi::Error invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("cudnn_rnn: " + message);
}

ffi::Error internal(const char* function, const char* reason) {
  return ffi::Error::Internal(std::string("cudnn_rnn: ") + function + ": " + reason);
}

// Indexed by the `dtype` attribute.
constexpr cudnnDataType_t kCudnnTypes[] = {CUDNN_DATA_FLOAT, CUDNN_DATA_HALF, CUDNN_DATA_BFLOAT16};
constexpr ffi::DataType kFfiTypes[] = {ffi::DataType::F32, ffi::DataType::F16,
                                       ffi::DataType::BF16};
constexpr const char* kTypeNames[] = {"float32", "float16", "bfloat16"};

// The product of positive factors, or -1 (no buffer's count) where it overflows an int64.
int64_t product(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (const int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return -1;
  }
  return out;
}

// The attributes that shape one call, shared by both handlers and the size query. The backward
// is a training call: it reads the reserve of the training forward.
struct Problem {
  int64_t cell, dtype, math, input_size, hidden_size, num_layers, bidirectional, batch, time,
      algo;
  const int32_t* lengths;
  int64_t lengths_count, training;

  bool lstm() const { return cell == 0; }
  int64_t dirs() const { return bidirectional ? 2 : 1; }
  cudnnForwardMode_t mode() const {
    return training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE;
  }
  int64_t x_count() const { return product({batch, time, input_size}); }
  int64_t y_count() const { return product({batch, time, dirs(), hidden_size}); }
  int64_t h_count() const { return product({num_layers, dirs(), batch, hidden_size}); }
};

// Enumerations in range and every size cuDNN takes as an int within one.
ffi::Error validate(const Problem& p) {
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  const std::tuple<const char*, int64_t, int64_t, int64_t, const char*> ranges[] = {
      {"cell", p.cell, 0, 1, " (0 LSTM, 1 GRU)"},
      {"dtype", p.dtype, 0, 2, " (0 float32, 1 float16, 2 bfloat16)"},
      {"math", p.math, CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH, " (a cudnnMathType_t)"},
      {"bidirectional", p.bidirectional, 0, 1, ""}, {"training", p.training, 0, 1, ""},
      {"algo", p.algo, 0, 1, " (0 standard, 1 persistent for small hidden sizes)"},
      {"input_size", p.input_size, 1, kMaxInt, ""}, {"hidden_size", p.hidden_size, 1, kMaxInt, ""},
      {"num_layers", p.num_layers, 1, kMaxInt, ""}, {"batch", p.batch, 1, kMaxInt, ""},
      {"time", p.time, 1, kMaxInt, ""}};
  for (const auto& [name, value, low, high, meaning] : ranges) {
    if (value < low || value > high)
      return invalid(std::string(name) + "=" + std::to_string(value) + " is outside [" +
                     std::to_string(low) + ", " + std::to_string(high) + "]" + meaning);
  }
  // Factors within an int each, so these products cannot overflow an int64.
  if (p.batch * p.hidden_size > kMaxInt || p.dirs() * p.hidden_size > kMaxInt)
    return invalid("batch * hidden_size and directions * hidden_size must fit an int");
  if (p.lengths_count != p.batch)
    return invalid("lengths has " + std::to_string(p.lengths_count) + " entries, not batch=" +
                   std::to_string(p.batch));
  return ffi::Error::Success();
}

// A data buffer of the call and the element count its shape implies.
struct Expect {
  const char* name;
  const ffi::AnyBuffer* buffer;
  int64_t count;
};

ffi::Error check_type(const Problem& p, const char* name, const ffi::AnyBuffer& buffer) {
  if (buffer.element_type() == kFfiTypes[p.dtype]) return ffi::Error::Success();
  return invalid(std::string(name) + " is not " + kTypeNames[p.dtype] + ", the call's dtype");
}

// Every listed buffer holds `count` elements of the call's data type.
ffi::Error check_data(const Problem& p, std::initializer_list<Expect> expected) {
  for (const Expect& e : expected) {
    JAXFUSE_TRY(check_type(p, e.name, *e.buffer));
    const int64_t count = static_cast<int64_t>(e.buffer->element_count());
    if (e.count < 0 || count != e.count)
      return invalid(std::string(e.name) + " has " + std::to_string(count) +
                     " elements where its shape implies " + std::to_string(e.count));
  }
  return ffi::Error::Success();
}

// A buffer cuDNN sizes: exactly its weight space (w, dw), or at least its scratch.
ffi::Error check_bytes(const char* name, const ffi::AnyBuffer& buffer, size_t bytes, bool exact) {
  const size_t held = buffer.size_bytes();
  if (exact ? held == bytes : held >= bytes) return ffi::Error::Success();
  return invalid(std::string(name) + " holds " + std::to_string(held) + " bytes but cuDNN " +
                 (exact ? "sizes this RNN's weight space at " : "needs ") +
                 std::to_string(bytes));
}

// The locked handle of one call and the descriptors it built. Members are destroyed in reverse
// order, so the descriptors go (the RNN before its dropout) while the handle is still locked.
struct Call {
  std::unique_lock<std::mutex> lock;
  cudnnHandle_t handle = nullptr;
  Owned<cudnnDropoutDescriptor_t, cudnnDestroyDropoutDescriptor> dropout;
  Owned<cudnnRNNDescriptor_t, cudnnDestroyRNNDescriptor> rnn;
  Owned<cudnnRNNDataDescriptor_t, cudnnDestroyRNNDataDescriptor> x, y;
  Owned<cudnnTensorDescriptor_t, cudnnDestroyTensorDescriptor> h;
  // cuDNN reads the fill of padded outputs as a host value of a type it derives from the data
  // type; a zero double's bytes are all zero, so it reads as zero whatever that type is.
  double padding_fill = 0.0;
  size_t weight_bytes = 0, workspace_bytes = 0, reserve_bytes = 0;
};

// One handle per device, kept for the process. A handle is not safe for concurrent use, so a
// call holds its device's mutex until it returns.
struct DeviceHandle {
  std::mutex mutex;
  cudnnHandle_t handle = nullptr;
};

DeviceHandle& device_handle(int device) {
  struct Registry {
    std::mutex mutex;
    std::map<int, DeviceHandle> devices;
  };
  // Never destroyed, so a call racing process exit never meets a destroyed mutex.
  static Registry* const registry = new Registry();
  const std::lock_guard<std::mutex> guard(registry->mutex);
  return registry->devices[device];  // a map's entries never move
}

// Every device's handle, made before any handler runs: a handler may first run while XLA
// captures a CUDA graph, where making one is not allowed.
ffi::Error create_handles() {
  int count = 0, current = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess) err = cudaGetDevice(&current);
  if (err != cudaSuccess) return internal("cudaGetDeviceCount", cudaGetErrorString(err));
  for (int device = 0; device < count; ++device) {
    DeviceHandle& entry = device_handle(device);
    const std::lock_guard<std::mutex> hold(entry.mutex);
    if (entry.handle != nullptr) continue;
    err = cudaSetDevice(device);
    if (err != cudaSuccess) return internal("cudaSetDevice", cudaGetErrorString(err));
    const cudnnStatus_t status = cudnnCreate(&entry.handle);
    err = cudaSetDevice(current);
    if (status != CUDNN_STATUS_SUCCESS) return internal("cudnnCreate", cudnnGetErrorString(status));
    if (err != cudaSuccess) return internal("cudaSetDevice", cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error lease(Call& call) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return internal("cudaGetDevice", cudaGetErrorString(err));
  DeviceHandle& entry = device_handle(device);
  call.lock = std::unique_lock<std::mutex>(entry.mutex);
  if (entry.handle == nullptr) JAXFUSE_CUDNN(cudnnCreate, &entry.handle);
  call.handle = entry.handle;
  return ffi::Error::Success();
}

// Locks the current device's handle, builds every descriptor of a validated problem and asks
// cuDNN for the sizes of its weight space and scratch buffers. Launches no work.
ffi::Error prepare(const Problem& p, Call& call) {
  JAXFUSE_TRY(lease(call));
  const cudnnDataType_t type = kCudnnTypes[p.dtype];
  const int hidden = static_cast<int>(p.hidden_size);
  JAXFUSE_CUDNN(cudnnCreateDropoutDescriptor, &call.dropout.raw);
  // No dropout between layers, so no random states to allocate or initialize.
  JAXFUSE_CUDNN(cudnnSetDropoutDescriptor, call.dropout.raw, call.handle, 0.0f, nullptr, 0, 0);
  JAXFUSE_CUDNN(cudnnCreateRNNDescriptor, &call.rnn.raw);
  // Float32 math for every data type: cuDNN runs bfloat16 data only with float32 math.
  JAXFUSE_CUDNN(cudnnSetRNNDescriptor_v8, call.rnn.raw,
                p.algo ? CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H : CUDNN_RNN_ALGO_STANDARD,
                p.lstm() ? CUDNN_LSTM : CUDNN_GRU, CUDNN_RNN_DOUBLE_BIAS,
                p.bidirectional ? CUDNN_BIDIRECTIONAL : CUDNN_UNIDIRECTIONAL, CUDNN_LINEAR_INPUT,
                type, CUDNN_DATA_FLOAT, static_cast<cudnnMathType_t>(p.math),
                static_cast<int32_t>(p.input_size), hidden, hidden /* no projection */,
                static_cast<int32_t>(p.num_layers), call.dropout.raw, CUDNN_RNN_PADDED_IO_ENABLED);
  // Time-major padded sequences (Python transposes JAX's batch-major ones): cuDNN rearranges
  // batch-major data into this layout with kernels of its own, which cost more. x's descriptor
  // also describes dx, an output of the backward pass, so it carries the fill as y's does.
  const std::pair<cudnnRNNDataDescriptor_t*, int64_t> data[] = {
      {&call.x.raw, p.input_size}, {&call.y.raw, p.dirs() * p.hidden_size}};
  for (const auto& [desc, width] : data) {
    JAXFUSE_CUDNN(cudnnCreateRNNDataDescriptor, desc);
    JAXFUSE_CUDNN(cudnnSetRNNDataDescriptor, *desc, type,
                  CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED, static_cast<int>(p.time),
                  static_cast<int>(p.batch), static_cast<int>(width), p.lengths,
                  &call.padding_fill);
  }
  const int dims[3] = {static_cast<int>(p.num_layers * p.dirs()), static_cast<int>(p.batch),
                       hidden};
  const int strides[3] = {static_cast<int>(p.batch) * hidden, hidden, 1};
  JAXFUSE_CUDNN(cudnnCreateTensorDescriptor, &call.h.raw);
  JAXFUSE_CUDNN(cudnnSetTensorNdDescriptor, call.h.raw, type, 3, dims, strides);
  JAXFUSE_CUDNN(cudnnGetRNNWeightSpaceSize, call.handle, call.rnn.raw, &call.weight_bytes);
  JAXFUSE_CUDNN(cudnnGetRNNTempSpaceSizes, call.handle, call.rnn.raw, p.mode(), call.x.raw,
                &call.workspace_bytes, &call.reserve_bytes);
  // Inference hands cuDNN no reserve, so none is asked of Python.
  if (!p.training) call.reserve_bytes = 0;
  return ffi::Error::Success();
}

using Buffer = ffi::AnyBuffer;
using Output = ffi::Result<ffi::AnyBuffer>;

ffi::Error RnnForwardImpl(cudaStream_t stream, Buffer x, Buffer hx, Buffer cx, Buffer w, Output y,
                          Output hy, Output cy, Output reserve, Output workspace, int64_t cell,
                          int64_t dtype, int64_t math, int64_t input_size, int64_t hidden_size,
                          int64_t num_layers, int64_t bidirectional, int64_t batch, int64_t time,
                          int64_t algo, ffi::Span<const int32_t> lengths, int64_t training) {
  const Problem p{cell, dtype, math, input_size, hidden_size, num_layers, bidirectional, batch,
                  time, algo, lengths.begin(), static_cast<int64_t>(lengths.size()), training};
  JAXFUSE_TRY(validate(p));
  JAXFUSE_TRY(check_data(p, {{"x", &x, p.x_count()}, {"hx", &hx, p.h_count()},
                             {"y", &*y, p.y_count()}, {"hy", &*hy, p.h_count()}}));
  if (p.lstm()) JAXFUSE_TRY(check_data(p, {{"cx", &cx, p.h_count()}, {"cy", &*cy, p.h_count()}}));
  Call call;
  JAXFUSE_TRY(prepare(p, call));
  JAXFUSE_TRY(check_type(p, "w", w));
  JAXFUSE_TRY(check_bytes("w", w, call.weight_bytes, true));
  JAXFUSE_TRY(check_bytes("workspace", *workspace, call.workspace_bytes, false));
  JAXFUSE_TRY(check_bytes("reserve", *reserve, call.reserve_bytes, false));
  JAXFUSE_CUDNN(cudnnSetStream, call.handle, stream);
  // cuDNN takes sequence lengths from the host array in the data descriptors, not the device.
  JAXFUSE_CUDNN(cudnnRNNForward, call.handle, call.rnn.raw, p.mode(), nullptr, call.x.raw,
                x.untyped_data(), call.y.raw, y->untyped_data(), call.h.raw, hx.untyped_data(),
                hy->untyped_data(), call.h.raw, p.lstm() ? cx.untyped_data() : nullptr,
                p.lstm() ? cy->untyped_data() : nullptr, call.weight_bytes, w.untyped_data(),
                call.workspace_bytes, workspace->untyped_data(), call.reserve_bytes,
                training ? reserve->untyped_data() : nullptr);
  return ffi::Error::Success();
}

ffi::Error RnnBackwardImpl(cudaStream_t stream, Buffer dy, Buffer dhy, Buffer dcy, Buffer x,
                           Buffer hx, Buffer cx, Buffer w, Buffer y,
                           Buffer /*reserve: the memory of reserve_out*/, Output dx, Output dhx,
                           Output dcx, Output dw, Output reserve_out, Output workspace,
                           int64_t cell, int64_t dtype, int64_t math, int64_t input_size,
                           int64_t hidden_size, int64_t num_layers, int64_t bidirectional,
                           int64_t batch, int64_t time, int64_t algo,
                           ffi::Span<const int32_t> lengths) {
  const Problem p{cell, dtype, math, input_size, hidden_size, num_layers, bidirectional, batch,
                  time, algo, lengths.begin(), static_cast<int64_t>(lengths.size()), 1};
  JAXFUSE_TRY(validate(p));
  JAXFUSE_TRY(check_data(p, {{"dy", &dy, p.y_count()}, {"dhy", &dhy, p.h_count()},
                             {"x", &x, p.x_count()}, {"hx", &hx, p.h_count()},
                             {"y", &y, p.y_count()}, {"dx", &*dx, p.x_count()},
                             {"dhx", &*dhx, p.h_count()}}));
  if (p.lstm())
    JAXFUSE_TRY(check_data(p, {{"dcy", &dcy, p.h_count()}, {"cx", &cx, p.h_count()},
                               {"dcx", &*dcx, p.h_count()}}));
  Call call;
  JAXFUSE_TRY(prepare(p, call));
  JAXFUSE_TRY(check_type(p, "w", w));
  JAXFUSE_TRY(check_type(p, "dw", *dw));
  JAXFUSE_TRY(check_bytes("w", w, call.weight_bytes, true));
  JAXFUSE_TRY(check_bytes("dw", *dw, call.weight_bytes, true));
  JAXFUSE_TRY(check_bytes("workspace", *workspace, call.workspace_bytes, false));
  JAXFUSE_TRY(check_bytes("reserve", *reserve_out, call.reserve_bytes, false));
  void* const reserve = reserve_out->untyped_data();
  JAXFUSE_CUDNN(cudnnSetStream, call.handle, stream);
  // The data gradient first: it rewrites the reserve into what the weight gradient reads.
  JAXFUSE_CUDNN(cudnnRNNBackwardData_v8, call.handle, call.rnn.raw, nullptr, call.y.raw,
                y.untyped_data(), dy.untyped_data(), call.x.raw, dx->untyped_data(), call.h.raw,
                hx.untyped_data(), dhy.untyped_data(), dhx->untyped_data(), call.h.raw,
                p.lstm() ? cx.untyped_data() : nullptr, p.lstm() ? dcy.untyped_data() : nullptr,
                p.lstm() ? dcx->untyped_data() : nullptr, call.weight_bytes, w.untyped_data(),
                call.workspace_bytes, workspace->untyped_data(), call.reserve_bytes, reserve);
  // cuDNN only accumulates weight gradients into dw, so it starts from zero.
  const cudaError_t err = cudaMemsetAsync(dw->untyped_data(), 0, call.weight_bytes, stream);
  if (err != cudaSuccess) return internal("cudaMemsetAsync", cudaGetErrorString(err));
  JAXFUSE_CUDNN(cudnnRNNBackwardWeights_v8, call.handle, call.rnn.raw, CUDNN_WGRAD_MODE_ADD,
                nullptr, call.x.raw, x.untyped_data(), call.h.raw, hx.untyped_data(), call.y.raw,
                y.untyped_data(), call.weight_bytes, dw->untyped_data(), call.workspace_bytes,
                workspace->untyped_data(), call.reserve_bytes, reserve);
  return ffi::Error::Success();
}

// The attributes both handlers share, in the order their implementations take them.
template <typename Binding>
auto with_problem(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("cell")
      .template Attr<int64_t>("dtype")
      .template Attr<int64_t>("math")
      .template Attr<int64_t>("input_size")
      .template Attr<int64_t>("hidden_size")
      .template Attr<int64_t>("num_layers")
      .template Attr<int64_t>("bidirectional")
      .template Attr<int64_t>("batch")
      .template Attr<int64_t>("time")
      .template Attr<int64_t>("algo")
      .template Attr<ffi::Span<const int32_t>>("lengths");
}

}  // namespace
}  // namespace jaxfuse

// Neither handler syncs with the host or allocates, so XLA may capture them into CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfuseCudnnRnnForward, jaxfuse::RnnForwardImpl,
    jaxfuse::with_problem(xla::ffi::Ffi::Bind()
                              .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                              .Arg<xla::ffi::AnyBuffer>()   // x
                              .Arg<xla::ffi::AnyBuffer>()   // hx
                              .Arg<xla::ffi::AnyBuffer>()   // cx
                              .Arg<xla::ffi::AnyBuffer>()   // w
                              .Ret<xla::ffi::AnyBuffer>()   // y
                              .Ret<xla::ffi::AnyBuffer>()   // hy
                              .Ret<xla::ffi::AnyBuffer>()   // cy
                              .Ret<xla::ffi::AnyBuffer>()   // reserve
                              .Ret<xla::ffi::AnyBuffer>())  // workspace
        .Attr<int64_t>("training"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfuseCudnnRnnBackward, jaxfuse::RnnBackwardImpl,
    jaxfuse::with_problem(xla::ffi::Ffi::Bind()
                              .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                              .Arg<xla::ffi::AnyBuffer>()    // dy
                              .Arg<xla::ffi::AnyBuffer>()    // dhy
                              .Arg<xla::ffi::AnyBuffer>()    // dcy
                              .Arg<xla::ffi::AnyBuffer>()    // x
                              .Arg<xla::ffi::AnyBuffer>()    // hx
                              .Arg<xla::ffi::AnyBuffer>()    // cx
                              .Arg<xla::ffi::AnyBuffer>()    // w
                              .Arg<xla::ffi::AnyBuffer>()    // y
                              .Arg<xla::ffi::AnyBuffer>()    // reserve
                              .Ret<xla::ffi::AnyBuffer>()    // dx
                              .Ret<xla::ffi::AnyBuffer>()    // dhx
                              .Ret<xla::ffi::AnyBuffer>()    // dcx
                              .Ret<xla::ffi::AnyBuffer>()    // dw
                              .Ret<xla::ffi::AnyBuffer>()    // reserve_out
                              .Ret<xla::ffi::AnyBuffer>()),  // workspace
    {xla::ffi::Traits::kCmdBufferCompatible});

// For the Python side, which sizes the buffers at trace time: the bytes of the workspace, the
// reserve (0 for inference) and the weight space of this RNN on the current device. Returns 0,
// or nonzero with a NUL-terminated message in `error`.
extern "C" int jaxfuse_cudnn_rnn_sizes(int64_t cell, int64_t dtype, int64_t math,
                                       int64_t input_size, int64_t hidden_size,
                                       int64_t num_layers, int64_t bidirectional, int64_t batch,
                                       int64_t time, int64_t algo, const int32_t* lengths,
                                       int64_t training,
                                       uint64_t* workspace_bytes, uint64_t* reserve_bytes,
                                       uint64_t* weight_bytes, char* error, int64_t error_size) {
  // A null array holds no lengths, which validate reports.
  const jaxfuse::Problem p{cell,  dtype, math,   input_size, hidden_size, num_layers,
                           bidirectional, batch, time, algo, lengths,
                           lengths == nullptr ? 0 : batch, training};
  jaxfuse::Call call;
  xla::ffi::Error status = jaxfuse::validate(p);
  if (status.success()) status = jaxfuse::create_handles();
  if (status.success()) status = jaxfuse::prepare(p, call);
  if (status.success()) {
    *workspace_bytes = call.workspace_bytes;
    *reserve_bytes = call.reserve_bytes;
    *weight_bytes = call.weight_bytes;
    return 0;
  }
  if (error != nullptr && error_size > 0)
    std::snprintf(error, static_cast<size_t>(error_size), "%s", status.message().c_str());
  return 1;
}
