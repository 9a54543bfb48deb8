// The routing probe: the rows each worker's first batch sends each expert at
// the job's initial weights, and the A2A imbalance F they give each level of
// a topology (each hop lasts as long as its larger side).
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "cluster/job_config.h"
#include "cluster/topology.h"
#include "coordinator/routing_probe.h"
#include "job_runner.h"

namespace xd {
namespace {

// A probe of `workers` workers, one layer, `experts` experts, with the rows
// given as rows[worker][expert].
RoutingProbe probe_of(const std::vector<std::vector<long long>>& rows) {
  RoutingProbe p;
  p.workers = static_cast<int>(rows.size());
  p.layers = 1;
  p.experts = static_cast<int>(rows[0].size());
  for (const auto& w : rows) p.rows.insert(p.rows.end(), w.begin(), w.end());
  return p;
}

JobConfig small_job() {
  auto job = parse_job_config(testing::model_yaml() +
                                  "cluster:\n  levels:\n    - name: dc\n      size: 2\n"
                                  "      link: {bandwidth: 1gbit, latency: 0ms, shape: false}\n"
                                  "    - name: worker\n      size: 2\n"
                                  "      link: {bandwidth: 10gbit, latency: 0ms, shape: false}\n",
                              "<test>");
  XD_CHECK(job.has_value());
  return *job;
}

TEST(RoutingProbe, AHopLastsAsLongAsItsLargerSide) {
  // Two workers, an expert each. Worker 0 sends 30 rows to worker 1's expert
  // and receives 10: its hop lasts 30 rows; so does worker 1's (10 out, 30 in).
  const RoutingProbe p = probe_of({{5, 30}, {10, 7}});
  const std::vector<double> f = routed_a2a_imbalance(p, Topology({2}, {1}));
  ASSERT_EQ(f.size(), 1u);
  EXPECT_DOUBLE_EQ(f[0], (30.0 + 30.0) / (30.0 + 10.0));
}

TEST(RoutingProbe, RowsSentAsMuchAsReceivedLoadEveryHopEvenly) {
  const RoutingProbe p = probe_of({{4, 4, 4, 4}, {4, 4, 4, 4}, {4, 4, 4, 4}, {4, 4, 4, 4}});
  EXPECT_EQ(routed_a2a_imbalance(p, Topology({2, 2}, {1, 1})), (std::vector<double>{1.0, 1.0}));
}

// Hierarchical EP on 2 x 2 walks the DC level first: a row crosses to the
// worker at its own offset in the owner's DC, then to the owner. Gathered
// at the DC level (domains 2 x 1), no row crosses it.
TEST(RoutingProbe, RowsWalkTheLevelsOuterFirstAndAGatheredLevelCarriesNone) {
  // Worker w owns expert w; ranks 0, 1 are DC 0 and 2, 3 DC 1. Only worker 0
  // sends: 8 rows to expert 3 (DC 1, offset 1) and 2 to expert 1.
  const RoutingProbe p = probe_of({{0, 2, 0, 8}, {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}});
  // DC level: worker 0 -> worker 2 (8 rows): 8 out at 0, 8 in at 2. Worker
  // level: 2 rows 0 -> 1, and 8 rows 2 -> 3.
  EXPECT_EQ(routed_a2a_imbalance(p, Topology({2, 2}, {1, 1})), (std::vector<double>{2.0, 2.0}));
  // Gathered across the DCs: expert 3 is held in DC 0 at offset 1, so worker
  // 0 sends all 10 rows to worker 1.
  EXPECT_EQ(routed_a2a_imbalance(p, Topology({2, 2}, {2, 1})), (std::vector<double>{1.0, 2.0}));
  // Everything gathered: nothing crosses anywhere.
  EXPECT_EQ(routed_a2a_imbalance(p, Topology({2, 2}, {2, 2})), (std::vector<double>{1.0, 1.0}));
}

// Each layer's exchanges wait for the worker whose experts compute the
// most rows. In EP on two workers both send expert 0 three rows and expert
// 1 one: worker 0 computes 6, worker 1 two, the mean 4. Gathered (domains
// of 2), each computes its own 4.
TEST(RoutingProbe, TheBusiestWorkersRowsSetTheExpertComputeImbalance) {
  const RoutingProbe p = probe_of({{3, 1}, {3, 1}});
  const ExpertLoad ep = routed_expert_load(p, Topology({2}, {1}));
  EXPECT_DOUBLE_EQ(ep.layers_busiest, 6.0 / 4.0);
  EXPECT_DOUBLE_EQ(ep.busiest_worker, 6.0 / 4.0);
  const ExpertLoad gathered = routed_expert_load(p, Topology({2}, {2}));
  EXPECT_DOUBLE_EQ(gathered.layers_busiest, 1.0);
  EXPECT_DOUBLE_EQ(gathered.busiest_worker, 1.0);
  // Over layers it is the sum of each layer's busiest over the sum of its
  // means: a second layer routed the other way is busiest on worker 1, and
  // though both workers compute 8 rows a step, each layer waits for 6.
  RoutingProbe two = p;
  two.layers = 2;
  two.rows = {3, 1, 1, 3, 3, 1, 1, 3};  // (worker, layer, expert)
  const ExpertLoad alternating = routed_expert_load(two, Topology({2}, {1}));
  EXPECT_DOUBLE_EQ(alternating.layers_busiest, (6.0 + 6.0) / (4.0 + 4.0));
  EXPECT_DOUBLE_EQ(alternating.busiest_worker, 1.0) << "each worker computes 8 rows of the mean 8";
}

TEST(RoutingProbe, CountsEveryRoutedRowOfEachWorkersFirstBatch) {
  const JobConfig job = small_job();
  const RoutingProbeOptions whole{.max_seconds = 0};  // no time budget: the same sequences every time
  auto probe = probe_routing(job, whole);
  ASSERT_TRUE(probe.has_value()) << probe.status().message();
  const ModelConfig& mc = job.train.model;
  ASSERT_EQ(probe->workers, 4);
  ASSERT_EQ(probe->layers, mc.num_layers);
  ASSERT_EQ(probe->experts, mc.num_experts);
  EXPECT_EQ(probe->tokens_per_worker, static_cast<long long>(job.train.batch_size) * job.train.seq_len);
  bool uneven = false;
  for (int w = 0; w < probe->workers; ++w)
    for (int l = 0; l < probe->layers; ++l) {
      long long sum = 0;
      for (int e = 0; e < probe->experts; ++e) {
        sum += probe->at(w, l, e);
        uneven = uneven || probe->at(w, l, e) != probe->at(w, l, 0);
      }
      EXPECT_EQ(sum, probe->tokens_per_worker * mc.top_k) << "dropless: every token reaches top_k experts";
    }
  EXPECT_TRUE(uneven) << "token-choice routing at initial weights is not uniform";
  // The same job probed again routes the same rows.
  auto again = probe_routing(job, whole);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->rows, probe->rows);
  // A cap on the tokens takes fewer sequences from each worker.
  auto capped = probe_routing(job, RoutingProbeOptions{.max_tokens = 4L * job.train.seq_len, .max_seconds = 0});
  ASSERT_TRUE(capped.has_value());
  EXPECT_EQ(capped->tokens_per_worker, job.train.seq_len);
  // So does a time budget too short for more: one sequence each, not none.
  auto hurried = probe_routing(job, RoutingProbeOptions{.max_seconds = 1e-9});
  ASSERT_TRUE(hurried.has_value());
  EXPECT_EQ(hurried->tokens_per_worker, job.train.seq_len);
  EXPECT_EQ(hurried->rows.size(), probe->rows.size());
}

TEST(RoutingProbe, AModelLargerThanItHoldsOrDataItCannotReadIsAClearError) {
  JobConfig job = small_job();
  auto big = probe_routing(job, RoutingProbeOptions{.max_param_bytes = 1000});
  ASSERT_FALSE(big.has_value());
  EXPECT_NE(big.status().message().find("larger than the routing probe holds"), std::string::npos)
      << big.status().message();
  job.train.data.source = "/nonexistent/xdmoe/corpus.txt";
  auto unread = probe_routing(job);
  ASSERT_FALSE(unread.has_value());
  EXPECT_NE(unread.status().message().find("routing probe"), std::string::npos) << unread.status().message();
}

}  // namespace
}  // namespace xd
