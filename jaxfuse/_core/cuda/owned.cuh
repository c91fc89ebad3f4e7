// A vendor library's descriptor (cuDNN's, cuBLASLt's) that its Destroy function releases on
// every exit path.
#pragma once

namespace jaxfuse {

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
