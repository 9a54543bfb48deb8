// Tests of the stream-based planner (the closed-form cases of HybridEP
// Eq. 10-12 under our whole-iteration model, the memory cap, the modes, the
// traffic formulas of docs/planner.md) and of the alpha-beta probes (FSMoE Eq. 1).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cluster/job_config.h"
#include "coordinator/link_probe.h"
#include "coordinator/planner.h"
#include "coordinator/step_probe.h"
#include "model/param_layout.h"

namespace xd {
namespace {

// One level of G workers, one MoE layer, one expert per worker, links of
// beta = 1 us/byte and no start-up cost: 1 MB costs one second.
Workload one_layer(double expert_bytes, double token_bytes, double pre_fwd_s = 0) {
  Workload w;
  w.num_moe_layers = 1;
  w.experts_per_worker = 1;
  w.expert_bytes = expert_bytes;
  w.token_bytes = token_bytes;
  w.pre_expert_fwd_s = pre_fwd_s;
  w.pre_expert_bwd_s = 2 * pre_fwd_s;
  return w;
}
const std::vector<LinkModel> kSlowLink = {{0.0, 1e-6}};

ExpertParallelSpec auto_mode(double cap = 1e300) {
  ExpertParallelSpec ep;
  ep.mode = EpMode::kAuto;
  ep.domain_sizes = {1};
  ep.memory_cap_bytes = cap;
  return ep;
}

TEST(Planner, EnumeratesEveryDivisorCombinationInOrder) {
  const auto c = domain_candidates({4, 6});
  ASSERT_EQ(c.size(), 3u * 4u);
  EXPECT_EQ(c.front(), (std::vector<int>{1, 1}));
  EXPECT_EQ(c[1], (std::vector<int>{1, 2}));
  EXPECT_EQ(c.back(), (std::vector<int>{4, 6}));
  EXPECT_EQ(domain_candidates({8}).size(), 4u);
}

TEST(Planner, ChoosesAgOnlyWhenTheAgHidesUnderPreExpertCompute) {
  // 2D < G P_E here, so the AG is only free because compute hides it (Eq. 11);
  // The smaller domains' A2As cost more than kPlanTieMargin of the step.
  const Plan plan = plan_workload(one_layer(1e6, 1e6, /*pre_fwd_s=*/20), {8}, kSlowLink, auto_mode());
  const PlanCandidate& c = plan.choice();
  EXPECT_EQ(c.domain_sizes, (std::vector<int>{8}));
  EXPECT_DOUBLE_EQ(c.a2a_s, 0.0);
  EXPECT_NEAR(c.ag_s, 7.0, 1e-9);  // 7 experts of 1 s each
  EXPECT_DOUBLE_EQ(c.exposed_ag_s, 0.0);
  EXPECT_DOUBLE_EQ(c.exposed_rs_s, 0.0);
  EXPECT_NEAR(c.iteration_s, c.compute_s, 1e-9);
}

TEST(Planner, ChoosesAgOnlyWhenTwiceTheTokensOutweighTheExperts) {
  // Case 2.2 of Eq. 12: nothing hides the AG, yet 2D >= G P_E. In training both
  // sides double (4 A2As against AG + RS), so the condition is unchanged.
  const Plan plan = plan_workload(one_layer(1e6, 5e6), {8}, kSlowLink, auto_mode());
  EXPECT_EQ(plan.choice().domain_sizes, (std::vector<int>{8}));
  // The model is linear in S: 4 D (1 - S/G) beta + 2 (S - 1) P_E beta.
  for (const PlanCandidate& c : plan.candidates) {
    const double s = c.domain_sizes[0];
    EXPECT_NEAR(c.iteration_s, 4 * 5.0 * (1 - s / 8) + 2 * (s - 1) * 1.0, 1e-9) << s;
  }
}

TEST(Planner, ChoosesPlainEpWhenExpertsAreHugeAndTokensFew) {
  // Case 2.1 with no compute to hide under: the maximal p, i.e. EP.
  const Plan plan = plan_workload(one_layer(1e7, 1e5), {8}, kSlowLink, auto_mode());
  EXPECT_EQ(plan.choice().domain_sizes, (std::vector<int>{1}));
  EXPECT_DOUBLE_EQ(plan.choice().gathered_bytes, 0.0);
  EXPECT_DOUBLE_EQ(plan.choice().ag_s, 0.0);
}

TEST(Planner, ChoosesTheLargestDomainWhoseAgStillHidesWhenExpertsOutweighTokens) {
  // Case 1 meets Case 2.1: pre-expert compute (3.5 s) hides the AG of S = 4
  // (3 s) but not of S = 8 (7 s); 2D < G P_E, so the exposed AG of S = 8 costs
  // more than the A2A it saves. HybridEP's p* = 1 - B Lat_PE / (P_E (G-1)) = 0.5.
  const Plan plan = plan_workload(one_layer(1e6, 1e6, /*pre_fwd_s=*/3.5), {8}, kSlowLink, auto_mode());
  EXPECT_EQ(plan.choice().domain_sizes, (std::vector<int>{4}));
  const PlanCandidate& s8 = plan.candidates.back();
  EXPECT_NEAR(s8.exposed_ag_s, 7 - 3.5, 1e-9);
  EXPECT_NEAR(s8.exposed_rs_s, 0.0, 1e-9);  // the backward pre-expert compute (7 s) hides the RS
  EXPECT_NEAR(plan.choice().a2a_s, 4 * 1.0 * 0.5, 1e-9);
}

TEST(Planner, TightMemoryCapRulesOutTheOtherwiseBestCandidate) {
  const Workload w = one_layer(1e6, 5e6);
  ASSERT_EQ(plan_workload(w, {8}, kSlowLink, auto_mode()).choice().domain_sizes,
            (std::vector<int>{8}));
  // Room for 3 replicas: S = 4 fits (3 gathered experts), S = 8 (7) does not.
  const Plan capped = plan_workload(w, {8}, kSlowLink, auto_mode(3e6));
  EXPECT_EQ(capped.choice().domain_sizes, (std::vector<int>{4}));
  EXPECT_TRUE(capped.choice().feasible);
  const PlanCandidate& s8 = capped.candidates.back();
  EXPECT_FALSE(s8.feasible);
  EXPECT_DOUBLE_EQ(s8.gathered_bytes, 7e6);
  EXPECT_NE(s8.why_infeasible.find("memory cap"), std::string::npos);
  EXPECT_LT(s8.iteration_s, capped.choice().iteration_s);  // it would have been faster
  // A zero cap leaves plain EP only.
  EXPECT_EQ(plan_workload(w, {8}, kSlowLink, auto_mode(0)).choice().domain_sizes,
            (std::vector<int>{1}));
}

// Predictions closer than kPlanTieMargin are a tie, and a tie goes to the
// candidate holding the fewest replicas; a clearly faster one still wins,
// and an infeasible one never does.
TEST(Planner, CandidatesPredictedWithinTheTieMarginGoToTheFewestGatheredBytes) {
  auto candidate = [](double iteration_s, double gathered_bytes, bool feasible = true) {
    PlanCandidate c;
    c.iteration_s = iteration_s;
    c.gathered_bytes = gathered_bytes;
    c.feasible = feasible;
    return c;
  };
  const double inside = 1.0 + 0.9 * kPlanTieMargin, outside = 1.0 + 1.1 * kPlanTieMargin;
  // Domains [1,1], [1,2], [2,1], [2,2] of the README demo, [2,2] fastest.
  std::vector<PlanCandidate> c = {candidate(2.0, 0), candidate(1.9, 1.5e6), candidate(inside, 1.5e6),
                                  candidate(1.0, 4.5e6)};
  EXPECT_EQ(choose_candidate(c), 2);
  c[2].iteration_s = outside;
  EXPECT_EQ(choose_candidate(c), 3);
  // Two inside the margin with the same bytes: the faster of them.
  c[2].iteration_s = inside;
  c[1].iteration_s = 1.0 + 0.5 * kPlanTieMargin;
  EXPECT_EQ(choose_candidate(c), 1);
  // The fewest bytes overall, if it is inside too.
  c[0].iteration_s = inside;
  EXPECT_EQ(choose_candidate(c), 0);
  c[0].feasible = false;
  EXPECT_EQ(choose_candidate(c), 1);
  // An infeasible fastest one does not set the margin.
  c = {candidate(1.0, 0, false), candidate(1.5, 1e6), candidate(1.5 * inside, 0.5e6)};
  EXPECT_EQ(choose_candidate(c), 2);
  c[2].iteration_s = 1.5 * outside;
  EXPECT_EQ(choose_candidate(c), 1);
  EXPECT_EQ(choose_candidate({candidate(1.0, 0, false)}), -1);
}

TEST(Planner, ModeEpTakesAllOnesAndModeHybridTheGivenSizes) {
  const Workload w = one_layer(1e6, 5e6);
  ExpertParallelSpec ep = auto_mode();
  ep.mode = EpMode::kEp;
  const Plan p1 = plan_workload(w, {8}, kSlowLink, ep);
  EXPECT_EQ(p1.mode, EpMode::kEp);
  EXPECT_EQ(p1.choice().domain_sizes, (std::vector<int>{1}));
  ep.mode = EpMode::kHybrid;
  ep.domain_sizes = {2};
  EXPECT_EQ(plan_workload(w, {8}, kSlowLink, ep).choice().domain_sizes, (std::vector<int>{2}));
  // Over the cap, hybrid still names the configured sizes and flags them.
  ep.memory_cap_bytes = 0;
  const Plan p3 = plan_workload(w, {8}, kSlowLink, ep);
  EXPECT_EQ(p3.choice().domain_sizes, (std::vector<int>{2}));
  EXPECT_FALSE(p3.choice().feasible);
}

TEST(Planner, TrafficPerLevelFollowsTheDesignFormulas) {
  Workload w;
  w.num_moe_layers = 3;
  w.experts_per_worker = 2;
  w.expert_bytes = 1000;
  w.token_bytes = 800;
  const std::vector<LinkModel> links = {{0, 1e-6}, {0, 1e-7}};
  const PlanCandidate c = evaluate_candidate(w, {2, 4}, links, {2, 2}, 1e300);
  // Level 0: A2A D (1 - 2/2) = 0; AG n P_E (S^0 - 1) = 2000, and as much RS.
  EXPECT_DOUBLE_EQ(c.level_bytes[0], 3 * (4 * 0 + 2 * 2000.0));
  // Level 1: A2A D (1 - 2/4) = 400 four times; AG n P_E S^0 (S^1 - 1) = 4000.
  EXPECT_DOUBLE_EQ(c.level_bytes[1], 3 * (4 * 400.0 + 2 * 4000.0));
  EXPECT_DOUBLE_EQ(c.gathered_bytes, 3 * 2 * 1000.0 * (2 * 2 - 1));
  EXPECT_NEAR(c.ag_s, 3 * (2000 * 1e-6 + 4000 * 1e-7), 1e-12);
  EXPECT_NEAR(c.rs_s, c.ag_s, 1e-12);
  EXPECT_NEAR(c.a2a_s, 3 * 4 * (400 * 1e-7), 1e-12);
  // Outer level first: the slow level carries 2000 bytes of experts per layer;
  // inner first, it would carry n P_E S^1 (S^0 - 1) = 4000.
}

// Tokens only: E = 4 experts, top-2, d = 64, 2 experts a worker.
Workload two_experts_a_worker_top2() {
  Workload w = one_layer(0, 6400);
  w.experts_per_worker = 2;
  w.num_experts = 4;
  w.routed_rows_per_token = 2;
  w.hidden = 64;
  return w;
}

// A token once per worker on 2 workers of 2 experts (EP). A token has one
// row per expert there, 1 on average; it misses the destination only when
// both its experts are at home, 1 in 6. Dispatch widens by 2K - 1 = 3
// columns, the backward of Dispatch by K = 2.
TEST(Planner, ATokenOncePerWorkerCountsItsRowsAndTheirWiderLayout) {
  Workload w = two_experts_a_worker_top2();
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  const PlanCandidate per_expert = evaluate_candidate(w, {2}, links, {1}, 1e300);
  w.grouped_rows = true;
  const PlanCandidate once = evaluate_candidate(w, {2}, links, {1}, 1e300);
  const double a2a = 6400 * 0.5;  // D (1 - 1/2)
  EXPECT_DOUBLE_EQ(per_expert.level_bytes[0], 4 * a2a);
  const double rows = 5.0 / 6;
  EXPECT_NEAR(once.level_bytes[0], 2 * a2a * rows * (64 + 1.5) / 64 + 2 * a2a * rows * (64 + 1) / 64, 1e-9);
  EXPECT_LT(once.a2a_s, per_expert.a2a_s);
  // Every expert held everywhere (HybridEP 2): no A2A, nothing to group.
  EXPECT_DOUBLE_EQ(evaluate_candidate(w, {2}, links, {2}, 1e300).a2a_s, 0.0);
}

// auto plans both layouts and keeps grouped rows only where they are
// clearly faster: with token rows on a slow link, yes; with every expert
// gathered (no token crosses) the two tie and a row per expert stays.
TEST(Planner, AutoSendsATokenOncePerWorkerOnlyWhereThatIsClearlyFaster) {
  const Workload w = two_experts_a_worker_top2();
  const std::vector<LinkModel> slow = {{0.0, 1e-6}};
  Workload automatic = w;
  automatic.grouped_rows_auto = true;
  const PlanCandidate per_expert = evaluate_candidate(w, {2}, slow, {1}, 1e300);
  EXPECT_FALSE(per_expert.tokens_once_per_worker);
  const PlanCandidate chosen = evaluate_candidate(automatic, {2}, slow, {1}, 1e300);
  EXPECT_TRUE(chosen.tokens_once_per_worker) << "5/6 of the rows on the only link";
  EXPECT_LT(chosen.iteration_s, per_expert.iteration_s * (1 - kPlanTieMargin));
  const PlanCandidate gathered = evaluate_candidate(automatic, {2}, slow, {2}, 1e300);
  EXPECT_FALSE(gathered.tokens_once_per_worker) << "no token crosses a link: nothing to gain";
  // One routed expert a token: a group is one row, only wider.
  automatic.routed_rows_per_token = 1;
  EXPECT_FALSE(evaluate_candidate(automatic, {2}, slow, {1}, 1e300).tokens_once_per_worker);
}

// auto never plans grouped rows a job cannot send: soft_moe routes slot
// inputs, and a lossy token codec would garble the ids and weights.
TEST(Planner, AutoStaysARowPerExpertForSoftMoeAndLossyTokenCodecs) {
  auto grouped_auto = [](const std::string& yaml) {
    auto job = parse_job_config(yaml, "job.yaml");
    EXPECT_TRUE(job) << job.status().message();
    if (!job) return true;
    EXPECT_EQ(job->cluster.expert_parallel.tokens_once_per_worker, TokensOncePerWorker::kAuto);
    return workload_of(planner_inputs_for(*job, spec_link_models(job->cluster), {2e10, 2e-6})).grouped_rows_auto;
  };
  const std::string cluster = "cluster:\n  levels:\n    - {name: dc, size: 2, link: {bandwidth: 1gbit, latency: 1ms, "
                              "codecs: {dispatch: CODEC}}}\n";
  auto with = [&](const std::string& codec) {
    std::string c = cluster;
    return c.replace(c.find("CODEC"), 5, codec);
  };
  EXPECT_TRUE(grouped_auto(with("raw")));
  EXPECT_TRUE(grouped_auto(with("zstd:1"))) << "zstd keeps every bit";
  EXPECT_FALSE(grouped_auto(with("bf16")));
  EXPECT_FALSE(grouped_auto("model:\n  gating: soft_moe\n" + with("raw")));
}

TEST(Planner, LatencyIsPaidOncePerCollectiveNotPerMessage) {
  Workload w = one_layer(0, 1000);
  w.experts_per_worker = 1;
  const std::vector<LinkModel> latency_only = {{0.01, 0}};
  const PlanCandidate once = evaluate_candidate(w, {4}, latency_only, {1}, 1e300);
  EXPECT_NEAR(once.a2a_s, 4 * 0.01, 1e-12);  // 3 peers at once through one egress, 4 A2As
  const PlanCandidate ag = evaluate_candidate(w, {4}, latency_only, {4}, 1e300);
  EXPECT_NEAR(ag.ag_s, 0.01, 1e-12);  // 3 domain peers at once
  EXPECT_DOUBLE_EQ(ag.a2a_s, 0.0);
}

TEST(Planner, ATokenCodecScalesItsLevelsBytesAndAddsItsTime) {
  Workload w = one_layer(0, 1000);  // no experts to gather: tokens only
  w.experts_per_worker = 1;
  const std::vector<LinkModel> links = {{0.0, 1e-6}, {0.0, 1e-7}};
  const PlanCandidate raw = evaluate_candidate(w, {2, 2}, links, {1, 1}, 1e300);
  // bf16 toward the experts on the outer level only, with a codec cost.
  std::vector<LinkCodecCost> codecs(2);
  codecs[0].dispatch_fraction = 0.5;
  codecs[0].dispatch_s_per_byte = 1e-9;
  const PlanCandidate half = evaluate_candidate(w, {2, 2}, links, {1, 1}, 1e300, codecs);
  // Level 0 moves D/2 per A2A: 2 A2As toward the experts now carry half.
  EXPECT_DOUBLE_EQ(half.level_bytes[0], raw.level_bytes[0] - 2 * 500.0 * 0.5);
  EXPECT_DOUBLE_EQ(half.level_bytes[1], raw.level_bytes[1]);
  // Each of those 2 A2As saves 250 bytes x 1e-6 s and pays 500 bytes x 1e-9 s.
  EXPECT_NEAR(half.a2a_s, raw.a2a_s - 2 * (250 * 1e-6) + 2 * (500 * 1e-9), 1e-12);
  PlannerInputs in;
  in.level_sizes = {2, 2};
  in.links = links;
  in.link_codecs = {LinkCodecCost{}};
  EXPECT_FALSE(in.validate().is_ok()) << "one cost per level";
}

TEST(Planner, ExpertAndDenseCodecsScaleTheirBytesAndTheSrBaseAddsOneBf16ExpertPerLayerToTheAllReduce) {
  Workload w = one_layer(1000, 0);  // experts only, no tokens
  w.dense_param_bytes = 400;
  w.base_syncs_per_step = 1;
  const std::vector<LinkModel> links = {{0.0, 1e-6}, {0.0, 1e-7}};
  const PlanCandidate raw = evaluate_candidate(w, {2, 2}, links, {2, 1}, 1e300);
  std::vector<LinkCodecCost> codecs(2);
  codecs[0].gather_fraction = 0.01;  // SR at 100x on the outer level
  codecs[0].gather_s_per_byte = 1e-9;
  codecs[0].gather_against_base = true;
  codecs[0].grad_fraction = 0.5;     // bf16 gradients
  codecs[0].dense_fraction = 0.5;    // bf16 dense gradients
  const PlanCandidate sr = evaluate_candidate(w, {2, 2}, links, {2, 1}, 1e300, codecs);
  // One expert (1000 bytes) crosses level 0 each way per layer.
  EXPECT_NEAR(raw.ag_s, 1000 * 1e-6, 1e-15);
  EXPECT_NEAR(sr.ag_s, 1000 * (0.01 * 1e-6 + 1e-9), 1e-15);
  EXPECT_NEAR(sr.rs_s, 1000 * 0.5 * 1e-6, 1e-15);
  // The all-reduce: level 1 (raw, no SR there) on 400 + 1000 base bytes, then
  // level 0 on the half left: 2 (1/2) (200 dense bytes and 500 base bytes,
  // both in bf16, halved: level 0's AG codes against the base).
  EXPECT_DOUBLE_EQ(sr.level_bytes[1] - raw.level_bytes[1], 1000.0);
  EXPECT_DOUBLE_EQ(sr.level_bytes[0], 1000 * (0.01 + 0.5) + 200 * 0.5 + 500 * 0.5);
  // base_codec: sign: the base's 500 bytes cross level 0 as a sign bit a
  // float, a scale and a bit per 1024; level 1 is unchanged.
  w.base_outer_sign = true;
  const PlanCandidate sign = evaluate_candidate(w, {2, 2}, links, {2, 1}, 1e300, codecs);
  EXPECT_DOUBLE_EQ(sign.level_bytes[0], 1000 * (0.01 + 0.5) + 200 * 0.5 + 500 * (1.0 + 33.0 / 1024) / 32);
  EXPECT_DOUBLE_EQ(sign.level_bytes[1], sr.level_bytes[1]);
  w.base_outer_sign = false;
  w.base_syncs_per_step = 0;  // base synchronised once: no per-step cost
  EXPECT_DOUBLE_EQ(evaluate_candidate(w, {2, 2}, links, {2, 1}, 1e300, codecs).level_bytes[1], raw.level_bytes[1]);
}

// The runtime all-reduces the dense gradients in two stages, the innermost
// level and one group across all the others; that group runs in bf16 when
// any of its link classes asks for it, so the planner prices it so too.
TEST(Planner, Bf16DenseGradientsOnOneOuterLevelAreBf16OnEveryOuterLevel) {
  Workload w = one_layer(0, 0);
  w.dense_param_bytes = 1600;
  const std::vector<LinkModel> links = {{0.0, 1e-6}, {0.0, 1e-7}, {0.0, 1e-8}};
  const PlanCandidate raw = evaluate_candidate(w, {2, 2, 2}, links, {1, 1, 1}, 1e300);
  std::vector<LinkCodecCost> codecs(3);
  codecs[0].dense_fraction = 0.5;  // bf16 on the outermost level only
  const PlanCandidate bf16 = evaluate_candidate(w, {2, 2, 2}, links, {1, 1, 1}, 1e300, codecs);
  EXPECT_DOUBLE_EQ(bf16.level_bytes[0], 0.5 * raw.level_bytes[0]);
  EXPECT_DOUBLE_EQ(bf16.level_bytes[1], 0.5 * raw.level_bytes[1]) << "the same outer group as level 0";
  EXPECT_DOUBLE_EQ(bf16.level_bytes[2], raw.level_bytes[2]) << "the innermost stage stays fp32";
}

TEST(Planner, ARawLevelInsideALossyOneRelaysWhatCrossedItAtThatLevelsFraction) {
  Workload w = one_layer(1000, 0);  // experts only, one per worker
  const std::vector<LinkModel> links = {{0.0, 1e-6}, {0.0, 1e-7}};
  const PlanCandidate raw = evaluate_candidate(w, {2, 2}, links, {2, 2}, 1e300);
  std::vector<LinkCodecCost> codecs(2);
  codecs[0].gather_fraction = 0.01;  // SR at 100x across level 0
  codecs[0].gather_s_per_byte = 3e-9;
  const PlanCandidate sr = evaluate_candidate(w, {2, 2}, links, {2, 2}, 1e300, codecs);
  // Level 1: each worker holds its own expert and one from across level 0;
  // raw, it sends both (2000 bytes); relaying, its own raw and the other's
  // message as it arrived (1000 + 10), which its peer decodes (a third of
  // the codec's time). The gradients' return is unchanged.
  EXPECT_DOUBLE_EQ(raw.level_bytes[1] - sr.level_bytes[1], 2000.0 - 1010.0);
  EXPECT_NEAR(raw.ag_s, 1000 * 1e-6 + 2000 * 1e-7, 1e-15);
  EXPECT_NEAR(sr.ag_s, 1000 * (0.01 * 1e-6 + 3e-9) + 1010 * 1e-7 + 1000 * 3e-9 / 3, 1e-15);
  EXPECT_NEAR(sr.rs_s, raw.rs_s, 1e-15);
  // A lossy inner level re-encodes everything it holds: nothing is relayed.
  codecs[1] = codecs[0];
  const PlanCandidate both = evaluate_candidate(w, {2, 2}, links, {2, 2}, 1e300, codecs);
  EXPECT_DOUBLE_EQ(raw.level_bytes[1] - both.level_bytes[1], 2000.0 * (1 - 0.01));
}

TEST(Planner, WhatCrossedAnExactDeltaLevelGoesOnRawInsideItNotRelayed) {
  Workload w = one_layer(1000, 0);
  const std::vector<LinkModel> links = {{0.0, 1e-6}, {0.0, 1e-7}};
  const PlanCandidate raw = evaluate_candidate(w, {2, 2}, links, {2, 2}, 1e300);
  std::vector<LinkCodecCost> codecs(2);
  codecs[0].gather_fraction = 0.7;  // delta: across level 0
  codecs[0].gather_s_per_byte = 3e-9;
  codecs[0].gather_delta = true;
  const PlanCandidate delta = evaluate_candidate(w, {2, 2}, links, {2, 2}, 1e300, codecs);
  // Level 0 carries 700 of 1000 bytes; level 1 its own and the rebuilt expert
  // raw (2000), one message, no decode beside the first.
  EXPECT_DOUBLE_EQ(raw.level_bytes[0] - delta.level_bytes[0], 1000.0 * (1 - 0.7));
  EXPECT_DOUBLE_EQ(delta.level_bytes[1], raw.level_bytes[1]);
  EXPECT_DOUBLE_EQ(delta.level_messages[1], raw.level_messages[1]);
  EXPECT_NEAR(delta.ag_s, 1000 * (0.7 * 1e-6 + 3e-9) + 2000 * 1e-7, 1e-15);
}

TEST(Planner, WorkloadCountsTheModelShapes) {
  PlannerInputs in;
  in.model = default_train_config().model;
  in.tokens_per_worker = 512;
  in.seq_len = 64;
  in.level_sizes = {2, 2};
  in.links = {{0.01, 8e-8}, {2e-4, 8e-9}};
  in.compute = {1e10, 0};
  ASSERT_TRUE(in.validate().is_ok()) << in.validate().message();
  const ModelConfig& m = in.model;
  const Workload w = workload_of(in);
  EXPECT_EQ(w.num_moe_layers, m.num_layers);
  EXPECT_DOUBLE_EQ(w.experts_per_worker, m.num_experts / 4.0);
  EXPECT_DOUBLE_EQ(w.expert_bytes, 3.0 * m.hidden_size * m.expert_intermediate_size * 4);
  EXPECT_DOUBLE_EQ(w.token_bytes, 512.0 * m.top_k * m.hidden_size * 4);
  // Dense parameters are exactly the model's parameters without routed experts.
  EXPECT_DOUBLE_EQ(w.dense_param_bytes, double(ParamLayout(m, 0, 0).size()) * 4);
  EXPECT_DOUBLE_EQ(w.expert_fwd_s, 512.0 * m.top_k * 6 * m.hidden_size * m.expert_intermediate_size / 1e10);
  EXPECT_DOUBLE_EQ(w.expert_bwd_s, 2 * w.expert_fwd_s);
  EXPECT_DOUBLE_EQ(w.pre_expert_bwd_s, 2 * w.pre_expert_fwd_s);
  EXPECT_GT(w.pre_expert_fwd_s, 0);
  EXPECT_DOUBLE_EQ(w.post_s, 3 * 2.0 * 512 * m.hidden_size * m.vocab_size / 1e10);
}

TEST(Planner, StreamsAddUpToTheIterationForTheExampleJobs) {
  for (const char* name : {"2dc", "4dc"}) {
    auto job = load_job_config(std::string(XD_SOURCE_DIR) + "/examples/" + name + ".yaml");
    ASSERT_TRUE(job) << job.status().message();
    const PlannerInputs in = planner_inputs_for(*job, spec_link_models(job->cluster), {2e10, 2e-6});
    ASSERT_TRUE(in.validate().is_ok()) << in.validate().message();
    const Plan plan = plan_iteration(in);
    ASSERT_EQ(plan.candidates.size(), domain_candidates(job->cluster.level_sizes()).size());
    for (const PlanCandidate& c : plan.candidates) {
      EXPECT_NEAR(c.iteration_s,
                  c.compute_s + c.exposed_a2a_s + c.exposed_ag_s + c.exposed_rs_s + c.exposed_allreduce_s,
                  1e-9 * c.iteration_s);
      // An A2A may also wait for the link behind expert and dense transfers.
      EXPECT_LE(c.exposed_a2a_s, c.a2a_s + c.ag_s + c.rs_s + c.allreduce_s + 1e-12);
      EXPECT_LE(c.exposed_ag_s, c.ag_s + 1e-12);
      // Overlapped, the dense buckets share the RS link queue behind backward.
      EXPECT_LE(c.exposed_rs_s, c.rs_s + c.allreduce_s + 1e-12);
      EXPECT_LE(c.exposed_allreduce_s, c.allreduce_s + 1e-12);
      EXPECT_GT(c.allreduce_s, 0);
      if (c.feasible) {
        EXPECT_GE(c.iteration_s, plan.choice().iteration_s);
      }
    }
    EXPECT_TRUE(plan.choice().feasible);
    // The same inputs give the same plan.
    EXPECT_EQ(plan_iteration(in).chosen, plan.chosen);
  }
}

TEST(Planner, RejectsWorkloadsItCannotSplit) {
  PlannerInputs in;
  in.model = default_train_config().model;
  in.level_sizes = {2, 2};
  in.links = {{0, 1e-8}, {0, 1e-9}};
  EXPECT_TRUE(in.validate().is_ok()) << in.validate().message();
  in.expert_parallel.pipeline_degree = -1;
  EXPECT_NE(in.validate().message().find("pipeline_degree"), std::string::npos);
  in.expert_parallel.pipeline_degree = 0;
  in.level_sizes = {3, 2};  // 8 experts over 6 workers
  in.links.resize(2);
  EXPECT_NE(in.validate().message().find("multiple of the world size"), std::string::npos);
}

// EP over one slow level, FarSkip on: 1 s of attention (a third of it part
// (a)), 2 s of experts, 1 s of shared experts per layer; each A2A 1 s.
Workload farskip_layer(bool overlapped, int r) {
  Workload w = one_layer(0, 2e6, 2.0);  // 2e6 bytes, half of it crosses: 1 s
  w.attention_qkv_fwd_s = 1.0 / 3;
  w.shared_fwd_s = 1.0;
  w.expert_fwd_s = 2.0;
  w.expert_bwd_s = 4.0;
  w.overlapped = overlapped;
  w.pipeline_degree = r;
  w.connectivity = {Connectivity::kFarSkip};
  return w;
}

TEST(Planner, NotOverlappedEveryA2ABlocksCompute) {
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  const PlanCandidate c = evaluate_candidate(farskip_layer(false, 1), {2}, links, {1}, 1e300);
  EXPECT_DOUBLE_EQ(c.a2a_s, 4.0);
  EXPECT_DOUBLE_EQ(c.exposed_a2a_s, 4.0);
  EXPECT_DOUBLE_EQ(c.iteration_s, c.compute_s + 4.0);
}

TEST(Planner, OverlappedFarSkipHidesWhatTheScheduleLetsItHide) {
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  const PlanCandidate c = evaluate_candidate(farskip_layer(true, 1), {2}, links, {1}, 1e300);
  // Forward: Dispatch (1 s) runs behind attention (b) (2/3 s); Combine (1 s)
  // behind the shared experts (1 s). Backward: the backward of Combine behind
  // the attention backward (2 s), the backward of Dispatch behind the
  // experts' weight gradients (2 s).
  EXPECT_NEAR(c.exposed_a2a_s, 1.0 / 3, 1e-9);
  EXPECT_NEAR(c.iteration_s, c.compute_s + 1.0 / 3, 1e-9);
  // Chunks let the experts hide Dispatch too.
  const PlanCandidate r4 = evaluate_candidate(farskip_layer(true, 4), {2}, links, {1}, 1e300);
  EXPECT_LT(r4.exposed_a2a_s, c.exposed_a2a_s);
  const PlanCandidate chosen = evaluate_candidate(farskip_layer(true, 0), {2}, links, {1}, 1e300);
  EXPECT_GT(chosen.pipeline_degree, 1);
  EXPECT_LE(chosen.iteration_s, r4.iteration_s);
}

// Overlapped without replicas, layer 0's expert weight gradients run after
// the embedding's bucket has left, so they hide the last buckets' flight:
// more of that compute leaves less of the all-reduce exposed. (Before them,
// the buckets' wait did not depend on it.)
TEST(Planner, WithoutReplicasLayerZerosWeightGradientsHideTheLastBuckets) {
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  Workload w = farskip_layer(true, 1);
  w.dense_param_bytes = 3e7;  // three buckets of 10 MB: the LM head's, the layer's, the embedding's
  const PlanCandidate some = evaluate_candidate(w, {2}, links, {1}, 1e300);
  w.expert_bwd_s *= 2;  // 2 s more of layer 0's weight gradients
  const PlanCandidate more = evaluate_candidate(w, {2}, links, {1}, 1e300);
  ASSERT_GT(some.exposed_allreduce_s, 0.0);
  EXPECT_LT(more.exposed_allreduce_s, some.exposed_allreduce_s);
  EXPECT_NEAR(more.iteration_s,
              more.compute_s + more.exposed_a2a_s + more.exposed_ag_s + more.exposed_rs_s + more.exposed_allreduce_s,
              1e-9);
  // The simple schedule keeps them in place: the all-reduce runs after all compute.
  w.overlapped = false;
  const PlanCandidate simple = evaluate_candidate(w, {2}, links, {1}, 1e300);
  EXPECT_NEAR(simple.exposed_allreduce_s, simple.allreduce_s, 1e-9);
}

TEST(Planner, ChunksPayTheLatencyOfEveryChunk) {
  // Latency only: more chunks are only more start-ups.
  const std::vector<LinkModel> latency = {{0.1, 0.0}};
  const PlanCandidate r1 = evaluate_candidate(farskip_layer(false, 1), {2}, latency, {1}, 1e300);
  const PlanCandidate r4 = evaluate_candidate(farskip_layer(false, 4), {2}, latency, {1}, 1e300);
  EXPECT_NEAR(r1.a2a_s, 0.4, 1e-12);
  EXPECT_NEAR(r4.a2a_s, 1.6, 1e-12);
  EXPECT_EQ(evaluate_candidate(farskip_layer(false, 0), {2}, latency, {1}, 1e300).pipeline_degree, 1);
}

// Each backward exchange of s = r / backward r chunks is one transfer: with
// latency only, the backward's A2As cost r / s start-ups each way.
TEST(Planner, ABackwardExchangeOfSeveralChunksPaysOneLatency) {
  const std::vector<LinkModel> latency = {{0.1, 0.0}};
  Workload w = farskip_layer(false, 4);
  w.backward_pipeline_degree = 1;
  const PlanCandidate c = evaluate_candidate(w, {2}, latency, {1}, 1e300);
  EXPECT_EQ(c.pipeline_degree, 4);
  EXPECT_EQ(c.backward_pipeline_degree, 1);
  EXPECT_NEAR(c.a2a_s, 0.1 * (4 + 4 + 1 + 1), 1e-12);  // forward 4 + 4, backward 1 + 1
}

// With the backward's degree auto, each r takes the best of its divisors,
// chosen apart from the forward's: the plan is the fastest pair, and a
// latency-bound link gives the backward fewer exchanges than the forward.
TEST(Planner, TheBackwardDegreeIsChosenOnItsOwnAmongTheDivisorsOfR) {
  const std::vector<LinkModel> latency = {{0.1, 0.0}};
  Workload w = farskip_layer(true, 4);
  w.backward_pipeline_degree = 0;
  const PlanCandidate chosen = evaluate_candidate(w, {2}, latency, {1}, 1e300);
  EXPECT_EQ(chosen.pipeline_degree, 4);
  double best = 1e300;
  for (int rb : {1, 2, 4}) {
    Workload fixed = w;
    fixed.backward_pipeline_degree = rb;
    const PlanCandidate c = evaluate_candidate(fixed, {2}, latency, {1}, 1e300);
    EXPECT_EQ(c.backward_pipeline_degree, rb);
    best = std::min(best, c.iteration_s);
  }
  EXPECT_NEAR(chosen.iteration_s, best, 1e-12);
  EXPECT_LT(chosen.backward_pipeline_degree, 4) << "latency only: fewer backward exchanges are faster";
  // Both auto: the pair (r, backward r) is chosen; the backward's divides r.
  w.pipeline_degree = 0;
  const PlanCandidate pair = evaluate_candidate(w, {2}, latency, {1}, 1e300);
  EXPECT_EQ(pair.pipeline_degree % pair.backward_pipeline_degree, 0);
  EXPECT_LE(pair.iteration_s, chosen.iteration_s + 1e-12);
}

// Late replica weight gradients move that compute (3 of the 4 held experts'
// weight gradients here) after the embedding's bucket, and the replicas'
// gradients with it. Where the step ends on the last dense buckets'
// all-reduce (small replicas, large dense buckets), those leave that much
// sooner and the replicas' gradients cross beside them: the step is shorter; where the replicas' gradients fill the link all backward
// long (large ones on a slow link), holding them back lengthens it. Auto
// takes late only in the first case.
TEST(Planner, ReplicaWeightGradientsGoLateWhereTheDenseBucketsEndTheStepNotWhereTheyFillTheLink) {
  auto workload = [](double expert_bytes, ReplicaWeightGradients when) {
    Workload w = one_layer(expert_bytes, 0, 1.0);
    w.num_moe_layers = 2;
    w.expert_fwd_s = 2.0;
    w.expert_bwd_s = 4.0;
    w.dense_param_bytes = 2e6;
    w.overlapped = true;
    w.replica_weight_gradients = when;
    return w;
  };
  const std::vector<LinkModel> dense_tail = {{0.1, 1e-6}}, slow = {{0.01, 1e-6}};
  struct Case {
    const char* name;
    double expert_bytes;
    std::vector<LinkModel> links;
    bool late_wins;
  };
  for (const Case& k : {Case{"the last dense buckets ending the step", 1e3, dense_tail, true},
                        Case{"replica gradients filling the link", 1e6, slow, false}}) {
    const PlanCandidate early =
        evaluate_candidate(workload(k.expert_bytes, ReplicaWeightGradients::kEarly), {4}, k.links, {4}, 1e300);
    const PlanCandidate late =
        evaluate_candidate(workload(k.expert_bytes, ReplicaWeightGradients::kLate), {4}, k.links, {4}, 1e300);
    const PlanCandidate chosen =
        evaluate_candidate(workload(k.expert_bytes, ReplicaWeightGradients::kAuto), {4}, k.links, {4}, 1e300);
    std::printf("[planner] %s: early %.3f s, late %.3f s, auto takes %s\n", k.name, early.iteration_s,
                late.iteration_s, chosen.replica_weights_late ? "late" : "early");
    EXPECT_FALSE(early.replica_weights_late);
    EXPECT_TRUE(late.replica_weights_late);
    EXPECT_NEAR(late.compute_s, early.compute_s, 1e-9) << k.name << ": the same compute, moved";
    if (k.late_wins) EXPECT_LT(late.iteration_s, early.iteration_s * (1 - kPlanTieMargin)) << k.name;
    else EXPECT_GT(late.iteration_s, early.iteration_s) << k.name;
    EXPECT_EQ(chosen.replica_weights_late, k.late_wins) << k.name;
    EXPECT_DOUBLE_EQ(chosen.iteration_s, k.late_wins ? late.iteration_s : early.iteration_s) << k.name;
  }
  // Without replicas (EP) or overlap there is nothing to hold back.
  EXPECT_FALSE(evaluate_candidate(workload(1e3, ReplicaWeightGradients::kLate), {4}, dense_tail, {1}, 1e300)
                   .replica_weights_late);
  Workload simple = workload(1e3, ReplicaWeightGradients::kLate);
  simple.overlapped = false;
  EXPECT_FALSE(evaluate_candidate(simple, {4}, dense_tail, {4}, 1e300).replica_weights_late);
}

// Overlapped, with one level of peers and raw rows, the runtime queues every
// chunk of an A2A on the link as it starts (actors/hybrid_exchange.h), so
// their latencies overlap; with a token codec a comm thread sends one chunk
// after the other has landed, and each pays the latency in turn.
TEST(Planner, DirectExchangesQueueTheirChunksBackToBackSoTheLatenciesOverlap) {
  const std::vector<LinkModel> latency = {{2.0, 0.0}};  // longer than the compute between A2As
  const Workload direct = farskip_layer(true, 4);
  const PlanCandidate queued = evaluate_candidate(direct, {2}, latency, {1}, 1e300);
  LinkCodecCost coded;  // a codec that changes no byte and costs no time, but is not raw
  coded.dispatch_s_per_byte = coded.combine_s_per_byte = 1e-30;
  const PlanCandidate in_turn = evaluate_candidate(direct, {2}, latency, {1}, 1e300, {coded});
  EXPECT_NEAR(queued.a2a_s, in_turn.a2a_s, 1e-12);  // the same transfers
  EXPECT_GT(in_turn.exposed_a2a_s, queued.exposed_a2a_s + 2.0);
  // Queued, four chunks wait no longer than one A2A.
  const PlanCandidate whole = evaluate_candidate(farskip_layer(true, 1), {2}, latency, {1}, 1e300);
  EXPECT_LE(queued.exposed_a2a_s, whole.exposed_a2a_s + 1e-12);
  // Not overlapped, nothing is direct: every chunk's latency is exposed.
  const PlanCandidate simple = evaluate_candidate(farskip_layer(false, 4), {2}, latency, {1}, 1e300);
  EXPECT_NEAR(simple.exposed_a2a_s, 4 * 4 * 2.0, 1e-12);
}

// What a worker sends in a step, over every level.
double bytes_sent(const PlanCandidate& c) {
  double bytes = 0;
  for (double b : c.level_bytes) bytes += b;
  return bytes;
}

// Overlapped, the transport's threads take the compute's cores for their CPU
// time per byte sent: compute stretches by exactly that. The simple schedule
// (the transfers run while compute waits) is left alone.
TEST(Planner, OverlappedTheTransportsCpuTimeStretchesComputeByItsBytes) {
  const std::vector<LinkModel> links = {{1e-3, 1e-7}};
  Workload w = farskip_layer(true, 2);
  const PlanCandidate plain = evaluate_candidate(w, {2}, links, {1}, 1e300);
  w.transport_cpu_s_per_byte = 1e-7;
  const PlanCandidate loaded = evaluate_candidate(w, {2}, links, {1}, 1e300);
  const double bytes = bytes_sent(loaded);
  EXPECT_GT(bytes, 0);
  EXPECT_NEAR(loaded.transport_cpu_s, 1e-7 * bytes, 1e-12);
  EXPECT_NEAR(loaded.compute_s, plain.compute_s + loaded.transport_cpu_s, 1e-9);
  EXPECT_GT(loaded.iteration_s, plain.iteration_s);
  EXPECT_EQ(plain.transport_cpu_s, 0);
  Workload simple = farskip_layer(false, 2);
  const double simple_compute = evaluate_candidate(simple, {2}, links, {1}, 1e300).compute_s;
  simple.transport_cpu_s_per_byte = 1e-7;
  EXPECT_DOUBLE_EQ(evaluate_candidate(simple, {2}, links, {1}, 1e300).compute_s, simple_compute);
}

// What a worker sends in a step, in messages, over every level.
double messages_sent(const PlanCandidate& c) {
  double messages = 0;
  for (double m : c.level_messages) messages += m;
  return messages;
}

// A token exchange sends each peer a message per chunk, r a direction
// forward and as many backward; the AG and the replica gradients one per
// domain peer; the norm's sum one per other member.
TEST(Planner, EveryChunkOfAnExchangeIsAMessageToEachPeer) {
  const std::vector<LinkModel> links = {{1e-3, 1e-7}};
  const PlanCandidate ep1 = evaluate_candidate(farskip_layer(true, 1), {4}, links, {1}, 1e300);
  Workload two = farskip_layer(true, 2);
  two.backward_pipeline_degree = 2;
  const PlanCandidate ep2 = evaluate_candidate(two, {4}, links, {1}, 1e300);
  EXPECT_DOUBLE_EQ(messages_sent(ep1), 2 * (1 + 1) * 3 + 3);
  EXPECT_DOUBLE_EQ(messages_sent(ep2), 2 * (2 + 2) * 3 + 3);
  const PlanCandidate hybrid = evaluate_candidate(farskip_layer(true, 1), {4}, links, {2}, 1e300);
  EXPECT_DOUBLE_EQ(messages_sent(hybrid), 2 * (1 + 1) * 1 + 2 + 3);
}

// Below a lossy level, a raw level relays each block that crossed it as it
// arrived: a message per origin to each peer, beside the worker's own.
TEST(Planner, ARawLevelBelowALossyOneRelaysAMessagePerOrigin) {
  const std::vector<LinkModel> links = {{1e-3, 1e-7}, {1e-4, 1e-8}};
  Workload w = one_layer(1e5, 0);
  w.overlapped = true;
  LinkCodecCost lossy;
  lossy.gather_fraction = 0.1;
  const std::vector<LinkCodecCost> codecs = {lossy, LinkCodecCost{}};
  const PlanCandidate raw = evaluate_candidate(w, {4, 2}, links, {4, 2}, 1e300);
  const PlanCandidate relayed = evaluate_candidate(w, {4, 2}, links, {4, 2}, 1e300, codecs);
  // Outer: 3 AG and 3 replica-gradient messages, and the norm's 3. Inner:
  // 1 and 1, and the norm's 1; relaying, 3 more AG messages (one per origin).
  EXPECT_DOUBLE_EQ(raw.level_messages[0], 3 + 3 + 3);
  EXPECT_DOUBLE_EQ(raw.level_messages[1], 1 + 1 + 1);
  EXPECT_DOUBLE_EQ(relayed.level_messages[0], 3 + 3 + 3);
  EXPECT_DOUBLE_EQ(relayed.level_messages[1], 1 + 3 + 1 + 1);
}

// Overlapped, the transport's CPU time per message sent stretches compute
// as its time per byte does.
TEST(Planner, OverlappedTheTransportsCpuTimeStretchesComputeByItsMessagesToo) {
  const std::vector<LinkModel> links = {{1e-3, 1e-7}};
  Workload w = farskip_layer(true, 2);
  const PlanCandidate plain = evaluate_candidate(w, {4}, links, {1}, 1e300);
  w.transport_cpu_s_per_message = 1e-3;
  const PlanCandidate loaded = evaluate_candidate(w, {4}, links, {1}, 1e300);
  EXPECT_NEAR(loaded.transport_cpu_s, 1e-3 * messages_sent(loaded), 1e-12);
  EXPECT_NEAR(loaded.compute_s, plain.compute_s + loaded.transport_cpu_s, 1e-9);
  w.transport_cpu_s_per_byte = 1e-8;
  const PlanCandidate both = evaluate_candidate(w, {4}, links, {1}, 1e300);
  EXPECT_NEAR(both.transport_cpu_s, 1e-3 * messages_sent(both) + 1e-8 * bytes_sent(both), 1e-12);
}

// Where the codecs share the compute's cores, their encode and decode
// seconds stretch the overlapped compute as the transport's CPU time does:
// a step's every coded byte, each token direction forward and backward, the
// AG's and the replica gradients'. Where they have cores of their own, only
// the hops carry them.
TEST(Planner, OverlappedTheCodecsCpuTimeStretchesComputeWhereTheyShareItsCores) {
  const std::vector<LinkModel> links = {{1e-3, 1e-7}};
  Workload w = farskip_layer(true, 1);
  w.expert_bytes = 1e5;
  LinkCodecCost coded;
  coded.dispatch_fraction = coded.combine_fraction = 0.5;
  coded.dispatch_s_per_byte = 1e-9;
  coded.combine_s_per_byte = 2e-9;
  coded.gather_fraction = coded.grad_fraction = 0.1;
  coded.gather_s_per_byte = 3e-9;
  coded.grad_s_per_byte = 4e-9;
  const std::vector<LinkCodecCost> codecs = {coded};
  const PlanCandidate apart = evaluate_candidate(w, {4}, links, {2}, 1e300, codecs);
  const double a2a_bytes = w.token_bytes * (1 - 2.0 / 4), own = w.experts_per_worker * w.expert_bytes;
  EXPECT_NEAR(apart.codec_cpu_s, 2 * a2a_bytes * 3e-9 + own * 3e-9 + own * 4e-9, 1e-15);
  EXPECT_EQ(apart.transport_cpu_s, 0);
  EXPECT_EQ(apart.codec_stretch_s, 0);
  w.codecs_share_compute_cores = true;
  const PlanCandidate shared = evaluate_candidate(w, {4}, links, {2}, 1e300, codecs);
  EXPECT_NEAR(shared.codec_stretch_s, shared.codec_cpu_s, 1e-15);
  EXPECT_EQ(shared.transport_cpu_s, 0) << "no transport CPU priced";
  EXPECT_NEAR(shared.compute_s, apart.compute_s + shared.codec_cpu_s, 1e-9);
  EXPECT_NEAR(shared.run_compute_s(), apart.compute_s, 1e-9);
  EXPECT_GT(shared.iteration_s, apart.iteration_s);
  Workload simple = farskip_layer(false, 1), simple_apart = farskip_layer(false, 1);
  simple.expert_bytes = simple_apart.expert_bytes = 1e5;
  simple.codecs_share_compute_cores = true;
  EXPECT_DOUBLE_EQ(evaluate_candidate(simple, {4}, links, {2}, 1e300, codecs).compute_s,
                   evaluate_candidate(simple_apart, {4}, links, {2}, 1e300, codecs).compute_s);
}

// The routed experts' flops are each layer's busiest worker's: a
// candidate's expert compute, forward and backward, scales by its
// layers_busiest; another candidate's entry leaves it alone. Of that, what
// lies beyond the busiest worker's own rows is its wait for the others,
// which a run counts as exposed time (run_compute_s leaves it out).
TEST(Planner, TheBusiestWorkersRowsStretchTheRoutedExpertsCompute) {
  Workload w = farskip_layer(false, 1);
  const PlanCandidate even = evaluate_candidate(w, {2}, kSlowLink, {1}, 1e300);
  EXPECT_EQ(even.expert_imbalance, 1.0);
  EXPECT_EQ(even.expert_wait_s, 0.0);
  w.routed_expert_load[{2}] = {1.5, 1.2};
  EXPECT_DOUBLE_EQ(evaluate_candidate(w, {2}, kSlowLink, {1}, 1e300).compute_s, even.compute_s);
  w.routed_expert_load[{1}] = {1.5, 1.2};
  const PlanCandidate busy = evaluate_candidate(w, {2}, kSlowLink, {1}, 1e300);
  const double expert_s = w.expert_fwd_s + w.expert_bwd_s;
  EXPECT_EQ(busy.expert_imbalance, 1.5);
  EXPECT_NEAR(busy.compute_s, even.compute_s + 0.5 * expert_s, 1e-9);
  EXPECT_NEAR(busy.iteration_s, even.iteration_s + 0.5 * expert_s, 1e-9);
  EXPECT_NEAR(busy.expert_wait_s, 0.3 * expert_s, 1e-9);
  EXPECT_NEAR(busy.run_compute_s(), even.compute_s + 0.2 * expert_s, 1e-9);
  PlannerInputs in;
  in.model = default_train_config().model;
  in.level_sizes = {2};
  in.links = {LinkModel{1e-3, 1e-9}};
  in.routed_expert_load[{1}] = {1.5, 1.2};
  EXPECT_TRUE(in.validate().is_ok()) << in.validate().message();
  in.routed_expert_load[{1}] = {1.5, 0.5};
  EXPECT_FALSE(in.validate().is_ok()) << "below 1";
  in.routed_expert_load[{1}] = {1.1, 1.2};
  EXPECT_FALSE(in.validate().is_ok()) << "each layer's busiest below the busiest worker's own";
  in.routed_expert_load[{1}] = {std::nan(""), 1.0};
  EXPECT_FALSE(in.validate().is_ok()) << "not a number";
}

// Not overlapped, each exchange's CPU time per message is the compute
// thread's wait, in the exposed time.
TEST(Planner, NotOverlappedEachExchangesCpuPerMessageIsWaitedOut) {
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  Workload w = farskip_layer(false, 1);
  const PlanCandidate plain = evaluate_candidate(w, {4}, links, {1}, 1e300);
  w.exchange_cpu_s_per_message = 0.01;
  const PlanCandidate loaded = evaluate_candidate(w, {4}, links, {1}, 1e300);
  // Four exchanges (Dispatch, Combine and their backwards), each a message
  // to each of 3 peers.
  EXPECT_NEAR(loaded.exchange_cpu_s, 4 * 3 * 0.01, 1e-12);
  EXPECT_NEAR(loaded.iteration_s, plain.iteration_s + loaded.exchange_cpu_s, 1e-9);
}

// Each A2A hop lasts as long as its larger side: F times the mean bytes on
// the link. What a worker sends on average (the bound's bytes) stays.
TEST(Planner, AnA2AImbalanceStretchesEveryHopOfItsLevelByItsFactor) {
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  Workload w = farskip_layer(false, 1);
  const PlanCandidate uniform = evaluate_candidate(w, {2}, links, {1}, 1e300);
  w.a2a_imbalance = {1.5};
  const PlanCandidate skewed = evaluate_candidate(w, {2}, links, {1}, 1e300);
  EXPECT_DOUBLE_EQ(uniform.exposed_a2a_s, 4.0);
  EXPECT_DOUBLE_EQ(skewed.exposed_a2a_s, 6.0);
  EXPECT_DOUBLE_EQ(skewed.iteration_s, uniform.iteration_s + 2.0);
  EXPECT_EQ(skewed.level_bytes, uniform.level_bytes);
  PlannerInputs in;
  in.model = default_train_config().model;
  in.level_sizes = {2};
  in.links = {LinkModel{1e-3, 1e-9}};
  in.a2a_imbalance = {1.2, 1.0};
  EXPECT_FALSE(in.validate().is_ok()) << "one per level";
  in.a2a_imbalance = {0.9};
  EXPECT_FALSE(in.validate().is_ok()) << "below 1";
  in.a2a_imbalance = {2.5};
  EXPECT_FALSE(in.validate().is_ok()) << "above 2: more than every row one way";
  in.a2a_imbalance = {1.2};
  EXPECT_TRUE(in.validate().is_ok()) << in.validate().message();
}

// Of a pair of peers, the one that sends more rows in a Dispatch sends fewer
// in the Combine (the rows return the way they came). Each A2A alone lasts
// as long as its larger side, so nothing overlapped, every one is F times
// as long; pipelined, a Combine chunk leaves on the peer's egress, which its
// lighter Dispatch left free, so the same imbalance costs less.
TEST(Planner, PipelinedTheImbalanceCostsLessThanWhenEveryA2ABlocks) {
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  auto stretch = [&](bool overlapped, int r) {
    Workload w = farskip_layer(overlapped, r);
    w.connectivity = {Connectivity::kRegular};
    const double uniform = evaluate_candidate(w, {2}, links, {1}, 1e300).iteration_s;
    w.a2a_imbalance = {1.5};
    return evaluate_candidate(w, {2}, links, {1}, 1e300).iteration_s - uniform;
  };
  EXPECT_DOUBLE_EQ(stretch(false, 1), 2.0) << "four 1 s A2As, each half as long again";
  const double pipelined = stretch(true, 4);
  EXPECT_GT(pipelined, 0.0);
  EXPECT_LT(pipelined, stretch(true, 1));
  EXPECT_LT(pipelined, 2.0);
}

// At start-up each candidate takes the routing probe's F for its own
// domains (they decide which rows cross which level); a measured F, once a
// run has one, holds for every candidate.
TEST(Planner, EachCandidateTakesTheRoutedImbalanceOfItsDomainsUntilOneIsMeasured) {
  const std::vector<LinkModel> links = {{0.0, 1e-6}};
  Workload w = farskip_layer(false, 1);
  const PlanCandidate uniform = evaluate_candidate(w, {2}, links, {1}, 1e300);
  w.routed_a2a_imbalance[{1}] = {1.5};
  w.routed_a2a_imbalance[{2}] = {1.25};
  const PlanCandidate routed = evaluate_candidate(w, {2}, links, {1}, 1e300);
  EXPECT_DOUBLE_EQ(routed.exposed_a2a_s, 6.0) << "F = 1.5 on 4 s of A2A";
  EXPECT_EQ(routed.a2a_imbalance, std::vector<double>{1.5});
  EXPECT_TRUE(uniform.a2a_imbalance.empty()) << "nothing routed, nothing measured: F = 1";
  w.a2a_imbalance = {1.25};  // measured by the run
  const PlanCandidate measured = evaluate_candidate(w, {2}, links, {1}, 1e300);
  EXPECT_DOUBLE_EQ(measured.exposed_a2a_s, 5.0);
  EXPECT_EQ(measured.a2a_imbalance, std::vector<double>{1.25});

  PlannerInputs in;
  in.model = default_train_config().model;
  in.level_sizes = {2};
  in.links = {LinkModel{1e-3, 1e-9}};
  in.routed_a2a_imbalance[{1}] = {1.5};
  EXPECT_TRUE(in.validate().is_ok()) << in.validate().message();
  EXPECT_EQ(in.a2a_imbalance_for({1}), std::vector<double>{1.5});
  EXPECT_TRUE(in.a2a_imbalance_for({2}).empty());
  in.a2a_imbalance = {1.1};
  EXPECT_EQ(in.a2a_imbalance_for({1}), std::vector<double>{1.1}) << "a measured F holds for every candidate";
  in.routed_a2a_imbalance[{2}] = {0.5};
  EXPECT_FALSE(in.validate().is_ok()) << "below 1";
  in.routed_a2a_imbalance.erase({2});
  in.routed_a2a_imbalance[{1, 1}] = {1.5, 1.5};
  EXPECT_FALSE(in.validate().is_ok()) << "a domain size per level";
}

// Not overlapped, each token exchange and dense bucket runs on the compute
// thread: the transport's CPU time for the bytes it sends is waited out on
// top of the link's time, once per byte, and nothing of it is compute.
// Overlapped, the exchanges' CPU runs beside the compute and adds no wait.
TEST(Planner, NotOverlappedTheExchangesCpuTimeAddsToTheStepForEveryByteSent) {
  const std::vector<LinkModel> links = {{1e-3, 1e-7}};
  Workload simple = farskip_layer(false, 2);
  const PlanCandidate plain = evaluate_candidate(simple, {2}, links, {1}, 1e300);
  simple.exchange_cpu_s_per_byte = 2e-8;
  const PlanCandidate loaded = evaluate_candidate(simple, {2}, links, {1}, 1e300);
  const double bytes = bytes_sent(loaded);
  EXPECT_GT(bytes, 0);
  EXPECT_NEAR(loaded.exchange_cpu_s, 2e-8 * bytes, 1e-12) << "EP: every byte sent is an A2A's or a bucket's";
  EXPECT_NEAR(loaded.iteration_s, plain.iteration_s + loaded.exchange_cpu_s, 1e-9);
  EXPECT_DOUBLE_EQ(loaded.compute_s, plain.compute_s);
  EXPECT_NEAR(loaded.exposed_a2a_s + loaded.exposed_allreduce_s,
              plain.exposed_a2a_s + plain.exposed_allreduce_s + loaded.exchange_cpu_s, 1e-9);
  Workload overlapped = farskip_layer(true, 2);
  const double before = evaluate_candidate(overlapped, {2}, links, {1}, 1e300).iteration_s;
  overlapped.exchange_cpu_s_per_byte = 2e-8;
  const PlanCandidate o = evaluate_candidate(overlapped, {2}, links, {1}, 1e300);
  EXPECT_EQ(o.exchange_cpu_s, 0);
  EXPECT_DOUBLE_EQ(o.iteration_s, before);
}

// The update runs once per step, after every gradient is in, over the
// parameters the worker updates: its dense ones and its owned experts.
TEST(Planner, TheOptimizerUpdateIsComputeOncePerStepOverTheWorkersParameters) {
  PlannerInputs in;
  in.model = default_train_config().model;
  in.tokens_per_worker = 256;
  in.seq_len = 64;
  in.level_sizes = {2};
  in.links = {LinkModel{1e-3, 1e-9}};
  const Workload without = workload_of(in);
  in.compute.optimizer_s_per_param = 5e-9;
  const Workload with = workload_of(in);
  const double params = without.dense_param_bytes / 4 +
                        without.experts_per_worker * in.model.num_layers * without.expert_bytes / 4;
  EXPECT_NEAR(with.optimizer_s, 5e-9 * params, 1e-15);
  EXPECT_EQ(without.optimizer_s, 0);
  const PlanCandidate a = evaluate_candidate(without, {1}, in.links, {1}, 1e300);
  const PlanCandidate b = evaluate_candidate(with, {1}, in.links, {1}, 1e300);
  EXPECT_NEAR(b.compute_s - a.compute_s, with.optimizer_s, 1e-12);
  EXPECT_NEAR(b.iteration_s - a.iteration_s, with.optimizer_s, 1e-12);
  EXPECT_NEAR(with_compute_scaled(with, 2).optimizer_s, 2 * with.optimizer_s, 1e-15);
}

TEST(StepProbe, CalibrationScalesEveryComputeTermByMeasuredOverPredicted) {
  const ModelConfig m = default_train_config().model;
  const ComputeModel gemm_only{1e10, 1e-6};
  PlannerInputs in;
  in.model = m;
  in.tokens_per_worker = 256;
  in.seq_len = 64;
  in.level_sizes = {1};
  in.links = {LinkModel{}};
  in.compute = gemm_only;
  const double predicted = evaluate_candidate(workload_of(in), {1}, in.links, {1}, 1e300).compute_s;
  ASSERT_GT(predicted, 0);

  const ComputeModel calibrated = calibrated_compute_model(gemm_only, StepProbe{m, 256, 64, 3 * predicted});
  EXPECT_NEAR(calibrated.non_gemm_factor, 3.0, 1e-9);
  EXPECT_EQ(calibrated.flops_per_s, gemm_only.flops_per_s);
  in.compute = calibrated;
  in.tokens_per_worker = 512;  // the factor carries over to the job's own batch
  in.level_sizes = {2, 2};
  in.links = {{0.01, 8e-8}, {2e-4, 8e-9}};
  const Workload w3 = workload_of(in);
  in.compute = gemm_only;
  const Workload w1 = workload_of(in);
  EXPECT_NEAR(w3.pre_expert_fwd_s, 3 * w1.pre_expert_fwd_s, 1e-12);
  EXPECT_NEAR(w3.pre_expert_bwd_s, 3 * w1.pre_expert_bwd_s, 1e-12);
  EXPECT_NEAR(w3.expert_fwd_s, 3 * w1.expert_fwd_s, 1e-12);
  EXPECT_NEAR(w3.expert_bwd_s, 3 * w1.expert_bwd_s, 1e-12);
  EXPECT_NEAR(w3.post_s, 3 * w1.post_s, 1e-12);
  EXPECT_NEAR(w3.gemm_overhead_s, 3 * w1.gemm_overhead_s, 1e-15);
  EXPECT_EQ(w3.token_bytes, w1.token_bytes);  // traffic does not change
  // The probe's update time per parameter carries over, and does not enter
  // the factor (the probe's step is forward and backward only).
  StepProbe with_update{m, 256, 64, 3 * predicted};
  with_update.optimizer_s_per_param = 4e-9;
  const ComputeModel both = calibrated_compute_model(gemm_only, with_update);
  EXPECT_NEAR(both.non_gemm_factor, 3.0, 1e-9);
  EXPECT_EQ(both.optimizer_s_per_param, 4e-9);
}

TEST(StepProbe, AStepFasterThanItsGemmsLeavesTheModelAlone) {
  const ComputeModel gemm_only{1e10, 0};
  const ModelConfig m = default_train_config().model;
  EXPECT_EQ(calibrated_compute_model(gemm_only, StepProbe{m, 256, 64, 1e-12}).non_gemm_factor, 1.0);
  EXPECT_EQ(calibrated_compute_model(gemm_only, StepProbe{}).non_gemm_factor, 1.0);
}

TEST(StepProbe, TimesARealStepOfTheModelAndRejectsABadSequenceLength) {
  ModelConfig m = default_train_config().model;
  StepProbeOptions o;
  o.max_tokens = 128;
  o.repetitions = 1;
  auto probe = probe_model_step(m, 32, 100000, o);
  ASSERT_TRUE(probe) << probe.status().message();
  EXPECT_EQ(probe->tokens, 128);  // capped, whole sequences
  EXPECT_EQ(probe->seq_len, 32);
  EXPECT_GT(probe->seconds, 0);
  EXPECT_FALSE(probe_model_step(m, m.max_seq_len + 1, 1024, o));
  EXPECT_FALSE(probe_model_step(m, 0, 1024, o));
  m.hidden_size = 0;
  EXPECT_FALSE(probe_model_step(m, 32, 1024, o));
}

TEST(StepProbe, TimesACutDownModelSoTheCoordinatorNeverHoldsAllOfABigOne) {
  ModelConfig m = default_train_config().model;
  m.num_layers = 6;
  m.num_experts = 32;
  m.top_k = 2;
  m.connectivity.assign(6, Connectivity::kRegular);
  m.connectivity[1] = Connectivity::kFarSkip;
  StepProbeOptions o;
  o.max_tokens = 64;
  o.repetitions = 1;
  auto probe = probe_model_step(m, 32, 4096, o);
  ASSERT_TRUE(probe) << probe.status().message();
  EXPECT_EQ(probe->model.num_layers, 2);
  EXPECT_EQ(probe->model.num_experts, 8);
  EXPECT_EQ(probe->model.top_k, 2);
  ASSERT_EQ(probe->model.connectivity.size(), 2u);
  EXPECT_EQ(probe->model.connectivity[1], Connectivity::kFarSkip);
  EXPECT_EQ(probe->model.hidden_size, m.hidden_size);
  EXPECT_EQ(probe->model.expert_intermediate_size, m.expert_intermediate_size);
}

// As many copies as workers share the machine's cores run at once, each on
// its own thread with its own model; the figures are their mean.
TEST(StepProbe, TimesCopiesAtOnceAsTheWorkersSharingTheCoresWillRun) {
  ModelConfig m = default_train_config().model;
  StepProbeOptions o;
  o.max_tokens = 64;
  o.repetitions = 2;
  o.copies = 3;
  auto probe = probe_model_step(m, 32, 4096, o);
  ASSERT_TRUE(probe) << probe.status().message();
  EXPECT_EQ(probe->copies, 3);
  EXPECT_GT(probe->seconds, 0);
  EXPECT_TRUE(std::isfinite(probe->seconds));
  EXPECT_GT(probe->optimizer_s_per_param, 0);
  EXPECT_TRUE(std::isfinite(probe->optimizer_s_per_param));
  o.copies = 0;  // read as one
  auto one = probe_model_step(m, 32, 4096, o);
  ASSERT_TRUE(one) << one.status().message();
  EXPECT_EQ(one->copies, 1);
}

// ---- probes -----------------------------------------------------------------

TEST(LinkProbe, FitLineRecoversKnownAlphaAndBeta) {
  const double alpha = 0.004, beta = 8e-8;
  std::vector<std::pair<double, double>> exact;
  for (double n : {1e3, 6.4e4, 5.12e5, 2e6}) exact.emplace_back(n, alpha + beta * n);
  const LinearFit f = fit_line(exact);
  EXPECT_NEAR(f.alpha, alpha, 1e-12);
  EXPECT_NEAR(f.beta, beta, 1e-18);
  EXPECT_NEAR(f.r2, 1.0, 1e-12);
  EXPECT_EQ(f.samples.size(), 4u);

  // With seeded noise of +-2% the fit stays within a few percent.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> noise(-0.02, 0.02);
  std::vector<std::pair<double, double>> noisy;
  for (int rep = 0; rep < 5; ++rep)
    for (double n : {1e3, 6.4e4, 5.12e5, 2e6}) noisy.emplace_back(n, (alpha + beta * n) * (1 + noise(rng)));
  const LinearFit g = fit_line(noisy);
  EXPECT_NEAR(g.beta / beta, 1.0, 0.03);
  EXPECT_NEAR(g.alpha / alpha, 1.0, 0.25);
  EXPECT_GT(g.r2, 0.99);
}

TEST(LinkProbe, FitLineOfOneDistinctSizeIsItsMean) {
  const LinearFit f = fit_line({{10, 1.0}, {10, 3.0}});
  EXPECT_DOUBLE_EQ(f.alpha, 2.0);
  EXPECT_DOUBLE_EQ(f.beta, 0.0);
  EXPECT_DOUBLE_EQ(f.r2, 0.0);
  EXPECT_DOUBLE_EQ(fit_line({}).beta, 0.0);
}

TEST(LinkProbe, ShapedLinkFitRecoversOneOverBandwidth) {
  const LinkShaping shaping{10e6, 2e-3};  // 80 mbit/s, 2 ms
  LinkProbeOptions o;
  o.sizes = {1 << 10, 128 << 10, 512 << 10, 1 << 20};  // the largest takes 0.1 s
  o.repetitions = 3;
  auto fit = probe_link(shaping, o);
  ASSERT_TRUE(fit) << fit.status().message();
  EXPECT_EQ(fit->samples.size(), 4u);  // the fastest of 3 rounds per size
  EXPECT_NEAR(fit->beta * shaping.bandwidth_bytes_per_s, 1.0, 0.15)
      << "beta " << fit->beta << " alpha " << fit->alpha;
  EXPECT_GT(fit->alpha, 0.5 * shaping.latency_s);
  EXPECT_LT(fit->alpha, shaping.latency_s + 0.010);
  EXPECT_GT(fit->r2, 0.95);
  // The shaper sleeps while it paces: the transports' CPU time per byte is
  // some, and far below the wall time per byte of this 80 mbit/s link.
  EXPECT_GT(fit->cpu_s_per_byte, 0);
  EXPECT_LT(fit->cpu_s_per_byte, 0.5 * fit->beta);
  // Each message costs its wake-ups and hand-offs, far below its latency.
  EXPECT_GT(fit->cpu_s_per_message, 0);
  EXPECT_LT(fit->cpu_s_per_message, fit->alpha);
}

TEST(LinkProbe, SlowLinksGetSmallerMessagesToStayWithinTheBudget) {
  const LinkShaping slow{200e3, 1e-3};  // 1.6 mbit/s: 2 MB would take 10 s
  LinkProbeOptions o;
  o.max_message_s = 0.05;
  o.repetitions = 2;
  auto fit = probe_link(slow, o);
  ASSERT_TRUE(fit) << fit.status().message();
  for (const auto& [bytes, seconds] : fit->samples) EXPECT_LE(bytes, 0.05 * slow.bandwidth_bytes_per_s);
  EXPECT_NEAR(fit->beta * slow.bandwidth_bytes_per_s, 1.0, 0.25);
}

TEST(LinkProbe, GemmProbeFitsAPlausibleRate) {
  GemmProbeOptions o;
  o.shapes = {{32, 32, 32}, {64, 64, 64}, {128, 64, 128}, {128, 128, 128}};
  o.min_seconds_per_shape = 0.01;
  const LinearFit f = probe_gemm(o);
  ASSERT_EQ(f.samples.size(), 4u);
  ASSERT_GT(f.beta, 0);
  const double rate = 1.0 / f.beta;
  EXPECT_GT(rate, 1e7);   // flop/s
  EXPECT_LT(rate, 1e13);
}

}  // namespace
}  // namespace xd
