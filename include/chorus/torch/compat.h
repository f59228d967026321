// The differences between the libtorch versions chorus builds against, in one place: Debian's 1.13
// (CPU; CI and this project's machines) and PyTorch 2.x (CUDA; the GPU machines). Code elsewhere
// calls these instead of the version-specific API, so that the same sources build against both.
// What differs (docs/gpu.md lists each with the version that changed it):
// - autocast: 1.13 has one function set per device (set_cpu_enabled, set_autocast_gpu_dtype, ...);
//   2.x has device-generic ones and deprecates the old names (a warning at run time);
// - Optimizer::state() is keyed by the parameter's TensorImpl address as text in 1.13, by the
//   address itself from 2.2 on;
// - c10::guts::to_string is gone in 2.x;
// - torch::cuda::device_count() returns size_t in 1.13, a c10::DeviceIndex (int8_t) in 2.x.
// The C++ standard differs too (2.11 needs C++20): the top-level CMakeLists.txt chooses it.
// Internal to chorus's libraries; not part of the API users program against.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <string>
#include <type_traits>

namespace chorus::compat {

inline constexpr bool kTorch2 = TORCH_VERSION_MAJOR >= 2;

inline bool autocast_enabled(c10::DeviceType device) {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                         : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

// The key of parameter p in optimizer.state(), whichever its type.
template <typename Optimizer>
auto optimizer_state_key(Optimizer& optimizer, const at::Tensor& p) {
  using Key = typename std::decay_t<decltype(optimizer.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    return Key(c10::str(p.unsafeGetTensorImpl()));  // 1.13: c10::guts::to_string of the address
  } else {
    return Key(p.unsafeGetTensorImpl());
  }
}

// A number as text (c10::guts::to_string's use for numbers).
template <typename T>
std::string to_string(const T& value) {
  return c10::str(value);
}

}  // namespace chorus::compat
