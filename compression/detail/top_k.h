// Exact top-k by magnitude in linear time. For finite floats the bits of |x|
// as unsigned integers order like the magnitudes. A small k of a large tensor
// takes one pass: a strided sample estimates a key that about 1.5 k elements
// exceed, one pass collects them (four at a time), and the exact k-th key is
// selected among those (a histogram of the keys' top bits, then the one bin
// that holds it). Otherwise (or when the estimate lets fewer than k through) a radix
// select on the key, 16 bits at a time. Either way one last pass takes every
// index above the threshold and, at the threshold, the lowest indices first.
// Inputs must be finite. Not thread-safe per Selector (it reuses buffers).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace xd::detail {

// How many of n entries (topk) or blocks (block_sign) a density keeps: at
// least one of a non-empty tensor or row, at most n.
inline uint64_t kept_count(double density, uint64_t n) {
  if (n == 0) return 0;
  const double k = std::ceil(density * static_cast<double>(n) - 1e-9);
  return std::min<uint64_t>(n, std::max<uint64_t>(1, static_cast<uint64_t>(k)));
}

class TopKSelector {
 public:
  // The indices of the k largest |x[i]| (ties: lower i first), ascending.
  void select(const float* x, size_t n, size_t k, std::vector<uint32_t>* indices);

 private:
  std::vector<uint32_t> histogram_, sample_, candidates_, keys_, bin_;
};

}  // namespace xd::detail
