// Whole-model and MoE-block gradient checks against finite differences, in
// double precision, for every connectivity and every gating function.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/rng.h"
#include "model/moe_layer.h"
#include "model/moe_transformer.h"
#include "test_util.h"

namespace xd {
namespace {

using test_util::random_tokens;

ModelConfig tiny_config(Gating gating, Connectivity conn) {
  ModelConfig c;
  c.vocab_size = 23;
  c.hidden_size = 16;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 8;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_intermediate_size = 12;
  c.num_shared_experts = 1;
  c.shared_intermediate_size = 8;
  c.gating = gating;
  c.aux_loss_coef = 0.1;  // large, so their gradients weigh in the check
  c.z_loss_coef = 0.05;
  c.init_std = 0.3;       // sharper routing: fewer near-ties for the finite differences
  c.connectivity.assign(c.num_layers, conn);
  return c;
}

// The worst per-tensor relative error over a few entries of every tensor: a
// small tensor (a router's temperature, say) is judged on its own, not
// drowned in the embedding's gradient.
double model_gradient_error(const ModelConfig& cfg, std::string* worst_tensor = nullptr, double* router_worst = nullptr) {
  ParamLayout layout(cfg);
  MoeTransformer<double> model(layout);
  model.init(7);
  // Training routing: GShard draws its (seeded, so repeatable) noise.
  model.set_routing_context(RoutingContext{true, 5, 3, 1});
  // GShard's noise weights start at 0; other values exercise the softplus.
  test_util::randomise_tensors(layout, model.params().data(), ".gate_noise.", 0.5, 13);
  const int B = 2, T = 6;
  auto in = random_tokens(B * T, cfg.vocab_size, 1), tg = random_tokens(B * T, cfg.vocab_size, 2);
  model.zero_grad();
  model.forward(in.data(), tg.data(), B, T);
  model.backward();
  std::vector<double> grad = model.grads();
  auto loss = [&] { return model.forward(in.data(), tg.data(), B, T).loss; };
  Rng rng(3);
  double worst = 0;
  for (const TensorSlot& s : layout.slots()) {
    std::vector<size_t> entries;
    for (int i = 0; i < 4; ++i) entries.push_back(s.offset + rng.next_u64() % s.numel());
    // Relative to the larger norm, with a floor: a tensor no token reached
    // has a zero gradient, and central differences give rounding noise there.
    double diff2 = 0, num2 = 0, ana2 = 0;
    for (size_t i : entries) {
      double* x = model.params().data() + i;
      const double saved = *x, h = 1e-5;
      *x = saved + h;
      const double up = loss();
      *x = saved - h;
      const double down = loss();
      *x = saved;
      const double num = (up - down) / (2 * h);
      diff2 += (num - grad[i]) * (num - grad[i]);
      num2 += num * num;
      ana2 += grad[i] * grad[i];
    }
    const double err = std::sqrt(diff2) / std::max(std::sqrt(std::max(num2, ana2)), 1e-6);
    if (err >= worst) {
      worst = err;
      if (worst_tensor) *worst_tensor = s.name;
    }
    if (router_worst && s.name.find("block_sparse_moe.gate") != std::string::npos)
      *router_worst = std::max(*router_worst, err);
  }
  return worst;
}

class WholeModelGradient : public ::testing::TestWithParam<std::tuple<Gating, Connectivity>> {};

TEST_P(WholeModelGradient, MatchesFiniteDifferences) {
  auto [gating, conn] = GetParam();
  std::string worst;
  double router = 0;
  double err = model_gradient_error(tiny_config(gating, conn), &worst, &router);
  std::printf("[grad] %s / %s: worst per-tensor relative error %.3e (%s); router tensors %.3e\n",
              gating_name(gating), connectivity_name(conn), err, worst.c_str(), router);
  EXPECT_LT(err, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    EveryGatingAndConnectivity, WholeModelGradient,
    ::testing::Combine(::testing::Values(Gating::kSoftmaxTopK, Gating::kSigmoidTopK,
                                         Gating::kExpertChoice, Gating::kGShardNoisyTopK, Gating::kXMoe,
                                         Gating::kSoftMoe),
                       ::testing::Values(Connectivity::kRegular, Connectivity::kFarSkip,
                                         Connectivity::kFarSkipAttention,
                                         Connectivity::kFarSkipMoe)),
    [](const auto& info) {
      return std::string(gating_name(std::get<0>(info.param))) + "_" +
             connectivity_name(std::get<1>(info.param));
    });

TEST(WholeModelGradientWithCapacity, MatchesFiniteDifferencesWhenTokensAreDropped) {
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kFarSkip);
  cfg.capacity_factor = 0.75;
  ParamLayout layout(cfg);
  MoeTransformer<double> model(layout);
  model.init(7);
  auto in = random_tokens(12, cfg.vocab_size, 1), tg = random_tokens(12, cfg.vocab_size, 2);
  EXPECT_GT(model.forward(in.data(), tg.data(), 2, 6).dropped, 0);
  double err = model_gradient_error(cfg);
  std::printf("[grad] capacity 0.75: relative error %.3e\n", err);
  EXPECT_LT(err, 1e-3);
}

TEST(WholeModelGradientWithMixedLayers, MatchesFiniteDifferencesWhenLayersDifferInConnectivity) {
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kRegular);
  cfg.connectivity = {Connectivity::kFarSkip, Connectivity::kRegular, Connectivity::kFarSkipAttention};
  EXPECT_LT(model_gradient_error(cfg), 1e-3);
}

// Pipeline degree r only splits each expert's rows into chunks that move and
// compute one after another; the loss and every gradient stay those of r = 1.
TEST(MoeTransformer, PipelineChunksGiveTheLossAndGradientsOfOneChunk) {
  for (Connectivity conn : {Connectivity::kRegular, Connectivity::kFarSkip}) {
    ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, conn);
    ParamLayout layout(cfg);
    const int B = 2, T = 6;
    auto in = random_tokens(B * T, cfg.vocab_size, 1), tg = random_tokens(B * T, cfg.vocab_size, 2);
    std::vector<double> losses, grads_r1;
    for (int r : {1, 3, 8}) {  // 8: more chunks than some experts have rows
      MoeTransformer<double> model(layout);
      model.init(7);
      model.set_pipeline_degree(r);
      model.zero_grad();
      losses.push_back(model.forward(in.data(), tg.data(), B, T).loss);
      model.backward();
      if (r == 1) {
        grads_r1 = model.grads();
        continue;
      }
      double diff = 0, norm = 0;
      for (size_t i = 0; i < grads_r1.size(); ++i) {
        diff += std::pow(model.grads()[i] - grads_r1[i], 2);
        norm += std::pow(grads_r1[i], 2);
      }
      EXPECT_NEAR(losses.back(), losses[0], 1e-12 * std::abs(losses[0])) << "r = " << r;
      EXPECT_LT(std::sqrt(diff / norm), 1e-12) << "r = " << r << ", " << connectivity_name(conn);
    }
  }
}

// A backward degree dividing r sends each group of forward chunks as one
// exchange; every chunk's math stays its own, so the gradients are r's to
// the bit, for token-choice and slot (SoftMoE) routing alike.
TEST(MoeTransformer, ABackwardDegreeDividingRGivesTheGradientsOfRToTheBit) {
  for (Gating gating : {Gating::kSoftmaxTopK, Gating::kSoftMoe}) {
    ModelConfig cfg = tiny_config(gating, Connectivity::kFarSkip);
    ParamLayout layout(cfg);
    const int B = 2, T = 6;
    auto in = random_tokens(B * T, cfg.vocab_size, 1), tg = random_tokens(B * T, cfg.vocab_size, 2);
    std::vector<double> grads_r4;
    for (int backward_r : {4, 2, 1}) {
      MoeTransformer<double> model(layout);
      model.init(7);
      model.set_pipeline_degree(4, backward_r);
      EXPECT_EQ(model.backward_pipeline_degree(), backward_r);
      model.zero_grad();
      model.forward(in.data(), tg.data(), B, T);
      model.backward();
      if (backward_r == 4) {
        grads_r4 = model.grads();
        continue;
      }
      size_t differ = 0;
      for (size_t i = 0; i < grads_r4.size(); ++i) differ += model.grads()[i] != grads_r4[i];
      EXPECT_EQ(differ, 0u) << gating_name(gating) << ", backward r = " << backward_r;
    }
  }
}

// The one-process exchange underneath, for test exchanges that only watch
// or change what the MoE layer asks besides the rows.
template <typename T>
class ForwardingExchange : public ExpertExchange<T> {
 public:
  explicit ForwardingExchange(int experts) : inner_(experts) {}
  void start_to_experts(const ExchangeTag& t, std::vector<T> rows, const std::vector<int>& counts,
                        int width) override {
    inner_.start_to_experts(t, std::move(rows), counts, width);
  }
  void finish_to_experts(const ExchangeTag& t, std::vector<T>* out, std::vector<int>* counts) override {
    inner_.finish_to_experts(t, out, counts);
  }
  void start_to_sources(const ExchangeTag& t, std::vector<T> rows, int width) override {
    inner_.start_to_sources(t, std::move(rows), width);
  }
  void finish_to_sources(const ExchangeTag& t, std::vector<T>* out) override { inner_.finish_to_sources(t, out); }
  const std::vector<int>& computed_experts() const override { return inner_.computed_experts(); }

 private:
  LocalExpertExchange<T> inner_;
};

// Records what the MoE layer asks of its exchange about replicas; odd
// computed experts play the part of gathered replicas.
class ReplicaRecordingExchange final : public ForwardingExchange<double> {
 public:
  ReplicaRecordingExchange(int experts, std::vector<std::string>* order)
      : ForwardingExchange<double>(experts), order_(order) {}
  bool is_replica(size_t j) const override { return j % 2 == 1; }
  void before_replicas(int layer) override { order_->push_back("replicas " + std::to_string(layer)); }
  void replicas_backward_done(int layer) override { order_->push_back("experts " + std::to_string(layer)); }

 private:
  std::vector<std::string>* order_;
};

// The backward hooks fire in the order the gradients become final: the LM
// head first, then each layer's replica gradients (the exchange's), its
// owned experts' and its dense group, last layer first, the embedding last. Forward waits for
// the replicas once per layer and chunk, after the owned experts.
TEST(MoeTransformer, BackwardHooksFireAsGradientsBecomeFinal) {
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kFarSkip);
  ParamLayout layout(cfg);
  MoeTransformer<double> model(layout);
  model.init(7);
  model.set_pipeline_degree(2);
  std::vector<std::string> order;
  model.set_backward_hooks({[&](int l) { order.push_back("owned " + std::to_string(l)); },
                            [&](int g) { order.push_back("dense " + std::to_string(g)); }});
  ReplicaRecordingExchange exchange(cfg.num_experts, &order);
  auto in = random_tokens(12, cfg.vocab_size, 1), tg = random_tokens(12, cfg.vocab_size, 2);
  const double loss = model.forward(in.data(), tg.data(), 2, 6, &exchange).loss;
  EXPECT_EQ(order, (std::vector<std::string>{"replicas 0", "replicas 0", "replicas 1", "replicas 1", "replicas 2",
                                             "replicas 2"}));
  order.clear();
  model.backward(&exchange);
  EXPECT_EQ(order, (std::vector<std::string>{"dense 3", "experts 2", "owned 2", "dense 2", "experts 1", "owned 1",
                                             "dense 1", "experts 0", "owned 0", "dense 0", "dense -1"}));
  // Owned experts first changes no sum: the same bits as the plain order.
  const std::vector<double> grads = model.grads();
  MoeTransformer<double> plain(layout);
  plain.init(7);
  plain.set_pipeline_degree(2);
  EXPECT_EQ(plain.forward(in.data(), tg.data(), 2, 6).loss, loss);
  plain.backward();
  EXPECT_EQ(plain.grads(), grads);
}

// The gradients of one step in the plain order (no hooks, no exchange), r = 2.
std::vector<double> plain_order_grads(const ParamLayout& layout, const std::vector<int32_t>& in,
                                      const std::vector<int32_t>& tg) {
  MoeTransformer<double> plain(layout);
  plain.init(7);
  plain.set_pipeline_degree(2);
  plain.forward(in.data(), tg.data(), 2, 6);
  plain.backward();
  return plain.grads();
}

// Deferred (the overlapped schedule), the owned experts' weight gradients
// come after the embedding's; late, the replicas' do too, just before them,
// each layer's sent home (replicas_backward_done) once computed, so every
// dense bucket is reported first. Neither moves a sum: the same bits.
TEST(MoeTransformer, LateReplicaWeightGradientsComeAfterEveryDenseBucketAndChangeNoBit) {
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kFarSkip);
  ParamLayout layout(cfg);
  auto in = random_tokens(12, cfg.vocab_size, 1), tg = random_tokens(12, cfg.vocab_size, 2);
  const std::vector<double> plain = plain_order_grads(layout, in, tg);
  for (const bool late : {false, true}) {
    MoeTransformer<double> model(layout);
    model.init(7);
    model.set_pipeline_degree(2);
    std::vector<std::string> order;
    // How much of the replicas' (odd experts') and the owned experts' weight
    // gradients exists when the embedding's bucket is reported.
    double replicas_then = -1, owned_then = -1;
    auto expert_grad_sum = [&](bool odd) {
      double sum = 0;
      for (const TensorSlot& t : layout.slots())
        if (t.is_routed_expert() && (t.expert % 2 == 1) == odd)
          for (size_t i = t.offset; i < t.offset + t.numel(); ++i) sum += std::abs(model.grads()[i]);
      return sum;
    };
    MoeTransformer<double>::BackwardHooks hooks;
    hooks.experts_done = [&](int l) { order.push_back("owned " + std::to_string(l)); };
    hooks.grads_ready = [&](int g) {
      order.push_back("dense " + std::to_string(g));
      if (g == -1) {
        replicas_then = expert_grad_sum(true);
        owned_then = expert_grad_sum(false);
      }
    };
    hooks.defer_owned_expert_weights = true;
    hooks.defer_replica_expert_weights = late;
    model.set_backward_hooks(hooks);
    ReplicaRecordingExchange exchange(cfg.num_experts, &order);
    model.zero_grad();
    model.forward(in.data(), tg.data(), 2, 6, &exchange);
    order.clear();
    model.backward(&exchange);
    const std::vector<std::string> expected =
        late ? std::vector<std::string>{"dense 3", "dense 2", "dense 1", "dense 0", "dense -1", "experts 2",
                                        "experts 1", "experts 0", "owned 2", "owned 1", "owned 0"}
             : std::vector<std::string>{"dense 3", "experts 2", "dense 2", "experts 1", "dense 1", "experts 0",
                                        "dense 0", "dense -1", "owned 2", "owned 1", "owned 0"};
    EXPECT_EQ(order, expected) << (late ? "late" : "deferred owned only");
    EXPECT_EQ(owned_then, 0.0) << "the owned experts' weight gradients come after the embedding's";
    if (late) EXPECT_EQ(replicas_then, 0.0) << "late: the replicas' weight gradients come after the embedding's";
    else EXPECT_GT(replicas_then, 0.0) << "the replicas' weight gradients come with their layer";
    EXPECT_EQ(model.grads(), plain) << (late ? "late" : "deferred owned only");
  }
}

// Without replicas (EP), the overlapped schedule defers only layer 0's
// weight gradients: the layers before keep theirs, which hide their own
// exchanges; layer 0's hide the last dense buckets' flight instead, so its
// experts are reported done after the embedding's bucket. No sum moves.
TEST(MoeTransformer, WithoutReplicasOnlyLayerZerosWeightGradientsWaitForTheEmbeddingsBucket) {
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kFarSkip);
  ParamLayout layout(cfg);
  auto in = random_tokens(12, cfg.vocab_size, 1), tg = random_tokens(12, cfg.vocab_size, 2);
  const std::vector<double> plain = plain_order_grads(layout, in, tg);
  MoeTransformer<double> model(layout);
  model.init(7);
  model.set_pipeline_degree(2);
  std::vector<std::string> order;
  auto layer_expert_grads = [&](int layer) {
    double sum = 0;
    for (const TensorSlot& t : layout.slots())
      if (t.is_routed_expert() && t.layer == layer)
        for (size_t i = t.offset; i < t.offset + t.numel(); ++i) sum += std::abs(model.grads()[i]);
    return sum;
  };
  double layer0_then = -1, layer1_then = -1;
  MoeTransformer<double>::BackwardHooks hooks;
  hooks.experts_done = [&](int l) { order.push_back("owned " + std::to_string(l)); };
  hooks.grads_ready = [&](int g) {
    order.push_back("dense " + std::to_string(g));
    if (g == -1) layer0_then = layer_expert_grads(0), layer1_then = layer_expert_grads(1);
  };
  hooks.defer_owned_expert_weights = true;
  model.set_backward_hooks(hooks);
  ForwardingExchange<double> exchange(cfg.num_experts);
  model.zero_grad();
  model.forward(in.data(), tg.data(), 2, 6, &exchange);
  model.backward(&exchange);
  ASSERT_EQ(cfg.num_layers, 3);
  EXPECT_EQ(order, (std::vector<std::string>{"dense 3", "owned 2", "dense 2", "owned 1", "dense 1", "dense 0",
                                             "dense -1", "owned 0"}));
  EXPECT_EQ(layer0_then, 0.0) << "layer 0's expert weight gradients come after the embedding's bucket";
  EXPECT_GT(layer1_then, 0.0) << "layer 1's come with their layer";
  EXPECT_EQ(model.grads(), plain);
}

// Each dense bucket is handed to the all-reduce when backward reports it
// complete (grads_ready), so nothing may write to it afterwards: a copy taken
// at the report equals the final gradients, in every connectivity, with
// replicas (which move the attention backward) and with nothing landed when
// the compute thread peeks (which moves the shared experts). The buckets
// cover every dense gradient exactly once and no routed expert's.
TEST(MoeTransformer, EveryDenseBucketIsFinalWhenBackwardReportsIt) {
  // Replicas, or nothing landed when the compute thread peeks (the moves of
  // "work while waiting"), or neither.
  class Exchange final : public ForwardingExchange<double> {
   public:
    Exchange(int experts, bool replicas, bool late)
        : ForwardingExchange<double>(experts), replicas_(replicas), late_(late) {}
    bool is_replica(size_t j) const override { return replicas_ && j % 2 == 1; }
    bool landed(const ExchangeTag&) const override { return !late_; }

   private:
    bool replicas_, late_;
  };
  for (const Connectivity conn : {Connectivity::kRegular, Connectivity::kFarSkip, Connectivity::kFarSkipAttention})
    for (const int variant : {0, 1, 2, 3}) {
      const bool replicas = variant & 1, late = variant & 2;
      const ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, conn);
      ParamLayout layout(cfg);
      MoeTransformer<double> model(layout);
      model.init(7);
      model.set_pipeline_degree(2);
      Exchange exchange(cfg.num_experts, replicas, late);
      const int L = cfg.num_layers;
      const auto buckets = dense_gradient_buckets(layout);
      ASSERT_EQ(buckets.size(), size_t(L + 2));
      std::vector<int> owner(model.grads().size(), -1);
      for (size_t b = 0; b < buckets.size(); ++b)
        for (auto [begin, end] : buckets[b])
          for (size_t i = begin; i < end; ++i) {
            EXPECT_EQ(owner[i], -1) << "element " << i << " in two buckets";
            owner[i] = int(b);
          }
      for (const TensorSlot& s : layout.slots())
        for (size_t i = s.offset; i < s.offset + s.numel(); ++i)
          EXPECT_EQ(owner[i] >= 0, !s.is_routed_expert()) << s.name;
      std::vector<std::vector<double>> copies(buckets.size());
      model.set_backward_hooks({nullptr, [&](int group) {
                                  const int b = dense_bucket_of_group(L, group);
                                  ASSERT_TRUE(copies[b].empty()) << "bucket " << b << " reported twice";
                                  for (auto [begin, end] : buckets[b])
                                    copies[b].insert(copies[b].end(), model.grads().begin() + begin,
                                                     model.grads().begin() + end);
                                }});
      auto in = random_tokens(12, cfg.vocab_size, 1), tg = random_tokens(12, cfg.vocab_size, 2);
      model.zero_grad();
      model.forward(in.data(), tg.data(), 2, 6, &exchange);
      model.backward(&exchange);
      for (size_t b = 0; b < buckets.size(); ++b) {
        std::vector<double> final_values;
        for (auto [begin, end] : buckets[b])
          final_values.insert(final_values.end(), model.grads().begin() + begin, model.grads().begin() + end);
        EXPECT_EQ(copies[b], final_values) << "bucket " << b << ", " << connectivity_name(conn)
                                           << (replicas ? ", replicas" : "") << (late ? ", late" : "");
      }
    }
}

// Every exchange still in flight whenever the compute thread peeks: the
// moves of "work while waiting" all happen (docs/overlap.md).
class LateExchange final : public ForwardingExchange<float> {
 public:
  explicit LateExchange(int experts) : ForwardingExchange<float>(experts) {}
  bool landed(const ExchangeTag& t) const override {
    ++peeks_[t.phase];
    return false;
  }
  mutable std::map<int, int> peeks_;  // by ExchangePhase
};

// Attention (b) sequence by sequence ahead of the router, the shared
// experts ahead of the routed ones (forward and backward): the same bits as
// the planned order, in fp32 as the workers run it.
TEST(MoeTransformer, WorkWhileWaitingChangesNoBit) {
  for (Connectivity conn : {Connectivity::kFarSkip, Connectivity::kFarSkipAttention, Connectivity::kRegular}) {
    ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, conn);
    ParamLayout layout(cfg);
    auto in = random_tokens(24, cfg.vocab_size, 1), tg = random_tokens(24, cfg.vocab_size, 2);
    MoeTransformer<float> late(layout), plain(layout);
    late.init(7);
    plain.init(7);
    late.set_pipeline_degree(2);
    plain.set_pipeline_degree(2);
    LateExchange exchange(cfg.num_experts);
    const double loss = late.forward(in.data(), tg.data(), 3, 8, &exchange).loss;
    late.backward(&exchange);
    EXPECT_EQ(plain.forward(in.data(), tg.data(), 3, 8).loss, loss) << connectivity_name(conn);
    plain.backward();
    EXPECT_EQ(plain.grads(), late.grads()) << connectivity_name(conn);
    // Combine peeked in layers 1 and 2 when the attention skips (once per
    // sequence), Dispatch in layers 0 and 1, Combine backward in every layer.
    const bool skips = conn != Connectivity::kRegular;
    EXPECT_EQ(exchange.peeks_[int(ExchangePhase::kCombine)], skips ? 2 * 3 : 0) << connectivity_name(conn);
    EXPECT_EQ(exchange.peeks_[int(ExchangePhase::kDispatch)], 2) << connectivity_name(conn);
    EXPECT_EQ(exchange.peeks_[int(ExchangePhase::kCombineBackward)], 3) << connectivity_name(conn);
  }
}

TEST(MoeBlock, WeightedSumOfSelectedExpertsMatchesADirectComputation) {
  // Cross-checks Gate + Order + Dispatch + Expert + Combine against a direct
  // per-token evaluation of sum_e w_e * expert_e(x).
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kRegular);
  cfg.num_shared_experts = 0;
  ParamLayout layout(cfg);
  MoeTransformer<double> model(layout);
  model.init(11);
  const int N = 10, d = cfg.hidden_size, ff = cfg.expert_intermediate_size;
  Rng rng(5);
  std::vector<double> x(N * d);
  for (auto& v : x) v = rng.normal();
  const LayerWeights<double>& W = model.weights().layers[0];
  MoeWeights<double> mw{RouterWeights<double>{W.router, nullptr}, {}, {}};
  for (int e = 0; e < cfg.num_experts; ++e) {
    size_t o = (size_t)e * ff * d;
    mw.computed.push_back({W.w1 + o, W.w3 + o, W.w2 + o, nullptr, nullptr, nullptr});
  }
  LocalExpertExchange<double> ex(cfg.num_experts);
  MoeCache<double> cache;
  std::vector<double> shared(N * d), routed(N * d);
  moe_forward(shared.data(), routed.data(), &cache, x.data(), mw, &ex, cfg, MoeDims{N, d, ff, 1, 0});
  for (int i = 0; i < N; ++i) {
    std::vector<double> logits(cfg.num_experts), expect(d, 0.0);
    double mx = -1e300, sum = 0;
    for (int e = 0; e < cfg.num_experts; ++e) {
      for (int j = 0; j < d; ++j) logits[e] += W.router[e * d + j] * x[i * d + j];
      mx = std::max(mx, logits[e]);
    }
    for (auto& l : logits) { l = std::exp(l - mx); sum += l; }
    std::vector<int> order = {0, 1, 2, 3};
    std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    double z = (logits[order[0]] + logits[order[1]]) / sum;
    for (int t = 0; t < 2; ++t) {
      int e = order[t];
      double w = logits[e] / sum / z;
      ExpertCache<double> c;
      std::vector<double> y(d);
      swiglu_expert_forward(y.data(), &c, &x[i * d], mw.computed[e], 1, d, ff);
      for (int j = 0; j < d; ++j) expect[j] += w * y[j];
    }
    for (int j = 0; j < d; ++j) EXPECT_NEAR(routed[i * d + j], expect[j], 1e-12);
  }
  for (double v : shared) EXPECT_EQ(v, 0.0);
}

TEST(MoeTransformer, FloatAndDoubleForwardAgree) {
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kFarSkip);
  cfg.init_std = 0.05;
  ParamLayout layout(cfg);
  MoeTransformer<double> md(layout);
  MoeTransformer<float> mf(layout);
  md.init(3);
  mf.init(3);
  auto in = random_tokens(12, cfg.vocab_size, 1), tg = random_tokens(12, cfg.vocab_size, 2);
  double ld = md.forward(in.data(), tg.data(), 2, 6).loss;
  double lf = mf.forward(in.data(), tg.data(), 2, 6).loss;
  EXPECT_NEAR(ld, lf, 1e-4 * ld);
}

TEST(MoeTransformer, InitialisationIsDeterministicAndIndependentOfExpertOwnership) {
  ModelConfig cfg = tiny_config(Gating::kSoftmaxTopK, Connectivity::kRegular);
  ParamLayout all(cfg), slice(cfg, 2, 2);
  MoeTransformer<float> a(all), b(all), c(slice);
  a.init(9);
  b.init(9);
  c.init(9);
  EXPECT_EQ(a.params(), b.params());
  const TensorSlot* in_all = all.find("model.layers.1.block_sparse_moe.experts.3.w2.weight");
  const TensorSlot* in_slice = slice.find("model.layers.1.block_sparse_moe.experts.3.w2.weight");
  ASSERT_TRUE(in_all && in_slice);
  for (size_t i = 0; i < in_all->numel(); ++i)
    EXPECT_EQ(a.params()[in_all->offset + i], c.params()[in_slice->offset + i]);
  EXPECT_EQ(slice.find("model.layers.1.block_sparse_moe.experts.1.w2.weight"), nullptr);
}

}  // namespace
}  // namespace xd
