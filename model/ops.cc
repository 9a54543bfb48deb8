#include "model/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/check.h"
#include "model/detail/vector_exp.h"
#include "model/gemm.h"

namespace xd {

template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* table, int n, int d) {
  for (int i = 0; i < n; ++i) std::memcpy(out + (size_t)i * d, table + (size_t)tokens[i] * d, sizeof(T) * d);
}

template <typename T>
void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int n, int d) {
  for (int i = 0; i < n; ++i) {
    T* row = dtable + (size_t)tokens[i] * d;
    const T* g = dout + (size_t)i * d;
    for (int j = 0; j < d; ++j) row[j] += g[j];
  }
}

template <typename T>
void linear_forward(T* out, const T* in, const T* weight, int n, int in_f, int out_f) {
  gemm<T>(false, true, n, out_f, in_f, T(1), in, in_f, weight, in_f, T(0), out, out_f);
}

template <typename T>
void linear_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight, int n,
                     int in_f, int out_f) {
  if (din) gemm<T>(false, false, n, in_f, out_f, T(1), dout, out_f, weight, in_f, T(1), din, in_f);
  if (dweight) gemm<T>(true, false, out_f, in_f, n, T(1), dout, out_f, in, in_f, T(1), dweight, in_f);
}

namespace {
// Sums of products in double, in four interleaved partial sums added
// pairwise at the end: a fixed order, so every rank and run gets the same
// bits, without each add waiting on the one before (a single running sum is
// bound by the add's latency, not by the loads).
template <typename Term>
double interleaved_sum(int d, Term term) {
  double s[4] = {0, 0, 0, 0};
  int j = 0;
  for (; j + 4 <= d; j += 4)
    for (int k = 0; k < 4; ++k) s[k] += term(j + k);
  for (; j < d; ++j) s[j % 4] += term(j);
  return (s[0] + s[1]) + (s[2] + s[3]);
}
}  // namespace

template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* in, const T* weight, int n, int d, double eps) {
  for (int i = 0; i < n; ++i) {
    const T* x = in + (size_t)i * d;
    const double ss = interleaved_sum(d, [x](int j) { return (double)x[j] * x[j]; });
    double r = 1.0 / std::sqrt(ss / d + eps);
    rstd[i] = static_cast<T>(r);
    T* y = out + (size_t)i * d;
    for (int j = 0; j < d; ++j) y[j] = static_cast<T>(x[j] * r) * weight[j];
  }
}

template <typename T>
void rmsnorm_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight,
                      const T* rstd, int n, int d) {
  for (int i = 0; i < n; ++i) {
    const T* x = in + (size_t)i * d;
    const T* g = dout + (size_t)i * d;
    double r = rstd[i];
    // y = w * x * r; dx = r * (w*g) - r^3/d * x * sum(w*g*x)
    const double dot = interleaved_sum(d, [&](int j) { return (double)g[j] * weight[j] * x[j]; });
    for (int j = 0; j < d; ++j) dweight[j] += static_cast<T>(g[j] * x[j] * r);
    double c = r * r * r * dot / d;
    T* dx = din + (size_t)i * d;
    for (int j = 0; j < d; ++j) dx[j] += static_cast<T>(r * g[j] * weight[j] - c * x[j]);
  }
}

namespace {
// The angles' cosines and sines for (seq, head_dim, theta), kept per thread:
// every layer's q and k, forward and backward, rotate by the same table, and
// its pow/cos/sin cost more than the rotation itself. Computed as before, so
// the same bits.
struct RopeTable {
  int seq = -1, hd = -1;
  double theta = 0;
  std::vector<double> cos, sin;  // (seq, hd / 2)
};

const RopeTable& rope_table(int seq, int hd, double theta) {
  thread_local RopeTable t;
  if (t.seq == seq && t.hd == hd && t.theta == theta) return t;
  const int half = hd / 2;
  t.cos.resize((size_t)seq * half);
  t.sin.resize((size_t)seq * half);
  for (int p = 0; p < seq; ++p)
    for (int i = 0; i < half; ++i) {
      double freq = std::pow(theta, -2.0 * i / hd);
      t.cos[(size_t)p * half + i] = std::cos(p * freq);
      t.sin[(size_t)p * half + i] = std::sin(p * freq);
    }
  t.seq = seq;
  t.hd = hd;
  t.theta = theta;
  return t;
}

template <typename T>
void rope_rotate(T* x, int batch, int seq, int heads, int hd, double theta, double sign) {
  const int half = hd / 2;
  const RopeTable& table = rope_table(seq, hd, theta);
  for (int b = 0; b < batch; ++b)
    for (int t = 0; t < seq; ++t)
      for (int h = 0; h < heads; ++h) {
        T* v = x + (((size_t)b * seq + t) * heads + h) * hd;
        const double* c = &table.cos[(size_t)t * half];
        const double* s = &table.sin[(size_t)t * half];
        for (int i = 0; i < half; ++i) {
          const double si = sign * s[i];  // exact: the backward rotates by -angle
          double x1 = v[i], x2 = v[i + half];
          v[i] = static_cast<T>(x1 * c[i] - x2 * si);
          v[i + half] = static_cast<T>(x2 * c[i] + x1 * si);
        }
      }
}
}  // namespace

template <typename T>
void rope_forward(T* x, int batch, int seq, int heads, int head_dim, double theta) {
  rope_rotate(x, batch, seq, heads, head_dim, theta, 1.0);
}

template <typename T>
void rope_backward(T* dx, int batch, int seq, int heads, int head_dim, double theta) {
  rope_rotate(dx, batch, seq, heads, head_dim, theta, -1.0);
}

namespace {
// Causal softmax of row t over columns 0..t, in place; the rest zeroed. The
// double path (and the naive reference) takes libm's exp in double.
template <typename T>
void causal_softmax_row_exact(T* row, int t, int seq) {
  double mx = row[0];
  for (int j = 1; j <= t; ++j) mx = std::max<double>(mx, row[j]);
  double sum = 0;
  for (int j = 0; j <= t; ++j) {
    double e = std::exp(row[j] - mx);
    row[j] = static_cast<T>(e);
    sum += e;
  }
  for (int j = 0; j <= t; ++j) row[j] = static_cast<T>(row[j] / sum);
  for (int j = t + 1; j < seq; ++j) row[j] = T(0);
}

// The float path takes its exponentials in SIMD float (model/detail/
// vector_exp.h), sums them in double: libm's double exp was the model's
// largest cost after the GEMMs.
template <typename T>
void causal_softmax_row(T* row, int t, int seq) {
  if constexpr (!std::is_same_v<T, float>) {
    causal_softmax_row_exact(row, t, seq);
  } else {
    float mx = row[0];
    for (int j = 1; j <= t; ++j) mx = std::max(mx, row[j]);
    const double sum = detail::exp_shifted_sum(row, row, (size_t)t + 1, mx);
    const float inv = static_cast<float>(1.0 / sum);
    for (int j = 0; j <= t; ++j) row[j] *= inv;
    for (int j = t + 1; j < seq; ++j) row[j] = 0.0f;
  }
}
}  // namespace

template <typename T>
void attention_forward(T* out, T* probs, const T* q, const T* k, const T* v,
                       const AttentionDims& dm) {
  const int T_ = dm.seq, H = dm.heads, KVH = dm.kv_heads, hd = dm.head_dim;
  const int group = H / KVH;
  const T scale = static_cast<T>(1.0 / std::sqrt((double)hd));
  for (int b = 0; b < dm.batch; ++b)
    for (int h = 0; h < H; ++h) {
      const int kvh = h / group;
      const T* qb = q + ((size_t)b * T_ * H + h) * hd;
      const T* kb = k + ((size_t)b * T_ * KVH + kvh) * hd;
      const T* vb = v + ((size_t)b * T_ * KVH + kvh) * hd;
      T* p = probs + ((size_t)b * H + h) * T_ * T_;
      T* ob = out + ((size_t)b * T_ * H + h) * hd;
      gemm<T>(false, true, T_, T_, hd, scale, qb, H * hd, kb, KVH * hd, T(0), p, T_);
      for (int t = 0; t < T_; ++t) causal_softmax_row(p + (size_t)t * T_, t, T_);
      gemm<T>(false, false, T_, hd, T_, T(1), p, T_, vb, KVH * hd, T(0), ob, H * hd);
    }
}

template <typename T>
void attention_forward_reference(T* out, T* probs, const T* q, const T* k, const T* v,
                                 const AttentionDims& dm) {
  const int T_ = dm.seq, H = dm.heads, KVH = dm.kv_heads, hd = dm.head_dim;
  const int group = H / KVH;
  const double scale = 1.0 / std::sqrt((double)hd);
  for (int b = 0; b < dm.batch; ++b)
    for (int h = 0; h < H; ++h) {
      const int kvh = h / group;
      T* p = probs + ((size_t)b * H + h) * T_ * T_;
      for (int t = 0; t < T_; ++t) {
        const T* qv = q + (((size_t)b * T_ + t) * H + h) * hd;
        for (int s = 0; s < T_; ++s) {
          double dot = 0;
          if (s <= t) {
            const T* kv = k + (((size_t)b * T_ + s) * KVH + kvh) * hd;
            for (int i = 0; i < hd; ++i) dot += (double)qv[i] * kv[i];
          }
          p[(size_t)t * T_ + s] = static_cast<T>(dot * scale);
        }
        causal_softmax_row_exact(p + (size_t)t * T_, t, T_);
        T* o = out + (((size_t)b * T_ + t) * H + h) * hd;
        for (int i = 0; i < hd; ++i) {
          double acc = 0;
          for (int s = 0; s <= t; ++s)
            acc += (double)p[(size_t)t * T_ + s] * v[(((size_t)b * T_ + s) * KVH + kvh) * hd + i];
          o[i] = static_cast<T>(acc);
        }
      }
    }
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* probs, const T* q,
                        const T* k, const T* v, const AttentionDims& dm) {
  const int T_ = dm.seq, H = dm.heads, KVH = dm.kv_heads, hd = dm.head_dim;
  const int group = H / KVH;
  const T scale = static_cast<T>(1.0 / std::sqrt((double)hd));
  std::vector<T> dp((size_t)T_ * T_);
  for (int b = 0; b < dm.batch; ++b)
    for (int h = 0; h < H; ++h) {
      const int kvh = h / group;
      const size_t qoff = ((size_t)b * T_ * H + h) * hd;
      const size_t kvoff = ((size_t)b * T_ * KVH + kvh) * hd;
      const T* p = probs + ((size_t)b * H + h) * T_ * T_;
      // dP = dO V^T ; dV += P^T dO
      gemm<T>(false, true, T_, T_, hd, T(1), dout + qoff, H * hd, v + kvoff, KVH * hd, T(0),
              dp.data(), T_);
      gemm<T>(true, false, T_, hd, T_, T(1), p, T_, dout + qoff, H * hd, T(1), dv + kvoff,
              KVH * hd);
      // dS = P * (dP - rowsum(P * dP)), masked entries have P = 0.
      for (int t = 0; t < T_; ++t) {
        const T* pr = p + (size_t)t * T_;
        T* dr = dp.data() + (size_t)t * T_;
        double dot = 0;
        for (int s = 0; s <= t; ++s) dot += (double)pr[s] * dr[s];
        for (int s = 0; s < T_; ++s) dr[s] = s <= t ? static_cast<T>(pr[s] * (dr[s] - dot)) : T(0);
      }
      // dQ += scale dS K ; dK += scale dS^T Q
      gemm<T>(false, false, T_, hd, T_, scale, dp.data(), T_, k + kvoff, KVH * hd, T(1),
              dq + qoff, H * hd);
      gemm<T>(true, false, T_, hd, T_, scale, dp.data(), T_, q + qoff, H * hd, T(1), dk + kvoff,
              KVH * hd);
    }
}

template <typename T>
void swiglu_forward(T* out, const T* a, const T* b, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    double x = a[i];
    double silu = x / (1.0 + std::exp(-x));
    out[i] = static_cast<T>(silu * b[i]);
  }
}

template <typename T>
void swiglu_backward(T* da, T* db, const T* dout, const T* a, const T* b, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    double x = a[i];
    double sig = 1.0 / (1.0 + std::exp(-x));
    double silu = x * sig;
    double dsilu = sig * (1.0 + x * (1.0 - sig));
    da[i] += static_cast<T>(dout[i] * b[i] * dsilu);
    db[i] += static_cast<T>(dout[i] * silu);
  }
}

namespace {
// The float path: one pass of SIMD float exponentials per row (summed in
// double) serves the loss and the gradient, p = e / sum. The double path
// below is its reference (CrossEntropy tests).
double cross_entropy_float(float* dlogits, const float* logits, const int32_t* targets, int n, int vocab,
                           double scale) {
  thread_local std::vector<float> e;
  e.resize(vocab);
  double total = 0;
  for (int i = 0; i < n; ++i) {
    const float* row = logits + (size_t)i * vocab;
    XD_CHECK(targets[i] >= 0 && targets[i] < vocab);
    float mx = row[0];
    for (int j = 1; j < vocab; ++j) mx = std::max(mx, row[j]);
    const double sum = detail::exp_shifted_sum(e.data(), row, vocab, mx);
    total += (double)mx + std::log(sum) - row[targets[i]];
    if (dlogits) {
      float* drow = dlogits + (size_t)i * vocab;
      const double k = scale / n;
      const float per = static_cast<float>(k / sum);
      for (int j = 0; j < vocab; ++j) drow[j] = e[j] * per;
      drow[targets[i]] = static_cast<float>(k * ((double)e[targets[i]] / sum - 1.0));
    }
  }
  return total / n;
}
}  // namespace

template <typename T>
double cross_entropy_forward_backward(T* dlogits, const T* logits, const int32_t* targets, int n,
                                      int vocab, double scale) {
  if constexpr (std::is_same_v<T, float>) return cross_entropy_float(dlogits, logits, targets, n, vocab, scale);
  double total = 0;
  for (int i = 0; i < n; ++i) {
    const T* row = logits + (size_t)i * vocab;
    XD_CHECK(targets[i] >= 0 && targets[i] < vocab);
    double mx = row[0];
    for (int j = 1; j < vocab; ++j) mx = std::max<double>(mx, row[j]);
    double sum = 0;
    for (int j = 0; j < vocab; ++j) sum += std::exp(row[j] - mx);
    double lse = mx + std::log(sum);
    total += lse - row[targets[i]];
    if (dlogits) {
      T* drow = dlogits + (size_t)i * vocab;
      for (int j = 0; j < vocab; ++j) {
        double p = std::exp(row[j] - lse);
        drow[j] = static_cast<T>(scale * (p - (j == targets[i] ? 1.0 : 0.0)) / n);
      }
    }
  }
  return total / n;
}

// The float path (the routers' gates) takes its exponentials in SIMD float,
// once per entry, summed in double; the double path keeps libm's exp.
template <typename T>
double softmax_row(T* out, const T* in, int n) {
  if constexpr (std::is_same_v<T, float>) {
    float mx = in[0];
    for (int j = 1; j < n; ++j) mx = std::max(mx, in[j]);
    const double sum = detail::exp_shifted_sum(out, in, (size_t)n, mx);
    const float inv = static_cast<float>(1.0 / sum);
    for (int j = 0; j < n; ++j) out[j] *= inv;
    return mx + std::log(sum);
  } else {
    double mx = in[0];
    for (int j = 1; j < n; ++j) mx = std::max<double>(mx, in[j]);
    double sum = 0;
    for (int j = 0; j < n; ++j) sum += std::exp(in[j] - mx);
    const double lse = mx + std::log(sum);
    for (int j = 0; j < n; ++j) out[j] = static_cast<T>(std::exp(in[j] - lse));
    return lse;
  }
}

#define XD_INSTANTIATE_OPS(T)                                                                  \
  template double softmax_row<T>(T*, const T*, int);                                           \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int, int);                  \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int, int);                 \
  template void linear_forward<T>(T*, const T*, const T*, int, int, int);                      \
  template void linear_backward<T>(T*, T*, const T*, const T*, const T*, int, int, int);       \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int, int, double);              \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int, int); \
  template void rope_forward<T>(T*, int, int, int, int, double);                               \
  template void rope_backward<T>(T*, int, int, int, int, double);                              \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionDims&); \
  template void attention_forward_reference<T>(T*, T*, const T*, const T*, const T*,           \
                                               const AttentionDims&);                          \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,      \
                                      const T*, const AttentionDims&);                         \
  template void swiglu_forward<T>(T*, const T*, const T*, int64_t);                            \
  template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t);             \
  template double cross_entropy_forward_backward<T>(T*, const T*, const int32_t*, int, int,    \
                                                    double);

XD_INSTANTIATE_OPS(float)
XD_INSTANTIATE_OPS(double)

}  // namespace xd
