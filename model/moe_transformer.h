// MoeTransformer: decoder-only MoE transformer in the HF Mixtral layout, with
// hand-written forward and backward on OpenBLAS (docs/model.md is the spec).
// Owns one contiguous parameter block and one gradient block (ParamLayout).
// forward() keeps the activations that backward() consumes; backward()
// accumulates into the gradient block. Not thread-safe. T is float for
// training and double for gradient checks.
//
// Both passes run in the overlapped order of docs/overlap.md: every exchange
// is started as early as its inputs allow and finished as late as its
// consumer allows, so an asynchronous ExpertExchange moves rows while this
// thread computes. With a synchronous exchange the same order gives the same
// numbers with no overlap.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/timeline.h"
#include "model/expert_exchange.h"
#include "model/model_config.h"
#include "model/moe_layer.h"
#include "model/param_layout.h"

namespace xd {

struct LossStats {
  double loss = 0;      // ce + aux_loss_coef * aux + z_loss_coef * z (what backward differentiates)
  double ce_loss = 0;   // mean next-token cross entropy, nats
  double aux_loss = 0;  // load-balancing loss summed over layers (before its coefficient)
  double z_loss = 0;    // router z-loss summed over layers (before its coefficient)
  int64_t dropped = 0;  // assignments dropped by expert capacity
};

template <typename T>
class MoeTransformer {
 public:
  // Resolves the weights of an expert this worker computes but does not own
  // (a gathered HybridEP replica). The default handles only owned experts.
  using ExpertResolver = std::function<ExpertParams<T>(int layer, int expert)>;
  // Called from backward() on this thread as gradients become final:
  // `experts_done(layer)` once the layer's routed-expert gradients are (all
  // chunks; the replicas' are final a little earlier,
  // ExpertExchange::replicas_backward_done), `grads_ready(group)` once a
  // group of dense gradients is: group num_layers is the LM head and final
  // norm (first), then each layer from the last down (its attention, norms,
  // router and shared experts), and -1 the token embedding (last).
  // With `defer_owned_expert_weights` and gathered replicas computed here,
  // the weight gradients of the experts this worker owns wait until after
  // the embedding's (nothing else needs them before the optimizer, and the
  // replicas' gradients then leave sooner); experts_done then comes for
  // every layer after them, from the last down. With
  // `defer_replica_expert_weights` too, the replicas' weight gradients wait
  // there as well and run first, layer by layer from the last down, each
  // layer's leaving when they are done (ExpertExchange::replicas_backward_done):
  // the dense buckets of the first layers and the embedding then leave
  // sooner, at the cost of the replicas' gradients leaving later. With
  // `defer_owned_expert_weights` and no replicas, only layer 0's owned
  // experts' weight gradients wait until after the embedding's (the layers
  // before keep theirs where they hide their own exchanges): they then hide
  // the last dense buckets' flight, which nothing was left to hide, and
  // experts_done(0) comes after them. The sums are the same bits.
  struct BackwardHooks {
    std::function<void(int layer)> experts_done;
    std::function<void(int group)> grads_ready;
    bool defer_owned_expert_weights = false;
    bool defer_replica_expert_weights = false;  // only with defer_owned_expert_weights
  };

  explicit MoeTransformer(const ParamLayout& layout);
  ~MoeTransformer();
  MoeTransformer(const MoeTransformer&) = delete;
  MoeTransformer& operator=(const MoeTransformer&) = delete;

  // Deterministic init: each tensor draws from its own stream keyed by (seed,
  // tensor name), so an expert's weights do not depend on which worker owns it.
  void init(uint64_t seed);

  // inputs/targets are (batch, seq) tokens. targets may be null (no loss).
  LossStats forward(const int32_t* inputs, const int32_t* targets, int batch, int seq,
                    ExpertExchange<T>* exchange = nullptr);
  // Backward of the last forward, which must have had targets.
  void backward(ExpertExchange<T>* exchange = nullptr);
  void zero_grad();

  const std::vector<T>& logits() const { return logits_; }  // (batch*seq, V)
  std::vector<T>& params() { return params_; }
  std::vector<T>& grads() { return grads_; }
  const ParamLayout& layout() const { return layout_; }
  const ModelConfig& config() const { return layout_.config(); }
  ModelWeights<T>& weights() { return w_; }
  ModelWeights<T>& grad_weights() { return g_; }
  void set_expert_resolver(ExpertResolver r) { resolver_ = std::move(r); }
  void set_backward_hooks(BackwardHooks hooks) { hooks_ = std::move(hooks); }
  // r: each layer's Dispatch and Combine go in r chunks (FSMoE Sec. 4); the
  // backward's exchanges in `backward_r` (a divisor of r; 0: r), each then
  // carrying r / backward_r chunks. Neither changes a result.
  void set_pipeline_degree(int r, int backward_r = 0);
  int pipeline_degree() const { return chunks_; }
  int backward_pipeline_degree() const { return backward_chunks_; }
  // A token goes once to each worker computing some of its experts, which
  // sums their outputs (model/detail/moe_grouped.h): fewer rows, the same
  // math up to the order of the sums. Token routers only (not SoftMoE).
  void set_tokens_once_per_worker(bool once) { once_per_worker_ = once; }
  bool tokens_once_per_worker() const { return once_per_worker_; }
  // How the next forward routes: GShard noise is drawn only when training,
  // keyed by the context (model/router.h). Default: evaluation, no noise.
  void set_routing_context(const RoutingContext& ctx) { routing_ = ctx; }
  const RoutingContext& routing_context() const { return routing_; }
  // Compute spans go here when it records (may be null).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }

 private:
  struct LayerCache;
  MoeWeights<T> moe_weights(int layer, const ExpertExchange<T>& exchange) const;
  MoeDims moe_dims(int layer) const;  // of the last forward's batch

  ParamLayout layout_;
  std::vector<T> params_, grads_;
  ModelWeights<T> w_, g_;
  ExpertResolver resolver_;
  BackwardHooks hooks_;
  int chunks_ = 1, backward_chunks_ = 1;
  bool once_per_worker_ = false;
  RoutingContext routing_;
  Timeline* timeline_ = nullptr;
  std::unique_ptr<LocalExpertExchange<T>> local_exchange_;

  // Activations of the last forward.
  int batch_ = 0, seq_ = 0;
  std::vector<int32_t> inputs_, targets_;
  std::vector<std::vector<T>> residual_;  // (L+1) x (N, d): o_0..o_L
  std::vector<LayerCache> layers_;
  std::vector<T> final_normed_, final_rstd_, logits_;
  ExpertExchange<T>* last_exchange_ = nullptr;
  // backward()'s (N, d) and (N, V) buffers, kept from step to step: a step
  // then allocates none, and fills with zeros only those it sums into.
  struct BackwardBuffers {
    std::vector<T> dout, dlogits, dnormed, dp_extra, dp, dnorm2, dshared_xn, dmoe_in, da, dctx, dq, dk, dv, dnorm1,
        dattn_in;
  };
  BackwardBuffers bw_;
};

}  // namespace xd
