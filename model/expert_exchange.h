// ExpertExchange: the Dispatch / Combine seam of the MoE layer (FSMoE Sec. 3.1).
// The MoE math calls it to move token rows to whichever worker computes each
// expert, and to bring results back. LocalExpertExchange keeps everything in
// process; the networked one, HybridExpertExchange in actors/ (EP, flat EP and
// HybridEP alike), implements the same interface, so the model code never
// changes.
//
// Every exchange is split in two: start_* hands the rows over and may return
// before they have moved; finish_* of the same tag blocks until they have
// arrived and hands the result back. Between the two the caller computes
// whatever does not depend on the result: that is how the FarSkip schedule
// hides communication (docs/overlap.md). An implementation that moves rows
// synchronously simply does the work in start_*. Each started tag is finished
// exactly once, and finish_* calls come in the order of their start_* calls
// per direction. One instance per worker compute thread; the calls are not
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

namespace xd {

// Identifies one exchange so concurrent ones never mix (layer, direction,
// pipeline chunk).
struct ExchangeTag {
  int layer = 0;
  int phase = 0;  // see ExchangePhase
  int chunk = 0;  // 0..r-1 with pipeline degree r (FSMoE Sec. 4)
  // Backward exchanges only: the forward chunks chunk..chunk+span-1 move as
  // one exchange, when the backward's degree is a divisor of the forward's.
  int span = 1;
  bool operator<(const ExchangeTag& o) const {
    return std::tie(layer, phase, chunk, span) < std::tie(o.layer, o.phase, o.chunk, o.span);
  }
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
  // Dispatch learns the route; the backward of Combine (same layer and chunk,
  // same counts) follows it. A backward exchange of span s > 1 carries its
  // chunks' rows one chunk after the other, with their counts one after the
  // other too (s x E); its `out` is grouped by computed expert, and within an
  // expert by chunk. Its to_sources rows come back in the same chunk order.
  virtual void start_to_experts(const ExchangeTag& tag, std::vector<T> rows, const std::vector<int>& counts,
                                int width) = 0;
  // `out` gets the rows this worker computes, grouped by the experts it
  // computes (in computed_experts() order), with `out_counts` per expert.
  virtual void finish_to_experts(const ExchangeTag& tag, std::vector<T>* out, std::vector<int>* out_counts) = 0;
  // Exact reverse of the to_experts exchange of the same layer and chunk:
  // `rows` in its `out` layout go back to their sources, into the order they
  // had there (A, width).
  virtual void start_to_sources(const ExchangeTag& tag, std::vector<T> rows, int width) = 0;
  virtual void finish_to_sources(const ExchangeTag& tag, std::vector<T>* out) = 0;
  // Global ids of the experts whose rows this worker receives, ascending.
  virtual const std::vector<int>& computed_experts() const = 0;
  // The worker that computes this worker's rows of `expert` (>= 0): rows of
  // two experts with the same destination may travel as one (grouped rows).
  // The default, a destination per expert, never groups.
  virtual int destination_of(int expert) const { return expert; }
  // HybridEP replicas: computed experts (by index into computed_experts())
  // whose weights arrive by the all-gather and whose weight gradients go
  // back to their owners. The MoE layer computes the owned experts first and
  // calls before_replicas(layer) before the first replica of each chunk (the
  // wait for the layer's gathered weights, which own-expert compute hides);
  // in backward it computes the replicas' weight gradients first and calls
  // replicas_backward_done(layer) once the last chunk's are final, before
  // the owned experts' (so their return overlaps that compute). The order of
  // experts changes no sum: each writes its own rows and gradients.
  virtual bool is_replica(size_t computed_index) const {
    (void)computed_index;
    return false;
  }
  virtual void before_replicas(int layer) { (void)layer; }
  // True when before_replicas(layer) would not block: the layer's gathered
  // weights are here. A peek, like landed(), for work while waiting.
  virtual bool replicas_landed(int layer) const {
    (void)layer;
    return true;
  }
  virtual void replicas_backward_done(int layer) { (void)layer; }
  // True when finish_* of this started tag would not block: its rows have
  // landed. A peek for the compute thread, which then does other ready work
  // instead of waiting (docs/overlap.md, "work while waiting"); it never
  // changes what finish_* returns. An exchange that moves rows in start_*
  // has always landed.
  virtual bool landed(const ExchangeTag& tag) const {
    (void)tag;
    return true;
  }

  // start then finish.
  void to_experts(const ExchangeTag& tag, const T* rows, const std::vector<int>& counts, int width,
                  std::vector<T>* out, std::vector<int>* out_counts);
  void to_sources(const ExchangeTag& tag, const T* rows, size_t num_rows, int width, std::vector<T>* out);
};

// Single process: every expert is computed here, rows stay where they are.
template <typename T>
class LocalExpertExchange final : public ExpertExchange<T> {
 public:
  explicit LocalExpertExchange(int num_experts);
  // Called by every start_to_experts (Dispatch and the backward of Combine)
  // with its tag, rows and counts before they move: for probes and
  // benchmarks that look at what a step routes where. May be empty.
  using Observer = std::function<void(const ExchangeTag&, const std::vector<T>& rows, const std::vector<int>& counts)>;
  void set_observer(Observer observer) { observer_ = std::move(observer); }
  void start_to_experts(const ExchangeTag& tag, std::vector<T> rows, const std::vector<int>& counts,
                        int width) override;
  void finish_to_experts(const ExchangeTag& tag, std::vector<T>* out, std::vector<int>* out_counts) override;
  void start_to_sources(const ExchangeTag& tag, std::vector<T> rows, int width) override;
  void finish_to_sources(const ExchangeTag& tag, std::vector<T>* out) override;
  const std::vector<int>& computed_experts() const override { return experts_; }
  int destination_of(int expert) const override {  // every expert computes here
    (void)expert;
    return 0;
  }

 private:
  struct Pending {
    std::vector<T> rows;
    std::vector<int> counts;
  };
  std::vector<int> experts_;
  Observer observer_;
  std::map<ExchangeTag, Pending> pending_;  // started, not finished
  // Per (layer, chunk) of a backward exchange of span > 1: its chunks'
  // counts, one after the other, to put its rows back in chunk order.
  std::map<std::pair<int, int>, std::vector<int>> span_counts_;
};

}  // namespace xd
