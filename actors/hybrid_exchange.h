// HybridExpertExchange: the networked Dispatch/Combine of the MoE layer for
// EP and HybridEP (docs/architecture.md, "Where a token goes").
// Dispatch walks the levels outermost first. At level l a token row stays put
// when its expert's owner is in this worker's level-l domain (that level's
// experts were all-gathered), or moves by all-to-all to the worker at the same
// offset in the owner's domain. After the last level the row sits at a worker
// that holds its expert (owned or gathered), grouped by expert. Combine walks
// the same path back. Domain sizes all 1 give hierarchical EP; a one-level
// topology of G workers gives flat EP. The route of each layer's Dispatch is
// kept for its Combine and for both backward exchanges.
// Rows to a peer can travel compressed: set_codecs() gives a codec per peer
// for each direction (toward the experts, back to the sources); a lossy codec
// changes the rows the other side computes with, raw (the default) nothing.
// Used by one compute thread; the Transport underneath is thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "cluster/topology.h"
#include "compression/codec.h"
#include "model/expert_exchange.h"
#include "transport/transport.h"

namespace xd {

class HybridExpertExchange final : public ExpertExchange<float> {
 public:
  // Called before a layer's Dispatch (wait for its gathered experts) and after
  // its DispatchBackward (its replica gradients are final).
  using LayerHook = std::function<void(int layer)>;

  HybridExpertExchange(Transport* transport, Topology topology, int num_experts,
                       std::chrono::milliseconds timeout = std::chrono::seconds(120));

  void set_step(uint32_t step) { step_ = step; }
  void set_hooks(LayerHook before_dispatch, LayerHook after_dispatch_backward);
  // Per peer rank: the codec of rows toward the experts (Dispatch and the
  // backward of Combine) and back to their sources (Combine and the backward
  // of Dispatch). Both vectors hold one pipeline per rank of the world.
  void set_codecs(std::vector<CodecPipeline> to_experts, std::vector<CodecPipeline> to_sources);
  // fp32 bytes of the rows sent since the last call, before any codec, per
  // peer rank: [0] toward the experts, [1] back to the sources.
  std::vector<std::array<double, 2>> take_raw_bytes();
  // Seconds spent encoding and decoding token rows since the last call.
  double take_codec_seconds();

  void to_experts(const ExchangeTag& tag, const float* rows, const std::vector<int>& counts,
                  int width, std::vector<float>* out, std::vector<int>* out_counts) override;
  void to_sources(const ExchangeTag& tag, const float* rows, int width,
                  std::vector<float>* out) override;
  const std::vector<int>& computed_experts() const override { return computed_; }

  // The worker holding expert e's weights as owner.
  int owner_of(int expert) const { return expert / experts_per_worker_; }
  // Seconds spent blocked in exchanges since the last call.
  double take_blocked_seconds();
  // The first failure of an exchange (a dead or silent peer), or ok.
  const Status& status() const { return status_; }

 private:
  struct Hop {
    std::vector<int> send_order;  // row indices in the order sent (grouped by member)
    std::vector<int> send_counts;  // per level-group member (coordinate order)
    std::vector<int> recv_counts;  // per member; own kept rows at own coordinate
  };
  struct Route {
    int rows_in = 0;               // plan rows at the source
    std::vector<Hop> hops;         // one per level
    std::vector<int> final_order;  // rows after the last hop, grouped by computed expert
    std::vector<int> out_counts;   // per computed expert
    std::vector<int> counts_in;    // the Dispatch counts, to check the backward
  };

  // Moves `data` (rows x width) one level along `hop`; `expert_ids` (may be
  // null) travel along. Forward: rows in send_order go out, the received
  // layout comes back (with `discover`, recv_counts are learnt from the
  // messages). Reverse: the received layout goes back and the rows return to
  // their order before the hop.
  Status move(const Tag& tag, int level, Hop* hop, bool forward, bool discover, int width,
              std::vector<float>* data, std::vector<int>* expert_ids);
  Status dispatch(int layer, const float* rows, const std::vector<int>& counts, int width,
                  std::vector<float>* data);
  Tag wire_tag(const ExchangeTag& t, bool forward_path, int level) const;
  void fail(const Status& st);

  Transport* transport_;
  std::vector<CodecPipeline> codec_to_experts_, codec_to_sources_;  // per rank; empty: raw
  std::vector<std::array<double, 2>> raw_bytes_;                   // per peer rank
  double codec_s_ = 0;
  Topology topology_;
  int rank_;
  int num_experts_, experts_per_worker_;
  std::vector<int> computed_;       // global expert ids computed here, ascending
  std::vector<int> computed_index_;  // expert -> index in computed_, or -1
  std::vector<Route> routes_;       // by layer
  std::chrono::milliseconds timeout_;
  uint32_t step_ = 0;
  LayerHook before_dispatch_, after_dispatch_backward_;
  double blocked_s_ = 0;
  Status status_;
};

}  // namespace xd
