// ExpertExchange: the Dispatch / Combine seam of the MoE layer (FSMoE Sec. 3.1).
// The MoE math calls it to move token rows to whichever worker computes each
// expert, and to bring results back. LocalExpertExchange keeps everything in
// process; the networked one, HybridExpertExchange in actors/ (EP, flat EP and
// HybridEP alike), implements the same interface, so the model code never
// changes. One instance per
// worker compute thread; implementations need not be thread-safe.
#pragma once

#include <cstdint>
#include <vector>

namespace xd {

// Identifies one exchange so concurrent ones never mix (layer, direction).
struct ExchangeTag {
  int layer = 0;
  int phase = 0;  // see ExchangePhase
};

enum class ExchangePhase : int {
  kDispatch = 0,          // forward, tokens to experts
  kCombine = 1,           // forward, expert outputs back
  kCombineBackward = 2,   // backward, output grads to experts
  kDispatchBackward = 3,  // backward, input grads back
};

template <typename T>
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  // `rows` (A, width) are grouped by global expert with `counts` (E) rows each.
  // On return `out` holds the rows this worker computes, grouped by the experts
  // it computes (in computed_experts() order), with `out_counts` per expert.
  virtual void to_experts(const ExchangeTag& tag, const T* rows, const std::vector<int>& counts,
                          int width, std::vector<T>* out, std::vector<int>* out_counts) = 0;
  // Exact reverse of the to_experts call of the same layer: `rows` in the `out`
  // layout go back to their sources, into plan order (A, width).
  virtual void to_sources(const ExchangeTag& tag, const T* rows, int width,
                          std::vector<T>* out) = 0;
  // Global ids of the experts whose rows this worker receives, in order.
  virtual const std::vector<int>& computed_experts() const = 0;
};

// Single process: every expert is computed here, rows stay where they are.
template <typename T>
class LocalExpertExchange final : public ExpertExchange<T> {
 public:
  explicit LocalExpertExchange(int num_experts);
  void to_experts(const ExchangeTag& tag, const T* rows, const std::vector<int>& counts,
                  int width, std::vector<T>* out, std::vector<int>* out_counts) override;
  void to_sources(const ExchangeTag& tag, const T* rows, int width,
                  std::vector<T>* out) override;
  const std::vector<int>& computed_experts() const override { return experts_; }

 private:
  std::vector<int> experts_;
  std::vector<int64_t> rows_by_layer_;  // rows of the last to_experts per layer
};

}  // namespace xd
