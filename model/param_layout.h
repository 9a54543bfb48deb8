// ParamLayout: where every parameter tensor lives inside one contiguous block.
// Parameters, gradients and both AdamW moments share this layout, so one offset
// table serves all four. Routed experts of a layer are contiguous (E, ., .) so a
// worker can own a slice of them. Pure arithmetic; no allocation of tensor data.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "model/model_config.h"

namespace xd {

// One named tensor inside the block, in HF Mixtral naming.
struct TensorSlot {
  std::string name;            // e.g. "model.layers.0.self_attn.q_proj.weight"
  size_t offset = 0;           // in elements from the block start
  std::vector<int64_t> shape;  // row-major
  size_t numel() const;
  bool is_routed_expert() const { return expert >= 0; }
  int layer = -1;              // -1 for embeddings, final norm, lm head
  int expert = -1;             // global routed expert id, or -1
};

template <typename T>
struct LayerWeights {
  T* input_layernorm;           // (d)
  T* q_proj;                    // (H*hd, d)
  T* k_proj;                    // (KVH*hd, d)
  T* v_proj;                    // (KVH*hd, d)
  T* o_proj;                    // (d, H*hd)
  T* post_attention_layernorm;  // (d)
  T* router;                    // (E, d); (E*p, d) SoftMoE slots; (d_e, d) X-MoE projection
  T* router_noise;              // (E, d) GShard noise weights, else null
  T* router_experts;            // (E, d_e) X-MoE expert embeddings, else null
  T* router_log_scale;          // (1) X-MoE log(1/temperature), else null
  T* w1;                        // (E_local, ff, d)  gate projection
  T* w3;                        // (E_local, ff, d)  up projection
  T* w2;                        // (E_local, d, ff)  down projection
  T* shared_w1;                 // (S, sff, d)
  T* shared_w3;                 // (S, sff, d)
  T* shared_w2;                 // (S, d, sff)
};

template <typename T>
struct ModelWeights {
  T* embed_tokens;  // (V, d)
  std::vector<LayerWeights<T>> layers;
  T* final_norm;    // (d)
  T* lm_head;       // (V, d)
};

class ParamLayout;

// The dense gradients (every tensor but the routed experts) in the buckets the
// all-reduce moves them in, in the order backward finishes them: LM head and
// final norm, layers last to first, then the token embedding. Bucket b of L + 2
// is a list of [begin, end) element ranges. The trainer all-reduces these and
// the simulator (simulation/) prices them, so both see the same buckets.
std::vector<std::vector<std::pair<size_t, size_t>>> dense_gradient_buckets(const ParamLayout& layout);
// The bucket that MoeTransformer's backward hook grads_ready(group) completes:
// group num_layers (the LM head's) is bucket 0, layer k's is num_layers - k,
// group -1 (the embedding's) the last, num_layers + 1.
inline int dense_bucket_of_group(int num_layers, int group) {
  return group >= 0 ? num_layers - group : num_layers + 1;
}
// Overlapped, bucket b moves on thread b mod kDenseBucketThreads.
constexpr int kDenseBucketThreads = 8;

class ParamLayout {
 public:
  // Holds routed experts [first_expert, first_expert + num_local_experts) of every
  // layer; the defaults hold all of them (single process).
  explicit ParamLayout(const ModelConfig& cfg, int first_expert = 0, int num_local_experts = -1);

  size_t size() const { return size_; }  // total elements
  const std::vector<TensorSlot>& slots() const { return slots_; }
  const TensorSlot* find(const std::string& name) const;
  int first_expert() const { return first_expert_; }
  int num_local_experts() const { return num_local_experts_; }
  const ModelConfig& config() const { return cfg_; }

  template <typename T>
  ModelWeights<T> bind(T* base) const;

 private:
  ModelConfig cfg_;
  int first_expert_;
  int num_local_experts_;
  size_t size_ = 0;
  std::vector<TensorSlot> slots_;
  // Offsets of the bound pointers, in the order bind() lists the LayerWeights fields.
  struct LayerOffsets { size_t f[16]; };  // kAbsent when the tensor is not there
  static constexpr size_t kAbsent = ~size_t{0};
  std::vector<LayerOffsets> layer_offsets_;
  size_t embed_ = 0, final_norm_ = 0, lm_head_ = 0;
};

template <typename T>
ModelWeights<T> ParamLayout::bind(T* base) const {
  ModelWeights<T> w;
  w.embed_tokens = base + embed_;
  w.final_norm = base + final_norm_;
  w.lm_head = base + lm_head_;
  w.layers.resize(layer_offsets_.size());
  for (size_t l = 0; l < layer_offsets_.size(); ++l) {
    const size_t* f = layer_offsets_[l].f;
    LayerWeights<T>& L = w.layers[l];
    T** fields[16] = {&L.input_layernorm, &L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj,
                      &L.post_attention_layernorm, &L.router, &L.w1, &L.w3, &L.w2,
                      &L.shared_w1, &L.shared_w3, &L.shared_w2, &L.router_noise, &L.router_experts,
                      &L.router_log_scale};
    for (int i = 0; i < 16; ++i) *fields[i] = f[i] == kAbsent ? nullptr : base + f[i];
  }
  return w;
}

// The slots holding a non-finite value in `values` (layout.size() floats), as
// "name (count of numel), ..." -- the first four, then how many more; for the
// non-finite guard's log; `if_none` when every value is finite.
std::string non_finite_tensors(const ParamLayout& layout, const float* values, const char* if_none = "no tensor");

}  // namespace xd
