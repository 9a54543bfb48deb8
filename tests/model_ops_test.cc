#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "grad_check.h"
#include "common/rng.h"
#include "model/detail/thin_gemm.h"
#include "model/detail/vector_exp.h"
#include "model/gemm.h"
#include "model/ops.h"
#include "model/swiglu_expert.h"

namespace xd {
namespace {

using testing::all_entries;
using testing::gradient_relative_error;

std::vector<double> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<double> v(n);
  for (double& x : v) x = rng.normal() * scale;
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

TEST(Gemm, BlasMatchesTheNaiveReferenceForEveryTransposeCombination) {
  const int m = 7, n = 5, k = 9;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      auto a = random_vector(m * k, 1), b = random_vector(k * n, 2);
      std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end());
      std::vector<float> c1(m * n, 1.f), c2(m * n, 1.f);
      const int lda = ta ? m : k, ldb = tb ? k : n;
      gemm<float>(ta, tb, m, n, k, 0.5f, af.data(), lda, bf.data(), ldb, 2.f, c1.data(), n);
      gemm_reference<float>(ta, tb, m, n, k, 0.5f, af.data(), lda, bf.data(), ldb, 2.f, c2.data(), n);
      for (int i = 0; i < m * n; ++i) EXPECT_NEAR(c1[i], c2[i], 1e-4) << ta << tb << i;
    }
}

// Thin products above OpenBLAS's small-matrix size are cut into row pieces,
// summed in pieces over k, or multiplied with op(B) transposed first
// (gemm_in_pieces, model/gemm.cc);
// uneven last pieces, padded leading dimensions and beta must all survive that.
// gemm<float> takes whichever path this machine chooses: on an AVX2 core
// without small-matrix kernels the first, second, fourth and last two cases
// go through the thin kernel (model/detail/thin_gemm.h; op(B) of at most 8192
// entries, transposed first where it is op(B) = B^T), the others one call.
TEST(Gemm, ThinProductsCutIntoPiecesMatchTheNaiveReference) {
  struct Case { bool ta, tb; int m, n, k; };
  const Case cases[] = {
      {false, false, 1037, 64, 64},   // row pieces, the last one shorter
      {false, true, 1037, 64, 64},    // op(B) transposed first, then row pieces
      {true, false, 64, 48, 1501},    // the sum over k in pieces
      {false, true, 300, 256, 32},    // op(B) too wide to transpose in pieces: one call
      {false, false, 300, 512, 64},   // too wide for pieces: one call
      {false, false, 300, 128, 128},  // B too large for row pieces: one call
      {false, true, 300, 128, 128},   // the same transposed: one call
      {true, false, 200, 200, 64},    // C too large for sum pieces: one call
      {false, true, 301, 40, 64},     // small enough for one call, or the thin kernel's 8-lane tail
      {false, false, 97, 100, 64},    // the same untransposed, a 4-lane tail
  };
  for (const Case& t : cases)
    for (float beta : {0.f, 2.f}) {
      const int lda = (t.ta ? t.m : t.k) + 3, ldb = (t.tb ? t.k : t.n) + 5, ldc = t.n + 2;
      const int a_rows = t.ta ? t.k : t.m, b_rows = t.tb ? t.n : t.k;
      auto a = random_vector(static_cast<size_t>(a_rows) * lda, 1, 0.1);
      auto b = random_vector(static_cast<size_t>(b_rows) * ldb, 2, 0.1);
      auto c = random_vector(static_cast<size_t>(t.m) * ldc, 3);
      std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end());
      std::vector<float> pieces(c.begin(), c.end()), fast(c.begin(), c.end());
      std::vector<float> naive(c.begin(), c.end());
      // The pieces whatever the core; gemm<float> as this machine chooses.
      gemm_in_pieces(t.ta, t.tb, t.m, t.n, t.k, 1.5f, af.data(), lda, bf.data(), ldb, beta,
                     pieces.data(), ldc);
      gemm<float>(t.ta, t.tb, t.m, t.n, t.k, 1.5f, af.data(), lda, bf.data(), ldb, beta,
                  fast.data(), ldc);
      gemm_reference<float>(t.ta, t.tb, t.m, t.n, t.k, 1.5f, af.data(), lda, bf.data(), ldb, beta,
                            naive.data(), ldc);
      double worst_pieces = 0, worst_fast = 0;
      for (size_t i = 0; i < naive.size(); ++i) {
        const double scale = 1.0 + std::fabs(naive[i]);
        worst_pieces = std::max(worst_pieces, std::fabs(double(pieces[i]) - naive[i]) / scale);
        worst_fast = std::max(worst_fast, std::fabs(double(fast[i]) - naive[i]) / scale);
      }
      std::string shape = t.ta ? "A^T " : "A ";
      shape += t.tb ? "B^T " : "B ";
      for (int dim : {t.m, t.n, t.k}) {
        shape += std::to_string(dim);
        shape += ' ';
      }
      EXPECT_LT(worst_pieces, 1e-5) << shape << " beta " << beta;
      EXPECT_LT(worst_fast, 1e-5) << shape << " beta " << beta;
    }
}

// The AVX2 kernel for thin products (model/detail/thin_gemm.h), called
// directly: every remainder of rows (1-5: m % 6) and of columns (1-15: n %
// 16, in 8- and 16-lane masked tiles), an empty sum, padded leading
// dimensions, beta 0 (C never read: NaN there must not leak) and 2, alpha 0
// (A and B never read: NaN there must not leak). Columns past n in C's
// padding stay as they were.
TEST(Gemm, TheThinKernelMatchesTheNaiveReferenceOnEveryEdge) {
  if (!detail::thin_gemm_available())
    GTEST_SKIP() << "this CPU has no AVX2 and FMA (or XDMOE_THIN_GEMM=0): the kernel is not used";
  const std::vector<int> rows = {1, 2, 3, 4, 5, 6, 7, 13, 100};
  std::vector<int> columns;
  for (int n = 1; n <= 33; ++n) columns.push_back(n);
  columns.push_back(64);
  int checked = 0;
  for (int m : rows)
    for (int n : columns)
      for (int k : {0, 1, 5, 64})
        for (float alpha : {1.5f, 0.f})
          for (float beta : {0.f, 2.f}) {
            const int lda = k + 3, ldb = n + 5, ldc = n + 2;
            auto a = random_vector(static_cast<size_t>(m) * lda, 1, 0.1);
            auto b = random_vector(static_cast<size_t>(k) * ldb, 2, 0.1);
            auto c = random_vector(static_cast<size_t>(m) * ldc, 3);
            std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end());
            std::vector<float> fast(c.begin(), c.end()), naive(c.begin(), c.end());
            if (beta == 0.f)
              for (int i = 0; i < m; ++i)
                for (int j = 0; j < n; ++j) fast[static_cast<size_t>(i) * ldc + j] = std::nanf("");
            if (alpha == 0.f && !af.empty()) af[0] = std::nanf("");
            detail::thin_gemm(m, n, k, alpha, af.data(), lda, bf.data(), ldb, beta, fast.data(), ldc);
            if (alpha == 0.f && !af.empty()) af[0] = 0.f;  // the reference multiplies it by 0
            gemm_reference<float>(false, false, m, n, k, alpha, af.data(), lda, bf.data(), ldb, beta,
                                  naive.data(), ldc);
            double worst = 0;
            for (int i = 0; i < m; ++i) {
              for (int j = 0; j < ldc; ++j) {
                const size_t at = static_cast<size_t>(i) * ldc + j;
                if (j >= n) {
                  ASSERT_EQ(fast[at], float(c[at])) << "padding written at " << i << "," << j;
                  continue;
                }
                ASSERT_TRUE(std::isfinite(fast[at]))
                    << m << "x" << n << "x" << k << " alpha " << alpha << " beta " << beta;
                worst = std::max(worst, std::fabs(double(fast[at]) - naive[at]) / (1.0 + std::fabs(naive[at])));
              }
            }
            EXPECT_LT(worst, 1e-6) << m << "x" << n << "x" << k << " alpha " << alpha << " beta " << beta;
            ++checked;
          }
  EXPECT_EQ(checked, 9 * 34 * 4 * 2 * 2);
}

// Each element of C is one chain of multiply-adds over k, in order, so a
// token row gets the same bits whatever rows share its call (as a worker's
// rows do with another worker's in a distributed run).
TEST(Gemm, TheThinKernelGivesARowTheSameBitsWhateverRowsShareItsCall) {
  if (!detail::thin_gemm_available())
    GTEST_SKIP() << "this CPU has no AVX2 and FMA (or XDMOE_THIN_GEMM=0): the kernel is not used";
  const int m = 23, n = 40, k = 64;
  auto a = random_vector(static_cast<size_t>(m) * k, 4), b = random_vector(static_cast<size_t>(k) * n, 5);
  auto c = random_vector(static_cast<size_t>(m) * n, 6);
  std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end());
  for (float beta : {0.f, 2.f}) {
    std::vector<float> all(c.begin(), c.end());
    detail::thin_gemm(m, n, k, 1.5f, af.data(), k, bf.data(), n, beta, all.data(), n);
    for (int i = 0; i < m; ++i) {
      std::vector<float> alone(c.begin() + static_cast<long>(i) * n, c.begin() + static_cast<long>(i + 1) * n);
      detail::thin_gemm(1, n, k, 1.5f, af.data() + static_cast<size_t>(i) * k, k, bf.data(), n, beta,
                        alone.data(), n);
      for (int j = 0; j < n; ++j)
        ASSERT_EQ(alone[j], all[static_cast<size_t>(i) * n + j]) << i << "," << j << " beta " << beta;
    }
  }
}

// gemm<float> hands the kernel exactly the thin products: op(A)
// untransposed, op(B) of at most 8192 entries, C at least 16 wide.
TEST(Gemm, OnlyThinProductsTakeTheThinKernel) {
  if (gemm_uses_pieces() || !detail::thin_gemm_available())
    GTEST_SKIP() << "OpenBLAS has small-matrix kernels here, or the CPU no AVX2 and FMA: "
                 << "the kernel is not used";
  EXPECT_TRUE(gemm_uses_thin_kernel(false, 64, 64));
  EXPECT_TRUE(gemm_uses_thin_kernel(false, 16, 512));     // 8192 entries, 16 wide
  EXPECT_FALSE(gemm_uses_thin_kernel(false, 15, 64));     // narrower than a tile
  EXPECT_FALSE(gemm_uses_thin_kernel(false, 8, 64));      // a router's logits
  EXPECT_FALSE(gemm_uses_thin_kernel(false, 17, 482));    // 8194 entries
  EXPECT_FALSE(gemm_uses_thin_kernel(false, 128, 128));   // a d = 128 weight
  EXPECT_FALSE(gemm_uses_thin_kernel(true, 64, 64));      // a weight gradient
}

TEST(Linear, GradientsMatchFiniteDifferences) {
  const int n = 3, in = 5, out = 4;
  auto x = random_vector(n * in, 1), w = random_vector(out * in, 2), r = random_vector(n * out, 3);
  std::vector<double> y(n * out);
  auto loss = [&] { linear_forward(y.data(), x.data(), w.data(), n, in, out); return dot(y, r); };
  std::vector<double> dx(x.size(), 0), dw(w.size(), 0);
  linear_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), n, in, out);
  EXPECT_LT(gradient_relative_error(loss, x.data(), dx.data(), all_entries(x.size())), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, w.data(), dw.data(), all_entries(w.size())), 1e-7);
}

TEST(RmsNorm, GradientsMatchFiniteDifferences) {
  const int n = 3, d = 8;
  auto x = random_vector(n * d, 1), w = random_vector(d, 2), r = random_vector(n * d, 3);
  std::vector<double> y(n * d), rstd(n);
  auto loss = [&] { rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), n, d, 1e-5); return dot(y, r); };
  loss();
  std::vector<double> dx(x.size(), 0), dw(w.size(), 0);
  rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), n, d);
  EXPECT_LT(gradient_relative_error(loss, x.data(), dx.data(), all_entries(x.size())), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, w.data(), dw.data(), all_entries(w.size())), 1e-7);
}

TEST(Rope, RotationPreservesNormAndBackwardIsTheTransposedRotation) {
  const int B = 2, T = 5, H = 3, hd = 8;
  auto x = random_vector(B * T * H * hd, 1), r = random_vector(B * T * H * hd, 2);
  std::vector<double> y;
  auto loss = [&] { y = x; rope_forward(y.data(), B, T, H, hd, 10000.0); return dot(y, r); };
  loss();
  EXPECT_NEAR(dot(y, y), dot(x, x), 1e-9);
  // Position 0 is the identity.
  for (int i = 0; i < hd; ++i) EXPECT_DOUBLE_EQ(y[i], x[i]);
  std::vector<double> dx = r;
  rope_backward(dx.data(), B, T, H, hd, 10000.0);
  EXPECT_LT(gradient_relative_error(loss, x.data(), dx.data(), all_entries(x.size())), 1e-7);
}

// The angle table is kept between calls; a call with another length, head
// size or theta must rotate by its own angles, to the bit.
TEST(Rope, EachShapeRotatesByItsOwnAnglesWhateverRanBefore) {
  auto naive = [](std::vector<double> v, int B, int T, int H, int hd, double theta) {
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
          for (int i = 0; i < hd / 2; ++i) {
            double* p = &v[(((size_t)b * T + t) * H + h) * hd];
            const double a = t * std::pow(theta, -2.0 * i / hd), x1 = p[i], x2 = p[i + hd / 2];
            p[i] = x1 * std::cos(a) - x2 * std::sin(a);
            p[i + hd / 2] = x2 * std::cos(a) + x1 * std::sin(a);
          }
    return v;
  };
  struct Shape { int T, hd; double theta; };
  for (const Shape s : {Shape{5, 8, 1e4}, Shape{7, 8, 1e4}, Shape{7, 4, 1e4}, Shape{7, 4, 1e6}, Shape{5, 8, 1e4}}) {
    const auto x = random_vector(2 * s.T * 3 * s.hd, s.T + s.hd);
    std::vector<double> y = x;
    rope_forward(y.data(), 2, s.T, 3, s.hd, s.theta);
    EXPECT_EQ(y, naive(x, 2, s.T, 3, s.hd, s.theta)) << "T " << s.T << " hd " << s.hd << " theta " << s.theta;
  }
}

TEST(Attention, BlasPathMatchesTheNaiveReferenceWithGroupedKvHeads) {
  AttentionDims dm{2, 6, 4, 2, 8};
  const size_t qn = (size_t)dm.batch * dm.seq * dm.heads * dm.head_dim;
  const size_t kvn = (size_t)dm.batch * dm.seq * dm.kv_heads * dm.head_dim;
  auto q = random_vector(qn, 1), k = random_vector(kvn, 2), v = random_vector(kvn, 3);
  std::vector<double> o1(qn), o2(qn), p1((size_t)dm.batch * dm.heads * dm.seq * dm.seq), p2(p1.size());
  attention_forward(o1.data(), p1.data(), q.data(), k.data(), v.data(), dm);
  attention_forward_reference(o2.data(), p2.data(), q.data(), k.data(), v.data(), dm);
  for (size_t i = 0; i < qn; ++i) EXPECT_NEAR(o1[i], o2[i], 1e-12);
  for (size_t i = 0; i < p1.size(); ++i) EXPECT_NEAR(p1[i], p2[i], 1e-12);
}

TEST(Attention, GradientsMatchFiniteDifferencesWithGroupedKvHeads) {
  AttentionDims dm{2, 5, 4, 2, 6};
  const size_t qn = (size_t)dm.batch * dm.seq * dm.heads * dm.head_dim;
  const size_t kvn = (size_t)dm.batch * dm.seq * dm.kv_heads * dm.head_dim;
  auto q = random_vector(qn, 1), k = random_vector(kvn, 2), v = random_vector(kvn, 3);
  auto r = random_vector(qn, 4);
  std::vector<double> o(qn), p((size_t)dm.batch * dm.heads * dm.seq * dm.seq);
  auto loss = [&] { attention_forward(o.data(), p.data(), q.data(), k.data(), v.data(), dm); return dot(o, r); };
  loss();
  std::vector<double> dq(qn, 0), dk(kvn, 0), dv(kvn, 0);
  attention_backward(dq.data(), dk.data(), dv.data(), r.data(), p.data(), q.data(), k.data(), v.data(), dm);
  EXPECT_LT(gradient_relative_error(loss, q.data(), dq.data(), all_entries(qn)), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, k.data(), dk.data(), all_entries(kvn)), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, v.data(), dv.data(), all_entries(kvn)), 1e-7);
}

TEST(Attention, OutputAtPositionTDependsOnlyOnPositionsUpToT) {
  AttentionDims dm{1, 6, 2, 2, 4};
  const size_t n = (size_t)dm.seq * dm.heads * dm.head_dim;
  auto q = random_vector(n, 1), k = random_vector(n, 2), v = random_vector(n, 3);
  std::vector<double> o1(n), o2(n), p((size_t)dm.heads * dm.seq * dm.seq);
  attention_forward(o1.data(), p.data(), q.data(), k.data(), v.data(), dm);
  const size_t last = (size_t)(dm.seq - 1) * dm.heads * dm.head_dim;
  for (size_t i = last; i < n; ++i) { k[i] += 1.0; v[i] -= 2.0; }
  attention_forward(o2.data(), p.data(), q.data(), k.data(), v.data(), dm);
  for (size_t i = 0; i < last; ++i) EXPECT_DOUBLE_EQ(o1[i], o2[i]);
}

TEST(SwiGlu, GradientsMatchFiniteDifferences) {
  const int n = 20;
  auto a = random_vector(n, 1, 2.0), b = random_vector(n, 2), r = random_vector(n, 3);
  std::vector<double> y(n);
  auto loss = [&] { swiglu_forward(y.data(), a.data(), b.data(), n); return dot(y, r); };
  std::vector<double> da(n, 0), db(n, 0);
  swiglu_backward(da.data(), db.data(), r.data(), a.data(), b.data(), n);
  EXPECT_LT(gradient_relative_error(loss, a.data(), da.data(), all_entries(n)), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, b.data(), db.data(), all_entries(n)), 1e-7);
}

TEST(SwiGluExpert, GradientsMatchFiniteDifferences) {
  const int n = 4, d = 6, ff = 10;
  auto x = random_vector(n * d, 1), w1 = random_vector(ff * d, 2, 0.5), w3 = random_vector(ff * d, 3, 0.5),
       w2 = random_vector(d * ff, 4, 0.5), r = random_vector(n * d, 5);
  std::vector<double> dw1(w1.size(), 0), dw3(w3.size(), 0), dw2(w2.size(), 0), dx(x.size(), 0), y(n * d);
  ExpertParams<double> p{w1.data(), w3.data(), w2.data(), dw1.data(), dw3.data(), dw2.data()};
  ExpertCache<double> cache;
  auto loss = [&] { swiglu_expert_forward(y.data(), &cache, x.data(), p, n, d, ff); return dot(y, r); };
  loss();
  swiglu_expert_backward(dx.data(), r.data(), x.data(), cache, p, n, d, ff);
  EXPECT_LT(gradient_relative_error(loss, x.data(), dx.data(), all_entries(x.size())), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, w1.data(), dw1.data(), all_entries(w1.size())), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, w3.data(), dw3.data(), all_entries(w3.size())), 1e-7);
  EXPECT_LT(gradient_relative_error(loss, w2.data(), dw2.data(), all_entries(w2.size())), 1e-7);
}

TEST(CrossEntropy, GradientsMatchFiniteDifferencesAndUniformLogitsGiveLogV) {
  const int n = 3, V = 7;
  std::vector<int32_t> t = {0, 3, 6};
  std::vector<double> zero(n * V, 0.0);
  EXPECT_NEAR(cross_entropy_forward_backward<double>(nullptr, zero.data(), t.data(), n, V, 1.0), std::log(7.0), 1e-12);
  auto x = random_vector(n * V, 1);
  auto loss = [&] { return cross_entropy_forward_backward<double>(nullptr, x.data(), t.data(), n, V, 1.0); };
  std::vector<double> dx(x.size());
  cross_entropy_forward_backward<double>(dx.data(), x.data(), t.data(), n, V, 1.0);
  EXPECT_LT(gradient_relative_error(loss, x.data(), dx.data(), all_entries(x.size())), 1e-7);
}

// The float model takes its exponentials in SIMD float; the double path
// (libm) is the reference for it.
TEST(VectorExp, MatchesLibmToTwoUlpsAndKeepsNaN) {
  std::vector<float> in(1003), out(in.size());  // not a multiple of 8: the tail goes through padded lanes
  for (size_t i = 0; i < in.size(); ++i) in[i] = -90.0f + 90.0f * float(i) / float(in.size() - 1);
  const double sum = detail::exp_shifted_sum(out.data(), in.data(), in.size(), 0.0f);
  double want_sum = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const double want = std::exp((double)in[i]);
    want_sum += want;
    if (in[i] >= -86.0f) EXPECT_NEAR(out[i], want, 2.5e-7 * want) << "exp(" << in[i] << ")";
    else EXPECT_EQ(out[i], (float)std::exp(-86.0)) << "below -86 the argument is clamped";
  }
  EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum);
  float nan_in[3] = {0.0f, std::nanf(""), -1.0f}, nan_out[3];
  EXPECT_TRUE(std::isnan(detail::exp_shifted_sum(nan_out, nan_in, 3, 0.0f)));
  EXPECT_TRUE(std::isnan(nan_out[1]));
  EXPECT_FLOAT_EQ(nan_out[0], 1.0f);
}

TEST(CrossEntropy, TheFloatPathMatchesTheDoublePath) {
  const int n = 6, V = 301;
  auto x = random_vector(n * V, 7, 3.0);
  std::vector<int32_t> t = {0, 5, 300, 17, 150, 299};
  std::vector<float> xf(x.begin(), x.end()), df(x.size());
  std::vector<double> xd(xf.begin(), xf.end()), dd(x.size());
  const double lf = cross_entropy_forward_backward<float>(df.data(), xf.data(), t.data(), n, V, 2.0);
  const double ld = cross_entropy_forward_backward<double>(dd.data(), xd.data(), t.data(), n, V, 2.0);
  EXPECT_NEAR(lf, ld, 1e-6 * ld);
  EXPECT_EQ(cross_entropy_forward_backward<float>(nullptr, xf.data(), t.data(), n, V, 2.0), lf)
      << "the loss does not depend on whether the gradient is asked for";
  for (size_t i = 0; i < dd.size(); ++i) EXPECT_NEAR(df[i], dd[i], 1e-6 * 2.0 / n) << "entry " << i;
}

TEST(SoftmaxRow, TheFloatPathMatchesTheDoublePath) {
  // Router-sized rows (1 to 64 experts) and a wide one, values up to +-20.
  for (int n : {1, 2, 3, 7, 8, 9, 16, 64, 301}) {
    auto x = random_vector(n, 100 + n, 20.0);
    std::vector<float> xf(x.begin(), x.end()), pf(n);
    std::vector<double> xd(xf.begin(), xf.end()), pd(n);
    const double lf = softmax_row<float>(pf.data(), xf.data(), n);
    const double ld = softmax_row<double>(pd.data(), xd.data(), n);
    EXPECT_NEAR(lf, ld, 1e-6 * std::max(1.0, std::abs(ld))) << "n " << n;
    double sum = 0;
    for (int j = 0; j < n; ++j) {
      EXPECT_NEAR(pf[j], pd[j], 1e-6) << "n " << n << ", entry " << j;
      sum += pf[j];
    }
    EXPECT_NEAR(sum, 1.0, 1e-5) << "n " << n;
  }
}

TEST(Attention, TheFloatPathMatchesTheDoubleReference) {
  AttentionDims dm{2, 13, 4, 2, 8};
  const size_t qn = (size_t)dm.batch * dm.seq * dm.heads * dm.head_dim;
  const size_t kvn = (size_t)dm.batch * dm.seq * dm.kv_heads * dm.head_dim;
  auto q = random_vector(qn, 1), k = random_vector(kvn, 2), v = random_vector(kvn, 3);
  std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end());
  std::vector<double> qd(qf.begin(), qf.end()), kd(kf.begin(), kf.end()), vd(vf.begin(), vf.end());
  const size_t pn = (size_t)dm.batch * dm.heads * dm.seq * dm.seq;
  std::vector<float> of(qn), pf(pn);
  std::vector<double> od(qn), pd(pn);
  attention_forward(of.data(), pf.data(), qf.data(), kf.data(), vf.data(), dm);
  attention_forward_reference(od.data(), pd.data(), qd.data(), kd.data(), vd.data(), dm);
  for (size_t i = 0; i < pn; ++i) EXPECT_NEAR(pf[i], pd[i], 1e-6) << "probability " << i;
  for (size_t i = 0; i < qn; ++i) EXPECT_NEAR(of[i], od[i], 1e-5) << "output " << i;
}

TEST(Embedding, BackwardAccumulatesRowsOfRepeatedTokens) {
  const int d = 3;
  std::vector<double> table(4 * d, 0.0), dout = {1, 2, 3, 10, 20, 30};
  std::vector<int32_t> tok = {2, 2};
  embedding_backward(table.data(), dout.data(), tok.data(), 2, d);
  EXPECT_DOUBLE_EQ(table[2 * d + 0], 11);
  EXPECT_DOUBLE_EQ(table[2 * d + 2], 33);
  EXPECT_DOUBLE_EQ(table[0], 0);
}

}  // namespace
}  // namespace xd
