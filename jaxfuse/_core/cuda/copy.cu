// Device-to-device copies for the bench's bandwidth ceiling: the driver's own copy
// (cudaMemcpyAsync) and a plain streaming kernel whose shape is chosen per run, so that the
// ceiling a kernel is judged against is the best copy this GPU does, not one compiler's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxfuse {
namespace {

// Each thread keeps `Unroll` 16-byte vectors in flight before storing any: the loads of one
// iteration overlap, which is what a copy needs to cover DRAM latency.
template <int Unroll, bool Streaming>
__global__ void copy_vectors(const uint4* __restrict__ src, uint4* __restrict__ dst,
                             int64_t vectors) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * Unroll;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x * Unroll + threadIdx.x; base < vectors;
       base += stride) {
    uint4 held[Unroll];
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      int64_t i = base + int64_t(u) * blockDim.x;
      if (i < vectors) held[u] = __ldcs(src + i);
    }
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      int64_t i = base + int64_t(u) * blockDim.x;
      if (i < vectors) {
        if constexpr (Streaming) {
          __stcs(dst + i, held[u]);
        } else {
          dst[i] = held[u];
        }
      }
    }
  }
}

__global__ void copy_tail(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                          int64_t from, int64_t bytes) {
  int64_t i = from + threadIdx.x;
  if (i < bytes) dst[i] = src[i];
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(what) + ": " + cudaGetErrorString(err));
}

ffi::Error MemcpyImpl(cudaStream_t stream, ffi::AnyBuffer src,
                      ffi::Result<ffi::AnyBuffer> dst) {
  return cuda_error("cudaMemcpyAsync", cudaMemcpyAsync(dst->untyped_data(), src.untyped_data(),
                                                       src.size_bytes(),
                                                       cudaMemcpyDeviceToDevice, stream));
}

template <int Unroll, bool Streaming>
void launch(const uint4* src, uint4* dst, int64_t vectors, int threads, int ctas,
            cudaStream_t stream) {
  copy_vectors<Unroll, Streaming><<<ctas, threads, 0, stream>>>(src, dst, vectors);
}

ffi::Error CopyImpl(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst,
                    int64_t unroll, int64_t ctas_per_sm, int64_t streaming) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int threads = 256;
  const int64_t bytes = src.size_bytes();
  const int64_t vectors = bytes / 16;
  const int64_t needed = (vectors + int64_t(threads) * unroll - 1) / (threads * unroll);
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed,
                                                                            sms * ctas_per_sm)));
  auto s = static_cast<const uint4*>(src.untyped_data());
  auto d = static_cast<uint4*>(dst->untyped_data());
  if (vectors > 0) {
    switch (unroll * 2 + (streaming != 0)) {
      case 2: launch<1, false>(s, d, vectors, threads, ctas, stream); break;
      case 3: launch<1, true>(s, d, vectors, threads, ctas, stream); break;
      case 4: launch<2, false>(s, d, vectors, threads, ctas, stream); break;
      case 5: launch<2, true>(s, d, vectors, threads, ctas, stream); break;
      case 8: launch<4, false>(s, d, vectors, threads, ctas, stream); break;
      case 9: launch<4, true>(s, d, vectors, threads, ctas, stream); break;
      case 16: launch<8, false>(s, d, vectors, threads, ctas, stream); break;
      case 17: launch<8, true>(s, d, vectors, threads, ctas, stream); break;
      default:
        return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                          "jaxfuse_copy: unroll must be 1, 2, 4 or 8, got " +
                              std::to_string(unroll));
    }
  }
  if (bytes > vectors * 16) {
    copy_tail<<<1, 16, 0, stream>>>(static_cast<const uint8_t*>(src.untyped_data()),
                                    static_cast<uint8_t*>(dst->untyped_data()), vectors * 16,
                                    bytes);
  }
  return cuda_error("jaxfuse_copy", cudaGetLastError());
}

}  // namespace
}  // namespace jaxfuse

// These handlers launch only on XLA's stream and allocate nothing, so XLA may capture them
// into the CUDA graphs it runs a jitted program's kernels from.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMemcpy, jaxfuse::MemcpyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseCopy, jaxfuse::CopyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("unroll")
                                  .Attr<int64_t>("ctas_per_sm")
                                  .Attr<int64_t>("streaming"),
    {ffi::Traits::kCmdBufferCompatible});
