// FarSkip overlap (docs/overlap.md) changes when things happen, never what is
// computed: the simple and the overlapped schedules give the same losses and
// weights, in EP and HybridEP, with and without pipeline chunks; a heavily
// delayed link changes nothing; and the distributed FarSkip run is the
// one-process FarSkip model on the global batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/distributed_trainer.h"
#include "cluster/job_config.h"
#include "job_runner.h"
#include "model/distributed_checkpoint.h"
#include "model/safetensors.h"
#include "model/trainer.h"

namespace xd {
namespace {

namespace fs = std::filesystem;

constexpr int kSteps = 10;

// The shared small model with FarSkip on, 10 steps, a checkpoint at the end.
std::string farskip_yaml(bool overlapped, const std::string& checkpoint_dir) {
  std::string y = testing::model_yaml();
  y.replace(y.find("  steps: 20\n"), 12, "  steps: " + std::to_string(kSteps) + "\n");
  y.replace(y.find("  eval_every: 0\n"), 16, "  eval_every: 0\n  checkpoint_dir: " + checkpoint_dir + "\n");
  y += std::string("farskip:\n  enabled: true\n  overlapped: ") + (overlapped ? "true" : "false") + "\n";
  return y;
}

// 2 DCs x 2 workers; `dc_latency` is the in-process delay of every message
// on the inter-DC link.
std::string cluster_yaml(int r, const std::string& dc_latency = "0ms", int backward_r = 0) {
  return "cluster:\n  levels:\n    - name: dc\n      size: 2\n      link: {bandwidth: 10gbit, latency: " + dc_latency +
         ", shape: true}\n    - name: worker\n      size: 2\n      link: {bandwidth: 10gbit, latency: 0ms, shape: false}\n"
         "  expert_parallel:\n    mode: ep\n    memory_cap: unlimited\n    pipeline_degree: " + std::to_string(r) + "\n" +
         (backward_r > 0 ? "    backward_pipeline_degree: " + std::to_string(backward_r) + "\n" : "");
}

// The FarSkip job (overlapped) on `cluster`, with step 4 traced into <dir>/trace.
std::string traced_yaml(const std::string& dir, const std::string& cluster) {
  std::string yaml = farskip_yaml(true, dir + "/ckpt") + cluster;
  yaml.replace(yaml.find("  eval_every: 0\n"), 16, "  eval_every: 0\n  trace_steps: [4]\n  trace_dir: " + dir + "/trace\n");
  return yaml;
}

// One worker's Chrome trace of step 4; a failure, and no events, when it wrote none.
nlohmann::json step4_trace(const std::string& dir, int rank) {
  std::ifstream in(dir + "/trace/trace-step4-rank" + std::to_string(rank) + ".json");
  if (!in) {
    ADD_FAILURE() << "rank " << rank << " wrote no trace";
    return nlohmann::json{{"traceEvents", nlohmann::json::array()}};
  }
  return nlohmann::json::parse(in);
}

std::string temp_dir(const std::string& name) {
  return (fs::temp_directory_path() / ("xdmoe_overlap_" + name + "_" + std::to_string(::getpid()))).string();
}

struct JobRun {
  std::vector<double> losses;
  std::string dir;
  nlohmann::json summary;
};

JobRun run_farskip(const std::string& name, bool overlapped, int r, const std::vector<std::string>& mode,
        const std::string& dc_latency = "0ms", int backward_r = 0) {
  JobRun out;
  out.dir = temp_dir(name);
  auto job = testing::run_job(out.dir,
                              farskip_yaml(overlapped, out.dir + "/ckpt") + cluster_yaml(r, dc_latency, backward_r), 4,
                              mode);
  if (job.ok() && backward_r > 0) {
    EXPECT_EQ(job.summary.value("backward_pipeline_degree", -1), backward_r) << name;
  }
  EXPECT_TRUE(job.ok()) << name << "\n" << job.logs();
  if (!job.ok() || !job.summary.contains("losses")) return out;
  for (const auto& l : job.summary["losses"]) out.losses.push_back(l.get<double>());
  out.summary = job.summary;
  return out;
}

// Largest |a - b| / |b| over the steps.
double worst_loss_difference(const JobRun& a, const JobRun& b) {
  EXPECT_EQ(a.losses.size(), b.losses.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.losses.size(), b.losses.size()); ++i)
    worst = std::max(worst, std::abs(a.losses[i] - b.losses[i]) / std::abs(b.losses[i]));
  return worst;
}

// Largest relative L2 difference over every tensor of every worker's final shard.
double worst_weight_difference(const JobRun& a, const JobRun& b) {
  double worst = 0;
  int tensors = 0;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string shard = "/ckpt/" + checkpoint_dir_name(kSteps) + "/" + shard_file_name(rank, 4);
    auto fa = SafetensorsFile::open(a.dir + shard);
    auto fb = SafetensorsFile::open(b.dir + shard);
    if (!fa || !fb) {
      ADD_FAILURE() << "missing shard " << shard;
      return 1e300;
    }
    for (const std::string& name : fa->names()) {
      const TensorInfo* info = fa->find(name);
      EXPECT_NE(info, nullptr);
      if (!info) continue;
      size_t n = 1;
      for (int64_t s : info->shape) n *= s;
      std::vector<float> x(n), y(n);
      EXPECT_TRUE(fa->read_f32(name, info->shape, x.data()).is_ok());
      EXPECT_TRUE(fb->read_f32(name, info->shape, y.data()).is_ok()) << name;
      double diff = 0, norm = 0;
      for (size_t i = 0; i < n; ++i) {
        diff += std::pow(double(x[i]) - y[i], 2);
        norm += std::pow(double(y[i]), 2);
      }
      worst = std::max(worst, norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff));
      ++tensors;
    }
  }
  EXPECT_GT(tensors, 4 * 10) << "every shard holds the dense tensors and its experts";
  return worst;
}

// The step's floor by phase (actors/distributed_trainer.h).
TEST(PhaseFloor, WhenEachPhaseIsComputeBoundItIsTheCompute) {
  const StepPhases p{.previous_optimizer_s = 0.02, .forward_compute_s = 0.10, .forward_link_s = 0.05,
                     .backward_compute_s = 0.20,  // the optimizer step's 0.02 included
                     .optimizer_s = 0.02, .backward_link_s = 0.15};
  EXPECT_NEAR(phase_floor_seconds(p), 0.30, 1e-12);
}

TEST(PhaseFloor, ABackwardWhoseTrafficOutlastsItsComputeLiftsItAboveTheBound) {
  // The forward's link idles 70 ms of its 170 ms window; the backward sends
  // 240 ms in a 180 ms compute window: no schedule of these phases beats
  // 170 + 240 ms, though max(compute, link) is only 350 ms.
  StepPhases p{.previous_optimizer_s = 0.02, .forward_compute_s = 0.15, .forward_link_s = 0.10,
               .backward_compute_s = 0.20, .optimizer_s = 0.02, .backward_link_s = 0.24};
  EXPECT_NEAR(std::max(p.forward_compute_s + p.backward_compute_s, p.forward_link_s + p.backward_link_s), 0.35, 1e-12);
  EXPECT_NEAR(phase_floor_seconds(p), 0.41, 1e-12);
  // The all-gather's window opens with the previous optimizer step: a
  // forward link busier than the forward's compute alone still fits there.
  p.forward_link_s = 0.165;
  EXPECT_NEAR(phase_floor_seconds(p), 0.41, 1e-12);
  p.forward_link_s = 0.19;
  EXPECT_NEAR(phase_floor_seconds(p), 0.43, 1e-12);
}

class SimpleVsOverlapped : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(SimpleVsOverlapped, GiveTheSameLossesAndWeights) {
  const auto [mode, r] = GetParam();
  const std::vector<std::string> args =
      mode == "ep" ? std::vector<std::string>{"--mode", "ep"} : std::vector<std::string>{"--mode", "hybrid", "--domains", "1,2"};
  const std::string name = mode + "_r" + std::to_string(r);
  const JobRun simple = run_farskip(name + "_simple", false, r, args);
  const JobRun overlapped = run_farskip(name + "_overlapped", true, r, args);
  ASSERT_EQ(simple.losses.size(), (size_t)kSteps);
  const double loss = worst_loss_difference(overlapped, simple);
  const double weights = worst_weight_difference(overlapped, simple);
  std::printf("[overlap] %-10s r=%d: simple vs overlapped over %d steps: worst loss difference %.2e, worst weight "
              "difference %.2e (final loss %.5f)\n", mode.c_str(), r, kSteps, loss, weights, simple.losses.back());
  EXPECT_LT(loss, 1e-6);
  EXPECT_LT(weights, 1e-6);
  EXPECT_EQ(weights, 0.0) << "the same operations in the same order: the same bits";
}

INSTANTIATE_TEST_SUITE_P(EpAndHybridWithOneAndFourChunks, SimpleVsOverlapped,
                         ::testing::Combine(::testing::Values("ep", "hybrid"), ::testing::Values(1, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_r" + std::to_string(std::get<1>(info.param));
                         });

// The partial variants reorder other parts of a layer (attention_only: the
// attention input skips; moe_only: the MoE input is outdated, and the last
// layer's experts run first): simple and overlapped still give the same
// bits, in EP and in HybridEP.
TEST(FarSkipOverlap, ThePartialVariantsGiveTheSameBitsSimpleAndOverlapped) {
  for (const char* variant : {"attention_only", "moe_only"})
    for (const auto& [mode, args] : {std::pair<std::string, std::vector<std::string>>{"ep", {"--mode", "ep"}},
                                     {"hybrid", {"--mode", "hybrid", "--domains", "1,2"}}}) {
      JobRun runs[2];
      for (int overlapped = 0; overlapped < 2; ++overlapped) {
        JobRun& out = runs[overlapped];
        out.dir = temp_dir(std::string(variant) + "_" + mode + (overlapped ? "_overlapped" : "_simple"));
        std::string yaml = farskip_yaml(overlapped, out.dir + "/ckpt") + cluster_yaml(4);
        yaml.replace(yaml.find("  enabled: true\n"), 16, "  enabled: true\n  " + std::string(variant) + ": true\n");
        auto job = testing::run_job(out.dir, yaml, 4, args);
        ASSERT_TRUE(job.ok()) << variant << " " << mode << "\n" << job.logs();
        for (const auto& l : job.summary["losses"]) out.losses.push_back(l.get<double>());
        const std::string connectivity = variant == std::string("attention_only") ? "farskip_attention" : "farskip_moe";
        EXPECT_EQ(job.summary.value("connectivity", ""), connectivity) << job.summary.dump();
      }
      ASSERT_EQ(runs[0].losses.size(), (size_t)kSteps);
      const double weights = worst_weight_difference(runs[1], runs[0]);
      std::printf("[overlap] %s %s: simple vs overlapped, worst loss difference %.2e, weights %.2e\n", variant,
                  mode.c_str(), worst_loss_difference(runs[1], runs[0]), weights);
      EXPECT_LT(worst_loss_difference(runs[1], runs[0]), 1e-6) << variant << " " << mode;
      EXPECT_EQ(weights, 0.0) << variant << " " << mode;
    }
}

// The backward in 2 exchanges of 2 forward chunks each: the same rows move,
// fewer and larger messages, over one level of peers (HybridEP 1 x 2, the
// compute thread's direct exchanges) and over two (EP, the comm threads'
// hops). A traced step shows each layer's 4 Dispatches and 2 backward
// exchanges a direction; the weights are those of r = 4 both ways, to the bit.
TEST(FarSkipOverlap, ABackwardDegreeDividingRMovesTheSameRowsInFewerExchanges) {
  for (const auto& [mode, args] : {std::pair<std::string, std::vector<std::string>>{"ep", {"--mode", "ep"}},
                                   {"hybrid", {"--mode", "hybrid", "--domains", "1,2"}}}) {
    const JobRun both = run_farskip(mode + "_r4_4", true, 4, args);
    JobRun halved;
    halved.dir = temp_dir(mode + "_r4_2");
    auto job = testing::run_job(halved.dir, traced_yaml(halved.dir, cluster_yaml(4, "0ms", 2)), 4, args);
    ASSERT_TRUE(job.ok()) << mode << "\n" << job.logs();
    EXPECT_EQ(job.summary.value("backward_pipeline_degree", -1), 2) << mode;
    for (const auto& l : job.summary["losses"]) halved.losses.push_back(l.get<double>());
    std::map<std::string, std::map<int, int>> per_layer;  // transfer name -> layer -> count
    const nlohmann::json trace = step4_trace(halved.dir, 0);
    for (const auto& e : trace["traceEvents"])
      if (e.value("ph", "") == "X" && e.value("cat", "") == "comm" && e.contains("args"))
        per_layer[e["name"].get<std::string>()][e["args"]["layer"].get<int>()]++;
    ASSERT_FALSE(per_layer["dispatch"].empty()) << mode;
    for (const auto& [layer, n] : per_layer["dispatch"]) {
      EXPECT_EQ(n, 4) << mode << ", layer " << layer;
      EXPECT_EQ(per_layer["combine backward"][layer], 2) << mode << ", layer " << layer;
      EXPECT_EQ(per_layer["dispatch backward"][layer], 2) << mode << ", layer " << layer;
    }
    ASSERT_EQ(both.losses.size(), (size_t)kSteps) << mode;
    const double loss = worst_loss_difference(halved, both);
    const double weights = worst_weight_difference(halved, both);
    std::printf("[overlap] %-6s r=4/2 vs r=4: worst loss difference %.2e, weights %.2e\n", mode.c_str(), loss,
                weights);
    EXPECT_LT(loss, 1e-12) << mode;
    EXPECT_EQ(weights, 0.0) << mode;
  }
}

// The one-process FarSkip model on the same global batch: the distributed
// schedule (overlapped, 4 chunks) computes the model of docs/model.md, in EP,
// in HybridEP with every expert held on every worker (domains 2 x 2: no
// token row leaves its worker; the exchange hands the rows on uncopied), and
// in HybridEP with the experts gathered across the DCs and the tokens
// exchanged inside them (domains 2 x 1), simple and overlapped.
TEST(FarSkipOverlap, TheDistributedRunIsTheOneProcessFarSkipModel) {
  const JobRun ep = run_farskip("vs_one_process", true, 4, {"--mode", "ep"});
  const JobRun held = run_farskip("held_vs_one_process", true, 4, {"--mode", "hybrid", "--domains", "2,2"});
  const JobRun gathered = run_farskip("gathered_vs_one_process", true, 4, {"--mode", "hybrid", "--domains", "2,1"});
  const JobRun gathered_simple =
      run_farskip("gathered_simple_vs_one_process", false, 4, {"--mode", "hybrid", "--domains", "2,1"});
  auto job = parse_job_config(farskip_yaml(true, ep.dir + "/unused") + cluster_yaml(4), "<test>");
  ASSERT_TRUE(job.has_value()) << job.status().to_string();
  ASSERT_EQ(job->train.model.layer_connectivity(0), Connectivity::kFarSkip);
  auto trainer = Trainer::create(one_process_equivalent(*job));
  ASSERT_TRUE(trainer.has_value()) << trainer.status().to_string();
  JobRun single;
  for (int i = 0; i < kSteps; ++i) single.losses.push_back((*trainer)->step()->loss.loss);
  for (const auto& [name, run] :
       {std::pair<const char*, const JobRun*>{"ep, overlapped", &ep}, {"hybrid 2 x 2, overlapped", &held},
        {"hybrid 2 x 1, overlapped", &gathered}, {"hybrid 2 x 1, simple", &gathered_simple}}) {
    const double worst = worst_loss_difference(*run, single);
    std::printf("[overlap] distributed FarSkip (%s, r=4) vs one process: worst loss difference %.2e\n",
                name, worst);
    EXPECT_LT(worst, 1e-4) << name;
  }
}

// A token once per worker (8 experts, top-2, d = 32), in EP over 2 x 2 (2
// experts a worker; two levels of all-to-all, on the comm threads) and
// HybridEP 1 x 2 (4 a worker, 2 of them gathered replicas; one level,
// direct; the backward's exchanges 2 chunks each): the losses and weights of
// one row per expert up to the order of sums, fewer token bytes on every
// link class with all-to-all, and the simple schedule's results to the bit.
TEST(TokensOncePerWorker, GivesThePerExpertResultsWithFewerTokenBytes) {
  for (const auto& [mode, args] : {std::pair<std::string, std::vector<std::string>>{"ep", {"--mode", "ep"}},
                                   {"hybrid", {"--mode", "hybrid", "--domains", "1,2"}}}) {
    std::vector<std::string> once_args = args, per_expert_args = args;
    once_args.push_back("--tokens-once-per-worker");
    per_expert_args.push_back("--tokens-once-per-worker=false");
    // HybridEP's backward in exchanges of 2 chunks each.
    const int backward_r = mode == "hybrid" ? 2 : 0;
    const JobRun per_expert = run_farskip(mode + "_per_expert", true, 4, per_expert_args, "0ms", backward_r);
    const JobRun once = run_farskip(mode + "_once", true, 4, once_args, "0ms", backward_r);
    ASSERT_EQ(once.losses.size(), (size_t)kSteps) << mode;
    const double loss = worst_loss_difference(once, per_expert);
    const double weights = worst_weight_difference(once, per_expert);
    EXPECT_LT(loss, 1e-6) << mode;
    EXPECT_LT(weights, 1e-5) << mode;
    for (const char* link : {"dc", "worker"}) {
      double rows[2] = {0, 0};
      for (int i = 0; i < 2; ++i) {
        const nlohmann::json& bytes = (i ? once : per_expert).summary["bytes_per_step"];
        for (const char* kind : {"moe_dispatch", "moe_combine"})
          rows[i] += bytes.value(std::string(link) + "/" + kind, 0.0);
      }
      std::printf("[overlap] %-6s once per worker: %s token bytes a step %.0f vs %.0f one row per expert (%.1f%%); "
                  "loss %.2e, weights %.2e apart\n", mode.c_str(), link, rows[1], rows[0],
                  100.0 * rows[1] / std::max(1.0, rows[0]), loss, weights);
      if (mode == "hybrid" && std::string(link) == "worker") continue;  // domains 1 x 2: no A2A inside a DC
      EXPECT_GT(rows[0], 0) << mode << " " << link;
      // Uniform routing would send 93% of the rows to a worker of 2 experts
      // (EP), 79% to one of 4 (HybridEP 1 x 2); 3 and 2 more columns of 32
      // take EP to about 97%, HybridEP to about 82% (docs/overlap.md).
      EXPECT_LT(rows[1], (mode == "ep" ? 0.995 : 0.9) * rows[0]) << mode << " " << link;
    }
    if (mode != "ep") continue;
    const JobRun simple = run_farskip(mode + "_once_simple", false, 4, once_args);
    EXPECT_EQ(worst_weight_difference(simple, once), 0.0) << "the schedule changes no sum";
  }
}

// 40 ms on every inter-DC message: every exchange lands long after the
// compute that could use it would have run, so reading a tensor before its
// communication completed would change the numbers.
TEST(FarSkipOverlap, AHeavilyDelayedLinkGivesIdenticalResults) {
  const std::vector<std::string> args = {"--mode", "hybrid", "--domains", "1,2"};
  const JobRun fast = run_farskip("fast", true, 4, args);
  const JobRun slow = run_farskip("slow", true, 4, args, "40ms");
  const double loss = worst_loss_difference(slow, fast);
  const double weights = worst_weight_difference(slow, fast);
  const double exposed_fast = fast.summary.value("mean_exposed_comm_s", -1.0);
  const double exposed_slow = slow.summary.value("mean_exposed_comm_s", -1.0);
  std::printf("[overlap] 40 ms inter-DC delay vs none (overlapped, r=4): worst loss difference %.2e, weights %.2e; "
              "exposed communication %.1f vs %.1f ms a step\n", loss, weights, exposed_slow * 1e3, exposed_fast * 1e3);
  // The delay took effect: every step's last Combine across the DCs lands
  // 40 ms after it left, and this model's compute cannot cover that.
  EXPECT_GE(exposed_slow, 0.040);
  EXPECT_LT(exposed_fast, exposed_slow - 0.030);
  // Weights to the bit; the reported loss is a mean over workers that the
  // coordinator sums in arrival order, so it may differ in the last bit.
  EXPECT_LT(loss, 1e-12);
  EXPECT_EQ(weights, 0.0);
}

// HybridEP with the experts gathered across the delayed link (domains 2 x 1):
// each layer's gathered experts land late, so the next layer's attention runs
// in the wait (docs/overlap.md, "Work while waiting"), and the owned experts'
// weight gradients wait until the end of backward. The weights are still
// those of the undelayed run, to the bit.
TEST(FarSkipOverlap, ExpertsGatheredOverADelayedLinkMoveWorkIntoTheWaitAndChangeNothing) {
  const std::vector<std::string> args = {"--mode", "hybrid", "--domains", "2,1"};
  const JobRun fast = run_farskip("gathered_fast", true, 1, args);
  JobRun slow;
  slow.dir = temp_dir("gathered_slow");
  auto job = testing::run_job(slow.dir, traced_yaml(slow.dir, cluster_yaml(1, "40ms")), 4, args);
  ASSERT_TRUE(job.ok()) << job.logs();
  for (const auto& l : job.summary["losses"]) slow.losses.push_back(l.get<double>());
  const double loss = worst_loss_difference(slow, fast);
  const double weights = worst_weight_difference(slow, fast);
  std::printf("[overlap] gathered over a 40 ms link vs none: worst loss difference %.2e, weights %.2e\n", loss, weights);
  EXPECT_LT(loss, 1e-12);
  EXPECT_EQ(weights, 0.0);
  int ahead = 0, deferred = 0;
  for (int rank = 0; rank < 4; ++rank) {
    const nlohmann::json trace = step4_trace(slow.dir, rank);
    double attention1 = 1e300, experts0 = 1e300;
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X" || e["cat"] != "compute") continue;
      const int layer = e.contains("args") ? e["args"]["layer"].get<int>() : -1;
      const double ts = e["ts"].get<double>();
      if (e["name"] == "attention (a)" && layer == 1) attention1 = std::min(attention1, ts);
      if (e["name"] == "routed experts" && layer == 0) experts0 = std::min(experts0, ts);
      if (e["name"] == "owned experts' weight gradients") ++deferred;
    }
    if (attention1 < experts0) ++ahead;
  }
  EXPECT_GT(ahead, 0) << "no worker began layer 1's attention while layer 0's experts were on their way";
  EXPECT_EQ(deferred, 4) << "every worker computes its owned experts' weight gradients after the embedding's";
}

// Late replica weight gradients (expert_parallel.replica_weight_gradients:
// late): every worker computes them after the embedding's gradients, and its
// replicas' gradients then cross the delayed link at the very end of
// backward. The owners still sum them before their update: the weights are
// those of the undelayed run with them early, to the bit.
TEST(FarSkipOverlap, LateReplicaWeightGradientsOverADelayedLinkChangeNoWeight) {
  const std::vector<std::string> args = {"--mode", "hybrid", "--domains", "2,1", "--replica-weight-gradients"};
  std::vector<std::string> early_args = args, late_args = args;
  early_args.push_back("early");
  late_args.push_back("late");
  const JobRun early = run_farskip("replicas_early", true, 1, early_args);
  JobRun late;
  late.dir = temp_dir("replicas_late");
  auto job = testing::run_job(late.dir, traced_yaml(late.dir, cluster_yaml(1, "40ms")), 4, late_args);
  ASSERT_TRUE(job.ok()) << job.logs();
  EXPECT_EQ(job.summary.value("replica_weight_gradients", ""), "late");
  for (const auto& l : job.summary["losses"]) late.losses.push_back(l.get<double>());
  EXPECT_LT(worst_loss_difference(late, early), 1e-12);
  EXPECT_EQ(worst_weight_difference(late, early), 0.0);
  for (int rank = 0; rank < 4; ++rank) {
    double replicas_begin = -1, last_attention_end = 0;
    const nlohmann::json trace = step4_trace(late.dir, rank);
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X" || e["cat"] != "compute") continue;
      const double ts = e["ts"].get<double>();
      if (e["name"] == "replicas' weight gradients") replicas_begin = ts;
      if (e["name"] == "attention backward") last_attention_end = std::max(last_attention_end, ts + e["dur"].get<double>());
    }
    EXPECT_GE(replicas_begin, last_attention_end)
        << "rank " << rank << " computed its replicas' weight gradients before its last attention backward";
  }
}

// With two levels of replicas (domains 2 x 2) too, overlapped, the owned
// experts' weight gradients wait until the end of backward; what the inner
// level's peers send for them is held back until they are final, so each
// layer's outer-level replica gradients leave without them
// (detail::HeldBackGradients; tests/actors_expert_communicator_test.cc
// checks that they do). Deferred without that, they held all of the outer
// level's traffic until the end of backward (611 against 476 ms a step on the
// README demo's job). The sums are those of the simple schedule, to the bit.
TEST(FarSkipOverlap, WithTwoLevelsOfReplicasTheDeferredOwnedGradientsSumAsInTheSimpleSchedule) {
  const std::vector<std::string> args = {"--mode", "hybrid", "--domains", "2,2"};
  const JobRun simple = run_farskip("two_levels_simple", false, 1, args);
  JobRun overlapped;
  overlapped.dir = temp_dir("two_levels");
  auto job = testing::run_job(overlapped.dir, traced_yaml(overlapped.dir, cluster_yaml(1)), 4, args);
  ASSERT_TRUE(job.ok()) << job.logs();
  for (const auto& l : job.summary["losses"]) overlapped.losses.push_back(l.get<double>());
  ASSERT_EQ(simple.losses.size(), (size_t)kSteps);
  EXPECT_LT(worst_loss_difference(overlapped, simple), 1e-12);
  EXPECT_EQ(worst_weight_difference(overlapped, simple), 0.0) << "the same sums in the same order";
  for (int rank = 0; rank < 4; ++rank) {
    int deferred = 0, outer_sends = 0;
    const nlohmann::json trace = step4_trace(overlapped.dir, rank);
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X") continue;
      deferred += e["name"] == "owned experts' weight gradients";
      outer_sends += e["name"] == "replica gradients out, level 0";
    }
    EXPECT_EQ(deferred, 1) << "rank " << rank << " computed its owned experts' weight gradients in their layer";
    EXPECT_EQ(outer_sends, 2) << "rank " << rank << ": one outer-level send of replica gradients per layer";
  }
}

// A traced step: every worker writes a Chrome trace of it with compute
// spans, waits, transfers on the comm threads and the shaped links'
// transmissions, and scripts/trace_png.py draws them with gnuplot.
TEST(FarSkipOverlap, ATracedStepGivesEachWorkerAChromeTraceAndAPng) {
  const std::string dir = temp_dir("trace");
  auto job = testing::run_job(dir, traced_yaml(dir, cluster_yaml(2)), 4, {"--mode", "hybrid", "--domains", "1,2"});
  ASSERT_TRUE(job.ok()) << job.logs();
  for (int rank = 0; rank < 4; ++rank) {
    const nlohmann::json trace = step4_trace(dir, rank);
    std::set<std::string> names, categories, rows;
    std::set<int> lanes;
    for (const auto& e : trace["traceEvents"]) {
      if (e["name"] == "thread_name") rows.insert(e["args"]["name"].get<std::string>());
      if (e["ph"] != "X") continue;
      names.insert(e["name"].get<std::string>());
      categories.insert(e["cat"].get<std::string>());
      lanes.insert(e["tid"].get<int>());
      EXPECT_GE(e["dur"].get<double>(), 0.0);
      EXPECT_EQ(e["pid"].get<int>(), rank);
    }
    for (const char* name : {"attention (a)", "routed experts", "dispatch", "combine", "dispatch backward",
                             "combine backward", "dense all-reduce", "expert all-gather", "optimizer",
                             "wait replica gradients"})
      EXPECT_TRUE(names.count(name)) << "rank " << rank << " has no '" << name << "' span";
    EXPECT_TRUE(categories.count("compute") && categories.count("comm")) << "rank " << rank;
    EXPECT_GE(lanes.size(), 4u) << "compute, both exchange threads, the dense all-reduce";
    // The shaped DC link's egress has a row of transmissions; the unshaped
    // worker link has none.
    EXPECT_TRUE(names.count("transmit") && categories.count("link")) << "rank " << rank;
    EXPECT_TRUE(rows.count("dc link egress")) << "rank " << rank;
    EXPECT_FALSE(rows.count("worker link egress")) << "rank " << rank;
  }
  EXPECT_FALSE(fs::exists(dir + "/trace/trace-step3-rank0.json")) << "only the asked-for step";
  {
    // Where the cores idled: the four workers' traces aligned on one clock.
    auto [code, out] = testing::run("python3 " + std::string(XD_SOURCE_DIR) + "/scripts/trace_png.py " + dir +
                                    "/trace --step 4 --idle --cores 2");
    ASSERT_EQ(code, 0) << out;
    EXPECT_NE(out.find("step 4: 4 workers on 2 cores"), std::string::npos) << out;
    EXPECT_NE(out.find("idle core-ms  computing  waiting"), std::string::npos) << out;
  }
  {
    // Per layer and pass: each worker's routed experts, how much longer the
    // layer's busiest worker computed (0 for that worker), its waits.
    auto [code, out] = testing::run("python3 " + std::string(XD_SOURCE_DIR) + "/scripts/trace_png.py " + dir +
                                    "/trace --step 4 --layers");
    ASSERT_EQ(code, 0) << out;
    std::istringstream lines(out);
    std::string line;
    std::set<std::string> passes_seen;
    while (std::getline(lines, line)) {
      std::istringstream row(line);
      std::string pass;
      int layer = -1;
      if (!(row >> pass >> layer) || (pass != "forward" && pass != "backward")) continue;
      passes_seen.insert(pass);
      std::vector<double> v;
      for (double x; row >> x;) v.push_back(x);
      ASSERT_EQ(v.size(), 12u) << "experts, over and waits for 4 workers: " << line;
      double longest = 0, least_over = 1e9;
      for (int w = 0; w < 4; ++w) {
        longest = std::max(longest, v[w]);
        least_over = std::min(least_over, v[4 + w]);
      }
      EXPECT_GT(longest, 0.0) << line;
      EXPECT_EQ(least_over, 0.0) << "the layer's busiest worker is over by nothing: " << line;
      for (int w = 0; w < 4; ++w) EXPECT_NEAR(v[4 + w], longest - v[w], 0.011) << line;
    }
    EXPECT_EQ(passes_seen.size(), 2u) << out;
  }
  if (testing::run("command -v gnuplot").first != 0) {
    GTEST_SKIP() << "gnuplot is not installed (scripts/install-deps.sh installs it): the PNG is not drawn";
  }
  const std::string png = dir + "/step4.png";
  auto [code, out] = testing::run("python3 " + std::string(XD_SOURCE_DIR) + "/scripts/trace_png.py " + dir +
                                  "/trace --step 4 --out " + png);
  ASSERT_EQ(code, 0) << out;
  std::ifstream image(png, std::ios::binary);
  char magic[8] = {};
  image.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG") << "not a PNG: " << out;
}

}  // namespace
}  // namespace xd
