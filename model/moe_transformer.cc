#include "model/moe_transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/rng.h"
#include "model/detail/moe_transformer_parts.h"
#include "model/ops.h"

namespace xd {

namespace {

// X-MoE temperature tau at initialisation; the router learns log(1 / tau).
constexpr double kXMoeInitialTemperature = 0.07;

}  // namespace

using detail::computes_replicas;

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
template class MoeTransformer<float>;
template class MoeTransformer<double>;

}  // namespace xd
