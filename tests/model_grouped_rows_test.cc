// A token once per worker (model/detail/moe_grouped.h): the plan entries
// that send one token to one worker travel as one row, and that worker sums
// their experts' weighted outputs. It is the same model as one row per
// expert, up to the order of sums, and it moves exactly one row per (token,
// destination) pair.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cluster/job_config.h"
#include "model/moe_transformer.h"
#include "test_util.h"

namespace xd {
namespace {

using test_util::random_tokens;

ModelConfig config(Gating gating, int experts, int top_k) {
  ModelConfig c;
  c.vocab_size = 23;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 8;
  c.num_experts = experts;
  c.top_k = top_k;
  c.expert_intermediate_size = 12;
  c.num_shared_experts = 1;
  c.shared_intermediate_size = 8;
  c.gating = gating;
  c.aux_loss_coef = 0.1;
  c.z_loss_coef = 0.05;
  c.init_std = 0.3;
  c.connectivity.assign(c.num_layers, Connectivity::kFarSkip);
  return c;
}

// One process whose experts sit on `workers` destinations (expert e on
// e * workers / E), so rows group as they would across that many workers.
// Counts the rows each Dispatch sends.
template <typename T>
class DestinationsExchange final : public ExpertExchange<T> {
 public:
  DestinationsExchange(int experts, int workers) : local_(experts), experts_(experts), workers_(workers) {}
  void start_to_experts(const ExchangeTag& tag, std::vector<T> rows, const std::vector<int>& counts,
                        int width) override {
    if (tag.phase == (int)ExchangePhase::kDispatch) {
      dispatched_rows += rows.size() / width;
      dispatch_width = width;
      // One row per expert: a token's rows hold the same values.
      std::set<std::pair<std::vector<T>, int>> pairs;
      size_t row = 0;
      for (size_t e = 0; e < counts.size(); ++e)
        for (int i = 0; i < counts[e]; ++i, ++row)
          pairs.insert({std::vector<T>(rows.begin() + row * width, rows.begin() + (row + 1) * width),
                        destination_of((int)e)});
      distinct_pairs += pairs.size();
    }
    local_.start_to_experts(tag, std::move(rows), counts, width);
  }
  void finish_to_experts(const ExchangeTag& tag, std::vector<T>* out, std::vector<int>* out_counts) override {
    local_.finish_to_experts(tag, out, out_counts);
  }
  void start_to_sources(const ExchangeTag& tag, std::vector<T> rows, int width) override {
    local_.start_to_sources(tag, std::move(rows), width);
  }
  void finish_to_sources(const ExchangeTag& tag, std::vector<T>* out) override { local_.finish_to_sources(tag, out); }
  const std::vector<int>& computed_experts() const override { return local_.computed_experts(); }
  int destination_of(int expert) const override { return expert * workers_ / experts_; }

  size_t dispatched_rows = 0;
  int dispatch_width = 0;
  // Distinct (row values, destination) pairs of each Dispatch: with one row
  // per expert, the (token, destination) pairs.
  size_t distinct_pairs = 0;

 private:
  LocalExpertExchange<T> local_;
  int experts_, workers_;
};

struct Case {
  Gating gating;
  int experts, top_k, workers, r;
  int backward_r = 0;  // 0: r; else each backward exchange carries r / backward_r chunks
};

std::string name_of(const Case& c) {
  return std::string(gating_name(c.gating)) + " E" + std::to_string(c.experts) + " k" + std::to_string(c.top_k) +
         " on " + std::to_string(c.workers) + " worker(s), r" + std::to_string(c.r) +
         (c.backward_r ? "/" + std::to_string(c.backward_r) : "");
}

double relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / norm);
}

TEST(GroupedRows, GiveTheLossAndGradientsOfOneRowPerExpert) {
  const Case cases[] = {{Gating::kSoftmaxTopK, 4, 2, 1, 1},  {Gating::kSoftmaxTopK, 4, 2, 2, 3},
                        {Gating::kSigmoidTopK, 8, 3, 2, 2},  {Gating::kExpertChoice, 4, 2, 2, 2},
                        {Gating::kGShardNoisyTopK, 8, 2, 4, 1}, {Gating::kXMoe, 8, 3, 4, 2},
                        {Gating::kSoftmaxTopK, 8, 4, 8, 2},  {Gating::kSoftmaxTopK, 8, 2, 2, 4, 2},
                        {Gating::kSigmoidTopK, 8, 3, 4, 4, 1}};
  for (const Case& c : cases) {
    const ModelConfig cfg = config(c.gating, c.experts, c.top_k);
    ParamLayout layout(cfg);
    const int B = 3, T = 8;
    auto in = random_tokens(B * T, cfg.vocab_size, 1), tg = random_tokens(B * T, cfg.vocab_size, 2);
    MoeTransformer<double> per_expert(layout), grouped(layout);
    for (MoeTransformer<double>* m : {&per_expert, &grouped}) {
      m->init(7);
      m->set_pipeline_degree(c.r, c.backward_r);
      m->set_routing_context(RoutingContext{true, 5, 3, 0});
      m->zero_grad();
    }
    grouped.set_tokens_once_per_worker(true);
    DestinationsExchange<double> exchange(c.experts, c.workers);
    const double loss = per_expert.forward(in.data(), tg.data(), B, T).loss;
    per_expert.backward();
    const double grouped_loss = grouped.forward(in.data(), tg.data(), B, T, &exchange).loss;
    grouped.backward(&exchange);
    const double grads = relative_difference(grouped.grads(), per_expert.grads());
    std::printf("[grouped] %-40s loss %.12f vs %.12f, gradients differ by %.2e\n", name_of(c).c_str(), grouped_loss,
                loss, grads);
    EXPECT_NEAR(grouped_loss, loss, 1e-12 * std::abs(loss)) << name_of(c);
    EXPECT_LT(grads, 1e-12) << name_of(c);
    // Every entry of a group in its row: K = top_k slots (every expert is
    // computed here), or every expert for expert choice.
    const int K = c.gating == Gating::kExpertChoice ? c.experts : c.top_k;
    EXPECT_EQ(exchange.dispatch_width, cfg.hidden_size + 2 * K - 1) << name_of(c);
    EXPECT_GT(exchange.dispatched_rows, 0u) << name_of(c);
  }
}

// Dropless top-k: one row per distinct (token, destination) pair, counted
// from what the same model sends one row per expert (every token id once, so
// that distinct tokens send distinct rows); on one worker that is every
// token once, with every expert its own worker every entry.
TEST(GroupedRows, SendOneRowPerTokenAndDestination) {
  const ModelConfig cfg = config(Gating::kSoftmaxTopK, 8, 3);
  ParamLayout layout(cfg);
  const int B = 2, T = 8, N = B * T, d = cfg.hidden_size, k = cfg.top_k, L = cfg.num_layers;
  std::vector<int32_t> in(N), tg = random_tokens(N, cfg.vocab_size, 2);
  for (int i = 0; i < N; ++i) in[i] = (i * 7) % cfg.vocab_size;  // 16 distinct ids of 23
  for (int workers : {1, 2, 4, 8}) {
    MoeTransformer<double> grouped(layout), per_expert(layout);
    grouped.init(7);
    per_expert.init(7);
    grouped.set_tokens_once_per_worker(true);
    DestinationsExchange<double> grouped_exchange(8, workers), per_expert_exchange(8, workers);
    grouped.forward(in.data(), tg.data(), B, T, &grouped_exchange);
    per_expert.forward(in.data(), tg.data(), B, T, &per_expert_exchange);
    EXPECT_EQ(grouped_exchange.dispatch_width, d + 2 * k - 1) << workers;
    EXPECT_EQ(per_expert_exchange.dispatch_width, d) << workers;
    EXPECT_EQ(per_expert_exchange.dispatched_rows, (size_t)N * k * L) << "dropless: k rows a token";
    EXPECT_EQ(grouped_exchange.dispatched_rows, per_expert_exchange.distinct_pairs) << workers << " worker(s)";
    if (workers == 1) {
      EXPECT_EQ(grouped_exchange.dispatched_rows, (size_t)N * L);
    } else if (workers == 8) {
      EXPECT_EQ(grouped_exchange.dispatched_rows, (size_t)N * k * L);
    }
    std::printf("[grouped] E8 k3 on %d worker(s): %zu rows instead of %zu\n", workers,
                grouped_exchange.dispatched_rows, per_expert_exchange.dispatched_rows);
  }
}

TEST(GroupedRows, TheJobRefusesSoftMoeAndLossyTokenCodecs) {
  const std::string cluster = R"(cluster:
  levels:
    - name: dc
      size: 2
      link: {bandwidth: 1gbit, latency: 1ms, codecs: {dispatch: CODEC}}
  expert_parallel: {mode: ep, tokens_once_per_worker: true}
)";
  auto with = [&](const std::string& model, const std::string& codec) {
    std::string c = cluster;
    c.replace(c.find("CODEC"), 5, codec);
    return parse_job_config(model + c, "job.yaml");
  };
  EXPECT_TRUE(with("", "raw").has_value());
  EXPECT_TRUE(with("", "zstd:3").has_value()) << "zstd keeps every bit";
  auto lossy = with("", "bf16");
  ASSERT_FALSE(lossy.has_value());
  EXPECT_NE(lossy.status().message().find("lossless token codecs"), std::string::npos) << lossy.status().message();
  auto soft = with("model:\n  gating: soft_moe\n", "raw");
  ASSERT_FALSE(soft.has_value());
  EXPECT_NE(soft.status().message().find("soft_moe"), std::string::npos) << soft.status().message();
}

}  // namespace
}  // namespace xd
