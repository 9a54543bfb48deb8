// Token-row permutations for the MoE exchange: a new buffer with the rows of
// another in a given order, written once (no zero fill before the copy; the
// exchange moves every token row several times a layer). Pure functions.
#pragma once

#include <cstddef>
#include <vector>

#include "common/check.h"

namespace xd::detail {

// Row k of the result is row order[k] of `src` (rows of `width` floats).
inline std::vector<float> rows_gathered(const float* src, const std::vector<int>& order, int width) {
  std::vector<float> out;
  out.reserve(order.size() * (size_t)width);
  for (int from : order) out.insert(out.end(), src + (size_t)from * width, src + (size_t)(from + 1) * width);
  return out;
}

// Whether `order` leaves every row where it is (0, 1, 2, ...): then a
// permutation can hand its buffer on instead of copying it.
inline bool is_identity(const std::vector<int>& order) {
  for (size_t k = 0; k < order.size(); ++k)
    if (order[k] != static_cast<int>(k)) return false;
  return true;
}

// The inverse permutation of `order`: inverse[order[k]] = k.
inline std::vector<int> inverse_order(const std::vector<int>& order) {
  std::vector<int> inverse(order.size(), -1);
  for (size_t k = 0; k < order.size(); ++k) {
    XD_CHECK(order[k] >= 0 && (size_t)order[k] < order.size() && inverse[order[k]] < 0);
    inverse[order[k]] = static_cast<int>(k);
  }
  return inverse;
}

// Row order[k] of the result is row k of `src`; `order` is a permutation.
inline std::vector<float> rows_scattered(const float* src, const std::vector<int>& order, int width) {
  return rows_gathered(src, inverse_order(order), width);
}

// Row order[k] of the result is the `width` floats at rows[k]: the rows of
// several buffers scattered in one copy, without first joining them.
inline std::vector<float> rows_scattered(const std::vector<const float*>& rows, const std::vector<int>& order,
                                         int width) {
  XD_CHECK(rows.size() == order.size());
  std::vector<float> out;
  out.reserve(order.size() * (size_t)width);
  for (int k : inverse_order(order)) out.insert(out.end(), rows[k], rows[k] + width);
  return out;
}

}  // namespace xd::detail
