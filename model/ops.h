// Dense transformer ops as forward/backward pairs (llm.c style). Forward writes
// its output (and cache); backward ACCUMULATES (+=) into dinput and dweights.
// Row-major throughout; N = number of token rows. Instantiated for float and
// double (double serves the finite-difference gradient checks). Stateless and
// thread-safe. attention_forward has a naive reference here; the GEMM paths
// are checked against gemm_reference (model/gemm.h).
#pragma once

#include <cstdint>

namespace xd {

// out (N, V... d) = embedding rows of `tokens`.
template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* table, int n, int d);
template <typename T>
void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int n, int d);

// out (N, out_f) = in (N, in_f) * W^T, W (out_f, in_f).
template <typename T>
void linear_forward(T* out, const T* in, const T* weight, int n, int in_f, int out_f);
template <typename T>
void linear_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight, int n,
                     int in_f, int out_f);

// out = in / rms(in) * weight, rms = sqrt(mean(in^2) + eps); rstd (N) is the cache.
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* in, const T* weight, int n, int d, double eps);
template <typename T>
void rmsnorm_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight,
                      const T* rstd, int n, int d);

// RoPE, rotate-half convention (HF Llama/Mixtral): for head vector x of size hd,
// half = hd/2, freq_i = theta^(-2i/hd), angle = pos * freq_i,
// y[i] = x[i] cos - x[i+half] sin, y[i+half] = x[i+half] cos + x[i] sin.
// x is (B, T, heads, hd), rotated in place; pos = t. Backward rotates by -angle.
template <typename T>
void rope_forward(T* x, int batch, int seq, int heads, int head_dim, double theta);
template <typename T>
void rope_backward(T* dx, int batch, int seq, int heads, int head_dim, double theta);

// Causal softmax attention with grouped KV heads. q (B,T,H,hd), k/v (B,T,KVH,hd),
// out (B,T,H,hd), probs cache (B,H,T,T) (upper triangle zero). Scale 1/sqrt(hd).
struct AttentionDims {
  int batch, seq, heads, kv_heads, head_dim;
};
template <typename T>
void attention_forward(T* out, T* probs, const T* q, const T* k, const T* v,
                       const AttentionDims& dims);
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* probs, const T* q,
                        const T* k, const T* v, const AttentionDims& dims);
// Naive loops, the reference for attention_forward.
template <typename T>
void attention_forward_reference(T* out, T* probs, const T* q, const T* k, const T* v,
                                 const AttentionDims& dims);

// SwiGLU gate: out = silu(a) * b, elementwise over count.
template <typename T>
void swiglu_forward(T* out, const T* a, const T* b, int64_t count);
template <typename T>
void swiglu_backward(T* da, T* db, const T* dout, const T* a, const T* b, int64_t count);

// Softmax of one row of n values into `out`; returns the row's log-sum-exp.
template <typename T>
double softmax_row(T* out, const T* in, int n);

// Mean cross-entropy over N rows of logits (N, V). Returns the loss; `dlogits`
// (nullable) is OVERWRITTEN with scale * d(loss)/d(logits).
template <typename T>
double cross_entropy_forward_backward(T* dlogits, const T* logits, const int32_t* targets, int n,
                                      int vocab, double scale);

}  // namespace xd
