// Live re-planning: the replanner re-fits a link class from the bursts the
// workers measured and re-plans only when the fit moves far; it re-fits the
// compute the workers measured and its prediction follows; and a running
// job throttled hard switches its domains at a step boundary and still
// trains exactly as one process does.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <fstream>
#include <sstream>
#include <regex>
#include <string>

#include "cluster/job_config.h"
#include "coordinator/planner.h"
#include "coordinator/replanner.h"
#include "job_runner.h"
#include "model/trainer.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using testing::xdmoe_binary;

std::string example_with(const std::map<std::string, std::string>& replace) {
  std::ifstream in(std::string(XD_SOURCE_DIR) + "/examples/2dc.yaml");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  for (const auto& [from, to] : replace) {
    const size_t at = text.find(from);
    XD_CHECK_MSG(at != std::string::npos, "examples/2dc.yaml changed");
    text.replace(at, from.size(), to);
  }
  return text;
}

// The demo model on 2 DCs of 2 workers; the DC link as given.
JobConfig demo_job(const std::string& dc_link) {
  auto job = parse_job_config(example_with({{"bandwidth: 100mbit, latency: 10ms", dc_link}}), "<test>");
  XD_CHECK(job.has_value());
  return *job;
}

// {bursts, bytes, seconds} a class of `bytes_per_s` and `alpha` would show.
std::array<double, 3> bursts_at(double bytes_per_s, double alpha, double bursts, double bytes) {
  return {bursts, bytes, bursts * alpha + bytes / bytes_per_s};
}

TEST(Replanner, ALinkMeasuredCloseToThePlansAssumptionChangesNothing) {
  const JobConfig job = demo_job("bandwidth: 1gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  Replanner r(in, plan_iteration(in), {"dc", "worker"}, {true, true}, 2, 2);
  for (int64_t step = 1; step <= 10; ++step)
    EXPECT_FALSE(r.on_step(step, {{"dc", bursts_at(0.8 * 125e6, 1e-3, 40, 8e6)}}, step, 100)) << step;
  EXPECT_NEAR(r.measured().at("dc"), 0.8 * 125e6, 1e3);  // the fit: (seconds - bursts * alpha) / bytes
}

// A run's first steps are not fitted (ReplanOptions::first_fitted_step; the
// coordinator's: 4): the same far measurement changes nothing over steps
// 1-3 and re-fits once steps 4-6 have filled a window.
TEST(Replanner, TheFirstStepsOfARunAreNotFitted) {
  const JobConfig job = demo_job("bandwidth: 1gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  ReplanOptions options;
  options.first_fitted_step = 4;
  Replanner r(in, plan_iteration(in), {"dc", "worker"}, {true, true}, 2, 2, options);
  std::optional<PlanChange> c;
  int64_t step = 1;
  for (; step <= 10 && !c; ++step) c = r.on_step(step, {{"dc", bursts_at(0.1 * 125e6, 1e-3, 40, 8e6)}}, step, 100);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->at_step, 6) << "the first window is steps 4-6";
  EXPECT_EQ(c->link, "dc");
}

// The replanner prices and reports the degrees the workers run. EP on a
// DC link measured at 40 Mbit/s: from degrees 8/1 it switches to the pair
// the fitted plan picks for the same domains, having priced 8/1 itself; from
// that pair the same measurement keeps the plan, whose candidate is then
// those domains at the running degrees.
TEST(Replanner, TheDegreesAloneCanSwitchAndAKeptPlanKeepsTheRunningDegrees) {
  const JobConfig job = demo_job("bandwidth: 100mbit, latency: 10ms");
  PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  in.expert_parallel.mode = EpMode::kEp;  // tokens cross the DC link: the degrees matter
  in.expert_parallel.domain_sizes = {1, 1};
  in.overlapped = true;
  const Plan start = plan_iteration(in);
  auto refit = [&](Replanner* r) {
    std::optional<PlanChange> c;
    for (int64_t step = 1; step <= 6 && !c; ++step)
      c = r->on_step(step, {{"dc", bursts_at(5e6, 10e-3, 40, 8e6)}}, step, 100);  // 40 Mbit/s: far
    return c;
  };
  Replanner odd(in, start, {"dc", "worker"}, {true, true}, 8, 1);
  const std::optional<PlanChange> c = refit(&odd);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->old_schedule.pipeline_degree, 8);
  EXPECT_EQ(c->old_schedule.backward_pipeline_degree, 1);
  ASSERT_TRUE(c->switched()) << c->reason;
  EXPECT_EQ(c->new_domains, c->old_domains);
  EXPECT_TRUE(c->new_schedule.pipeline_degree != 8 || c->new_schedule.backward_pipeline_degree != 1);
  EXPECT_EQ(c->new_schedule.pipeline_degree % c->new_schedule.backward_pipeline_degree, 0);
  EXPECT_LT(c->new_predicted_s, 0.95 * c->old_now_predicted_s);
  EXPECT_EQ(odd.pipeline_degree(), c->new_schedule.pipeline_degree);
  EXPECT_EQ(odd.backward_pipeline_degree(), c->new_schedule.backward_pipeline_degree);
  std::printf("[replan] EP at 8/1, the DC link measured at 40 Mbit/s: -> %d/%d (predicted %.1f -> %.1f ms)\n",
              c->new_schedule.pipeline_degree, c->new_schedule.backward_pipeline_degree, c->old_now_predicted_s * 1e3,
              c->new_predicted_s * 1e3);

  Replanner best(in, start, {"dc", "worker"}, {true, true}, c->new_schedule.pipeline_degree,
                 c->new_schedule.backward_pipeline_degree);
  const std::optional<PlanChange> kept = refit(&best);
  ASSERT_TRUE(kept.has_value());
  EXPECT_FALSE(kept->switched()) << kept->reason;
  EXPECT_EQ(best.plan().choice().pipeline_degree, c->new_schedule.pipeline_degree);
  EXPECT_EQ(best.plan().choice().backward_pipeline_degree, c->new_schedule.backward_pipeline_degree);
  EXPECT_NEAR(kept->old_now_predicted_s, c->new_predicted_s, 1e-9);
}

// When the replicas' weight gradients come is part of the plan the workers
// run: a FarSkip job started with them late (HybridEP 2 x 1 over a 10 Gbit/s
// DC link) whose DC link then measures at 100 Mbit/s, where those gradients
// fill the link all backward, switches them to early; the replanner prices
// the running plan late and reports both.
TEST(Replanner, ASlowLinkMovesTheReplicasWeightGradientsBackToEarly) {
  auto parsed = parse_job_config(example_with({{"bandwidth: 100mbit, latency: 10ms", "bandwidth: 10gbit, latency: 10ms"},
                                               {"# farskip: {enabled: true}", "farskip: {enabled: true}"}}),
                                 "<test>");
  ASSERT_TRUE(parsed.has_value()) << parsed.status().to_string();
  const JobConfig& job = *parsed;
  PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  in.expert_parallel.mode = EpMode::kHybrid;
  in.expert_parallel.domain_sizes = {2, 1};
  in.overlapped = true;
  PlannerInputs started_late = in;
  started_late.expert_parallel.replica_weight_gradients = ReplicaWeightGradients::kLate;
  const Plan start = plan_iteration(started_late);
  ASSERT_TRUE(start.choice().replica_weights_late);
  const int r = start.choice().pipeline_degree, rb = start.choice().backward_pipeline_degree;
  Replanner replanner(in, start, {"dc", "worker"}, {true, true}, r, rb);
  EXPECT_TRUE(replanner.replica_weights_late());
  std::optional<PlanChange> c;
  for (int64_t step = 1; step <= 6 && !c; ++step)
    c = replanner.on_step(step, {{"dc", bursts_at(12.5e6, 10e-3, 40, 8e6)}}, step, 100);  // 100 Mbit/s
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(c->switched()) << c->reason;
  EXPECT_TRUE(c->old_schedule.replica_weights_late);
  EXPECT_FALSE(c->new_schedule.replica_weights_late);
  EXPECT_FALSE(replanner.replica_weights_late());
  EXPECT_EQ(c->new_domains, c->old_domains);
  EXPECT_LT(c->new_predicted_s, c->old_now_predicted_s);
  std::printf("[replan] HybridEP 2 x 1, replicas' weight gradients late, the DC link at 100 Mbit/s: early "
              "(predicted %.1f -> %.1f ms)\n", c->old_now_predicted_s * 1e3, c->new_predicted_s * 1e3);
}

TEST(Replanner, AThrottledLinkIsReFittedAndTheBetterDomainsStartTwoStepsAhead) {
  // At 10 Gbit/s gathering every expert ([2,2]) is best; at 100 Mbit/s the
  // experts gathered inside each DC only ([1,2]) are.
  const JobConfig job = demo_job("bandwidth: 10gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  const Plan start = plan_iteration(in);
  Replanner r(in, start, {"dc", "worker"}, {true, true}, 2, 2);
  for (int64_t step = 1; step <= 3; ++step) EXPECT_FALSE(r.on_step(step, {{"dc", bursts_at(1.25e9, 1e-3, 40, 8e6)}}, step, 100));
  std::optional<PlanChange> c;
  for (int64_t step = 4; step <= 6 && !c; ++step)
    c = r.on_step(step, {{"dc", bursts_at(12.5e6, 1e-3, 40, 8e6)}}, step + 1, 100);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->at_step, 6);
  EXPECT_NEAR(c->measured_bytes_per_s, 12.5e6, 1e3);
  EXPECT_FALSE(c->compute_refit());
  EXPECT_EQ(c->old_domains, start.choice().domain_sizes);
  ASSERT_TRUE(c->switched()) << c->reason;
  EXPECT_EQ(c->from_step, 7 + 3);  // the furthest reported step + lead_steps
  EXPECT_NE(c->new_domains, c->old_domains);
  EXPECT_LT(c->new_predicted_s, 0.95 * c->old_now_predicted_s);
  EXPECT_EQ(r.plan().choice().domain_sizes, c->new_domains);
  // Steps of the old plan still in flight are not measured again.
  EXPECT_FALSE(r.on_step(7, {{"dc", bursts_at(1.25e9, 1e-3, 40, 8e6)}}, 9, 100));
}

TEST(Replanner, ANewPlanThatMeasuresSlowerThanTheOneItReplacedIsSwitchedBack) {
  const JobConfig job = demo_job("bandwidth: 10gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  const Plan start = plan_iteration(in);
  Replanner r(in, start, {"dc", "worker"}, {true, true}, 2, 2);
  std::optional<PlanChange> c;
  for (int64_t step = 1; step <= 3 && !c; ++step)  // the old plan's steps under the slow link: 0.5 s
    c = r.on_step(step, {{"dc", bursts_at(12.5e6, 1e-3, 40, 8e6)}}, step, 100, 0.5);
  ASSERT_TRUE(c && c->switched());
  const int64_t from = c->from_step;
  // The new plan runs, and measures 0.7 s a step: 40% slower than the old one.
  std::optional<PlanChange> back;
  for (int64_t step = 4; step <= from + 3 && !back; ++step)
    back = r.on_step(step, {{"dc", bursts_at(12.5e6, 1e-3, 40, 8e6)}}, step, 100, step >= from ? 0.7 : 0.5);
  ASSERT_TRUE(back);
  EXPECT_TRUE(back->reverted);
  EXPECT_EQ(back->at_step, from + 3);
  EXPECT_EQ(back->new_domains, start.choice().domain_sizes);
  EXPECT_EQ(back->old_domains, c->new_domains);
  EXPECT_EQ(r.plan().choice().domain_sizes, start.choice().domain_sizes);
  EXPECT_NE(back->reason.find("measured 700.0 ms per step against 500.0 ms"), std::string::npos) << back->reason;
}

TEST(Replanner, ANewPlanThatMeasuresAsFastIsKept) {
  const JobConfig job = demo_job("bandwidth: 10gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  Replanner r(in, plan_iteration(in), {"dc", "worker"}, {true, true}, 2, 2);
  std::optional<PlanChange> c;
  for (int64_t step = 1; step <= 3 && !c; ++step)
    c = r.on_step(step, {{"dc", bursts_at(12.5e6, 1e-3, 40, 8e6)}}, step, 100, 0.5);
  ASSERT_TRUE(c && c->switched());
  // 5% slower: within the margin. The new plan's first step (the rebuild, 10x
  // as long) is not judged.
  for (int64_t step = 4; step <= c->from_step + 6; ++step) {
    const double t = step == c->from_step ? 5.0 : step > c->from_step ? 0.525 : 0.5;
    EXPECT_FALSE(r.on_step(step, {{"dc", bursts_at(12.5e6, 1e-3, 40, 8e6)}}, step, 100, t)) << step;
  }
  EXPECT_EQ(r.plan().choice().domain_sizes, c->new_domains);
}

TEST(Replanner, UnshapedLinksAndSwitchesPastTheLastStepAreLeftAlone) {
  const JobConfig job = demo_job("bandwidth: 10gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  Replanner unshaped(in, plan_iteration(in), {"dc", "worker"}, {false, false}, 2, 2);
  for (int64_t step = 1; step <= 6; ++step)
    EXPECT_FALSE(unshaped.on_step(step, {{"dc", bursts_at(12.5e6, 1e-3, 40, 8e6)}}, step, 100));
  Replanner late(in, plan_iteration(in), {"dc", "worker"}, {true, true}, 2, 2);
  std::optional<PlanChange> c;
  for (int64_t step = 1; step <= 3; ++step) c = late.on_step(step, {{"dc", bursts_at(12.5e6, 1e-3, 40, 8e6)}}, step, 4);
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->switched());
  EXPECT_NE(c->reason.find("too close to the end"), std::string::npos) << c->reason;
}

// The plan's compute as the workers measure it (without the transport's CPU time).
double planned_compute(const Plan& p) { return p.choice().run_compute_s(); }

TEST(Replanner, ComputeMeasuredSlowerInEveryStepOfAWindowReFitsThePredictionAndKeepsTheDomains) {
  const JobConfig job = demo_job("bandwidth: 1gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  const Plan start = plan_iteration(in);
  const double assumed = planned_compute(start);
  ASSERT_GT(assumed, 0);
  Replanner r(in, start, {"dc", "worker"}, {true, true}, 2, 2);
  const auto link = std::map<std::string, std::array<double, 3>>{{"dc", bursts_at(0.8 * 125e6, 1e-3, 40, 8e6)}};
  std::optional<PlanChange> c;
  const double slow[] = {1.25, 1.35, 1.30};  // a machine 30% slower, noisily
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_FALSE(c) << "a change before the window was full";
    c = r.on_step(step, link, step, 100, 0.5, slow[step - 1] * assumed);
  }
  ASSERT_TRUE(c);
  EXPECT_EQ(c->link, "compute");
  EXPECT_TRUE(c->compute_refit());
  EXPECT_EQ(c->at_step, 3);
  EXPECT_FALSE(c->switched());
  EXPECT_EQ(c->new_domains, start.choice().domain_sizes);
  EXPECT_EQ(c->new_schedule.pipeline_degree, 2) << "the workers' r stays";
  EXPECT_DOUBLE_EQ(c->assumed_compute_s, assumed);
  EXPECT_NEAR(c->measured_compute_s, 1.30 * assumed, 1e-12);
  // The new prediction's compute is what was measured; its step is longer.
  EXPECT_NEAR(planned_compute(r.plan()), 1.30 * assumed, 1e-9 * assumed);
  EXPECT_EQ(r.plan().choice().domain_sizes, start.choice().domain_sizes);
  EXPECT_EQ(r.plan().choice().pipeline_degree, 2);
  EXPECT_GT(c->new_predicted_s, c->old_predicted_s);
  EXPECT_DOUBLE_EQ(c->new_predicted_s, r.plan().choice().iteration_s);
  EXPECT_NE(c->reason.find("the prediction follows"), std::string::npos) << c->reason;
  EXPECT_TRUE(r.history().empty()) << "a re-fit is no re-plan";
  EXPECT_EQ(r.compute_refits(), 1);
  // The fitted compute is the assumption now: the same speed changes nothing.
  for (int64_t step = 4; step <= 12; ++step)
    EXPECT_FALSE(r.on_step(step, link, step, 100, 0.5, 1.32 * assumed)) << step;
}

TEST(Replanner, ComputeWithinTheToleranceOrOffInOnlySomeStepsChangesNothing) {
  const JobConfig job = demo_job("bandwidth: 1gbit, latency: 1ms");
  const PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  const Plan start = plan_iteration(in);
  const double assumed = planned_compute(start);
  const auto link = std::map<std::string, std::array<double, 3>>{{"dc", bursts_at(0.8 * 125e6, 1e-3, 40, 8e6)}};
  Replanner close(in, start, {"dc", "worker"}, {true, true}, 2, 2);
  for (int64_t step = 1; step <= 12; ++step)
    EXPECT_FALSE(close.on_step(step, link, step, 100, 0.5, (step % 2 ? 1.04 : 0.96) * assumed)) << step;
  Replanner spiky(in, start, {"dc", "worker"}, {true, true}, 2, 2);  // one slow step in each window
  for (int64_t step = 1; step <= 12; ++step)
    EXPECT_FALSE(spiky.on_step(step, link, step, 100, 0.5, (step % 3 == 0 ? 2.0 : 1.0) * assumed)) << step;
  Replanner off(in, start, {"dc", "worker"}, {true, true}, 2, 2, ReplanOptions{.compute_tolerance = 0});
  for (int64_t step = 1; step <= 6; ++step) EXPECT_FALSE(off.on_step(step, link, step, 100, 0.5, 2 * assumed)) << step;
  Replanner faster(in, start, {"dc", "worker"}, {true, true}, 2, 2);
  std::optional<PlanChange> c;
  for (int64_t step = 1; step <= 3; ++step) c = faster.on_step(step, link, step, 100, 0.5, 0.8 * assumed);
  ASSERT_TRUE(c) << "a faster machine is followed too";
  EXPECT_LT(c->new_predicted_s, c->old_predicted_s);
}

// At start-up the plan assumes the routing probe's F for its domains: a run
// that measures about that moves nothing, and a re-fit names it as the
// assumption it leaves.
TEST(Replanner, TheRoutingProbesImbalanceIsWhatARunIsComparedWith) {
  const JobConfig job = demo_job("bandwidth: 1gbit, latency: 1ms");
  PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  in.expert_parallel.mode = EpMode::kEp;
  in.routed_a2a_imbalance[{1, 1}] = {1.25, 1.0};
  const Plan start = plan_iteration(in);
  ASSERT_EQ(start.choice().a2a_imbalance, (std::vector<double>{1.25, 1.0}));
  const double compute = planned_compute(start);
  const auto link = std::map<std::string, std::array<double, 3>>{{"dc", bursts_at(0.8 * 125e6, 1e-3, 40, 8e6)}};
  Replanner as_probed(in, start, {"dc", "worker"}, {true, true}, 1, 1);
  for (int64_t step = 1; step <= 6; ++step)
    EXPECT_FALSE(as_probed.on_step(step, link, step, 100, 0.5, compute, {1.26, 1.02})) << step;
  Replanner skewed(in, start, {"dc", "worker"}, {true, true}, 1, 1);
  std::optional<PlanChange> c;
  for (int64_t step = 1; step <= 3; ++step) c = skewed.on_step(step, link, step, 100, 0.5, compute, {1.5, 1.0});
  ASSERT_TRUE(c);
  EXPECT_EQ(c->assumed_a2a_imbalance, (std::vector<double>{1.25, 1.0}));
  EXPECT_NE(c->reason.find("dc 1.50 (assumed 1.25)"), std::string::npos) << c->reason;
  EXPECT_GT(c->new_predicted_s, c->old_predicted_s);
}

// The routing's A2A imbalance (each hop lasts as long as its larger side)
// measured in every step of a window moves the prediction of the current
// domains and r; a level no token crossed keeps what it had.
TEST(Replanner, AMeasuredA2AImbalanceMovesThePredictionNotThePlan) {
  const JobConfig job = demo_job("bandwidth: 1gbit, latency: 1ms");
  PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  in.expert_parallel.mode = EpMode::kEp;  // tokens cross both levels
  const Plan start = plan_iteration(in);
  const double compute = planned_compute(start);
  const auto link = std::map<std::string, std::array<double, 3>>{{"dc", bursts_at(0.8 * 125e6, 1e-3, 40, 8e6)}};
  Replanner r(in, start, {"dc", "worker"}, {true, true}, 1, 1);
  std::optional<PlanChange> c;
  const double dc[] = {1.20, 1.30, 1.25};
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_FALSE(c) << "a change before the window was full";
    c = r.on_step(step, link, step, 100, 0.5, compute, {dc[step - 1], 0.0});
  }
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->imbalance_refit());
  EXPECT_FALSE(c->compute_refit());
  EXPECT_TRUE(c->model_refit());
  EXPECT_FALSE(c->switched());
  EXPECT_EQ(c->link, "routing");
  EXPECT_EQ(c->new_domains, start.choice().domain_sizes);
  EXPECT_EQ(c->new_schedule.pipeline_degree, 1);
  ASSERT_EQ(c->measured_a2a_imbalance.size(), 2u);
  EXPECT_NEAR(c->measured_a2a_imbalance[0], 1.25, 1e-12);
  EXPECT_EQ(c->measured_a2a_imbalance[1], 1.0) << "no token crossed the worker level: it stays uniform";
  EXPECT_EQ(r.inputs().a2a_imbalance, c->measured_a2a_imbalance);
  EXPECT_GT(c->new_predicted_s, c->old_predicted_s) << "longer hops on the DC link";
  EXPECT_DOUBLE_EQ(c->new_predicted_s, r.plan().choice().iteration_s);
  EXPECT_NE(c->reason.find("dc 1.25 (assumed 1.00)"), std::string::npos) << c->reason;
  EXPECT_TRUE(r.history().empty()) << "a re-fit is no re-plan";
  EXPECT_EQ(r.imbalance_refits(), 1);
  EXPECT_EQ(r.compute_refits(), 0);
  // The fitted imbalance is the assumption now: the same routing changes nothing.
  for (int64_t step = 4; step <= 12; ++step)
    EXPECT_FALSE(r.on_step(step, link, step, 100, 0.5, compute, {1.26, 0.0})) << step;
  // Within the tolerance, or never measured, nothing moves either.
  Replanner close(in, start, {"dc", "worker"}, {true, true}, 1, 1);
  for (int64_t step = 1; step <= 6; ++step) {
    EXPECT_FALSE(close.on_step(step, link, step, 100, 0.5, compute, {1.03, 1.02})) << step;
    EXPECT_FALSE(close.on_step(step + 6, link, step + 6, 100, 0.5, compute)) << step;
  }
}

// A coded traffic kind's wire fraction measured in every step of a window
// (the run's bytes over the fp32 bytes) replaces the one the planner
// measured at start-up, and the prediction follows; raw traffic and a
// fraction within the tolerance move nothing.
TEST(Replanner, MeasuredCodecFractionsMoveThePredictionAndRawTrafficIsNeverFitted) {
  const JobConfig job = demo_job("bandwidth: 50mbit, latency: 1ms");
  PlannerInputs in = planner_inputs_for(job, spec_link_models(job.cluster), ComputeModel{});
  in.expert_parallel.mode = EpMode::kEp;  // token rows cross the DC link
  in.link_codecs.assign(2, LinkCodecCost{});
  in.link_codecs[0].dispatch_fraction = in.link_codecs[0].combine_fraction = 0.5;  // bf16 rows
  in.link_codecs[0].dispatch_s_per_byte = in.link_codecs[0].combine_s_per_byte = 1e-10;
  const Plan start = plan_iteration(in);
  const double compute = planned_compute(start);
  const int rf = start.choice().pipeline_degree, rb = start.choice().backward_pipeline_degree;
  const auto link = std::map<std::string, std::array<double, 3>>{{"dc", bursts_at(0.8 * 6.25e6, 1e-3, 40, 8e6)}};
  // The rows on the wire hold their expert ids too: 0.52 of the fp32 bytes.
  // The worker level is raw: whatever it shows is not a codec's.
  const std::vector<CodecFractions> measured = {{0.52, 0.51, 0, 0}, {0.9, 0.9, 0, 0}};
  Replanner close(in, start, {"dc", "worker"}, {true, true}, rf, rb);
  for (int64_t step = 1; step <= 6; ++step)
    EXPECT_FALSE(close.on_step(step, link, step, 100, 0.5, compute, {}, measured)) << step;
  // bf16 rows with zstd behind them: a third of the bytes, not half.
  Replanner r(in, start, {"dc", "worker"}, {true, true}, rf, rb);
  std::optional<PlanChange> c;
  const double dispatch[] = {0.30, 0.34, 0.35};
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_FALSE(c) << "a change before the window was full";
    c = r.on_step(step, link, step, 100, 0.5, compute, {}, {{dispatch[step - 1], 0.33, 0, 0}, {0.9, 0.9, 0, 0}});
  }
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->codec_refit());
  EXPECT_TRUE(c->model_refit());
  EXPECT_FALSE(c->switched());
  EXPECT_EQ(c->link, "codecs");
  EXPECT_EQ(c->new_domains, start.choice().domain_sizes);
  ASSERT_EQ(c->measured_codec_fractions.size(), 2u);
  EXPECT_NEAR(c->measured_codec_fractions[0].dispatch, 0.33, 1e-12);
  EXPECT_NEAR(c->measured_codec_fractions[0].combine, 0.33, 1e-12);
  EXPECT_EQ(c->measured_codec_fractions[1].dispatch, 1.0) << "raw traffic keeps its fraction";
  EXPECT_EQ(c->assumed_codec_fractions[0].dispatch, 0.5);
  EXPECT_NEAR(r.inputs().link_codecs[0].dispatch_fraction, 0.33, 1e-12);
  EXPECT_EQ(r.inputs().link_codecs[1].dispatch_fraction, 1.0);
  EXPECT_LT(c->new_predicted_s, c->old_predicted_s) << "fewer bytes on the slow DC link";
  EXPECT_DOUBLE_EQ(c->new_predicted_s, r.plan().choice().iteration_s);
  EXPECT_NE(c->reason.find("dc dispatch 0.33 (assumed 0.5), dc combine 0.33 (assumed 0.5)"), std::string::npos)
      << c->reason;
  EXPECT_EQ(r.codec_refits(), 1);
  EXPECT_TRUE(r.history().empty()) << "a re-fit is no re-plan";
  // The fitted fractions are the assumption now: the same bytes change nothing.
  for (int64_t step = 4; step <= 12; ++step)
    EXPECT_FALSE(r.on_step(step, link, step, 100, 0.5, compute, {}, {{0.33, 0.33, 0, 0}})) << step;
}

// The same global batch in one process.
std::vector<double> one_process_losses(const std::string& yaml, int steps) {
  auto job = parse_job_config(yaml, "<test>");
  XD_CHECK(job.has_value());
  auto t = Trainer::create(one_process_equivalent(*job));
  XD_CHECK(t.has_value());
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) losses.push_back((*t)->step()->loss.loss);
  return losses;
}

TEST(Replan, AJobThrottledHardSwitchesDomainsAtAStepBoundaryAndStillTrainsAsOneProcess) {
  const int steps = 14;
  // 5 ms across the DCs: at 1 Gbit/s the planner's pick, [2,1], is clear of
  // [1,2] (with 1 ms the two tie, and [1,2]'s all-to-all across the
  // loopback "DC" measures a third of its rate on two busy cores, a re-plan
  // the throttle did not cause).
  const std::string yaml = example_with({{"bandwidth: 100mbit, latency: 10ms", "bandwidth: 1gbit, latency: 5ms"},
                                         {"steps: 60", "steps: " + std::to_string(steps)},
                                         {"log_every: 10", "log_every: 1"},
                                         // The load-balancing loss is per worker batch (Megatron's
                                         // choice): off, so that one process computes the same loss.
                                         {"gating: softmax_topk", "gating: softmax_topk\n  aux_loss_coef: 0.0"}});
  const std::string dir = (fs::temp_directory_path() / ("xdmoe_replan_" + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir + "/job.yaml") << yaml;
  int fd = -1;
  // The spec's link figures (no start-up probe): 1 Gbit/s across the DCs.
  subprocess::Child coordinator = subprocess::spawn_piped(
      {xdmoe_binary(), "coordinator", "--config", dir + "/job.yaml", "--no-probe", "--bind", "tcp://127.0.0.1:*",
       "--cli-bind", "ipc://" + dir + "/cli", "--http-port", "-1", "--summary", dir + "/summary.json",
       "--endpoints-file", dir + "/endpoints.json"},
      {}, &fd);
  ASSERT_GE(fd, 0);
  const nlohmann::json eps = testing::wait_for_endpoints(dir + "/endpoints.json", coordinator);
  ASSERT_TRUE(eps.contains("workers"));
  std::vector<subprocess::Child> workers;
  for (int r = 0; r < 4; ++r)
    workers.push_back(subprocess::spawn({xdmoe_binary(), "worker", "--coordinator", eps["workers"].get<std::string>(),
                                         "--rank", std::to_string(r)},
                                        dir + "/worker" + std::to_string(r) + ".log", {"OPENBLAS_NUM_THREADS=1"}));
  FILE* in = ::fdopen(fd, "r");
  std::string out, status;
  char line[8192];
  bool throttled = false;
  while (std::fgets(line, sizeof line, in)) {
    out += line;
    const std::string l(line);
    if (!throttled && l.rfind("step     3/", 0) == 0) {  // hard: a twentieth of the bandwidth
      auto [code, text] = testing::run(xdmoe_binary() + " throttle --coordinator ipc://" + dir +
                                       "/cli --link dc --bandwidth 50mbit");
      ASSERT_EQ(code, 0) << text;
      throttled = true;
    }
    if (status.empty() && l.find("-> ") != std::string::npos && l.rfind("re-plan", 0) == 0)
      status = testing::run(xdmoe_binary() + " status --coordinator ipc://" + dir + "/cli").second;
  }
  std::fclose(in);
  ASSERT_EQ(subprocess::wait_for(coordinator, std::chrono::seconds(300)), 0) << out;
  for (auto& w : workers) EXPECT_EQ(subprocess::wait_for(w, std::chrono::seconds(30)), 0);
  std::printf("%s", out.substr(0, out.find("summary:")).c_str());
  nlohmann::json summary;
  std::ifstream(dir + "/summary.json") >> summary;
  // The plan switched once the throttle was measured, and says why.
  nlohmann::json switched, last;
  for (const auto& c : summary["plan_changes"])
    if (c["switched"].get<bool>()) {
      if (switched.is_null()) switched = c;  // the throttle's
      last = c;                              // or a switch back, if the new plan measured slower
    }
  ASSERT_FALSE(switched.is_null()) << summary["plan_changes"].dump(2) << out;
  EXPECT_GT(switched["after_step"].get<int>(), 3);
  EXPECT_NE(switched["new_domain_sizes"], switched["old_domain_sizes"]);
  EXPECT_LT(switched["measured_bytes_per_s"].get<double>(), 0.5 * switched["assumed_bytes_per_s"].get<double>());
  EXPECT_EQ(summary["domain_sizes"], last["new_domain_sizes"]);
  EXPECT_NE(status.find("re-planned after step"), std::string::npos) << status;
  EXPECT_NE(status.find("why: link class 'dc' measured"), std::string::npos) << status;
  EXPECT_NE(status.find("step / bound"), std::string::npos) << status;  // the last step's block too
  // Each pass's communication, exposed part and overlap.
  EXPECT_TRUE(std::regex_search(status, std::regex("  forward:  comm [0-9.]+ ms, exposed [0-9.]+ ms, overlap")))
      << status;
  EXPECT_TRUE(std::regex_search(status, std::regex("  backward: comm [0-9.]+ ms, exposed [0-9.]+ ms, overlap")))
      << status;
  std::istringstream status_lines(status);
  for (std::string line; std::getline(status_lines, line);) EXPECT_LE(line.size(), 80u) << "too wide: " << line;
  // Every worker switched at the same step.
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(subprocess::read_text(workers[r].log_path)
                  .find("from step " + switched["from_step"].dump() + ", domains"),
              std::string::npos)
        << subprocess::read_text(workers[r].log_path);
  // And the losses are still those of one process, before and after the switch.
  const std::vector<double> expected = one_process_losses(yaml, steps);
  ASSERT_EQ(summary["losses"].size(), expected.size());
  for (int i = 0; i < steps; ++i) {
    const double rel = std::abs(summary["losses"][i].get<double>() - expected[i]) / expected[i];
    std::printf("step %2d: loss %.6f, one process %.6f, relative difference %.2e\n", i + 1,
                summary["losses"][i].get<double>(), expected[i], rel);
    EXPECT_LT(rel, 1e-6) << "step " << i + 1;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace xd
