#include "model/moe_transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/rng.h"
#include "model/ops.h"

namespace xd {

template <typename T>
struct MoeTransformer<T>::LayerCache {
  std::vector<T> attn_in;            // (N, d) o_{k-1}, or p_{k-1} under FarSkip attention
  std::vector<T> norm1, rstd1;       // (N, d), (N)
  std::vector<T> q, k, v;            // post-RoPE, (N, H*hd), (N, KVH*hd) x2
  std::vector<T> probs;              // (B, H, T, T)
  std::vector<T> context;            // (N, H*hd)
  std::vector<T> attn_out;           // a_k (N, d)
  std::vector<T> moe_in;             // (N, d)
  std::vector<T> norm2, rstd2;
  std::vector<T> shared_out, routed_out;  // s_k, r_k (N, d)
  std::vector<T> partial;            // p_k = o_{k-1} + a_k + s_k: o_k before r_k arrives (N, d)
  MoeCache<T> moe;
};

namespace {

// X-MoE temperature tau at initialisation; the router learns log(1 / tau).
constexpr double kXMoeInitialTemperature = 0.07;

bool farskip_attention(Connectivity c) {
  return c == Connectivity::kFarSkip || c == Connectivity::kFarSkipAttention;
}
bool farskip_moe(Connectivity c) {
  return c == Connectivity::kFarSkip || c == Connectivity::kFarSkipMoe;
}
// Whether gathered experts (HybridEP replicas) are among those computed here.
template <typename T>
bool computes_replicas(const ExpertExchange<T>& exchange) {
  for (size_t j = 0; j < exchange.computed_experts().size(); ++j)
    if (exchange.is_replica(j)) return true;
  return false;
}
}  // namespace

template <typename T>
MoeTransformer<T>::MoeTransformer(const ParamLayout& layout)
    : layout_(layout), params_(layout.size(), T(0)), grads_(layout.size(), T(0)) {
  XD_CHECK(layout_.config().validate().is_ok());
  w_ = layout_.bind(params_.data());
  g_ = layout_.bind(grads_.data());
  local_exchange_ = std::make_unique<LocalExpertExchange<T>>(layout_.config().num_experts);
}

template <typename T>
MoeTransformer<T>::~MoeTransformer() = default;

template <typename T>
void MoeTransformer<T>::init(uint64_t seed) {
  const double stddev = config().init_std;
  for (const TensorSlot& s : layout_.slots()) {
    T* p = params_.data() + s.offset;
    if (s.name.ends_with(".gate_log_scale")) {
      *p = static_cast<T>(std::log(1.0 / kXMoeInitialTemperature));
      continue;
    }
    if (s.name.find(".gate_noise.") != std::string::npos) {  // no signal, some noise (Shazeer et al.)
      std::fill(p, p + s.numel(), T(0));
      continue;
    }
    const bool is_norm = s.shape.size() == 1;
    if (is_norm) {
      std::fill(p, p + s.numel(), T(1));
      continue;
    }
    Rng rng(hash_string(s.name, seed));
    const double spread = config().expert_init_spread;
    if (s.is_routed_expert() && spread < 1) {
      // The layer's shared draw: the same name with "*" for the expert index.
      const std::string tag = "experts." + std::to_string(s.expert) + ".";
      std::string shared_name = s.name;
      const size_t at = shared_name.find(tag);
      XD_CHECK(at != std::string::npos);
      shared_name.replace(at, tag.size(), "experts.*.");
      Rng shared(hash_string(shared_name, seed));
      const double a = std::sqrt(1 - spread * spread) * stddev, b = spread * stddev;
      for (size_t i = 0; i < s.numel(); ++i) p[i] = static_cast<T>(a * shared.normal() + b * rng.normal());
      continue;
    }
    for (size_t i = 0; i < s.numel(); ++i) p[i] = static_cast<T>(rng.normal() * stddev);
  }
}

template <typename T>
void MoeTransformer<T>::zero_grad() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <typename T>
MoeWeights<T> MoeTransformer<T>::moe_weights(int l, const ExpertExchange<T>& ex) const {
  const ModelConfig& cfg = config();
  const size_t d = cfg.hidden_size, ff = cfg.expert_intermediate_size;
  const size_t sff = cfg.shared_intermediate_size;
  const LayerWeights<T>& W = w_.layers[l];
  const LayerWeights<T>& G = g_.layers[l];
  MoeWeights<T> mw;
  mw.router = RouterWeights<T>{W.router, G.router, W.router_noise, G.router_noise,
                               W.router_experts, G.router_experts, W.router_log_scale, G.router_log_scale};
  for (int e : ex.computed_experts()) {
    const int j = e - layout_.first_expert();
    if (j >= 0 && j < layout_.num_local_experts()) {
      const size_t o = (size_t)j * ff * d;
      mw.computed.push_back({W.w1 + o, W.w3 + o, W.w2 + o, G.w1 + o, G.w3 + o, G.w2 + o});
    } else {
      XD_CHECK_MSG(resolver_, "exchange computes an expert this worker neither owns nor resolves");
      mw.computed.push_back(resolver_(l, e));
    }
  }
  for (int s = 0; s < cfg.num_shared_experts; ++s) {
    const size_t o = (size_t)s * sff * d;
    mw.shared.push_back({W.shared_w1 + o, W.shared_w3 + o, W.shared_w2 + o, G.shared_w1 + o,
                         G.shared_w3 + o, G.shared_w2 + o});
  }
  return mw;
}

template <typename T>
MoeDims MoeTransformer<T>::moe_dims(int layer) const {
  const ModelConfig& cfg = config();
  MoeDims dm{batch_ * seq_, cfg.hidden_size, cfg.expert_intermediate_size, cfg.shared_intermediate_size, layer,
             chunks_};
  dm.backward_chunks = backward_chunks_;
  dm.once_per_worker = once_per_worker_;
  dm.seq_len = seq_;
  dm.routing = routing_;
  return dm;
}

template <typename T>
void MoeTransformer<T>::set_pipeline_degree(int r, int backward_r) {
  if (backward_r == 0) backward_r = r;
  XD_CHECK(r >= 1 && backward_r >= 1 && r % backward_r == 0);
  chunks_ = r;
  backward_chunks_ = backward_r;
}

template <typename T>
LossStats MoeTransformer<T>::forward(const int32_t* inputs, const int32_t* targets, int batch,
                                     int seq, ExpertExchange<T>* exchange) {
  const ModelConfig& cfg = config();
  XD_CHECK(seq <= cfg.max_seq_len && batch > 0 && seq > 0);
  if (!exchange) exchange = local_exchange_.get();
  last_exchange_ = exchange;
  batch_ = batch;
  seq_ = seq;
  const int N = batch * seq, d = cfg.hidden_size, L = cfg.num_layers, V = cfg.vocab_size;
  const int H = cfg.num_heads, KVH = cfg.num_kv_heads, hd = cfg.head_dim();
  const size_t Nd = (size_t)N * d;
  inputs_.assign(inputs, inputs + N);
  if (targets) targets_.assign(targets, targets + N); else targets_.clear();

  // Every o_k is written whole below (the embedding, then each Combine's
  // sum), so the buffers of the last forward are reused as they are.
  residual_.resize(L + 1);
  for (std::vector<T>& o : residual_) o.resize(Nd);
  layers_.resize(L);
  embedding_forward(residual_[0].data(), inputs, w_.embed_tokens, N, d);
  LossStats stats;
  auto dims = [&](int l) { return moe_dims(l); };
  // Layer l's Combine lands: r_l, then o_l = p_l + r_l.
  auto finish_combine = [&](int l) {
    LayerCache& c = layers_[l];
    c.routed_out.resize(Nd);
    moe_combine_finish(c.routed_out.data(), &c.moe, exchange, dims(l));
    T* o = residual_[l + 1].data();
    for (size_t j = 0; j < Nd; ++j) o[j] = c.partial[j] + c.routed_out[j];
  };
  // The steps of docs/overlap.md: under FarSkip the attention needs only
  // p_{k-1} and the MoE only o_{k-1}, so Combine(k-1) overlaps attention
  // part (a) and Dispatch(k) part (b); Combine(k) overlaps the shared experts.
  const bool replicas = computes_replicas(*exchange);
  // Attention (a) of layer l from its input, and its core sequence by
  // sequence: attended[l] counts the sequences done, -1 before part (a).
  std::vector<int> attended(L, -1);
  auto attention_a = [&](int l) {
    LayerCache& c = layers_[l];
    const LayerWeights<T>& W = w_.layers[l];
    ScopedSpan span(timeline_, "attention (a)", l);
    c.norm1.resize(Nd);
    c.rstd1.resize(N);
    rmsnorm_forward(c.norm1.data(), c.rstd1.data(), c.attn_in.data(), W.input_layernorm, N, d, cfg.rms_norm_eps);
    c.q.resize((size_t)N * H * hd);
    c.k.resize((size_t)N * KVH * hd);
    c.v.resize((size_t)N * KVH * hd);
    linear_forward(c.q.data(), c.norm1.data(), W.q_proj, N, d, H * hd);
    linear_forward(c.k.data(), c.norm1.data(), W.k_proj, N, d, KVH * hd);
    linear_forward(c.v.data(), c.norm1.data(), W.v_proj, N, d, KVH * hd);
    rope_forward(c.q.data(), batch, seq, H, hd, cfg.rope_theta);
    rope_forward(c.k.data(), batch, seq, KVH, hd, cfg.rope_theta);
    c.probs.resize((size_t)batch * H * seq * seq);
    c.context.resize((size_t)N * H * hd);
    attended[l] = 0;
  };
  auto attend = [&](int l, int upto) {
    LayerCache& c = layers_[l];
    const size_t b0 = attended[l];
    attention_forward(c.context.data() + b0 * seq * H * hd, c.probs.data() + b0 * H * seq * seq,
                      c.q.data() + b0 * seq * H * hd, c.k.data() + b0 * seq * KVH * hd,
                      c.v.data() + b0 * seq * KVH * hd, AttentionDims{upto - attended[l], seq, H, KVH, hd});
    attended[l] = upto;
  };
  for (int l = 0; l < L; ++l) {
    LayerCache& c = layers_[l];
    const LayerWeights<T>& W = w_.layers[l];
    const Connectivity conn = cfg.layer_connectivity(l);
    const MoeDims dm = dims(l);
    const T* o_prev = residual_[l].data();
    bool combined = l == 0;  // o_{l-1} is known (o_{-1} is the embedding, r_{-1} = 0)
    if (attended[l] < 0) {  // not begun while layer l-1 waited for its experts (below)
      if (farskip_attention(conn)) {
        const T* partial_prev = l > 0 ? layers_[l - 1].partial.data() : o_prev;
        c.attn_in.assign(partial_prev, partial_prev + Nd);
      } else {
        if (!combined) finish_combine(l - 1);
        combined = true;
        c.attn_in.assign(o_prev, o_prev + Nd);
      }
      attention_a(l);
    }
    // Work while waiting: attention (b)'s core needs neither o_{l-1} nor the
    // router, so while Combine(l-1) is still in flight (a slower peer, a busy
    // link) it runs sequence by sequence instead of the wait; what is left
    // of it then hides Dispatch(l). Per sequence it is the same arithmetic.
    if (!combined) {
      if (attended[l] < batch && !moe_combine_landed(*exchange, dims(l - 1))) {
        ScopedSpan span(timeline_, "attention (b)", l);
        do attend(l, attended[l] + 1);
        while (attended[l] < batch && !moe_combine_landed(*exchange, dims(l - 1)));
      }
      finish_combine(l - 1);
    }
    const MoeWeights<T> mw = moe_weights(l, *exchange);
    auto route = [&] {
      ScopedSpan span(timeline_, "router", l);
      c.norm2.resize(Nd);
      c.rstd2.resize(N);
      rmsnorm_forward(c.norm2.data(), c.rstd2.data(), c.moe_in.data(), W.post_attention_layernorm, N, d,
                      cfg.rms_norm_eps);
      moe_route_forward(&c.moe, c.norm2.data(), mw, exchange, cfg, dm);
    };
    if (farskip_moe(conn)) {
      c.moe_in.assign(o_prev, o_prev + Nd);
      route();
    }
    auto finish_attention_b = [&] {
      ScopedSpan span(timeline_, "attention (b)", l);
      if (attended[l] < batch) attend(l, batch);
      c.attn_out.resize(Nd);
      linear_forward(c.attn_out.data(), c.context.data(), W.o_proj, N, H * hd, d);
    };
    // The last layer's Combine has nothing after it to hide under but this
    // layer's own work, and under FarSkip MoE nothing needs attention (b)
    // before the layer's output: there the shared experts take Dispatch's
    // place, and attention (b) hides the Combine.
    const bool last_experts_first = l + 1 == L && farskip_moe(conn);
    if (!last_experts_first) finish_attention_b();
    if (!farskip_moe(conn)) {
      c.moe_in.resize(Nd);
      for (size_t j = 0; j < Nd; ++j) c.moe_in[j] = o_prev[j] + c.attn_out[j];
      route();
    }
    stats.aux_loss += c.moe.router.gate.aux_loss;
    stats.z_loss += c.moe.router.gate.z_loss;
    stats.dropped += c.moe.plan.dropped;
    // The shared experts need no Dispatch and no gathered experts: when
    // either has not landed (HybridEP's layer 0 waits for its all-gather
    // most) they run first, in its place; otherwise after the routed
    // experts, hiding Combine(l). In the last layer they run first under
    // FarSkip MoE (above), and otherwise after, as only they can hide its
    // Combine.
    auto shared_experts = [&] {
      ScopedSpan span(timeline_, "shared experts", l);
      c.shared_out.resize(Nd);
      moe_shared_forward(c.shared_out.data(), &c.moe, c.norm2.data(), mw, dm);
    };
    auto make_partial = [&] {
      c.partial.resize(Nd);
      for (size_t j = 0; j < Nd; ++j) c.partial[j] = o_prev[j] + c.attn_out[j] + c.shared_out[j];
    };
    const bool replicas_late = replicas && !exchange->replicas_landed(l);
    const bool shared_first =
        last_experts_first || (l + 1 < L && (!moe_dispatch_landed(*exchange, dm) || replicas_late));
    if (shared_first) shared_experts();
    // Work while waiting: a Dispatch still in flight after them takes
    // attention (b) sequence by sequence.
    if (last_experts_first && attended[l] < batch && !moe_dispatch_landed(*exchange, dm)) {
      ScopedSpan span(timeline_, "attention (b)", l);
      do attend(l, attended[l] + 1);
      while (attended[l] < batch && !moe_dispatch_landed(*exchange, dm));
    }
    // Still waiting for the gathered experts (HybridEP's layer 0 most):
    // under FarSkip attention the next layer's attention needs only p_l =
    // o_{l-1} + a_l + s_l, known now, so its part (a) and, sequence by
    // sequence, its core run in the wait's place.
    // (Asked again: they may have landed while the shared experts ran.)
    const bool partial_first = !last_experts_first && shared_first && l + 1 < L &&
                               farskip_attention(cfg.layer_connectivity(l + 1)) &&
                               replicas && !exchange->replicas_landed(l);
    if (partial_first) {
      make_partial();
      layers_[l + 1].attn_in.assign(c.partial.begin(), c.partial.end());
      attention_a(l + 1);
      if (!exchange->replicas_landed(l)) {
        ScopedSpan span(timeline_, "attention (b)", l + 1);
        do attend(l + 1, attended[l + 1] + 1);
        while (attended[l + 1] < batch && !exchange->replicas_landed(l));
      }
    }
    {
      ScopedSpan span(timeline_, "routed experts", l);
      moe_experts_forward(&c.moe, mw, exchange, dm);
    }
    if (last_experts_first) finish_attention_b();
    if (!shared_first) shared_experts();
    if (!partial_first) make_partial();
  }
  finish_combine(L - 1);

  ScopedSpan head_span(timeline_, "head");
  final_normed_.resize(Nd);
  final_rstd_.resize(N);
  rmsnorm_forward(final_normed_.data(), final_rstd_.data(), residual_[L].data(), w_.final_norm, N,
                  d, cfg.rms_norm_eps);
  logits_.resize((size_t)N * V);
  linear_forward(logits_.data(), final_normed_.data(), w_.lm_head, N, d, V);
  if (targets) {
    stats.ce_loss = cross_entropy_forward_backward<T>(nullptr, logits_.data(), targets, N, V, 1.0);
    stats.loss = stats.ce_loss + cfg.aux_loss_coef * stats.aux_loss + cfg.z_loss_coef * stats.z_loss;
  }
  return stats;
}

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

template class MoeTransformer<float>;
template class MoeTransformer<double>;

}  // namespace xd
