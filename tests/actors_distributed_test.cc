// Distributed training across real processes gives the arithmetic of one
// process on the global batch: EP, flat EP and HybridEP with every feasible
// domain choice, on 2 x 2 and 4 x 2 layouts.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "cluster/job_config.h"
#include "cluster/topology.h"
#include "coordinator/routing_probe.h"
#include "job_runner.h"
#include "model/distributed_checkpoint.h"
#include "model/safetensors.h"
#include "model/trainer.h"

namespace xd {
namespace {

namespace fs = std::filesystem;

constexpr int kSteps = 20;
constexpr int kBatchPerWorker = 2;

using testing::model_yaml;

std::string cluster_yaml(int dcs, int per_dc) {
  return "cluster:\n  levels:\n    - name: dc\n      size: " + std::to_string(dcs) +
         "\n      link: {bandwidth: 1gbit, latency: 0ms, shape: false}\n    - name: worker\n      size: " +
         std::to_string(per_dc) + "\n      link: {bandwidth: 10gbit, latency: 0ms, shape: false}\n"
         "  expert_parallel:\n    mode: ep\n    memory_cap: unlimited\n";
}

// The same global batch in one process, G x batch sequences per step: the
// one-process equivalent that `xdmoe train` runs for a job config.
std::vector<double> single_process_losses(int world, std::vector<float>* final_params,
                                          std::unique_ptr<Trainer>* keep = nullptr) {
  auto job = parse_job_config(model_yaml() + cluster_yaml(world / 2, 2), "<test>");
  XD_CHECK(job.has_value());
  const TrainConfig tc = one_process_equivalent(*job);
  XD_CHECK(tc.batch_size == kBatchPerWorker * world);
  auto t = Trainer::create(tc);
  XD_CHECK(t.has_value());
  std::vector<double> losses;
  for (int i = 0; i < kSteps; ++i) losses.push_back((*t)->step()->loss.loss);
  if (final_params) *final_params = (*t)->model().params();
  if (keep) *keep = std::move(*t);
  return losses;
}

void expect_same_losses(const testing::JobResult& r, const std::vector<double>& expected, const std::string& label) {
  ASSERT_TRUE(r.ok()) << label << "\n" << r.logs();
  ASSERT_TRUE(r.summary.contains("losses")) << label;
  const auto& losses = r.summary["losses"];
  ASSERT_EQ(losses.size(), expected.size()) << label;
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double rel = std::abs(losses[i].get<double>() - expected[i]) / std::abs(expected[i]);
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-4) << label << " step " << i + 1 << ": " << losses[i].get<double>() << " vs " << expected[i];
  }
  std::printf("[dist] %-28s %d steps, worst relative loss difference %.2e (final %.5f)\n", label.c_str(),
              (int)expected.size(), worst, expected.back());
}

std::string temp_dir(const std::string& name) {
  return (fs::temp_directory_path() / ("xdmoe_dist_" + name + "_" + std::to_string(::getpid()))).string();
}

TEST(Distributed, FourWorkerEpMatchesOneProcessOnTheSameGlobalBatch) {
  const auto expected = single_process_losses(4, nullptr);
  for (const char* flat : {"", "--flat-ep"}) {
    std::vector<std::string> args = {"--mode", "ep"};
    if (*flat) args.push_back(flat);
    const std::string label = std::string("2x2 ep") + (*flat ? " (flat)" : " (per level)");
    auto r = testing::run_job(temp_dir("ep"), model_yaml() + cluster_yaml(2, 2), 4, args);
    expect_same_losses(r, expected, label);
    EXPECT_EQ(r.summary.value("mean_codec_s", -1.0), 0.0) << "raw rows cost no codec time";
  }
}

// bf16 token rows on the inter-DC links only: the dc link carries about half
// the token bytes, and training stays within a stated bound of one process
// (the intra-DC links stay raw and exact).
TEST(Distributed, Bf16TokensOnTheInterDcLinkHalveItsTokenBytesAndTrainWithinABound) {
  const auto expected = single_process_losses(4, nullptr);
  std::string config = model_yaml() + cluster_yaml(2, 2);
  const std::string dc_link = "link: {bandwidth: 1gbit, latency: 0ms, shape: false}";
  ASSERT_NE(config.find(dc_link), std::string::npos);
  config.replace(config.find(dc_link), dc_link.size(),
                 "link: {bandwidth: 1gbit, latency: 0ms, shape: false, codecs: {dispatch: bf16, combine: bf16}}");
  auto r = testing::run_job(temp_dir("bf16"), config, 4, {"--mode", "ep"});
  ASSERT_TRUE(r.ok()) << r.logs();
  const auto& losses = r.summary["losses"];
  ASSERT_EQ(losses.size(), expected.size());
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i)
    worst = std::max(worst, std::abs(losses[i].get<double>() - expected[i]) / expected[i]);
  const auto& bytes = r.summary["bytes_per_step"];
  const double wire = bytes["dc/moe_dispatch"].get<double>() + bytes["dc/moe_combine"].get<double>();
  const double raw = bytes["dc/moe_dispatch_raw"].get<double>() + bytes["dc/moe_combine_raw"].get<double>();
  std::printf("[dist] bf16 tokens on dc: worst relative loss difference %.2e over %zu steps; dc token bytes "
              "%.0f on the wire for %.0f raw (%.2fx)\n", worst, expected.size(), wire, raw, raw / wire);
  EXPECT_GT(worst, 0.0) << "bf16 must change something: is the codec applied?";
  EXPECT_GT(r.summary["mean_codec_s"].get<double>(), 0.0) << "the codec's time is reported";
  EXPECT_LT(worst, 2e-3);
  EXPECT_GT(raw / wire, 1.6) << "bf16 rows (plus expert ids and headers) should be close to half";
  EXPECT_FALSE(bytes.contains("worker/moe_dispatch") && bytes["worker/moe_dispatch"].get<double>() <
                                                            0.6 * bytes["worker/moe_dispatch_raw"].get<double>())
      << "the intra-DC links stay raw";
}

// Routing is not uniform, so each A2A hop reports its larger side (rows sent
// or received), which xdmoe simulate takes as the run's imbalance.
// Flat EP's one hop spans both link classes; each class's peers count as
// one side each way, as a hierarchical hop's do.
TEST(Distributed, EachA2aHopCountsItsLargerSideBetweenTheRowsSentAndTwiceThem) {
  for (const char* flat : {"", "--flat-ep"}) {
    std::vector<std::string> args = {"--mode", "ep"};
    if (*flat) args.push_back(flat);
    auto r = testing::run_job(temp_dir("peak"), model_yaml() + cluster_yaml(2, 2), 4, args);
    ASSERT_TRUE(r.ok()) << r.logs();
    const auto& bytes = r.summary["bytes_per_step"];
    // At least what was sent, at most what was sent and received (the world
    // receives what it sends).
    for (const char* link : {"dc", "worker"}) {
      const std::string l = link;
      const double sent = bytes[l + "/moe_dispatch_raw"].get<double>() + bytes[l + "/moe_combine_raw"].get<double>();
      ASSERT_GT(sent, 0) << l << flat;
      ASSERT_TRUE(bytes.contains(l + "/moe_peak_raw")) << l << flat;
      EXPECT_GE(bytes[l + "/moe_peak_raw"].get<double>(), sent) << l << flat;
      EXPECT_LE(bytes[l + "/moe_peak_raw"].get<double>(), 2 * sent) << l << flat;
    }
  }
}

// The coordinator's routing probe routes each worker's first batch through
// the initial weights as the workers do, so at one chunk a hop the run's
// first step measures exactly the imbalance the start-up plan assumed.
// EP walks both levels; HybridEP with domains 2 x 1 gathers the experts
// across the DCs, so its rows cross only the worker level, to the worker
// holding the owner's experts or their replicas.
TEST(Distributed, TheFirstStepMeasuresTheImbalanceTheRoutingProbeForetold) {
  std::string config = model_yaml() + cluster_yaml(2, 2);
  const std::string steps = "steps: 20";
  ASSERT_NE(config.find(steps), std::string::npos);
  config.replace(config.find(steps), steps.size(), "steps: 1");
  for (const std::string domains : {"1,1", "2,1"}) {
    auto r = testing::run_job(temp_dir("routing"), config, 4,
                              {"--mode", "hybrid", "--domains", domains, "--pipeline-degree", "1"});
    ASSERT_TRUE(r.ok()) << r.logs();
    ASSERT_TRUE(r.summary.contains("startup_a2a_imbalance")) << r.coordinator_log;
    // The start-up plan's expert load is in the summary too: the probe's
    // walk of the same rows through these domains.
    ASSERT_TRUE(r.summary.contains("startup_expert_imbalance")) << r.coordinator_log;
    auto job = parse_job_config(config, "<test>");
    ASSERT_TRUE(job) << job.status().to_string();
    auto probe = probe_routing(*job);
    ASSERT_TRUE(probe) << probe.status().to_string();
    const std::vector<int> domain_sizes = domains == "1,1" ? std::vector<int>{1, 1} : std::vector<int>{2, 1};
    EXPECT_DOUBLE_EQ(r.summary["startup_expert_imbalance"].get<double>(),
                     routed_expert_load(*probe, Topology({2, 2}, domain_sizes)).layers_busiest);
    // The slowest worker's waits by what for are its exposed time, split.
    ASSERT_TRUE(r.summary.contains("mean_critical_waits_s")) << r.coordinator_log;
    double forward = 0, backward = 0;
    for (const auto& [key, seconds] : r.summary["mean_critical_waits_s"].items())
      (key.rfind("forward/", 0) == 0 ? forward : backward) += seconds.get<double>();
    EXPECT_EQ(r.summary["mean_critical_waits_s"].size(), 6u) << r.summary["mean_critical_waits_s"].dump();
    EXPECT_NEAR(backward, r.summary["mean_critical_bwd_exposed_s"].get<double>(), 1e-9);
    EXPECT_GE(forward + 1e-9, r.summary["mean_critical_fwd_exposed_s"].get<double>())
        << "the forward's exposed time is its waits, at most the pass";
    const auto& assumed = r.summary["startup_a2a_imbalance"];
    const auto& bytes = r.summary["bytes_per_step"];
    ASSERT_EQ(assumed.size(), 2u);
    size_t level = 0;
    for (const std::string l : {"dc", "worker"}) {
      const double f = assumed[level++].get<double>();
      if (!bytes.contains(l + "/moe_dispatch_raw")) {
        EXPECT_EQ(domains, "2,1") << l << ": only the gathered level carries no rows";
        EXPECT_EQ(f, 1.0) << l << ": no row crosses it";
        continue;
      }
      const double sent = bytes[l + "/moe_dispatch_raw"].get<double>() + bytes[l + "/moe_combine_raw"].get<double>();
      const double measured = bytes[l + "/moe_peak_raw"].get<double>() / sent;
      std::printf("[dist] domains %s, %s: the routing probe's F %.4f, step 1 measured %.4f\n", domains.c_str(),
                  l.c_str(), f, measured);
      EXPECT_GT(measured, 1.0) << l << ": the initial routing is uneven, or this compares nothing";
      EXPECT_NEAR(f, measured, 1e-9) << domains << " " << l;
    }
  }
}

class HybridDomains : public ::testing::TestWithParam<std::tuple<int, int, int, int>> {};

TEST_P(HybridDomains, HybridEpMatchesOneProcessForThisDomainChoice) {
  auto [dcs, per_dc, s0, s1] = GetParam();
  static std::map<int, std::vector<double>> reference;  // by world size
  const int world = dcs * per_dc;
  if (!reference.count(world)) reference[world] = single_process_losses(world, nullptr);
  auto r = testing::run_job(temp_dir("hy"), model_yaml() + cluster_yaml(dcs, per_dc), world,
                            {"--mode", "hybrid", "--domains", std::to_string(s0) + "," + std::to_string(s1)});
  expect_same_losses(r, reference[world], std::to_string(dcs) + "x" + std::to_string(per_dc) + " hybrid domains " +
                                              std::to_string(s0) + "x" + std::to_string(s1));
}

INSTANTIATE_TEST_SUITE_P(
    EveryFeasibleDomainChoice, HybridDomains,
    ::testing::Values(std::make_tuple(2, 2, 1, 1), std::make_tuple(2, 2, 1, 2), std::make_tuple(2, 2, 2, 1),
                      std::make_tuple(2, 2, 2, 2), std::make_tuple(4, 2, 1, 1), std::make_tuple(4, 2, 2, 1),
                      std::make_tuple(4, 2, 4, 1), std::make_tuple(4, 2, 1, 2), std::make_tuple(4, 2, 2, 2),
                      std::make_tuple(4, 2, 4, 2)),
    [](const auto& info) {
      const auto& p = info.param;
      return std::to_string(std::get<0>(p)) + "x" + std::to_string(std::get<1>(p)) + "_domains_" +
             std::to_string(std::get<2>(p)) + "x" + std::to_string(std::get<3>(p));
    });

TEST(Distributed, OwnersWeightsAfterTrainingEqualTheOneProcessWeights) {
  std::vector<float> params;
  std::unique_ptr<Trainer> single;
  single_process_losses(4, &params, &single);
  const std::string dir = temp_dir("owners");
  const std::string ckpt = dir + "/ckpt";
  std::string fixed = model_yaml();
  fixed.replace(fixed.find("  eval_every: 0\n"), 16, "  eval_every: 0\n  checkpoint_dir: " + ckpt + "\n");
  auto r = testing::run_job(dir, fixed + cluster_yaml(2, 2), 4, {"--mode", "hybrid", "--domains", "2,2"});
  ASSERT_TRUE(r.ok()) << r.logs();
  const ParamLayout& layout = single->model().layout();
  double worst = 0;
  int experts_checked = 0;
  for (int rank = 0; rank < 4; ++rank) {
    auto shard = SafetensorsFile::open(ckpt + "/step_000020/" + shard_file_name(rank, 4));
    ASSERT_TRUE(shard) << shard.status().to_string();
    for (const std::string& name : shard->names()) {
      if (name.starts_with("exp_avg")) continue;  // the AdamW moments beside the weights
      const TensorSlot* slot = layout.find(name);
      ASSERT_NE(slot, nullptr) << name;
      std::vector<float> got(slot->numel());
      ASSERT_TRUE(shard->read_f32(name, slot->shape, got.data()).is_ok());
      double diff = 0, norm = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        diff += std::pow(got[i] - params[slot->offset + i], 2);
        norm += std::pow(params[slot->offset + i], 2);
      }
      worst = std::max(worst, std::sqrt(diff / norm));
      if (slot->is_routed_expert()) {
        ++experts_checked;
        EXPECT_EQ(slot->expert / 2, rank) << name << " is in the wrong shard";
      }
    }
  }
  std::printf("[dist] owners' weights after %d steps (2x2, domains 2x2): worst relative difference %.2e over %d expert tensors\n",
              kSteps, worst, experts_checked);
  EXPECT_EQ(experts_checked, 8 * 2 * 3);  // every expert of every layer, w1/w3/w2
  EXPECT_LT(worst, 1e-4);
}

}  // namespace
}  // namespace xd
