// MoeTransformer's backward (model/moe_transformer.h), in the order of
// docs/overlap.md, "The backward schedule".
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "model/detail/moe_transformer_parts.h"
#include "model/moe_transformer.h"
#include "model/ops.h"

namespace xd {

using detail::computes_replicas;

template <typename T>
void MoeTransformer<T>::backward(ExpertExchange<T>* exchange) {
  const ModelConfig& cfg = config();
  XD_CHECK_MSG(!targets_.empty(), "backward needs a forward with targets");
  if (!exchange) exchange = last_exchange_;
  const int N = batch_ * seq_, d = cfg.hidden_size, L = cfg.num_layers, V = cfg.vocab_size;
  const int H = cfg.num_heads, KVH = cfg.num_kv_heads, hd = cfg.head_dim();
  const size_t Nd = (size_t)N * d;

  // The buffers summed into start at zero; the others are written whole
  // before they are read (dp, da, dlogits), or zeroed where they are used.
  std::vector<T>& dout = bw_.dout;  // d loss / d o_k, walking k down
  dout.assign(Nd, T(0));
  {
    ScopedSpan span(timeline_, "head backward");
    std::vector<T>& dlogits = bw_.dlogits;
    dlogits.resize((size_t)N * V);
    cross_entropy_forward_backward<T>(dlogits.data(), logits_.data(), targets_.data(), N, V, 1.0);
    std::vector<T>& dnormed = bw_.dnormed;
    dnormed.assign(Nd, T(0));
    linear_backward(dnormed.data(), g_.lm_head, dlogits.data(), final_normed_.data(), w_.lm_head, N, d, V);
    rmsnorm_backward(dout.data(), g_.final_norm, dnormed.data(), residual_[L].data(), w_.final_norm,
                     final_rstd_.data(), N, d);
  }
  if (hooks_.grads_ready) hooks_.grads_ready(L);

  // p_k feeds o_k and, under FarSkip attention, layer k+1's attention input:
  // d p_k = d o_k + dp_extra, while d r_k = d o_k.
  std::vector<T>& dp_extra = bw_.dp_extra;
  dp_extra.assign(Nd, T(0));
  std::vector<T>& dp = bw_.dp;
  std::vector<T>& dnorm2 = bw_.dnorm2;
  std::vector<T>& dshared_xn = bw_.dshared_xn;
  std::vector<T>& dmoe_in = bw_.dmoe_in;
  std::vector<T>& da = bw_.da;
  std::vector<T>& dnorm1 = bw_.dnorm1;
  std::vector<T>& dattn_in = bw_.dattn_in;
  for (std::vector<T>* b : {&dp, &dnorm2, &dshared_xn, &dmoe_in, &da, &dnorm1, &dattn_in}) b->resize(Nd);
  std::vector<T>& dctx = bw_.dctx;  // these four are zeroed per layer, at their own sizes
  std::vector<T>& dq = bw_.dq;
  std::vector<T>& dk = bw_.dk;
  std::vector<T>& dv = bw_.dv;
  const bool replicas = computes_replicas(*exchange);
  const bool defer = hooks_.defer_owned_expert_weights && replicas;
  // Without replicas only layer 0's wait (see BackwardHooks).
  const bool defer_first_layer = hooks_.defer_owned_expert_weights && !replicas;
  const bool defer_replicas = defer && hooks_.defer_replica_expert_weights;
  std::vector<std::function<void()>> deferred;  // the owned experts' weight gradients, in order
  std::vector<std::function<void()>> deferred_replicas;  // the replicas', each layer's then its send
  for (int l = L - 1; l >= 0; --l) {
    LayerCache& c = layers_[l];
    const LayerWeights<T>& W = w_.layers[l];
    const LayerWeights<T>& G = g_.layers[l];
    const Connectivity conn = cfg.layer_connectivity(l);
    const MoeDims dm = moe_dims(l);
    const MoeWeights<T> mw = moe_weights(l, *exchange);
    auto attention_backward_pass = [&](const T* dattn_out) {
      ScopedSpan span(timeline_, "attention backward", l);
      dctx.assign((size_t)N * H * hd, T(0));
      linear_backward(dctx.data(), G.o_proj, dattn_out, c.context.data(), W.o_proj, N, H * hd, d);
      dq.assign(c.q.size(), T(0));
      dk.assign(c.k.size(), T(0));
      dv.assign(c.v.size(), T(0));
      attention_backward(dq.data(), dk.data(), dv.data(), dctx.data(), c.probs.data(), c.q.data(),
                         c.k.data(), c.v.data(), AttentionDims{batch_, seq_, H, KVH, hd});
      rope_backward(dq.data(), batch_, seq_, H, hd, cfg.rope_theta);
      rope_backward(dk.data(), batch_, seq_, KVH, hd, cfg.rope_theta);
      std::fill(dnorm1.begin(), dnorm1.end(), T(0));
      linear_backward(dnorm1.data(), G.q_proj, dq.data(), c.norm1.data(), W.q_proj, N, d, H * hd);
      linear_backward(dnorm1.data(), G.k_proj, dk.data(), c.norm1.data(), W.k_proj, N, d, KVH * hd);
      linear_backward(dnorm1.data(), G.v_proj, dv.data(), c.norm1.data(), W.v_proj, N, d, KVH * hd);
      std::fill(dattn_in.begin(), dattn_in.end(), T(0));
      rmsnorm_backward(dattn_in.data(), G.input_layernorm, dnorm1.data(), c.attn_in.data(),
                       W.input_layernorm, c.rstd1.data(), N, d);
    };

    for (size_t j = 0; j < Nd; ++j) dp[j] = dout[j] + dp_extra[j];
    // The backward of Combine needs only d r_k = d o_k: it starts first, and
    // whatever does not need the experts' answer runs while it moves.
    moe_combine_backward_start(&c.moe, dout.data(), exchange, dm);
    std::fill(dnorm2.begin(), dnorm2.end(), T(0));
    // Under FarSkip MoE the attention backward (d a_k = d p_k) needs nothing
    // of the experts. With gathered replicas (HybridEP) it waits until the
    // experts' backward has sent their weight gradients home, the backward's
    // longest transfer, and then hides that; otherwise it hides the
    // backward of Combine.
    const bool attention_after_experts = farskip_moe(conn) && replicas;
    if (farskip_moe(conn) && !attention_after_experts) attention_backward_pass(dp.data());
    {
      ScopedSpan span(timeline_, "router backward", l);
      moe_router_backward(dnorm2.data(), &c.moe, c.norm2.data(), mw, cfg, dm, 1.0);
    }
    // The shared experts' backward needs no expert answer: when the backward
    // of Combine has not landed it runs first, in its place. It sums into its
    // own buffer, added at one fixed point, so the order changes no bit.
    auto shared_backward = [&] {
      ScopedSpan span(timeline_, "shared experts backward", l);
      std::fill(dshared_xn.begin(), dshared_xn.end(), T(0));
      moe_shared_backward(dshared_xn.data(), dp.data(), &c.moe, c.norm2.data(), mw, dm);  // d s_k = d p_k
    };
    const bool shared_first = !moe_combine_backward_landed(*exchange, dm);
    if (shared_first) shared_backward();
    const bool defers_this_layer = defer || (defer_first_layer && l == 0);
    {
      ScopedSpan span(timeline_, "routed experts backward", l);
      moe_experts_backward(&c.moe, mw, exchange, dm, defers_this_layer ? &deferred : nullptr,
                           defer_replicas ? &deferred_replicas : nullptr);
    }
    if (hooks_.experts_done && !defers_this_layer) hooks_.experts_done(l);
    if (attention_after_experts) attention_backward_pass(dp.data());
    if (!shared_first) shared_backward();
    for (size_t j = 0; j < Nd; ++j) dnorm2[j] += dshared_xn[j];
    moe_dispatch_backward_finish(dnorm2.data(), &c.moe, c.norm2.data(), mw, exchange, cfg, dm);
    std::fill(dmoe_in.begin(), dmoe_in.end(), T(0));
    rmsnorm_backward(dmoe_in.data(), G.post_attention_layernorm, dnorm2.data(), c.moe_in.data(),
                     W.post_attention_layernorm, c.rstd2.data(), N, d);
    if (!farskip_moe(conn)) {  // moe_in = o_{k-1} + a_k
      for (size_t j = 0; j < Nd; ++j) da[j] = dp[j] + dmoe_in[j];
      attention_backward_pass(da.data());
    }
    if (hooks_.grads_ready) hooks_.grads_ready(l);
    // o_{k-1} feeds p_k, the MoE input and (unless FarSkip) the attention
    // input; p_{k-1} feeds the attention input under FarSkip.
    const bool partial = farskip_attention(conn);
    for (size_t j = 0; j < Nd; ++j) {
      dout[j] = dp[j] + dmoe_in[j] + (partial ? T(0) : dattn_in[j]);
      dp_extra[j] = partial ? dattn_in[j] : T(0);
    }
  }
  // o_{-1} = p_{-1} is the embedding.
  for (size_t j = 0; j < Nd; ++j) dout[j] += dp_extra[j];
  embedding_backward(g_.embed_tokens, dout.data(), inputs_.data(), N, d);
  if (hooks_.grads_ready) hooks_.grads_ready(-1);
  if (defer_replicas) {
    ScopedSpan span(timeline_, "replicas' weight gradients");
    for (auto& weights : deferred_replicas) weights();
  }
  if (defer || defer_first_layer) {
    // Every layer's (with replicas), or layer 0's alone (the span says which).
    ScopedSpan span(timeline_, "owned experts' weight gradients", defer ? -1 : 0);
    for (auto& weights : deferred) weights();
    if (hooks_.experts_done)
      for (int l = defer ? L - 1 : 0; l >= 0; --l) hooks_.experts_done(l);
  }
}

template void MoeTransformer<float>::backward(ExpertExchange<float>* exchange);
template void MoeTransformer<double>::backward(ExpertExchange<double>* exchange);

}  // namespace xd
