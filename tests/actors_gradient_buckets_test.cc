// The dense-gradient all-reduce in buckets (FSMoE Sec. 5) gives the sums of
// one all-reduce of the whole buffer, whether the buckets run on their own
// thread while the caller goes on or one after another at the end.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <thread>

#include "actors/detail/dense_all_reduce.h"
#include "actors/detail/gradient_buckets.h"
#include "common/rng.h"
#include "local_transports.h"
#include "transport/communicator.h"
#include "transport/transport.h"

namespace xd {
namespace {

constexpr int kWorld = 4;  // 2 groups of 2: inner pairs, outer pairs

struct Cluster {
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<std::unique_ptr<Communicator>> inner, outer;
  Cluster() : transports(testing::local_transports(kWorld)) {
    for (int r = 0; r < kWorld; ++r) {
      inner.push_back(std::make_unique<Communicator>(transports[r].get(), std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}));
      outer.push_back(std::make_unique<Communicator>(transports[r].get(), std::vector<int>{r % 2, r % 2 + 2}));
    }
  }
};

std::vector<float> gradients(int rank, size_t n) {
  Rng rng(100 + rank);
  std::vector<float> g(n);
  for (float& v : g) v = static_cast<float>(rng.normal());
  return g;
}

void expect_buckets_equal_one_all_reduce(bool overlapped, bool bf16) {
  const size_t n = 10000;
  // Ranges as a model lays them out: uneven, one bucket of two pieces, a
  // hole (routed experts) the buckets must leave alone; more buckets than
  // threads (a deep model), so that some share one; and an empty one.
  std::vector<detail::GradientBuckets::Ranges> buckets = {{{9000, 10000}}, {{0, 10}, {5000, 9000}}, {}};
  for (size_t begin = 10; begin < 4000; begin += 399) buckets.push_back({{begin, std::min<size_t>(begin + 399, 4000)}});
  XD_CHECK(buckets.size() > size_t(kDenseBucketThreads));
  Cluster cluster;
  std::vector<std::vector<float>> expected(kWorld), got(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] {
      const detail::DenseWirePrecision precision{bf16, bf16};
      // One all-reduce of every bucketed float, in bucket order.
      std::vector<float> g = gradients(r, n), flat;
      for (const auto& ranges : buckets)
        for (auto [b, e] : ranges) flat.insert(flat.end(), g.begin() + b, g.begin() + e);
      XD_CHECK(detail::dense_all_reduce(cluster.inner[r].get(), cluster.outer[r].get(), precision,
                                        CollectiveTag(0, kNoLayer, 1), flat.data(), flat.size()).is_ok());
      expected[r] = g;
      size_t k = 0;
      for (const auto& ranges : buckets)
        for (auto [b, e] : ranges)
          for (size_t i = b; i < e; ++i) expected[r][i] = flat[k++] * 0.25f;

      detail::GradientBuckets gb(cluster.inner[r].get(), cluster.outer[r].get(), precision, buckets, overlapped,
                                 nullptr);
      got[r] = gradients(r, n);
      for (int b = 0; b < gb.num_buckets(); ++b) gb.start(1, b, got[r].data());
      XD_CHECK(gb.finish(1, got[r].data(), 0.25f).is_ok());
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    if (bf16) {
      // Which member owns (and sums in fp32) an element depends on where the
      // buffer is cut, so bf16 sums agree to bf16 rounding, not to the bit.
      double worst = 0;
      for (size_t i = 0; i < n; ++i) worst = std::max(worst, double(std::abs(got[r][i] - expected[r][i])));
      EXPECT_LT(worst, 0.05) << "rank " << r;  // sums of 4 unit normals, 8-bit mantissas
      EXPECT_EQ(got[r][4500], expected[r][4500]);
    } else {
      EXPECT_EQ(got[r], expected[r]) << "rank " << r;
    }
  }
  // Untouched: the hole between the buckets' ranges keeps the local values.
  EXPECT_EQ(got[0][4500], gradients(0, n)[4500]);
  EXPECT_NE(got[0][100], gradients(0, n)[100]);
}

// bf16 on the wire, fp32 sums (MegaScale-MoE Sec. 5), against the exact sums
// in double: within bf16's rounding of each partial and of the result, the
// same bits on every rank. Inner pairs with 2 outer members (the outer
// stage in one round) and with 4 outer members and a shard past the
// one-round limit (a bf16 reduce-scatter, fp32 sums, a bf16 all-gather).
TEST(DenseAllReduce, Bf16SumsAreTheExactSumsToBf16PrecisionOnEveryPathAndTheSameBitsEverywhere) {
  for (const auto& [world, n] : {std::pair<int, size_t>{4, 10000}, {8, 40000}}) {
    const int outer_size = world / 2;
    auto transports = testing::local_transports(world);
    std::vector<std::unique_ptr<Communicator>> inner, outer;
    for (int r = 0; r < world; ++r) {
      inner.push_back(std::make_unique<Communicator>(transports[r].get(), std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}));
      std::vector<int> across;
      for (int o = 0; o < outer_size; ++o) across.push_back(r % 2 + 2 * o);
      outer.push_back(std::make_unique<Communicator>(transports[r].get(), across));
    }
    const size_t shard_bytes = n / 2 * sizeof(float);
    EXPECT_EQ(Communicator::one_shot_all_reduce(outer_size, shard_bytes), world == 4) << "the path this case takes";
    std::vector<std::vector<float>> got(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        got[r] = gradients(r, n);
        XD_CHECK(detail::dense_all_reduce(inner[r].get(), outer[r].get(), detail::DenseWirePrecision{true, true},
                                          CollectiveTag(0, kNoLayer, 1), got[r].data(), n).is_ok());
      });
    for (auto& t : threads) t.join();
    std::vector<std::vector<float>> g(world);
    for (int r = 0; r < world; ++r) g[r] = gradients(r, n);
    double worst = 0;  // |got - exact| over the bound
    for (size_t i = 0; i < n; ++i) {
      double exact = 0, magnitude = 0;
      for (int r = 0; r < world; ++r) exact += g[r][i], magnitude += std::abs(g[r][i]);
      // Each partial and each stage's sum rounded to 8 mantissa bits once.
      const double bound = 3 * std::ldexp(magnitude, -8);
      worst = std::max(worst, std::abs(got[0][i] - exact) / bound);
    }
    std::printf("[dense bf16] %d ranks, %zu floats: worst error %.2f of the bound\n", world, n, worst);
    EXPECT_LE(worst, 1.0) << world << " ranks";
    EXPECT_GT(worst, 0.0) << "bf16 rounds something";
    for (int r = 1; r < world; ++r)
      EXPECT_EQ(0, std::memcmp(got[r].data(), got[0].data(), n * sizeof(float))) << "rank " << r << " of " << world;
  }
}

TEST(GradientBuckets, OverlappedBucketsGiveTheSumsOfOneAllReduce) { expect_buckets_equal_one_all_reduce(true, false); }
TEST(GradientBuckets, BucketsRunAtTheEndGiveTheSumsOfOneAllReduce) { expect_buckets_equal_one_all_reduce(false, false); }
TEST(GradientBuckets, Bf16BucketsGiveTheSumsOfOneBf16AllReduce) { expect_buckets_equal_one_all_reduce(true, true); }

// Two members all-reduce in one round (Communicator::one_shot_all_reduce):
// one message each way, no reduce-scatter, the same bits on both; a third
// member and a large buffer keep the two rounds.
TEST(OneShotAllReduce, TwoMembersSendOneMessageEachAndHoldTheSameBits) {
  EXPECT_TRUE(Communicator::one_shot_all_reduce(2, size_t(1) << 20));
  EXPECT_FALSE(Communicator::one_shot_all_reduce(2, size_t(64) << 20));
  EXPECT_TRUE(Communicator::one_shot_all_reduce(4, 16 << 10));
  EXPECT_FALSE(Communicator::one_shot_all_reduce(4, 32 << 10));
  Cluster cluster;
  const size_t n = 30000;  // 120 KB: a reduce-scatter would have been worth it for more members
  std::vector<std::vector<float>> got(kWorld);
  std::vector<TransportStats> before(kWorld);
  for (int r = 0; r < kWorld; ++r) before[r] = cluster.transports[r]->stats();
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] {
      got[r] = gradients(r, n);
      XD_CHECK(cluster.outer[r]->all_reduce(CollectiveTag(3, kNoLayer, 1), got[r].data(), n).wait().is_ok());
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    const int peer = r < 2 ? r + 2 : r - 2;  // outer pairs {0, 2}, {1, 3}
    const std::vector<float> mine = gradients(r, n), theirs = gradients(peer, n);
    for (size_t k = 0; k < n; ++k) ASSERT_EQ(got[r][k], mine[k] + theirs[k]) << "rank " << r << " element " << k;
    const TransportStats after = cluster.transports[r]->stats();
    const auto sent = [&](MessageKind kind) {
      return after.messages_sent_by_kind[(int)kind] - before[r].messages_sent_by_kind[(int)kind];
    };
    EXPECT_EQ(sent(MessageKind::kAllReduce), 1u) << "rank " << r;
    EXPECT_EQ(sent(MessageKind::kReduceScatter), 0u) << "rank " << r;
  }
}

// The gradient norm's sum (DistributedTrainer::reduce_dense_gradients): the
// same bits everywhere, a NaN from one worker reaching all.
TEST(HierarchicalSum, EveryWorkerGetsTheSameBitsOfTheSumAndANanReachesAll) {
  Cluster cluster;
  for (bool with_nan : {false, true}) {
    std::vector<double> got(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r)
      threads.emplace_back([&, r] {
        got[r] = with_nan && r == 2 ? std::nan("") : 0.1 * (r + 1) + 1e-17 * r;
        XD_CHECK(hierarchical_sum(cluster.inner[r].get(), cluster.outer[r].get(),
                                  CollectiveTag(with_nan ? 2 : 1, kNoLayer, 3), &got[r]).wait().is_ok());
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < kWorld; ++r) {
      if (with_nan) {
        EXPECT_TRUE(std::isnan(got[r])) << "rank " << r;
      } else {
        EXPECT_EQ(std::memcmp(&got[r], &got[0], sizeof(double)), 0) << "rank " << r;
        EXPECT_NEAR(got[r], 0.1 + 0.2 + 0.3 + 0.4, 1e-15);
      }
    }
  }
}

}  // namespace
}  // namespace xd
