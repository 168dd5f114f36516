#pragma once
// Development switches of the CUDA backend: kernels and paths kept beside the default for before /
// after measurements (STRATA_CUDA_*, docs/cuda.md), each read from the environment once and
// overridable by tests. Host code only (included by .cu and .cpp files alike).
#include <atomic>
#include <cstdlib>

namespace strata::cuda::detail {

/// One integer switch: the value `parse` gives for the environment variable `name` (read on first
/// use, thread-safe), unless a test set an override. parse receives the variable's text, or
/// nullptr when it is unset, and returns the mode (any int but kUnset). Define one at namespace
/// scope; the constexpr constructor makes it constant-initialized (C++17: the .cu files' dialect),
/// so it is usable from other static initializers, for example
///   EnvSwitch g_x1{"STRATA_CUDA_Q8_X1", off_if_zero};
class EnvSwitch {
 public:
  static constexpr int kUnset = -0x7fffffff;
  constexpr EnvSwitch(const char* name, int (*parse)(const char*)) : name_(name), parse_(parse) {}
  EnvSwitch(const EnvSwitch&) = delete;
  EnvSwitch& operator=(const EnvSwitch&) = delete;

  /// The override when set, else the environment's mode.
  int get() const {
    const int o = override_.load(std::memory_order_relaxed);
    if (o != kUnset) return o;
    int v = env_.load(std::memory_order_relaxed);
    if (v == kUnset) {
      v = parse_(std::getenv(name_));
      int expected = kUnset;
      if (!env_.compare_exchange_strong(expected, v, std::memory_order_relaxed)) v = expected;
    }
    return v;
  }
  /// Overrides the environment with `mode` (tests); clear() returns to the environment's mode.
  void set(int mode) { override_.store(mode, std::memory_order_relaxed); }
  void clear() { override_.store(kUnset, std::memory_order_relaxed); }

 private:
  const char* name_;
  int (*parse_)(const char*);
  mutable std::atomic<int> env_{kUnset};
  std::atomic<int> override_{kUnset};
};

/// parse for on-by-default switches: 0 when the variable is exactly "0", else 1.
inline int off_if_zero(const char* v) { return v && v[0] == '0' && v[1] == '\0' ? 0 : 1; }
/// parse for off-by-default switches: 1 when the variable is set, non-empty and not "0", else 0.
inline int on_if_set(const char* v) { return v && v[0] && !(v[0] == '0' && v[1] == '\0') ? 1 : 0; }

}  // namespace strata::cuda::detail
