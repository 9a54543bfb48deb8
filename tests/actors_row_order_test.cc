// The MoE exchange's row permutations: scattering the rows of several
// buffers in one copy gives what joining them first and scattering gives.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "actors/detail/row_order.h"
#include "common/rng.h"

namespace xd {
namespace {

TEST(RowOrder, GatheringByAnOrderAndScatteringByItAreInverses) {
  const int width = 3, rows = 7;
  std::vector<float> src(rows * width);
  std::iota(src.begin(), src.end(), 0.0f);
  const std::vector<int> order = {4, 0, 6, 2, 1, 5, 3};
  const std::vector<float> gathered = detail::rows_gathered(src.data(), order, width);
  for (int k = 0; k < rows; ++k)
    for (int c = 0; c < width; ++c) EXPECT_EQ(gathered[k * width + c], src[order[k] * width + c]);
  EXPECT_EQ(detail::rows_scattered(gathered.data(), order, width), src);
}

TEST(RowOrder, RowsOfSeveralBuffersScatterInOneCopyAsIfJoinedFirst) {
  const int width = 5;
  Rng rng(7);
  // Three members' rows, one of them empty, as a hop receives them.
  std::vector<std::vector<float>> members = {std::vector<float>(4 * width), {}, std::vector<float>(6 * width)};
  std::vector<float> joined;
  std::vector<const float*> row_pointers;
  for (std::vector<float>& m : members) {
    for (float& v : m) v = static_cast<float>(rng.normal());
    joined.insert(joined.end(), m.begin(), m.end());
    for (size_t r = 0; r < m.size() / width; ++r) row_pointers.push_back(m.data() + r * width);
  }
  std::vector<int> order(row_pointers.size());
  std::iota(order.begin(), order.end(), 0);
  for (size_t k = order.size() - 1; k > 0; --k) std::swap(order[k], order[rng.next_u64() % (k + 1)]);
  const std::vector<float> expected = detail::rows_scattered(joined.data(), order, width);
  EXPECT_EQ(detail::rows_scattered(row_pointers, order, width), expected);
  EXPECT_EQ(detail::rows_scattered(std::vector<const float*>{}, {}, width), std::vector<float>{});
}

}  // namespace
}  // namespace xd
