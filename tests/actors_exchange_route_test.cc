// A backward exchange carrying several forward chunks follows their routes
// merged (actors/detail/exchange_route.h): to each member the chunks' rows go
// one chunk after the other, and at the end each computed expert's rows come
// chunk after chunk.
#include <gtest/gtest.h>

#include <vector>

#include "actors/detail/exchange_route.h"

namespace xd {
namespace {

using detail::ExchangeHop;
using detail::ExchangeRoute;

// One level of two members; this worker is member 0.
ExchangeRoute chunk_a() {
  ExchangeRoute r;
  r.rows_in = 3;
  r.counts_in = {2, 1};
  r.hops = {ExchangeHop{{2, 0, 1}, {1, 2}, {1, 1}}};  // row 2 stays, rows 0 and 1 go to member 1
  r.final_order = {1, 0};                              // the row from member 1 is expert 0's
  r.out_counts = {1, 1};
  return r;
}

ExchangeRoute chunk_b() {
  ExchangeRoute r;
  r.rows_in = 2;
  r.counts_in = {0, 2};
  r.hops = {ExchangeHop{{0, 1}, {0, 2}, {0, 3}}};  // both rows go; three come from member 1
  r.final_order = {2, 0, 1};
  r.out_counts = {2, 1};
  return r;
}

TEST(ExchangeRoute, MergedChunksSendEachMembersRowsChunkAfterChunk) {
  const ExchangeRoute a = chunk_a(), b = chunk_b();
  const ExchangeRoute m = detail::merge_routes({&a, &b}, 1);
  EXPECT_EQ(m.rows_in, 5);
  EXPECT_EQ(m.counts_in, (std::vector<int>{2, 1, 0, 2}));
  ASSERT_EQ(m.hops.size(), 1u);
  // b's rows sit at 3 and 4 before the hop; member 1 gets a's two, then b's two.
  EXPECT_EQ(m.hops[0].send_order, (std::vector<int>{2, 0, 1, 3, 4}));
  EXPECT_EQ(m.hops[0].send_counts, (std::vector<int>{1, 4}));
  EXPECT_EQ(m.hops[0].recv_counts, (std::vector<int>{1, 4}));
  // After the hop: a's kept row (0), then from member 1 a's row (1) and b's
  // three (2..4). Expert 0 takes a's row from member 1, then b's third and
  // first; expert 1 a's kept row, then b's second.
  EXPECT_EQ(m.final_order, (std::vector<int>{1, 4, 2, 0, 3}));
  EXPECT_EQ(m.out_counts, (std::vector<int>{3, 2}));
}

TEST(ExchangeRoute, OneChunkMergedIsItsOwnRoute) {
  const ExchangeRoute a = chunk_a();
  const ExchangeRoute m = detail::merge_routes({&a}, 1);
  EXPECT_EQ(m.hops[0].send_order, a.hops[0].send_order);
  EXPECT_EQ(m.hops[0].recv_counts, a.hops[0].recv_counts);
  EXPECT_EQ(m.final_order, a.final_order);
  EXPECT_EQ(m.counts_in, a.counts_in);
}

// A chunk whose Dispatch failed has no hops: the merged route keeps the
// shapes (so the math can finish) and has none either, which the exchange
// reports as a backward exchange without its Dispatch.
TEST(ExchangeRoute, AChunkWithoutItsDispatchLeavesTheMergedRouteWithoutHops) {
  const ExchangeRoute a = chunk_a();
  ExchangeRoute failed;
  failed.rows_in = 2;
  failed.counts_in = {1, 1};
  failed.out_counts = {0, 0};
  const ExchangeRoute m = detail::merge_routes({&a, &failed}, 1);
  EXPECT_TRUE(m.hops.empty());
  EXPECT_TRUE(m.final_order.empty());
  EXPECT_EQ(m.rows_in, 5);
  EXPECT_EQ(m.out_counts, (std::vector<int>{1, 1}));
}

}  // namespace
}  // namespace xd
