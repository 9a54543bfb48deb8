// Every router trains the same across real worker processes as in one
// process on the global batch: GShard noisy top-k (whose seeded noise must
// follow each token to its worker), X-MoE, and causal SoftMoE (whose exchange
// moves slot inputs instead of token rows), in EP and in HybridEP.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>

#include "cluster/job_config.h"
#include "job_runner.h"
#include "model/trainer.h"

namespace xd {
namespace {

constexpr int kSteps = 12;

std::string router_job_yaml(const std::string& gating) {
  std::string y = testing::model_yaml();
  std::string extra = "  gating: " + gating + "\n";
  if (gating == "soft_moe") extra += "  soft_moe_slots: 2\n";
  if (gating == "xmoe") extra += "  router_dim: 4\n";
  y.replace(y.find("model:\n"), 7, "model:\n" + extra);
  y.replace(y.find("  steps: 20\n"), 12, "  steps: " + std::to_string(kSteps) + "\n");
  return y + "cluster:\n  levels:\n    - name: dc\n      size: 2\n      link: {bandwidth: 1gbit, latency: 0ms, "
             "shape: false}\n    - name: worker\n      size: 2\n      link: {bandwidth: 10gbit, latency: 0ms, "
             "shape: false}\n  expert_parallel:\n    mode: ep\n    memory_cap: unlimited\n";
}

class RouterDistributed : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(RouterDistributed, TheDistributedRunIsTheOneProcessRun) {
  const auto& [gating, mode] = GetParam();
  const std::string yaml = router_job_yaml(gating);
  auto job = parse_job_config(yaml, "<test>");
  ASSERT_TRUE(job.has_value()) << job.status().to_string();
  auto single = Trainer::create(one_process_equivalent(*job));
  ASSERT_TRUE(single.has_value()) << single.status().to_string();
  std::vector<double> expected;
  for (int i = 0; i < kSteps; ++i) expected.push_back((*single)->step()->loss.loss);

  std::vector<std::string> args = {"--mode", mode};
  if (mode == "hybrid") args.insert(args.end(), {"--domains", "2,1"});
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("xdmoe_router_" + gating + "_" + mode + "_" + std::to_string(::getpid()))).string();
  auto r = testing::run_job(dir, yaml, 4, args);
  ASSERT_TRUE(r.ok()) << r.logs();
  const auto& losses = r.summary["losses"];
  ASSERT_EQ(losses.size(), expected.size());
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double rel = std::abs(losses[i].get<double>() - expected[i]) / std::abs(expected[i]);
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-4) << "step " << i + 1;
  }
  std::printf("[router-dist] %s %s 2x2: %d steps, worst relative loss difference %.2e (final %.5f)\n",
              gating.c_str(), mode.c_str(), kSteps, worst, expected.back());
  EXPECT_LT(expected.back(), expected.front()) << "it trains";
}

INSTANTIATE_TEST_SUITE_P(
    EveryNewRouterInEpAndHybridEp, RouterDistributed,
    ::testing::Combine(::testing::Values("gshard_noisy_topk", "xmoe", "soft_moe"), ::testing::Values("ep", "hybrid")),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

}  // namespace
}  // namespace xd
