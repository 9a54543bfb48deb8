// ExpertCommunicator: HybridEP's asynchronous expert communicator (Fig. 10).
// During an optimizer step every layer's experts are queued, layer by layer
// as the update writes them, for the all-gather inside the expert domains
// (outer level first); layer k takes its replicas only when its Dispatch
// needs them, so the AG of later layers overlaps the compute of earlier
// ones. In the backward pass the replicas' gradients go back to their
// owners, level by level in reverse (a reduce-scatter), as soon as each
// layer's replica gradients are final. The transfers run on the
// communicator's own threads; wait_* calls come from the compute thread.
// Own experts' weights are read, and what comes back for them is added to
// their gradients in place once owned_grads_final(layer) says the compute
// thread is done with them; the caller must not touch a layer's replica
// gradients between start_reduce(layer) and wait_reduced(), nor its owned
// gradients between owned_grads_final(layer) and wait_reduced().
//
// Compression (set_codecs): each level's weights and gradients go through an
// ExpertCodecSpec. The SR base experts (the mean of each layer's experts) are
// re-synchronised by an all-reduce over the whole world, started after the
// gathers of a step so it overlaps that step's compute; the gathers of the
// next step use it, and before the first step it runs first. Every worker
// thus encodes and decodes against the same bits.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "actors/actor.h"
#include "cluster/topology.h"
#include "common/timeline.h"
#include "compression/expert_codec.h"
#include "model/moe_transformer.h"
#include "transport/communicator.h"
#include "transport/transport.h"

namespace xd {

class ExpertStreamCodec;
struct ExpertTensorRef;
struct PackSums;
namespace detail {
struct SignDeltaState;
class HeldBackGradients;
}

struct ExpertCodecOptions {
  std::vector<ExpertCodecSpec> gather;  // per level (the link class of the AG at that level)
  std::vector<ExpertCodecSpec> grad;    // per level
  int base_sync_every = 1;              // steps; 0: once, before the first step
  // Pack the first-level AG rows and the base share inside the optimizer
  // step (fused_encoder); false: a separate pass when the gather starts.
  bool fused_encode = true;
  // The base all-reduce runs inside `base_inner`, then across `base_outer`
  // (together the whole world; see hierarchical_all_reduce).
  Communicator* base_inner = nullptr;
  Communicator* base_outer = nullptr;
  // bf16 on the wire (fp32 sums) inside base_inner / across base_outer. The
  // base only has to hold the same bits everywhere, not to be the exact mean.
  bool base_inner_bf16 = false;
  bool base_outer_bf16 = false;
  // Across base_outer, sign-coded changes of the partial sums instead
  // (`base_codec: sign`, actors/detail/dense_all_reduce.h).
  bool base_outer_sign = false;
};

// What the codecs did at one level since the last take_codec_figures().
struct ExpertCodecFigures {
  double gather_raw_bytes = 0, grad_raw_bytes = 0;  // what raw floats would have sent
  double gather_error = 0, gather_signal = 0;       // reconstruction NMSE = error / signal
  double grad_error = 0, grad_signal = 0;
  // CPU seconds in the level's codecs: encoding (packing inside the
  // optimizer step included) and decoding, the relayed messages at the level
  // they were first sent at. Raw levels count nothing.
  CodecSeconds gather_codec, grad_codec;
  // The SR base's bf16 all-reduce: its casts' seconds and rounding error
  // (detail::CastFigures; the inner stage at the innermost level, the outer
  // stage at the outermost).
  CodecSeconds base_codec;
  double base_error = 0, base_signal = 0;
};

class ExpertCommunicator {
 public:
  ExpertCommunicator(Transport* transport, Topology topology, MoeTransformer<float>* model,
                     std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~ExpertCommunicator();

  // Before the first start_gather; all workers must pass the same options.
  Status set_codecs(const ExpertCodecOptions& options);
  // The base experts in use, (layers, 3, ff*d); empty without sr:.
  std::vector<float> base_copy() const;
  std::vector<ExpertCodecFigures> take_codec_figures();  // per level
  // Blocks until everything started so far (gathers, reduces, the base
  // all-reduce) has run.
  void drain();

  // Weights and gradient buffers of a gathered replica (layer, global expert).
  ExpertParams<float> replica(int layer, int expert);
  bool holds_replicas() const { return replicas_per_layer_ > 0; }
  size_t replica_bytes() const;  // weights of all replicas, all layers

  // Transfers and waits go here (may be null); set before the first start_gather.
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }
  // The optimizer step's hook (HybridEP Fig. 10a, SREncode fused with the
  // update). Call on the compute thread after wait_reduced() and before
  // start_gather(next_step). The function returned (empty when there is
  // nothing to do) takes each block [begin, end) of the model's parameters
  // right after the optimizer has written it, in order, and packs from it,
  // while it is in cache, this worker's share of the next base and its
  // first-level AG rows; it also sends each layer's first-level AG messages
  // as soon as the update has written that layer's own experts, while it
  // goes on with the later layers (HybridEP Fig. 10: the all-gather starts
  // as early as the weights allow).
  // start_gather(next_step) sends the rest and takes the receives.
  std::function<void(size_t begin, size_t end)> fused_encoder(uint32_t next_step);
  // Messages sent from rows the optimizer step packed, so far.
  int64_t fused_messages() const { return fused_messages_.load(); }
  // Layers whose first-level AG messages the optimizer step sent, so far.
  int64_t sent_during_update() const { return sent_during_update_.load(); }
  void start_gather(uint32_t step);  // every layer, in order
  void wait_gathered(int layer);     // blocks; its time is counted as AG wait
  bool gathered(int layer) const;    // wait_gathered(layer) would not block
  // The layer's replica gradients are final (compute thread): they leave
  // now; what comes back for owned experts is added once
  // owned_grads_final(layer) says the compute thread is done with them.
  void start_reduce(uint32_t step, int layer);
  void owned_grads_final(int layer);
  Status wait_reduced();             // every layer started this step
  void zero_replica_grads();

  std::vector<double> take_gather_wait_seconds();  // per layer, since last call
  double take_reduce_wait_seconds();
  Status status() const;

 private:
  struct LayerState {
    bool gathered = true, reduced = true;
    bool owned_final = true;  // false from zero_replica_grads() to owned_grads_final()
  };
  // One level's messages of one layer, sent and not yet received.
  struct LevelExchange {
    std::vector<std::shared_ptr<RecvSlot>> slots;
    std::vector<std::shared_ptr<Completion>> sends;
    double error = 0, signal = 0;  // what a lossy codec lost (ReconstructionError)
    CodecSeconds codec;
    double raw_bytes = 0;
    Status status;  // of the send
  };
  // One layer's replica-gradient return between its two halves: what the
  // receiving thread did without the owned experts' gradients, and what is
  // left for when they are final.
  struct PendingReduce {
    Status status = Status::internal("the replica-gradient return did not run");  // until reduce_replicas has
    // Inner levels' messages for the owned experts, innermost first.
    std::vector<std::unique_ptr<detail::HeldBackGradients>> held_back;
    int last_level = -1;                  // the outermost level with peers
    std::shared_ptr<LevelExchange> last;  // its messages, received into the owned experts
  };
  // One layer's first-level AG rows, packed by fused_encoder().
  struct PackedRows;
  // What fused_encoder() packed for start_gather(step); compute thread only.
  // A layer's first-level AG messages, handed to the sender thread.
  struct FirstSend {
    std::shared_ptr<LevelExchange> exchange;  // null: not sent yet
    std::shared_future<void> sent;
  };
  struct Prepared {
    uint32_t step = 0;
    std::shared_ptr<std::vector<float>> base_sums;  // (layers, 3, ff*d), or null
    std::vector<std::shared_ptr<PackedRows>> rows;  // per layer, or empty
    std::vector<FirstSend> sent;                    // per layer, or empty: sent during the update
  };
  // An all-gather message that crossed a lossy level, kept while its layer
  // gathers: an inner raw level passes it on as it arrived (a relay, in
  // actors/expert_relay.cc), and its receivers there decode it as its first
  // receivers did, into the same bits, instead of taking the decoded floats
  // raw.
  struct Relayed {
    int level = 0;   // where it was first sent
    int origin = 0;  // who sent it there
    size_t tensors = 0;  // expert tensors it carries
    std::shared_ptr<IncomingMessage> message;
  };
  // A message a peer relays at some level: (level, sender) where it was
  // first sent, and the workers whose experts it carries.
  struct RelaySource {
    int level = 0, origin = 0;
    std::vector<int> workers;
  };
  // How one level's all-gather runs with relays, fixed by the topology and
  // the codecs (plan_relays, in set_codecs); `relays` false: as without.
  struct RelayLevel {
    bool relays = false;
    std::vector<int> own;                                // workers in this worker's own message
    std::vector<std::vector<int>> peer_own;              // per AG peer, in its own message
    std::vector<std::vector<RelaySource>> peer_relayed;  // per AG peer, what it relays
  };
  // (level, sender) of the messages worker m passes on at level l, or none:
  // l's codec is lossy, or no lossy level before it reached m.
  std::vector<std::pair<int, int>> relay_origins(int m, int level) const;
  // The workers whose experts m sends in its own message at level l: those
  // it holds after the levels before, less what it relays.
  std::vector<int> own_message_workers(int m, int level) const;
  void plan_relays();
  // Level l of one layer's all-gather with relays: this worker's own message
  // through l's codec, and every message in `kept` as it arrived; those
  // relayed to this worker are decoded and added to `kept`.
  Status relay_gather_level(uint32_t step, int layer, int level, std::vector<Relayed>* kept);
  FirstSend post_first_send(uint32_t step, int layer, std::shared_ptr<PackedRows> rows);
  std::function<void(size_t, size_t)> packer(uint32_t next_step);
  // Where this worker's experts' (layer, which) block, (experts per worker,
  // ff*d), starts in the model's parameters.
  size_t own_block(int layer, int which);
  // Every level in order; the first level with peers may have been sent
  // already (`first_sent`, or null), or its rows packed (`rows`, or null).
  Status gather_layer(uint32_t step, int layer, LevelExchange* first_sent, PackedRows* rows);
  // Every level's sends, and the receives of all but the outermost, with the
  // owned experts' shares held back: nothing here waits for the owned
  // gradients, so the next layer's return follows at once.
  Status reduce_replicas(uint32_t step, int layer, const std::shared_ptr<LevelExchange>& first_sent,
                         PendingReduce* pending);
  // Once the owned gradients are final: the held-back shares, then the outermost level's.
  Status reduce_owned(int layer, PendingReduce* pending);
  // Level l's own gather message of one layer to every AG peer: the experts of
  // `workers` (by default all it holds after the outer levels; a relaying
  // level's: route.own), with the optimizer step's packed `rows` if any.
  Status send_gather_level(uint32_t step, int layer, int level, LevelExchange* x, PackedRows* rows = nullptr,
                           const std::vector<int>* workers = nullptr);
  int first_gather_level() const;  // the outermost level with AG peers, or -1
  bool base_due(uint32_t step) const;
  std::vector<float> base_share();  // this worker's experts summed per (layer, which)
  // With `kept`, every message received at a lossy level is kept for relays.
  Status receive_gather_level(int layer, int level, LevelExchange* x, std::vector<Relayed>* kept = nullptr);
  Status send_reduce_level(uint32_t step, int layer, int level, LevelExchange* x);
  // With `held_back` (an outer level still sends after this one), what the
  // peers send for this worker's own experts goes there instead; without,
  // into the owned gradients, which the caller has waited to be final.
  Status receive_reduce_level(int layer, int level, LevelExchange* x,
                              std::unique_ptr<detail::HeldBackGradients>* held_back);
  Status wait_owned_final(int layer);
  Status receive_level(int level, LevelExchange* x, bool gather,
                       const std::function<std::vector<ExpertTensorRef>(int peer)>& refs_of,
                       std::vector<Relayed>* kept = nullptr);
  std::vector<ExpertTensorRef> gather_refs(int layer, const std::vector<int>& workers);
  std::vector<ExpertTensorRef> grad_refs(int layer, const std::vector<int>& workers);
  // Workers whose experts m holds after the AG of levels < l (W_{l-1}(m)).
  std::vector<int> held_after(int m, int level) const;
  // Owned (in the model) or gathered (replica store); which: 0 w1, 1 w3, 2 w2.
  float* tensor_of(int layer, int expert, int which, bool gradient);
  float* weights_of(int layer, int expert, int which);
  float* grads_of(int layer, int expert, int which);
  void finish(int layer, bool gather, const Status& st);
  // Sums every worker's `sums` in place, divides by E and installs the result.
  Status sync_base(uint32_t step, std::vector<float>& sums);
  uint64_t tensor_key(int layer, int expert, int which) const;
  const float* base_of(int layer, int which) const;

  Transport* transport_;
  Topology topology_;
  MoeTransformer<float>* model_;
  std::chrono::milliseconds timeout_;
  int rank_, experts_per_worker_, layers_;
  size_t expert_floats_;  // ff * d, one projection
  int replicas_per_layer_ = 0;
  std::vector<int> replica_slot_;  // expert -> slot, or -1
  std::vector<float> replica_weights_, replica_grads_;  // (layers, slots, 3, ff*d)

  // Codecs, per level; used on the actor and sender threads under codec_mu_.
  std::mutex codec_mu_;
  std::vector<std::unique_ptr<ExpertStreamCodec>> gather_codecs_, grad_codecs_;
  std::vector<RelayLevel> relay_levels_;  // per level; set with the codecs
  ExpertCodecOptions codec_options_;
  bool uses_base_ = false;
  bool first_gather_ = true;  // caller's thread (start_gather)
  Prepared prepared_;         // caller's thread (fused_encoder, start_gather)
  std::atomic<int64_t> fused_messages_{0};
  std::atomic<int64_t> sent_during_update_{0};
  std::vector<float> base_;  // (layers, 3, ff*d) with sr:, else empty; written on the actor thread under mu_
  Status base_status_;       // actor thread only: a failed base all-reduce
  std::unique_ptr<detail::SignDeltaState> base_sign_;  // actor thread only: base_codec sign's copies
  std::atomic<uint64_t> base_version_{0};  // counts the installed bases

  mutable std::mutex mu_;
  std::vector<ExpertCodecFigures> figures_;
  std::condition_variable cv_;
  bool stopping_ = false;  // the destructor runs: waits for owned gradients end (under mu_)
  std::vector<LayerState> state_;
  std::vector<double> gather_wait_;
  double reduce_wait_ = 0;
  Status status_;
  Timeline* timeline_ = nullptr;
  std::unique_ptr<Actor> actor_;   // the comm thread: receives, deeper levels, the base
  std::unique_ptr<Actor> sender_;  // first-level sends, so they never queue behind receives
  // What of each layer's gradient return waits for the owned experts'
  // gradients, so that it never holds up the next layer's on actor_.
  std::unique_ptr<Actor> owned_;
};

}  // namespace xd
