// The routers beyond plain top-k: GShard noisy top-k, X-MoE cosine routing and
// causal SoftMoE, and the Order step they share. Gradients are checked in
// model_grad_test.cc and against PyTorch in model_torch_reference_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/rng.h"
#include "model/moe_transformer.h"
#include "model/order.h"
#include "model/router.h"
#include "test_util.h"

namespace xd {
namespace {

ModelConfig router_config(Gating gating) {
  ModelConfig c;
  c.vocab_size = 31;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.max_seq_len = 12;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_intermediate_size = 8;
  c.gating = gating;
  c.init_std = 0.3;
  return c;
}

using test_util::random_tokens;

TEST(RoutingNoise, IsTheGeneratorDocumentedInTheModelSpec) {
  // docs/model.md, "Router noise": seed 1, step 2, layer 0, global token 5, E = 4.
  double eps[4];
  routing_noise(eps, RoutingContext{true, 1, 2, 0}, 0, 5, 1, 4);
  const double documented[4] = {-0.68936729819403664, 0.41703224567581754, -0.97036029216993402,
                                0.42034796902896659};
  for (int e = 0; e < 4; ++e) EXPECT_DOUBLE_EQ(eps[e], documented[e]) << "expert " << e;
}

TEST(RoutingNoise, ATokenDrawsTheSameNoiseHoweverTheBatchIsSplit) {
  const RoutingContext ctx{true, 42, 7, 0};
  std::vector<double> whole(6 * 4), first(3 * 4), second(3 * 4);
  routing_noise(whole.data(), ctx, 1, 0, 6, 4);
  routing_noise(first.data(), ctx, 1, 0, 3, 4);
  routing_noise(second.data(), ctx, 1, 3, 3, 4);
  first.insert(first.end(), second.begin(), second.end());
  EXPECT_EQ(whole, first);
  std::vector<double> next_step(6 * 4), other_layer(6 * 4);
  routing_noise(next_step.data(), RoutingContext{true, 42, 8, 0}, 1, 0, 6, 4);
  routing_noise(other_layer.data(), ctx, 0, 0, 6, 4);
  EXPECT_NE(whole, next_step);
  EXPECT_NE(whole, other_layer);
}

TEST(GShardNoisyTopK, NoiseOnlyInTrainingAndTheSameNoiseForTheSameStep) {
  const ModelConfig cfg = router_config(Gating::kGShardNoisyTopK);
  ParamLayout layout(cfg);
  MoeTransformer<double> model(layout);
  model.init(3);
  test_util::randomise_tensors(layout, model.params().data(), ".gate_noise.", 1.0, 8);
  const auto in = random_tokens(2 * 8, cfg.vocab_size, 1), tg = random_tokens(2 * 8, cfg.vocab_size, 2);
  const double eval_a = model.forward(in.data(), tg.data(), 2, 8).loss;
  model.set_routing_context(RoutingContext{true, 5, 1, 0});
  const double step1_a = model.forward(in.data(), tg.data(), 2, 8).loss;
  const double step1_b = model.forward(in.data(), tg.data(), 2, 8).loss;
  model.set_routing_context(RoutingContext{true, 5, 2, 0});
  const double step2 = model.forward(in.data(), tg.data(), 2, 8).loss;
  model.set_routing_context(RoutingContext{});
  const double eval_b = model.forward(in.data(), tg.data(), 2, 8).loss;
  EXPECT_EQ(eval_a, eval_b);
  // At evaluation it is softmax top-k on gate.weight, whatever the noise weights hold.
  ModelConfig plain_cfg = cfg;
  plain_cfg.gating = Gating::kSoftmaxTopK;
  ParamLayout plain_layout(plain_cfg);
  MoeTransformer<double> plain(plain_layout);
  for (const TensorSlot& s : plain_layout.slots()) {
    const TensorSlot* from = layout.find(s.name);
    ASSERT_NE(from, nullptr) << s.name;
    std::copy_n(model.params().data() + from->offset, s.numel(), plain.params().data() + s.offset);
  }
  EXPECT_EQ(plain.forward(in.data(), tg.data(), 2, 8).loss, eval_a);
  EXPECT_EQ(step1_a, step1_b) << "the noise is a function of the step, not a running generator";
  EXPECT_NE(step1_a, eval_a);
  EXPECT_NE(step1_a, step2);
}

TEST(XMoe, RoutingIgnoresTheScaleOfTheProjectionAndLogitsStayWithinOneOverTheTemperature) {
  ModelConfig cfg = router_config(Gating::kXMoe);
  cfg.router_dim = 3;
  const int N = 20, d = cfg.hidden_size, E = cfg.num_experts, de = 3;
  Rng rng(9);
  std::vector<double> x(N * d), proj(de * d), experts(E * de), scaled(de * d);
  for (auto& v : x) v = rng.normal();
  for (auto& v : proj) v = rng.normal();
  for (auto& v : experts) v = rng.normal();
  for (size_t i = 0; i < proj.size(); ++i) scaled[i] = 7.5 * proj[i];
  const double log_scale = std::log(1 / 0.07);
  RouterCall call{N, N, 0, {}};
  RouterCache<double> a, b;
  DispatchPlan<double> pa, pb;
  router_forward(&a, &pa, x.data(), RouterWeights<double>{proj.data(), nullptr, nullptr, nullptr, experts.data(),
                                                          nullptr, &log_scale, nullptr}, cfg, call);
  router_forward(&b, &pb, x.data(), RouterWeights<double>{scaled.data(), nullptr, nullptr, nullptr, experts.data(),
                                                          nullptr, &log_scale, nullptr}, cfg, call);
  EXPECT_EQ(pa.token, pb.token);
  for (int i = 0; i < pa.size(); ++i) EXPECT_NEAR(pa.weight[i], pb.weight[i], 1e-12);
  for (double l : a.logits) EXPECT_LE(std::abs(l), 1 / 0.07 + 1e-9);
}

TEST(SoftMoe, NoPositionSeesTheFuture) {
  ModelConfig cfg = router_config(Gating::kSoftMoe);
  cfg.soft_moe_slots = 2;
  ParamLayout layout(cfg);
  MoeTransformer<double> model(layout);
  model.init(4);
  const int B = 2, T = 10, V = cfg.vocab_size;
  auto in = random_tokens(B * T, V, 5);
  model.forward(in.data(), nullptr, B, T);
  const std::vector<double> before = model.logits();
  for (int cut : {0, 4, 8}) {
    auto changed = in;
    for (int b = 0; b < B; ++b)
      for (int t = cut + 1; t < T; ++t) changed[b * T + t] = (changed[b * T + t] + 1 + t) % V;
    model.forward(changed.data(), nullptr, B, T);
    const std::vector<double>& after = model.logits();
    for (int b = 0; b < B; ++b)
      for (int t = 0; t <= cut; ++t)
        for (int v = 0; v < V; ++v) {
          const size_t i = ((size_t)b * T + t) * V + v;
          ASSERT_EQ(after[i], before[i]) << "position " << t << " saw a change after position " << cut;
        }
    bool later_changed = false;
    for (int t = cut + 1; t < T; ++t) later_changed |= after[(size_t)t * V] != before[(size_t)t * V];
    EXPECT_TRUE(later_changed) << "the change must reach the later positions";
  }
}

TEST(SoftMoe, EveryTokenReachesEverySlotNothingIsDroppedAndTheLastPositionIsTheOriginalSoftMoe) {
  ModelConfig cfg = router_config(Gating::kSoftMoe);
  cfg.soft_moe_slots = 3;
  cfg.capacity_factor = 0.5;  // ignored: SoftMoE never drops
  const int B = 2, T = 5, N = B * T, d = cfg.hidden_size, E = cfg.num_experts, S = E * 3;
  Rng rng(2);
  std::vector<double> x(N * d), phi(S * d);
  for (auto& v : x) v = rng.normal();
  for (auto& v : phi) v = 0.5 * rng.normal();
  RouterCache<double> c;
  DispatchPlan<double> plan;
  router_forward(&c, &plan, x.data(), RouterWeights<double>{phi.data(), nullptr}, cfg, RouterCall{N, T, 0, {}});
  EXPECT_EQ(plan.size(), N * S);
  EXPECT_EQ(plan.dropped, 0);
  for (int e = 0; e < E; ++e) EXPECT_EQ(plan.count(e), N * 3);
  std::vector<double> weight_sum(N, 0.0);
  for (int a = 0; a < plan.size(); ++a) weight_sum[plan.token[a]] += plan.weight[a];
  for (double w : weight_sum) EXPECT_NEAR(w, 1.0, 1e-12);
  // At the last position the causal prefix is the whole sequence: the slot
  // input is the original SoftMoE's softmax-over-tokens mix.
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < S; ++s) {
      std::vector<double> logit(T), mix(d, 0.0);
      double mx = -1e300, sum = 0;
      for (int u = 0; u < T; ++u) {
        for (int j = 0; j < d; ++j) logit[u] += x[(b * T + u) * d + j] * phi[s * d + j];
        mx = std::max(mx, logit[u]);
      }
      for (int u = 0; u < T; ++u) sum += std::exp(logit[u] - mx);
      for (int u = 0; u < T; ++u)
        for (int j = 0; j < d; ++j) mix[j] += std::exp(logit[u] - mx) / sum * x[(b * T + u) * d + j];
      const double* got = router_source(c, x.data(), cfg) + ((size_t)(b * T + T - 1) * S + s) * d;
      for (int j = 0; j < d; ++j) EXPECT_NEAR(got[j], mix[j], 1e-12);
    }
}

TEST(Order, GroupsByExpertKeepingTheRoutersOrderAndItsReverseIsTheAdjoint) {
  const std::vector<RouteAssignment<double>> asg = {
      {2, 0, 0, 0.5}, {0, 1, 0, 0.5}, {2, 5, 1, 1.0}, {1, 3, 2, 0.25}, {0, 4, 2, 0.75}};
  DispatchPlan<double> plan;
  order_plan(&plan, asg, 3, 3);
  EXPECT_EQ(plan.expert_offsets, (std::vector<int>{0, 2, 3, 5}));
  EXPECT_EQ(plan.source_row, (std::vector<int>{1, 4, 3, 0, 5}));
  EXPECT_EQ(plan.token, (std::vector<int>{0, 2, 2, 0, 1}));
  // <gather(x), y> = <x, scatter_add(y)> for the rows of any subset of entries.
  const int d = 3, rows = 6;
  Rng rng(1);
  std::vector<double> x(rows * d), y(4 * d), back(rows * d, 0.0);
  for (auto& v : x) v = rng.normal();
  for (auto& v : y) v = rng.normal();
  const std::vector<int> entries = {4, 0, 2, 3};
  std::vector<double> gathered;
  order_gather(&gathered, x.data(), plan, entries, d);
  order_scatter_add(back.data(), y.data(), plan, entries, d);
  const double lhs = std::inner_product(gathered.begin(), gathered.end(), y.begin(), 0.0);
  const double rhs = std::inner_product(x.begin(), x.end(), back.begin(), 0.0);
  EXPECT_NEAR(lhs, rhs, 1e-12);
  // Combine: token rows get their weighted outputs back.
  std::vector<double> out_rows(5 * d), combined(3 * d);
  for (auto& v : out_rows) v = rng.normal();
  order_combine(combined.data(), out_rows.data(), plan, d);
  for (int j = 0; j < d; ++j) EXPECT_NEAR(combined[1 * d + j], 1.0 * out_rows[4 * d + j], 1e-15);
}

}  // namespace
}  // namespace xd
