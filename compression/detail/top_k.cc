#include "compression/detail/top_k.h"

#include <bit>

namespace xd::detail {

namespace {
inline uint32_t magnitude_key(float f) { return std::bit_cast<uint32_t>(f) & 0x7fffffffu; }
}  // namespace

void TopKSelector::select(const float* x, size_t n, size_t k, std::vector<uint32_t>* indices) {
  indices->clear();
  if (k == 0 || n == 0) return;
  if (k >= n) {
    indices->resize(n);
    for (size_t i = 0; i < n; ++i) (*indices)[i] = static_cast<uint32_t>(i);
    return;
  }
  // Pass 1: the high 16 bits of the threshold.
  histogram_.assign(1 << 16, 0);
  for (size_t i = 0; i < n; ++i) ++histogram_[magnitude_key(x[i]) >> 16];
  size_t above = 0;  // elements in bins above the threshold's bin
  uint32_t high = 0xffff;
  for (;; --high) {
    if (above + histogram_[high] >= k) break;
    above += histogram_[high];
  }
  // Pass 2: the low 16 bits, among the elements of that bin.
  histogram_.assign(1 << 16, 0);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = magnitude_key(x[i]);
    if ((key >> 16) == high) ++histogram_[key & 0xffff];
  }
  uint32_t low = 0xffff;
  for (;; --low) {
    if (above + histogram_[low] >= k) break;
    above += histogram_[low];
  }
  const uint32_t threshold = (high << 16) | low;
  size_t ties = k - above;  // how many at the threshold are kept
  // Pass 3: everything above the threshold, and the first `ties` at it.
  indices->reserve(k);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = magnitude_key(x[i]);
    if (key > threshold || (key == threshold && ties > 0)) {
      if (key == threshold) --ties;
      indices->push_back(static_cast<uint32_t>(i));
    }
  }
}

}  // namespace xd::detail
