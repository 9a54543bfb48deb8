// AdamW<float>'s SIMD float path against the double reference, and its
// paths (8 lanes, 4 lanes, scalar) against each other.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "model/adamw.h"
#include "model/detail/adamw_kernel.h"

namespace xd {
namespace {

TEST(AdamW, TheFloatPathStaysWithinFloatRoundingOfTheDoubleReference) {
  const size_t n = 2 * AdamW<float>::kBlock + 77;
  // Norm weights (no decay) in two runs that straddle a block edge and the
  // vector lanes.
  const std::vector<std::pair<size_t, size_t>> no_decay = {{5, 37}, {AdamW<float>::kBlock - 3, AdamW<float>::kBlock + 9}};
  std::mt19937 rng(7);
  std::normal_distribution<double> weight(0.0, 0.02), grad(0.0, 0.05);
  std::vector<double> pd(n);
  for (double& x : pd) x = weight(rng);
  std::vector<float> pf(pd.begin(), pd.end());
  pd.assign(pf.begin(), pf.end());  // both start from the same float values
  AdamWConfig config;
  config.grad_clip = 1.0;
  AdamW<float> fast(n, config, no_decay);
  AdamW<double> reference(n, config, no_decay);
  double max_diff = 0, max_move = 0;
  for (int step = 0; step < 30; ++step) {
    std::vector<float> gf(n);
    for (float& g : gf) g = static_cast<float>(grad(rng) * (step % 3 == 0 ? 10.0 : 1.0));  // some steps clip
    std::vector<double> gd(gf.begin(), gf.end());
    const double lr = 3e-3 * (1 + step % 4);
    const double nf = fast.step(pf.data(), gf.data(), lr);
    const double nd = reference.step(pd.data(), gd.data(), lr);
    EXPECT_NEAR(nf, nd, 1e-9 * nd) << "the same norm from the same gradients";
    for (size_t i = 0; i < n; ++i) {
      max_diff = std::max(max_diff, std::fabs(pf[i] - pd[i]));
      ASSERT_NEAR(fast.first_moment()[i], reference.first_moment()[i], 1e-6 * (1 + std::fabs(gd[i])));
      ASSERT_NEAR(fast.second_moment()[i], reference.second_moment()[i], 1e-5 * reference.second_moment()[i] + 1e-12);
    }
  }
  for (size_t i = 0; i < n; ++i) max_move = std::max(max_move, std::fabs(double(pf[i])));
  std::printf("[adamw] after 30 steps the float path is within %.3g of the double one (weights up to %.3g)\n",
              max_diff, max_move);
  // 30 steps of up to 1.2e-2 each; float keeps about 7 digits of it.
  EXPECT_LT(max_diff, 2e-7);
}

TEST(AdamW, NoDecayRangesAreNotDecayedOnTheFloatPath) {
  const size_t n = 40;
  AdamWConfig config;
  config.weight_decay = 0.5;
  AdamW<float> opt(n, config, {{8, 24}});
  std::vector<float> p(n, 1.0f), g(n, 0.0f);  // no gradient: only the decay moves a weight
  opt.step(p.data(), g.data(), 0.1);
  for (size_t i = 0; i < n; ++i) {
    if (i >= 8 && i < 24) EXPECT_EQ(p[i], 1.0f) << i;
    else EXPECT_FLOAT_EQ(p[i], 0.95f) << i;
  }
}

TEST(AdamWKernel, EveryPathGivesAnElementTheSameBitsWhereverItsSpanStarts) {
  const size_t n = 1000;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 0.1f);
  std::vector<float> p0(n), g0(n), m0(n), v0(n);
  for (size_t i = 0; i < n; ++i) {
    p0[i] = dist(rng);
    g0[i] = dist(rng);
    m0[i] = 0.1f * dist(rng);
    v0[i] = 0.01f * std::fabs(dist(rng));
  }
  detail::AdamWFloatStep s;
  s.clip = 0.7f;
  s.beta1 = 0.9f, s.one_minus_beta1 = 0.1f;
  s.beta2 = 0.95f, s.one_minus_beta2 = 0.05f;
  s.decay_factor = 0.9997f;
  s.step_size = 3e-3f;
  s.inv_sqrt_c2 = 1.3f;
  s.eps = 1e-8f;
  struct State {
    std::vector<float> p, g, m, v;
  };
  auto fresh = [&] { return State{p0, g0, m0, v0}; };
  State whole = fresh(), portable = fresh(), pieces = fresh(), scalar = fresh();
  detail::adamw_float_span(whole.p.data(), whole.g.data(), whole.m.data(), whole.v.data(), n, true, s);
  detail::adamw_float_span_portable(portable.p.data(), portable.g.data(), portable.m.data(), portable.v.data(), n,
                                    true, s);
  // Spans of odd lengths at odd offsets: elements move between lanes and tails.
  for (size_t at = 0, len = 1; at < n; at += len, len = len % 13 + 2) {
    const size_t k = std::min(len, n - at);
    detail::adamw_float_span(pieces.p.data() + at, pieces.g.data() + at, pieces.m.data() + at,
                             pieces.v.data() + at, k, true, s);
  }
  for (size_t i = 0; i < n; ++i)  // one element at a time: the scalar tail only
    detail::adamw_float_span(&scalar.p[i], &scalar.g[i], &scalar.m[i], &scalar.v[i], 1, true, s);
  for (const State* other : {&portable, &pieces, &scalar}) {
    EXPECT_EQ(0, std::memcmp(whole.p.data(), other->p.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(whole.g.data(), other->g.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(whole.m.data(), other->m.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(whole.v.data(), other->v.data(), n * sizeof(float)));
  }
  EXPECT_NE(0, std::memcmp(whole.p.data(), p0.data(), n * sizeof(float))) << "the update moved the weights";
}

}  // namespace
}  // namespace xd
