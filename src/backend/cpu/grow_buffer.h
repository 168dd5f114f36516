#pragma once
// A grow-only array for scratch that is written before it is read.
#include <algorithm>
#include <cstddef>
#include <memory>
#include <type_traits>

namespace strata::cpu {

/// At least size() elements of a trivially copyable T, grown (never shrunk) by grow(), whose new
/// elements are left uninitialized. Unlike std::vector::resize, growing neither zero-fills nor
/// touches the memory, so its pages fault in where a parallel loop first writes them, on every
/// thread, instead of on the calling thread alone: a serial part of prefill (docs/kernels.md,
/// "Serial parts of prefill"). Copies are deep (size() elements); == compares size and elements.
template <class T>
class GrowBuffer {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  GrowBuffer() = default;
  GrowBuffer(const GrowBuffer& o) : p_(o.n_ ? new T[o.n_] : nullptr), n_(o.n_) {
    std::copy_n(o.p_.get(), n_, p_.get());
  }
  GrowBuffer& operator=(const GrowBuffer& o) {
    if (this != &o) *this = GrowBuffer(o);
    return *this;
  }
  GrowBuffer(GrowBuffer&&) noexcept = default;
  GrowBuffer& operator=(GrowBuffer&&) noexcept = default;

  /// At least n elements; a growth does not keep the old contents. Throws std::bad_alloc.
  T* grow(size_t n) {
    if (n > n_) {
      p_.reset();  // the old block goes first: peak memory is the new size, not both
      p_.reset(new T[n]);
      n_ = n;
    }
    return p_.get();
  }
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_[i]; }
  const T& operator[](size_t i) const { return p_[i]; }
  bool operator==(const GrowBuffer& o) const { return n_ == o.n_ && std::equal(p_.get(), p_.get() + n_, o.p_.get()); }

 private:
  std::unique_ptr<T[]> p_;
  size_t n_ = 0;
};

}  // namespace strata::cpu
