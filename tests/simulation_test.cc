// The step schedule recorded from the model, and `xdmoe simulate` on SimGrid
// (one engine per process, so every simulation runs as its own process).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cluster/job_config.h"
#include "simulation/simulator.h"
#include "simulation/step_schedule.h"
#include "tests/job_runner.h"
#include "tests/test_util.h"

namespace xd {
namespace {

namespace fs = std::filesystem;

ScheduleShape shape(Connectivity c, bool overlapped, int r, bool gathers) {
  ScheduleShape s;
  s.model = test_util::small_config();
  s.model.num_layers = 3;
  s.model.num_shared_experts = 1;
  s.model.connectivity.assign(3, c);
  s.pipeline_degree = r;
  s.overlapped = overlapped;
  s.gathers_experts = gathers;
  return s;
}

// Index of the first op matching `pred`, or -1.
template <typename P>
int find_op(const StepSchedule& s, P pred) {
  for (size_t i = 0; i < s.ops.size(); ++i)
    if (pred(s.ops[i])) return static_cast<int>(i);
  return -1;
}

TEST(StepSchedule, EveryCommunicationStartsOnceAndIsWaitedForOnceAfterwards) {
  for (Connectivity c : {Connectivity::kRegular, Connectivity::kFarSkip})
    for (bool overlapped : {false, true})
      for (int r : {1, 4})
        for (bool gathers : {false, true}) {
          auto s = record_step_schedule(shape(c, overlapped, r, gathers));
          ASSERT_TRUE(s.has_value()) << s.status().to_string();
          std::vector<int> started(s->comms.size(), -1), waited(s->comms.size(), -1);
          for (size_t i = 0; i < s->ops.size(); ++i) {
            const StepOp& op = s->ops[i];
            if (op.type == StepOp::Type::kCompute) continue;
            auto& at = op.type == StepOp::Type::kStart ? started : waited;
            EXPECT_EQ(at[op.comm], -1) << "communication " << op.comm << " twice\n" << s->describe();
            at[op.comm] = static_cast<int>(i);
          }
          for (size_t k = 0; k < s->comms.size(); ++k) {
            EXPECT_GE(started[k], 0) << comm_kind_name(s->comms[k].kind) << " never started";
            EXPECT_GT(waited[k], started[k]) << comm_kind_name(s->comms[k].kind) << " waited before it started";
          }
          // Per layer: 4 exchanges of r chunks; with replicas an AG and its
          // gradients; L + 2 dense buckets; the norm's sum.
          const int L = 3;
          const size_t expected = 4 * L * r + (gathers ? 2 * L : 0) + (L + 2) + 1;
          EXPECT_EQ(s->comms.size(), expected);
        }
}

// Late replica weight gradients (overlapped, with replicas): every layer's
// replicas' share comes after the embedding's bucket has left, one layer at
// a time from the last, each right before that layer's replica gradients
// leave; early, none of it is there.
TEST(StepSchedule, LateReplicaWeightsComeLayerByLayerBeforeTheirSendAfterTheEmbeddingsBucket) {
  for (const bool late : {false, true}) {
    ScheduleShape sh = shape(Connectivity::kFarSkip, true, 2, true);
    sh.defers_owned_expert_weights = true;
    sh.defers_replica_expert_weights = late;
    auto s = record_step_schedule(sh);
    ASSERT_TRUE(s.has_value()) << s.status().to_string();
    EXPECT_EQ(s->defers_replica_expert_weights, late);
    int embedding_bucket = -1;  // the last dense bucket to start
    std::vector<int> replica_compute;  // layers, in order
    for (size_t i = 0; i < s->ops.size(); ++i) {
      const StepOp& op = s->ops[i];
      if (op.type == StepOp::Type::kStart && s->comms[op.comm].kind == CommKind::kDenseBucket)
        embedding_bucket = static_cast<int>(i);
      if (op.type != StepOp::Type::kCompute || op.compute != ComputeKind::kReplicaExpertsWeightBackward) continue;
      replica_compute.push_back(op.layer);
      EXPECT_GT(static_cast<int>(i), embedding_bucket) << s->describe();
      ASSERT_LT(i + 1, s->ops.size());
      const StepOp& next = s->ops[i + 1];
      EXPECT_EQ(next.type, StepOp::Type::kStart) << s->describe();
      EXPECT_EQ(s->comms[next.comm].kind, CommKind::kReplicaGradients) << s->describe();
      EXPECT_EQ(next.layer, op.layer) << s->describe();
    }
    const std::vector<int> layers = late ? std::vector<int>({2, 1, 0}) : std::vector<int>();
    EXPECT_EQ(replica_compute, layers) << s->describe();
  }
}

// Overlapped without replicas (EP), as the runtime: layer 0's weight
// gradients run once the embedding's bucket has left, as one op, and the
// norm's sum leaves after them; the other layers keep theirs per chunk.
TEST(StepSchedule, WithoutReplicasLayerZerosWeightGradientsFollowTheEmbeddingsBucketThenTheNorm) {
  ScheduleShape sh = shape(Connectivity::kFarSkip, true, 2, false);
  sh.defers_owned_expert_weights = true;
  auto s = record_step_schedule(sh);
  ASSERT_TRUE(s.has_value()) << s.status().to_string();
  EXPECT_TRUE(s->defers_first_layer_expert_weights);
  int last_bucket = -1, deferred = -1, norm = -1;
  std::set<int> chunk_weight_layers;
  for (size_t i = 0; i < s->ops.size(); ++i) {
    const StepOp& op = s->ops[i];
    if (op.type == StepOp::Type::kStart && s->comms[op.comm].kind == CommKind::kDenseBucket) last_bucket = (int)i;
    if (op.type == StepOp::Type::kStart && s->comms[op.comm].kind == CommKind::kNormSum) norm = (int)i;
    if (op.type != StepOp::Type::kCompute) continue;
    if (op.compute == ComputeKind::kOwnedExpertsWeightBackward) {
      EXPECT_EQ(deferred, -1) << "one op: " << s->describe();
      EXPECT_EQ(op.layer, 0) << s->describe();
      deferred = (int)i;
    }
    if (op.compute == ComputeKind::kExpertsWeightBackward) chunk_weight_layers.insert(op.layer);
  }
  EXPECT_GT(deferred, last_bucket) << s->describe();
  EXPECT_GT(norm, deferred) << s->describe();
  EXPECT_EQ(chunk_weight_layers, (std::set<int>{1, 2})) << s->describe();
}

// Moving layer 0's weight gradients to the end moves their compute and
// changes none of it: the simulated step computes as long either way.
TEST(StepSchedule, DeferringLayerZerosWeightGradientsChangesNoComputeTime) {
  SimulationInputs in;
  in.workload.num_moe_layers = 3;
  in.workload.experts_per_worker = 2;
  in.workload.pre_expert_fwd_s = 0.003;
  in.workload.pre_expert_bwd_s = 0.006;
  in.workload.expert_fwd_s = 0.004;
  in.workload.expert_bwd_s = 0.008;
  in.workload.shared_fwd_s = 0.001;
  in.workload.post_s = 0.002;
  in.level_sizes = {2};
  in.domain_sizes = {1};
  for (const int r : {1, 2, 4}) {
    double seconds[2] = {0, 0};
    for (const bool defers : {false, true}) {
      ScheduleShape sh = shape(Connectivity::kFarSkip, true, r, false);
      sh.defers_owned_expert_weights = defers;
      auto s = record_step_schedule(sh);
      ASSERT_TRUE(s.has_value()) << s.status().to_string();
      EXPECT_EQ(s->defers_first_layer_expert_weights, defers);
      seconds[defers] = schedule_compute_seconds(*s, in);
    }
    EXPECT_GT(seconds[0], 0.0);
    EXPECT_NEAR(seconds[1], seconds[0], 1e-12) << "r = " << r;
  }
}

TEST(StepSchedule, NotOverlappedEveryExchangeIsWaitedForAtOnce) {
  auto s = record_step_schedule(shape(Connectivity::kFarSkip, false, 2, true));
  ASSERT_TRUE(s.has_value());
  for (size_t i = 0; i + 1 < s->ops.size(); ++i) {
    const StepOp& op = s->ops[i];
    if (op.type != StepOp::Type::kStart || s->comms[op.comm].kind > CommKind::kDispatchBackward) continue;
    EXPECT_EQ(s->ops[i + 1].type, StepOp::Type::kWait) << s->describe();
    EXPECT_EQ(s->ops[i + 1].comm, op.comm);
  }
}

// The owned experts' norm is final once layer 0's expert backward is done
// when nothing comes back to them: overlapped without replicas its sum
// leaves then, right after layer 0's deferred weight gradients (as
// `xdmoe simulate` and the runtime defer them); with replicas, or simple,
// after backward.
TEST(StepSchedule, WithoutReplicasTheNormSumLeavesOnceLayerZerosExpertsAreDone) {
  for (bool overlapped : {false, true})
    for (bool gathers : {false, true}) {
      ScheduleShape sh = shape(Connectivity::kFarSkip, overlapped, 2, gathers);
      sh.defers_owned_expert_weights = overlapped;
      auto s = record_step_schedule(sh);
      ASSERT_TRUE(s.has_value());
      const int norm = find_op(*s, [&](const StepOp& op) {
        return op.type == StepOp::Type::kStart && s->comms[op.comm].kind == CommKind::kNormSum;
      });
      int last_compute = -1, experts0 = -1;  // of backward
      for (size_t i = 0; i < s->ops.size(); ++i) {
        const StepOp& op = s->ops[i];
        if (op.type != StepOp::Type::kCompute || op.compute == ComputeKind::kOptimizer) continue;
        last_compute = static_cast<int>(i);
        if ((op.compute == ComputeKind::kExpertsWeightBackward ||
             op.compute == ComputeKind::kOwnedExpertsWeightBackward) && op.layer <= 0)
          experts0 = static_cast<int>(i);
      }
      ASSERT_GE(norm, 0);
      ASSERT_GE(experts0, 0);
      if (overlapped && !gathers) {
        EXPECT_EQ(norm, experts0 + 1) << "right after layer 0's weight gradients\n" << s->describe();
        EXPECT_EQ(experts0, last_compute) << "the last of backward\n" << s->describe();
      } else {
        EXPECT_GT(norm, last_compute) << "overlapped " << overlapped << " gathers " << gathers << "\n"
                                      << s->describe();
      }
    }
}

TEST(StepSchedule, FarSkipStartsDispatchBeforeAttentionPartBAndRegularAfter) {
  for (Connectivity c : {Connectivity::kRegular, Connectivity::kFarSkip}) {
    auto s = record_step_schedule(shape(c, true, 1, false));
    ASSERT_TRUE(s.has_value());
    for (int layer = 0; layer < 3; ++layer) {
      const int dispatch = find_op(*s, [&](const StepOp& op) {
        return op.type == StepOp::Type::kStart && s->comms[op.comm].kind == CommKind::kDispatch && op.layer == layer;
      });
      const int part_b = find_op(*s, [&](const StepOp& op) {
        return op.type == StepOp::Type::kCompute && op.compute == ComputeKind::kAttentionB && op.layer == layer;
      });
      ASSERT_GE(dispatch, 0);
      ASSERT_GE(part_b, 0);
      if (c == Connectivity::kFarSkip) EXPECT_LT(dispatch, part_b) << "layer " << layer << "\n" << s->describe();
      else EXPECT_GT(dispatch, part_b) << "layer " << layer;
    }
  }
}

TEST(StepSchedule, EachChunkComputesItsExpertsOnceItsRowsAreIn) {
  const int r = 3;
  auto s = record_step_schedule(shape(Connectivity::kFarSkip, true, r, true));
  ASSERT_TRUE(s.has_value());
  std::map<ComputeKind, int> per_layer0;
  for (const StepOp& op : s->ops)
    if (op.type == StepOp::Type::kCompute && op.layer == 0) per_layer0[op.compute]++;
  EXPECT_EQ(per_layer0[ComputeKind::kRoutedExperts], r);
  EXPECT_EQ(per_layer0[ComputeKind::kExpertsInputBackward], r);
  EXPECT_EQ(per_layer0[ComputeKind::kExpertsWeightBackward], r);
  EXPECT_EQ(per_layer0[ComputeKind::kAttentionA], 1);
  // Chunk i's experts run right after its Dispatch is waited for, and the
  // layer's gathered experts are waited for before the first.
  for (size_t i = 0; i < s->ops.size(); ++i)
    if (s->ops[i].type == StepOp::Type::kCompute && s->ops[i].compute == ComputeKind::kRoutedExperts) {
      ASSERT_GT(i, 0u);
      const StepOp& before = s->ops[i - 1];
      EXPECT_EQ(before.type, StepOp::Type::kWait);
      EXPECT_EQ(s->comms[before.comm].kind, CommKind::kDispatch);
    }
  const int gather0 = find_op(*s, [&](const StepOp& op) {
    return op.type == StepOp::Type::kWait && s->comms[op.comm].kind == CommKind::kExpertGather && op.layer == 0;
  });
  const int experts0 = find_op(*s, [&](const StepOp& op) {
    return op.type == StepOp::Type::kCompute && op.compute == ComputeKind::kRoutedExperts && op.layer == 0;
  });
  EXPECT_GE(gather0, 0);
  EXPECT_LT(gather0, experts0);
}

// A backward degree of 2 with r = 4: each backward exchange carries two
// chunks, so a layer has two of each backward A2A, each handing over two
// chunks' compute; the forward keeps its four.
TEST(StepSchedule, ABackwardExchangeOfTwoChunksHandsOverBothChunksCompute) {
  ScheduleShape sh = shape(Connectivity::kFarSkip, true, 4, true);
  sh.backward_pipeline_degree = 2;
  auto s = record_step_schedule(sh);
  ASSERT_TRUE(s.has_value()) << s.status().to_string();
  EXPECT_EQ(s->backward_pipeline_degree, 2);
  std::map<CommKind, int> layer0;
  for (const ScheduledComm& c : s->comms)
    if (c.layer == 0) {
      layer0[c.kind]++;
      const bool backward = c.kind == CommKind::kCombineBackward || c.kind == CommKind::kDispatchBackward;
      if (c.kind <= CommKind::kDispatchBackward) {
        EXPECT_EQ(c.span, backward ? 2 : 1) << comm_kind_name(c.kind);
      }
    }
  EXPECT_EQ(layer0[CommKind::kDispatch], 4);
  EXPECT_EQ(layer0[CommKind::kCombine], 4);
  EXPECT_EQ(layer0[CommKind::kCombineBackward], 2);
  EXPECT_EQ(layer0[CommKind::kDispatchBackward], 2);
  std::map<ComputeKind, int> per_layer0;
  for (const StepOp& op : s->ops)
    if (op.type == StepOp::Type::kCompute && op.layer == 0) per_layer0[op.compute]++;
  EXPECT_EQ(per_layer0[ComputeKind::kExpertsInputBackward], 4);
  EXPECT_EQ(per_layer0[ComputeKind::kExpertsWeightBackward], 4);
  EXPECT_NE(s->describe().find("combine backward chunks 2..3"), std::string::npos) << s->describe();
  sh.backward_pipeline_degree = 3;
  EXPECT_FALSE(record_step_schedule(sh).has_value()) << "3 does not divide 4";
}

// A traced run's compute spans with the moves of "work while waiting"
// (docs/overlap.md) undone: an early piece of attention (b) before the
// router, or before the routed experts where the plan puts part (b) after
// them (the last layer under FarSkip MoE), and the shared experts before the
// routed ones, forward (where the plan does not put them first) or backward.
// Anything else out of place stays out of place.
std::vector<std::string> without_waiting_moves(std::vector<std::string> spans) {
  auto layer_of = [](const std::string& s) { return s.substr(s.rfind(' ') + 1); };
  // HybridEP, layer l's gathered experts late: layer l+1's attention (a) and
  // part of its (b) ran before layer l's routed experts; back after them.
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].rfind("attention (a) ", 0) != 0) continue;
    const std::string next = layer_of(spans[i]);
    size_t j = i + 1;
    while (j < spans.size() && spans[j] == "attention (b) " + next) ++j;
    if (j < spans.size() && spans[j] == "routed experts " + std::to_string(std::stoi(next) - 1))
      std::rotate(spans.begin() + i, spans.begin() + j, spans.begin() + j + 1);
  }
  std::set<std::string> experts_first;  // layers whose attention (b) ends after their routed experts
  for (size_t i = 0; i < spans.size(); ++i)
    for (size_t j = i + 1; j < spans.size(); ++j)
      if (spans[i].rfind("routed experts ", 0) == 0 && spans[j] == "attention (b) " + layer_of(spans[i]))
        experts_first.insert(layer_of(spans[i]));
  for (size_t i = 0; i + 1 < spans.size();) {
    const std::string layer = layer_of(spans[i]);
    if (spans[i] == "attention (b) " + layer &&
        (spans[i + 1] == "router " + layer ||
         (experts_first.count(layer) && spans[i + 1] == "routed experts " + layer))) {
      spans.erase(spans.begin() + i);
      if (i > 0) --i;  // an earlier piece may now stand before the router
    } else
      ++i;
  }
  for (size_t i = 0; i + 1 < spans.size(); ++i) {
    const std::string layer = layer_of(spans[i]);
    if (spans[i] == "shared experts " + layer && spans[i + 1] == "routed experts " + layer &&
        !experts_first.count(layer))
      std::swap(spans[i], spans[i + 1]);
    // Backward: back to its planned place, after the routed experts and
    // after an attention backward that follows them (HybridEP).
    if (spans[i] == "shared experts backward " + layer && spans[i + 1] == "routed experts backward " + layer) {
      const size_t to = i + 2 < spans.size() && spans[i + 2] == "attention backward " + layer ? i + 2 : i + 1;
      std::rotate(spans.begin() + i, spans.begin() + i + 1, spans.begin() + to + 1);
    }
  }
  return spans;
}

TEST(StepSchedule, WaitingMovesAreUndoneAndNothingElse) {
  const std::vector<std::string> moved = {"attention (a) 1",  "attention (b) 1",          "router 1",
                                          "attention (b) 1",  "shared experts 1",         "routed experts 1",
                                          "shared experts backward 1", "routed experts backward 1"};
  const std::vector<std::string> planned = {"attention (a) 1", "router 1", "attention (b) 1",
                                            "routed experts 1", "shared experts 1", "routed experts backward 1",
                                            "shared experts backward 1"};
  EXPECT_EQ(without_waiting_moves(moved), planned);
  EXPECT_EQ(without_waiting_moves(planned), planned);
  // Shared experts of another layer, or attention (b) after the router, stay.
  const std::vector<std::string> other = {"shared experts 0", "routed experts 1", "router 1", "attention (b) 1"};
  EXPECT_EQ(without_waiting_moves(other), other);
  // The last layer under FarSkip MoE: the shared experts first and part (b)
  // after the routed experts are the plan; an early piece of part (b) is not.
  const std::vector<std::string> last = {"router 1", "shared experts 1", "routed experts 1", "attention (b) 1"};
  EXPECT_EQ(without_waiting_moves({"router 1", "shared experts 1", "attention (b) 1", "routed experts 1",
                                   "attention (b) 1"}),
            last);
  EXPECT_EQ(without_waiting_moves(last), last);
  // HybridEP, layer 0's experts late: layer 1's attention began in the wait,
  // its core in two pieces (one more while Combine(0) was in flight).
  EXPECT_EQ(without_waiting_moves({"attention (a) 0", "router 0", "attention (b) 0", "shared experts 0",
                                   "attention (a) 1", "attention (b) 1", "routed experts 0", "attention (b) 1",
                                   "router 1", "attention (b) 1"}),
            (std::vector<std::string>{"attention (a) 0", "router 0", "attention (b) 0", "routed experts 0",
                                      "shared experts 0", "attention (a) 1", "router 1", "attention (b) 1"}));
  // HybridEP's backward: the attention backward follows the routed experts.
  EXPECT_EQ(without_waiting_moves({"shared experts backward 1", "routed experts backward 1", "attention backward 1",
                                   "router backward 0"}),
            (std::vector<std::string>{"routed experts backward 1", "attention backward 1",
                                      "shared experts backward 1", "router backward 0"}));
}

// The compute spans a traced real run makes, in order, are the schedule's:
// the schedule is the runtime's, not a copy of it. With the replicas' weight
// gradients early and late.
TEST(StepSchedule, IsTheOrderOfATracedRealRun) {
  for (const bool late : {false, true}) {
    SCOPED_TRACE(late ? "late" : "early");
    const std::string dir = (fs::temp_directory_path() / ("xdmoe_schedule_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir);
    std::string yaml = testing::model_yaml();
    yaml.replace(yaml.find("  steps: 20\n"), 12, "  steps: 3\n");
    yaml.replace(yaml.find("  eval_every: 0\n"), 16,
                 "  eval_every: 0\n  trace_steps: [2]\n  trace_dir: " + dir + "/trace\n");
    yaml += "farskip:\n  enabled: true\n  overlapped: true\n"
            "cluster:\n  levels:\n    - name: dc\n      size: 2\n"
            "      link: {bandwidth: 10gbit, latency: 0ms, shape: true}\n"
            "    - name: worker\n      size: 2\n      link: {bandwidth: 10gbit, latency: 0ms, shape: false}\n"
            "  expert_parallel:\n    mode: hybrid\n    domain_sizes: [1, 2]\n    memory_cap: unlimited\n"
            "    pipeline_degree: 2\n    replica_weight_gradients: " + std::string(late ? "late" : "early") + "\n";
    auto job = testing::run_job(dir, yaml, 4, {});
    ASSERT_TRUE(job.ok()) << job.logs();
    auto cfg = parse_job_config(yaml, "<test>");
    ASSERT_TRUE(cfg.has_value()) << cfg.status().to_string();
    // Domains 1 x 2: one level of replicas, so the owned experts' weight
    // gradients come after the embedding's (late, the replicas' too).
    ScheduleShape shape{cfg->train.model, 2, true, true, true};
    shape.defers_replica_expert_weights = late;
    auto s = record_step_schedule(shape);
    ASSERT_TRUE(s.has_value());
    // The schedule's compute, chunks of one span merged into one, and the
    // late replicas' layers into the one span the runtime traces.
    auto span_of = [](ComputeKind k) -> std::string {
      if (k == ComputeKind::kExpertsInputBackward || k == ComputeKind::kExpertsWeightBackward)
        return "routed experts backward";
      return compute_kind_name(k);
    };
    std::vector<std::string> expected;
    int replica_layers = 0;
    for (const StepOp& op : s->ops) {
      // The traced step's optimizer span is the previous step's update.
      if (op.type != StepOp::Type::kCompute || op.compute == ComputeKind::kOptimizer) continue;
      const bool replicas = op.compute == ComputeKind::kReplicaExpertsWeightBackward;
      replica_layers += replicas;
      const std::string e = span_of(op.compute) + " " + std::to_string(replicas ? -1 : op.layer);
      const bool merged = e.rfind("routed experts", 0) == 0 || replicas;
      if (expected.empty() || expected.back() != e || !merged) expected.push_back(e);
    }
    EXPECT_EQ(replica_layers, late ? cfg->train.model.num_layers : 0) << "late: one per layer, before its send";
    for (int rank = 0; rank < 4; ++rank) {
      std::ifstream in(dir + "/trace/trace-step2-rank" + std::to_string(rank) + ".json");
      ASSERT_TRUE(in) << "rank " << rank << " wrote no trace";
      const nlohmann::json trace = nlohmann::json::parse(in);
      std::vector<std::pair<double, std::string>> spans;
      for (const auto& e : trace["traceEvents"]) {
        if (e["ph"] != "X" || e["cat"] != "compute" || e["name"] == "optimizer") continue;
        const int layer = e.contains("args") ? e["args"]["layer"].get<int>() : -1;
        spans.emplace_back(e["ts"].get<double>(), e["name"].get<std::string>() + " " + std::to_string(layer));
      }
      std::sort(spans.begin(), spans.end());
      std::vector<std::string> got;
      for (auto& [t, name] : spans) got.push_back(name);
      got = without_waiting_moves(got);
      EXPECT_EQ(got, expected) << "rank " << rank << "\nschedule:\n" << s->describe();
    }
    fs::remove_all(dir);
  }
}

nlohmann::json simulate(const std::string& args);

// One small validation case (bench/simulate_validation.py has the full
// table): on the demo's 2 DC x 2 links, EP and HybridEP [2, 1] run for real;
// the simulator, given each run's measured compute, ranks them as the runs do.
// EP is about twice as slow there, so the ranking is robust to a noisy machine.
TEST(Simulator, RanksEpAndHybridEpAsRealRunsDo) {
  const std::string dir = (fs::temp_directory_path() / ("xdmoe_simval_" + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string config = dir + "/job.yaml";
  test_util::spit(config,
                  "model:\n  expert_intermediate_size: 128\n  shared_intermediate_size: 128\n"
                  "train:\n  steps: 6\n  log_every: 100\n  eval_every: 0\n"
                  "cluster:\n  expert_parallel:\n    memory_cap: unlimited\n");
  auto [code, out] = testing::run(testing::xdmoe_binary() + " launch --config " + config + " --run-dir " + dir +
                                  " --no-replan --no-probe --mode ep+farskip+r1 --mode hybrid+farskip+r1+d2x1");
  ASSERT_EQ(code, 0) << out;
  std::map<std::string, double> measured, simulated, full;
  for (const std::string run : {"ep+farskip+r1", "hybrid+farskip+r1+d2x1"}) {
    std::ifstream in(dir + "/" + run + "/summary.json");
    ASSERT_TRUE(in) << run;
    const nlohmann::json j = nlohmann::json::parse(in);
    measured[run] = j["mean_step_s"].get<double>();
    const std::string domains = run[0] == 'e' ? "1,1" : "2,1";
    const std::string args = "--config " + config + " --mode hybrid --domains " + domains +
                             " --farskip --pipeline-degree 1 --measured-compute-s " +
                             std::to_string(j["mean_compute_s"].get<double>());
    const nlohmann::json sim = simulate(args);
    ASSERT_TRUE(sim.contains("simulated_step_s")) << run;
    simulated[run] = sim["simulated_step_s"].get<double>();
    // The full model: the run's routing skew per link (its summary) and the
    // per-hop overhead a traced 2 x 2 EP step measured (docs/simulation.md).
    std::string extra = " --hop-overhead dc=1.7ms --hop-overhead worker=2.8ms";
    const nlohmann::json& bytes = j["bytes_per_step"];
    for (const char* link : {"dc", "worker"}) {
      const std::string l = link;
      const double sent = bytes.value(l + "/moe_dispatch_raw", 0.0) + bytes.value(l + "/moe_combine_raw", 0.0);
      if (sent <= 0) continue;
      const double factor = std::max(1.0, bytes.value(l + "/moe_peak_raw", 0.0) / sent);
      extra += " --a2a-imbalance " + l + "=" + std::to_string(factor);
    }
    const nlohmann::json with = simulate(args + extra);
    ASSERT_TRUE(with.contains("simulated_step_s")) << run;
    full[run] = with["simulated_step_s"].get<double>();
    std::printf("[simulate] %s: measured %.1f ms, simulated %.1f ms (%+.1f%%), with routing and hop overhead %.1f ms "
                "(%+.1f%%)\n",
                run.c_str(), measured[run] * 1e3, simulated[run] * 1e3, 100 * (simulated[run] / measured[run] - 1),
                full[run] * 1e3, 100 * (full[run] / measured[run] - 1));
  }
  const std::string ep = "ep+farskip+r1", hybrid = "hybrid+farskip+r1+d2x1";
  const bool measured_hybrid_faster = measured[hybrid] < measured[ep];
  EXPECT_EQ(measured_hybrid_faster, simulated[hybrid] < simulated[ep]);
  EXPECT_EQ(measured_hybrid_faster, full[hybrid] < full[ep]);
  // EP waits on the most hops in series: routing and the CPU per hop are
  // what the network model alone misses there, so they bring it closer.
  EXPECT_LT(std::abs(full[ep] - measured[ep]), std::abs(simulated[ep] - measured[ep]));
  fs::remove_all(dir);
}

// `xdmoe simulate --json` with these arguments.
nlohmann::json simulate(const std::string& args) {
  auto [code, out] = testing::run(testing::xdmoe_binary() + " simulate --json --flops-per-s 2e10 " + args);
  EXPECT_EQ(code, 0) << out;
  const size_t brace = out.find('{');
  if (code != 0 || brace == std::string::npos) return nlohmann::json::object();
  return nlohmann::json::parse(out.substr(brace));
}

TEST(Simulator, LeavingDatacentersToSymmetryGivesTheWholePlatformsAnswer) {
  const std::string job = "--dcs 8 --workers-per-dc 2 --experts-per-worker 1 --mode hybrid --domains 2,1 "
                          "--uplink 200mbit --backbone 1gbit --farskip --steps 2 --flows aggregate";
  const nlohmann::json all = simulate(job + " --simulated-dcs 8");
  ASSERT_TRUE(all.contains("simulated_step_s"));
  EXPECT_EQ(all["simulated_workers"], 16);
  for (int k : {1, 2}) {
    const nlohmann::json part = simulate(job + " --simulated-dcs " + std::to_string(k));
    ASSERT_TRUE(part.contains("simulated_step_s"));
    EXPECT_EQ(part["simulated_workers"], 2 * k);
    EXPECT_NEAR(part["simulated_step_s"].get<double>(), all["simulated_step_s"].get<double>(),
                1e-9 * all["simulated_step_s"].get<double>())
        << k << " of 8 datacenters";
  }
}

TEST(Simulator, AFlowPerMessageAndAFlowPerWorkerAgreeWhenSendersAreTheBottleneck) {
  const std::string job = "--dcs 4 --workers-per-dc 2 --experts-per-worker 1 --mode hybrid --domains 1,2 --steps 2";
  const nlohmann::json pairs = simulate(job + " --flows pairs");
  const nlohmann::json aggregate = simulate(job + " --flows aggregate");
  ASSERT_TRUE(pairs.contains("simulated_step_s") && aggregate.contains("simulated_step_s"));
  EXPECT_EQ(pairs["flows"], "pairs");
  EXPECT_GT(pairs["flow_count"].get<int64_t>(), aggregate["flow_count"].get<int64_t>());
  // A flow carries whole bytes, rounded up: per message or per worker and
  // phase, so with fractional sizes (a token once per worker's grouped share)
  // the two may differ by under a byte a message: 3.2 us of 1.49 s here.
  EXPECT_NEAR(pairs["simulated_step_s"].get<double>(), aggregate["simulated_step_s"].get<double>(),
              1e-5 * pairs["simulated_step_s"].get<double>());
}

TEST(Simulator, AnOversubscribedUplinkSlowsTheStepTheStreamModelDoesNotSee) {
  const std::string job = "--dcs 4 --workers-per-dc 4 --experts-per-worker 1 --mode ep --steps 2 --bandwidth dc=1gbit "
                          "--bandwidth worker=100gbit";
  const nlohmann::json free = simulate(job);
  const nlohmann::json shared = simulate(job + " --uplink 1gbit");  // 4 workers' 1gbit into one 1gbit uplink
  ASSERT_TRUE(free.contains("simulated_step_s") && shared.contains("simulated_step_s"));
  EXPECT_EQ(free["planner_step_s"], shared["planner_step_s"]) << "the planner has no uplinks";
  EXPECT_GT(shared["simulated_step_s"].get<double>(), 1.2 * free["simulated_step_s"].get<double>());
  // The uplink is the busiest link: it carries four workers' inter-DC bytes.
  EXPECT_GT(shared["steps"][1]["busiest_link_s"].get<double>(), 3.9 * free["steps"][1]["busiest_link_s"].get<double>());
}

TEST(Simulator, EveryStepTakesAtLeastItsBound) {
  for (const char* mode : {"--mode ep", "--mode hybrid --domains 2,1", "--mode hybrid --domains 2,2 --farskip"}) {
    const nlohmann::json r = simulate(std::string(mode) + " --steps 3");
    ASSERT_TRUE(r.contains("steps")) << mode;
    for (const auto& st : r["steps"]) {
      EXPECT_GE(st["step_s"].get<double>(), st["bound_s"].get<double>() * (1 - 1e-9)) << mode;
    }
  }
}

TEST(Simulator, ASharedBackboneIsInTheBound) {
  const std::string job = "--dcs 4 --workers-per-dc 2 --experts-per-worker 1 --mode ep --steps 2 --bandwidth dc=1gbit";
  const nlohmann::json free = simulate(job);
  const nlohmann::json narrow = simulate(job + " --backbone 100mbit");
  ASSERT_TRUE(free.contains("steps") && narrow.contains("steps"));
  // All 8 workers' inter-DC bytes cross a backbone a tenth of one worker's
  // egress: 80 times one egress's time, at least 20 times the busiest link's.
  EXPECT_GT(narrow["steps"][1]["busiest_link_s"].get<double>(), 20 * free["steps"][1]["busiest_link_s"].get<double>());
  EXPECT_GE(narrow["steps"][1]["step_s"].get<double>(), narrow["steps"][1]["bound_s"].get<double>() * (1 - 1e-9));
}

TEST(Simulator, RoutingImbalanceLengthensTheStepButNotItsBound) {
  const std::string job = "--mode ep --steps 2 --bandwidth dc=100mbit";
  const nlohmann::json uniform = simulate(job);
  const nlohmann::json skewed = simulate(job + " --a2a-imbalance dc=1.5");
  ASSERT_TRUE(uniform.contains("steps") && skewed.contains("steps"));
  EXPECT_EQ(skewed["a2a_imbalance"][0].get<double>(), 1.5);
  EXPECT_EQ(skewed["a2a_imbalance"][1].get<double>(), 1.0) << "levels not named stay uniform";
  // The demo's EP step is mostly token A2As over the DC link: half as many
  // bytes again on each hop lengthens it by more than a fifth; the bound
  // counts the bytes uniform routing moves.
  EXPECT_GT(skewed["simulated_step_s"].get<double>(), 1.2 * uniform["simulated_step_s"].get<double>());
  EXPECT_DOUBLE_EQ(skewed["steps"][1]["bound_s"].get<double>(), uniform["steps"][1]["bound_s"].get<double>());
  // The planner's prediction beside it prices the longer hops too. Its
  // pipelined A2As lose less than the simulator's: a Combine chunk leaves on
  // the peer's egress, which its lighter Dispatch left free (the simulator
  // lengthens every message); with every A2A blocking, both lose as much.
  EXPECT_GT(skewed["planner_step_s"].get<double>(), 1.1 * uniform["planner_step_s"].get<double>());
  const nlohmann::json simple = simulate(job + " --no-overlap");
  const nlohmann::json simple_skewed = simulate(job + " --no-overlap --a2a-imbalance dc=1.5");
  ASSERT_TRUE(simple.contains("planner_step_s") && simple_skewed.contains("planner_step_s"));
  EXPECT_GT(simple_skewed["planner_step_s"].get<double>(), 1.2 * simple["planner_step_s"].get<double>());
  EXPECT_NEAR(simple_skewed["planner_step_s"].get<double>() / simple["planner_step_s"].get<double>(),
              simple_skewed["simulated_step_s"].get<double>() / simple["simulated_step_s"].get<double>(), 0.02);
}

// A token once per worker: the flows carry the planner's grouped rows. On
// 2 DCs of one worker holding 2 of the 4 experts each (top-2), 5/6 of the
// token rows cross, so the link is busy less and auto (the default) picks
// it; with every expert gathered (HybridEP 2 x 2) no token crosses a link.
TEST(Simulator, ATokenOncePerWorkerMovesFewerTokenBytes) {
  const std::string job =
      "--dcs 2 --workers-per-dc 1 --experts-per-worker 2 --mode ep --steps 2 --bandwidth dc=100mbit";
  const nlohmann::json per_expert = simulate(job + " --tokens-once-per-worker=false");
  const nlohmann::json once = simulate(job + " --tokens-once-per-worker");
  const nlohmann::json chosen = simulate(job);
  const nlohmann::json gathered = simulate("--mode hybrid --domains 2,2 --steps 2");
  ASSERT_TRUE(per_expert.contains("steps") && once.contains("steps") && chosen.contains("steps") &&
              gathered.contains("steps"));
  EXPECT_FALSE(per_expert["tokens_once_per_worker"].get<bool>());
  EXPECT_TRUE(once["tokens_once_per_worker"].get<bool>());
  EXPECT_TRUE(chosen["tokens_once_per_worker"].get<bool>()) << "auto: clearly faster on the slow link";
  EXPECT_FALSE(gathered["tokens_once_per_worker"].get<bool>()) << "nothing to group: a row per expert stays";
  const double busy = per_expert["steps"][1]["busiest_link_s"].get<double>();
  const double busy_once = once["steps"][1]["busiest_link_s"].get<double>();
  std::printf("[simulate] busiest link per step: %.1f ms a row per expert, %.1f ms once per worker\n", busy * 1e3,
              busy_once * 1e3);
  EXPECT_LT(busy_once, 0.95 * busy);
  EXPECT_LT(once["simulated_step_s"].get<double>(), per_expert["simulated_step_s"].get<double>());
  EXPECT_LT(once["planner_step_s"].get<double>(), per_expert["planner_step_s"].get<double>());
}

TEST(Simulator, AHopOverheadDelaysEveryTokenHopOnItsLevelButNotTheBound) {
  // One chunk per A2A (r = 1): chunks of a pipeline can hide one another's
  // overhead.
  const std::string job = "--mode ep --steps 2 --bandwidth dc=100mbit --pipeline-degree 1";
  const nlohmann::json plain = simulate(job);
  const nlohmann::json slow = simulate(job + " --hop-overhead worker=5ms");
  ASSERT_TRUE(plain.contains("steps") && slow.contains("steps"));
  EXPECT_EQ(slow["hop_overhead_s"][0].get<double>(), 0.0) << "levels not named cost nothing more";
  EXPECT_EQ(slow["hop_overhead_s"][1].get<double>(), 0.005);
  // The demo's EP step waits for 16 token A2As (4 MoE layers, forward and
  // backward Dispatch and Combine), each with a hop inside the DC: at least
  // 16 overheads more; the bound counts bytes only.
  EXPECT_GE(slow["simulated_step_s"].get<double>() - plain["simulated_step_s"].get<double>(), 16 * 0.005 * (1 - 1e-9));
  EXPECT_DOUBLE_EQ(slow["steps"][1]["bound_s"].get<double>(), plain["steps"][1]["bound_s"].get<double>());
}

TEST(Simulator, BadArgumentsAreRefusedByName) {
  auto [code, out] = testing::run(testing::xdmoe_binary() + " simulate --flops-per-s 2e10 --dcs 3");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("num_experts"), std::string::npos) << out;
  std::tie(code, out) = testing::run(testing::xdmoe_binary() + " simulate --flops-per-s 2e10 --bandwidth moon=1gbit");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("no level named 'moon'"), std::string::npos) << out;
  std::tie(code, out) = testing::run(testing::xdmoe_binary() +
                                     " simulate --flops-per-s 2e10 --dcs 8 --experts-per-worker 1 --simulated-dcs 2 --flows pairs");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("pairs needs every datacenter"), std::string::npos) << out;
  std::tie(code, out) = testing::run(testing::xdmoe_binary() + " simulate --flops-per-s 2e10 --a2a-imbalance dc=0.5");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("imbalance must be in [1, 2]"), std::string::npos) << out;
  std::tie(code, out) = testing::run(testing::xdmoe_binary() + " simulate --flops-per-s 2e10 --a2a-imbalance dc=3");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("imbalance must be in [1, 2]"), std::string::npos) << out;
  std::tie(code, out) = testing::run(testing::xdmoe_binary() + " simulate --flops-per-s 2e10 --a2a-imbalance dc=x");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("'x' is not a number"), std::string::npos) << out;
  std::tie(code, out) = testing::run(testing::xdmoe_binary() + " simulate --flops-per-s 2e10 --hop-overhead dc=-1ms");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("--hop-overhead dc=-1ms: bad duration"), std::string::npos) << out;
  std::tie(code, out) = testing::run(testing::xdmoe_binary() + " simulate --flops-per-s 2e10 --cfg no/such:setting");
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("no/such"), std::string::npos) << out;
}

}  // namespace
}  // namespace xd
