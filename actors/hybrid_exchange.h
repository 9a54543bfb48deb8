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
// Asynchronous: with set_overlapped(true) (the default) start_* queues the
// exchange on one of two comm threads -- rows toward the experts, rows back
// to their sources -- and returns; finish_* blocks until it is done. When
// only one level has all-to-all peers and the rows travel raw (EP over one
// level; HybridEP whose domains leave one level of A2A), no comm thread is
// needed: start_* sends from the caller's thread and finish_* receives on it
// ("direct", update_direct()), so a pipeline's chunks queue on the link back
// to back and a landed transfer costs no thread hand-off. With
// set_overlapped(false) start_* does the whole exchange on the caller's
// thread (FarSkip's "simple" implementation: the same messages, no overlap).
// An exchange with no all-to-all peer at any level (the domains span every
// level: every expert is held here) sends nothing; it runs on the caller's
// thread either way, sparing two thread hand-offs per exchange.
// The public calls come from one compute thread; the comm threads share
// the routes, byte counters and status under a mutex, and the Transport
// underneath is thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "cluster/topology.h"
#include "common/timeline.h"
#include "compression/codec.h"
#include "model/expert_exchange.h"
#include "transport/transport.h"

namespace xd {

namespace detail {
class WorkThread;
struct ExchangeHop;
struct ExchangeRoute;
}

// What the token rows exchanged with one peer rank cost, per direction
// ([0] toward the experts: Dispatch and the backward of Combine; [1] back to
// the sources).
struct TokenCodecFigures {
  std::array<double, 2> raw_bytes{};  // fp32 bytes of the rows sent, before any codec
  // CPU seconds encoding the rows sent to the peer and decoding the rows
  // received from it (the NMSE sample's decode not counted).
  std::array<CodecSeconds, 2> codec{};
  // A lossy codec's ||x - decoded||^2 and ||x||^2 over the first message of
  // the direction since the last take (a sample: one decode more a step).
  std::array<double, 2> error{}, signal{};
};

class HybridExpertExchange final : public ExpertExchange<float> {
 public:
  // Called on the compute thread: before_replicas, before a layer's
  // gathered replicas compute (HybridEP waits there for the layer's
  // all-gather; owned experts have computed meanwhile); after_replica_grads,
  // once a layer's replica gradients are final (their return starts).
  using LayerHook = std::function<void(int layer)>;
  // replicas_landed: whether before_replicas(layer) would return at once.
  using LayerQuery = std::function<bool(int layer)>;

  HybridExpertExchange(Transport* transport, Topology topology, int num_experts,
                       std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~HybridExpertExchange() override;

  void set_step(uint32_t step) { step_ = step; }
  // Waits until this worker's own messages of direct exchanges have left
  // (finish_* does not wait for them); called at the end of a step, before
  // anything could tear the transport down under them.
  void complete_sends();
  void set_before_replicas(LayerHook hook) { before_replicas_ = std::move(hook); }
  void set_replicas_landed(LayerQuery query) { replicas_landed_ = std::move(query); }
  void set_after_replica_grads(LayerHook hook) { after_replica_grads_ = std::move(hook); }
  // true (the default): exchanges run on the comm threads.
  void set_overlapped(bool overlapped);
  // Transfers (comm threads) and waits (compute thread) go here (may be null).
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }
  // Per peer rank: the codec of rows toward the experts (Dispatch and the
  // backward of Combine) and back to their sources (Combine and the backward
  // of Dispatch). Both vectors hold one pipeline per rank of the world.
  void set_codecs(std::vector<CodecPipeline> to_experts, std::vector<CodecPipeline> to_sources);
  // What the rows exchanged with each peer rank cost since the last call,
  // per peer rank (TokenCodecFigures).
  std::vector<TokenCodecFigures> take_token_figures();
  // Per level since the last call: the sum over this worker's A2A hops of
  // max(row bytes sent, row bytes received), before any codec. With routing
  // that is not uniform a hop lasts as long as its larger side; against the
  // rows sent (take_token_figures) it measures the imbalance.
  std::vector<double> take_peak_bytes();
  // Per peer rank, the link class its rows cross, of `classes`: the peak
  // bytes are then summed per link class, each hop's peers of a class as one
  // side each way (flat EP's one level spans every class). Before the first
  // exchange; by default the classes are this exchange's levels.
  void set_peer_link_classes(std::vector<int> class_of_peer, int classes);

  void start_to_experts(const ExchangeTag& tag, std::vector<float> rows, const std::vector<int>& counts,
                        int width) override;
  void finish_to_experts(const ExchangeTag& tag, std::vector<float>* out, std::vector<int>* out_counts) override;
  void start_to_sources(const ExchangeTag& tag, std::vector<float> rows, int width) override;
  void finish_to_sources(const ExchangeTag& tag, std::vector<float>* out) override;
  bool landed(const ExchangeTag& tag) const override;
  const std::vector<int>& computed_experts() const override { return computed_; }
  int destination_of(int expert) const override;
  bool is_replica(size_t computed_index) const override { return owner_of(computed_[computed_index]) != rank_; }
  void before_replicas(int layer) override {
    if (before_replicas_) before_replicas_(layer);
  }
  bool replicas_landed(int layer) const override { return !replicas_landed_ || replicas_landed_(layer); }
  void replicas_backward_done(int layer) override {
    if (after_replica_grads_) after_replica_grads_(layer);
  }

  // The worker holding expert e's weights as owner.
  int owner_of(int expert) const { return expert / experts_per_worker_; }
  // Seconds the compute thread spent blocked in finish_* since the last call:
  // [0] forward exchanges (Dispatch, Combine), [1] backward ones.
  std::array<double, 2> take_blocked_seconds();
  // The first failure of an exchange (a dead or silent peer), or ok.
  Status status() const;

 private:
  using Hop = detail::ExchangeHop;
  using Route = detail::ExchangeRoute;

  // One level's hop of `data` (rows x width) between its sends and its
  // receives (actors/hybrid_exchange_hop.cc). Forward: rows in send_order go
  // out, the received layout comes back (with `discover`, recv_counts are
  // learnt from the messages). Reverse: the received layout goes back and the
  // rows return to their order before the hop. Expert ids (Dispatch) travel
  // along when given, to both calls alike.
  struct HopInFlight {
    Tag tag;
    int level = 0;
    Hop* hop = nullptr;
    bool forward = true, discover = false;
    // No A2A peer at this level and the rows keep their order: the hop hands
    // its rows on untouched (every expert of the level is held here).
    bool passthrough = false;
    int width = 0;
    std::vector<int> group, in_counts, out_off;
    int me = 0, members = 0;
    std::shared_ptr<std::vector<float>> staged;
    std::shared_ptr<std::vector<int32_t>> staged_ids;
    std::vector<std::shared_ptr<RecvSlot>> slots;  // per member; null: no message
    std::vector<std::shared_ptr<Completion>> sends;
    double sent_at = 0;
  };
  struct HopWait {  // the time a receive blocked, and from when until when
    double seconds = 0, from = 0, until = 0;
  };
  Status send_hop(HopInFlight* h, std::vector<float>* data, const std::vector<int>* ids);
  Status receive_hop(HopInFlight* h, std::vector<float>* data, std::vector<int>* ids, bool wait_sends,
                     HopWait* waited);
  bool hop_landed(const HopInFlight& h) const;
  bool networked(const HopInFlight& h) const;  // some member gets a message

  struct Result {
    Status status;
    std::vector<float> rows;
    std::vector<int> counts;  // to experts: per computed expert
  };
  // One exchange on its way through the levels: toward the experts from the
  // outermost level in, back to the sources from the innermost out.
  struct Pass {
    ExchangeTag tag;
    uint32_t step = 0;
    int width = 0;
    bool to_experts = true;
    Route* route = nullptr;
    std::vector<int> counts;  // toward the experts: the caller's, per expert
    std::vector<float> data;
    std::vector<int> ids;     // Dispatch: each row's expert
    Status status;
    int levels_done = 0;
    std::unique_ptr<HopInFlight> in_flight;  // sent, its receives not taken
    double started = 0;
  };
  Pass begin_pass(const ExchangeTag& tag, std::vector<float> rows, const std::vector<int>& counts, int width,
                  uint32_t step);
  Hop dispatch_hop(int level, const std::vector<int>& ids) const;
  // Hops the pass through its levels; with `stop_after_send`, it returns once
  // a level with peers has sent, its receives left in pass->in_flight.
  void advance(Pass* pass, bool stop_after_send);
  Result conclude(Pass* pass);
  // The exchanges themselves; on a comm thread, or the caller's when not
  // overlapped. They publish into results_.
  void run_to_experts(const ExchangeTag& tag, std::vector<float> rows, const std::vector<int>& counts, int width,
                      uint32_t step);
  void run_to_sources(const ExchangeTag& tag, std::vector<float> rows, int width, uint32_t step);
  // Direct exchanges (direct_): start_* sends from the compute thread and
  // finish_* receives on it, no comm thread in between.
  void start_direct(const ExchangeTag& tag, std::vector<float> rows, const std::vector<int>& counts, int width);
  Result finish_direct(const ExchangeTag& tag);
  void update_direct();
  Result wait_result(const ExchangeTag& tag);
  // Counts `seconds` of the compute thread blocked on `tag`; traces from..until
  // unless empty.
  void note_wait(const ExchangeTag& tag, double seconds, double from, double until);
  void publish(const ExchangeTag& tag, Result result);
  template <typename F>
  void run_inline(const ExchangeTag& tag, F run);
  // Adds to the figures of the rows exchanged with `peer` in a direction
  // (0: toward the experts).
  void add_codec_seconds(int peer, int direction, CodecSeconds s);
  // With a lossy codec, once per peer, direction and step: decodes what
  // `encoded` will deliver and adds its error against `rows` (the NMSE sample).
  void sample_token_error(int peer, int direction, const CodecPipeline& codec, const float* rows, size_t count,
                          const EncodedTensor& encoded);
  // The Dispatch's route of the tag's layer and chunk; of a span, the routes
  // of its chunks merged (built by its backward of Combine).
  Route& route(const ExchangeTag& tag);
  Tag wire_tag(const ExchangeTag& t, bool forward_path, int level, uint32_t step) const;
  void fail(const Status& st);

  Transport* transport_;
  std::vector<CodecPipeline> codec_to_experts_, codec_to_sources_;  // per rank; empty: raw
  std::vector<TokenCodecFigures> figures_;                         // per peer rank; under mu_
  std::vector<double> peak_bytes_;                                 // per link class; under mu_
  std::vector<int> peer_class_;  // per rank, fixed before the first exchange; empty: the hop's level
  Topology topology_;
  std::vector<std::vector<int>> dispatch_member_;  // per level, per owner rank: the hop's member it goes to
  int rank_;
  int num_experts_, experts_per_worker_;
  std::vector<int> computed_;       // global expert ids computed here, ascending
  std::vector<int> computed_index_;  // expert -> index in computed_, or -1
  bool local_only_ = true;           // no all-to-all peer at any level
  std::chrono::milliseconds timeout_;
  uint32_t step_ = 0;             // compute thread
  LayerHook before_replicas_, after_replica_grads_;
  LayerQuery replicas_landed_;
  std::array<double, 2> blocked_s_{};  // compute thread
  Timeline* timeline_ = nullptr;
  bool direct_ = false;                                      // see start_direct
  std::map<ExchangeTag, Pass> direct_passes_;                // compute thread
  std::vector<std::shared_ptr<Completion>> direct_sends_;    // compute thread; checked at the next step

  mutable std::mutex mu_;          // guards what follows
  std::condition_variable done_;
  // By (layer, chunk, span); each route stays put while hops point into it
  // (held by pointer: ExchangeRoute is only declared here, its header being
  // an internal one).
  std::map<std::tuple<int, int, int>, std::unique_ptr<Route>> routes_;
  std::map<ExchangeTag, Result> results_;       // finished, not yet taken
  Status status_;
  // Last: destroyed first, so no queued exchange outlives the state above.
  std::unique_ptr<detail::WorkThread> to_experts_thread_, to_sources_thread_;
};

}  // namespace xd
