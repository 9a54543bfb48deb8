// AdamW over one contiguous parameter block, with global-norm gradient clipping.
// The moments m and v share the parameter layout (model/param_layout.h), so a
// checkpoint can store them under the parameters' names. AdamW<float> updates
// in float on SIMD lanes (model/detail/adamw_kernel.h); AdamW<double> in
// double, element by element, the reference the float path is tested
// against. Not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace xd {

struct AdamWConfig {
  double learning_rate = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // max global L2 norm; <= 0 disables clipping
};

template <typename T>
class AdamW {
 public:
  // `no_decay` lists [begin, end) element ranges exempt from weight decay (norms).
  AdamW(size_t num_params, AdamWConfig config,
        std::vector<std::pair<size_t, size_t>> no_decay = {});

  // Clips `grads` in place to the configured global norm, then updates `params`.
  // `grad_norm_sq` is the squared global norm when the caller already reduced it
  // across workers; pass a negative value to compute it locally.
  // Returns the global gradient norm before clipping. `after_block`, when
  // set, is called with each block [begin, end) of kBlock elements right
  // after it is updated, in order, while it is still in cache (work fused
  // with the update, such as packing the next step's compressed experts).
  double step(T* params, T* grads, double learning_rate, double grad_norm_sq = -1.0,
              const std::function<void(size_t begin, size_t end)>& after_block = {});
  static constexpr size_t kBlock = 8192;

  std::vector<T>& first_moment() { return m_; }
  std::vector<T>& second_moment() { return v_; }
  const std::vector<T>& first_moment() const { return m_; }
  const std::vector<T>& second_moment() const { return v_; }
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t s) { step_count_ = s; }

 private:
  AdamWConfig config_;
  std::vector<T> m_, v_;
  // Maximal runs of elements that share their weight decay, in order: run k
  // ends (exclusive) at runs_[k].end. Built once, walked by every step.
  struct DecayRun {
    size_t end;
    bool decay;
  };
  std::vector<DecayRun> runs_;
  int64_t step_count_ = 0;
};

}  // namespace xd
