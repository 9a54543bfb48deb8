// Sliding-window evaluation of sequences longer than the model's context
// (model/sliding_window.h): one window is a plain forward; longer inputs score
// every target once, each from the window the result says.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/rng.h"
#include "model/ops.h"
#include "model/param_layout.h"
#include "model/sliding_window.h"

namespace xd {
namespace {

ModelConfig tiny() {
  ModelConfig c;
  c.vocab_size = 256;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.max_seq_len = 16;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_intermediate_size = 16;
  c.init_std = 0.2;
  return c;
}

std::vector<int32_t> random_tokens(int n, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.next_u64() % 256);
  return t;
}

// Logits of one plain forward of tokens[begin, begin + len).
std::vector<float> direct(MoeTransformer<float>& m, const std::vector<int32_t>& t, int begin, int len) {
  m.forward(t.data() + begin, nullptr, 1, len);
  return m.logits();
}

float max_abs_diff(const float* a, const float* b, int n) {
  float d = 0;
  for (int i = 0; i < n; ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

class SlidingWindow : public ::testing::Test {
 protected:
  void SetUp() override { model.init(7); }
  ParamLayout layout{tiny()};
  MoeTransformer<float> model{layout};
  const int V = 256, W = 16;
};

TEST_F(SlidingWindow, ASequenceThatFitsOneWindowIsOnePlainForward) {
  const auto t = random_tokens(12, 1);
  auto r = evaluate_sliding_window(model, t);
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(r->windows, 1);
  const std::vector<float> plain = direct(model, t, 0, 12);
  EXPECT_EQ(max_abs_diff(r->logits.data(), plain.data(), 12 * V), 0.0f);
  const LossStats s = model.forward(t.data(), t.data() + 1, 1, 11);
  EXPECT_NEAR(r->mean_ce, s.ce_loss, 1e-5);
}

TEST_F(SlidingWindow, ALongSequenceScoresEveryTargetOnceFromItsWindow) {
  const int T = 57;  // 3.5 windows
  const auto t = random_tokens(T, 2);
  for (int stride : {1, 5, 8, 15}) {
    auto r = evaluate_sliding_window(model, t, {W, stride});
    ASSERT_TRUE(r) << r.status().to_string();
    // Windows start at 0, stride, 2 stride, ... until one reaches the end.
    EXPECT_EQ(r->windows, (T - W + stride - 1) / stride + 1) << "stride " << stride;
    // The loss is the mean over all T - 1 targets of the logits returned.
    double ce = 0;
    for (int p = 0; p + 1 < T; ++p)
      ce += cross_entropy_forward_backward<float>(nullptr, r->logits.data() + size_t(p) * V, t.data() + p + 1, 1, V, 1.0);
    EXPECT_NEAR(r->mean_ce, ce / (T - 1), 1e-5) << "stride " << stride;
    // Each row comes from the window that scored its target.
    std::vector<int> begins;
    for (int s = 0;; s += stride) {
      begins.push_back(std::min(s, T - W));
      if (begins.back() + W == T) break;
    }
    int scored_until = 1;
    for (int b : begins) {
      const std::vector<float> window = direct(model, t, b, W);
      for (int target = scored_until; target < b + W; ++target) {
        const int row = target - 1;
        ASSERT_EQ(max_abs_diff(r->logits.data() + size_t(row) * V, window.data() + size_t(row - b) * V, V), 0.0f)
            << "stride " << stride << ", row " << row << " should come from the window at " << b;
      }
      scored_until = b + W;
    }
    const std::vector<float> last = direct(model, t, T - W, W);
    EXPECT_EQ(max_abs_diff(r->logits.data() + size_t(T - 1) * V, last.data() + size_t(W - 1) * V, V), 0.0f);
  }
}

TEST_F(SlidingWindow, MoreContextPerTargetChangesTheLossButNeverTheCoverage) {
  const auto t = random_tokens(64, 3);
  auto short_ctx = evaluate_sliding_window(model, t, {4, 3});
  auto long_ctx = evaluate_sliding_window(model, t, {16, 1});
  ASSERT_TRUE(short_ctx && long_ctx);
  EXPECT_TRUE(std::isfinite(short_ctx->mean_ce) && std::isfinite(long_ctx->mean_ce));
  EXPECT_NE(short_ctx->mean_ce, long_ctx->mean_ce);
}

TEST_F(SlidingWindow, BadWindowsAndStridesAreRefusedWithTheReason) {
  const auto t = random_tokens(40, 4);
  EXPECT_NE(evaluate_sliding_window(model, t, {17, 4}).status().message().find("max_seq_len 16"), std::string::npos);
  EXPECT_NE(evaluate_sliding_window(model, t, {16, 16}).status().message().find("must overlap"), std::string::npos);
  EXPECT_FALSE(evaluate_sliding_window(model, t, {16, -1}));
  EXPECT_FALSE(evaluate_sliding_window(model, t, {1, 1}));
  EXPECT_FALSE(evaluate_sliding_window(model, {}, {}));
  EXPECT_NE(evaluate_sliding_window(model, {1, 300, 2}).status().message().find("vocabulary"), std::string::npos);
}

}  // namespace
}  // namespace xd
