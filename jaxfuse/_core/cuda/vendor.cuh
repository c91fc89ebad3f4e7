// What the vendor libraries' bindings (cuDNN's RNN, cuBLASLt's products) share: a descriptor
// released on every exit path, and a step whose failure returns from the handler.
#pragma once

#include "xla/ffi/api/ffi.h"

// Returns the error of a failed step from the enclosing function.
#define JAXFUSE_TRY(step)                \
  do {                                   \
    ::xla::ffi::Error error_ = (step);   \
    if (error_.failure()) return error_; \
  } while (0)

namespace jaxfuse {

// A vendor library's descriptor that its Destroy function releases on every exit path.
template <typename T, auto Destroy>
struct Owned {
  T raw = nullptr;

  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (raw != nullptr) Destroy(raw);
  }
};

}  // namespace jaxfuse
