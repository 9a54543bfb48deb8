// Exact top-k by magnitude in linear time: a radix select on the bits of
// |x| (for finite floats, their order as unsigned integers is the order of
// the magnitudes), 16 bits at a time, then one pass that takes every index
// above the threshold and, at the threshold, the lowest indices first.
// Inputs must be finite. Not thread-safe per Selector (it reuses buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace xd::detail {

class TopKSelector {
 public:
  // The indices of the k largest |x[i]| (ties: lower i first), ascending.
  void select(const float* x, size_t n, size_t k, std::vector<uint32_t>* indices);

 private:
  std::vector<uint32_t> histogram_;
};

}  // namespace xd::detail
