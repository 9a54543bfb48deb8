#include "coordinator/detail/step_timeline.h"

#include <algorithm>
#include <array>

#include "cluster/topology.h"
#include "common/check.h"
#include "coordinator/detail/link_queue.h"
#include "model/param_layout.h"

namespace xd::detail {

namespace {

// One candidate at one pair of pipeline degrees. The constructor prices
// every transfer as a route of hops (plan_levels: the token A2As, the AG and
// the RS, level by level; plan_dense: the dense buckets, the SR base and the
// norm's sum) and the compute terms (plan_compute); run() then walks the
// compute stream through the forward, the backward and the step's tail,
// each link a queue in wall time beside it.
class StepTimeline {
 public:
  StepTimeline(const Workload& w, const std::vector<int>& level_sizes, const std::vector<LinkModel>& links,
               const std::vector<int>& domain_sizes, double memory_cap_bytes,
               const std::vector<LinkCodecCost>& link_codecs, int r, int rb, bool late)
      : w_(w),
        level_sizes_(level_sizes),
        links_(links),
        link_codecs_(link_codecs),
        r_(r),
        rb_(rb),
        span_(r / rb),
        late_(late),
        num_levels_(static_cast<int>(level_sizes.size())),
        layers_(w.num_moe_layers),
        n_(w.experts_per_worker) {
    XD_CHECK(Topology::check(level_sizes, domain_sizes).is_ok());
    XD_CHECK(r >= 1 && rb >= 1 && r % rb == 0);
    XD_CHECK(links.size() == level_sizes.size());
    c_.domain_sizes = domain_sizes;
    c_.pipeline_degree = r;
    c_.backward_pipeline_degree = rb;
    c_.level_bytes.assign(num_levels_, 0.0);
    c_.level_messages.assign(num_levels_, 0.0);
    plan_levels(domain_sizes);
    plan_memory(memory_cap_bytes);
    plan_dense();
    plan_compute(domain_sizes);
  }

  PlanCandidate run() {
    start_gathers();
    forward();
    backward();
    finish();
    return std::move(c_);
  }

 private:
  void plan_levels(const std::vector<int>& domain_sizes);
  void plan_memory(double memory_cap_bytes);
  Route all_reduce(double bytes, bool base, double times, double* sent_total = nullptr,
                   double* messages_total = nullptr);
  void plan_dense();
  void plan_compute(const std::vector<int>& domain_sizes);

  double send(double at, const Route& route) {
    for (const Hop& h : route) at = link_[h.level].send(at, h);
    return at;
  }
  void compute(double dt) {
    t_ += dt;
    c_.compute_s += dt;
  }
  void wait_for(double done) {
    if (done <= t_) return;
    c_.exposed_a2a_s += done - t_;
    t_ = done;
  }
  double a2a(const Route& route, double bytes, double* free);
  Connectivity connectivity(int k) const {
    return w_.connectivity.empty() ? Connectivity::kRegular
                                   : w_.connectivity[std::min<size_t>(k, w_.connectivity.size() - 1)];
  }
  void release_bucket(int group) {  // MoeTransformer's grads_ready(group)
    if (w_.overlapped) dense_done_ = std::max(dense_done_, send(t_, bucket_[dense_bucket_of_group(layers_, group)]));
  }
  void start_gathers();
  void forward();
  void backward();
  void finish();

  const Workload& w_;
  const std::vector<int>& level_sizes_;
  const std::vector<LinkModel>& links_;
  const std::vector<LinkCodecCost>& link_codecs_;
  const int r_, rb_;
  const int span_;  // forward chunks per backward exchange
  bool late_;       // the replicas' weight gradients after the embedding's (where it applies: plan_levels)
  const int num_levels_, layers_;
  const double n_;  // experts per worker
  PlanCandidate c_;

  // One A2A toward the experts (Dispatch, backward of Combine) and one back
  // to the sources (Combine, backward of Dispatch) of one MoE layer, level by
  // level (outer first toward the experts), each through its token codec;
  // one layer's AG (outer level first, forwarding what the outer levels
  // gathered) and its RS (inner level first). Codec time rides on the hop.
  Route to_experts_chunk_, to_sources_chunk_, ag_layer_, rs_layer_;
  Route to_experts_span_, to_sources_span_;  // a backward exchange: span_ chunks, one latency
  double to_experts_chunk_bytes_ = 0, to_sources_chunk_bytes_ = 0;  // sent per chunk, all levels
  double held_ = 0;                 // experts per layer incl. own
  double kept_weights_ = 1;         // of each layer's weight gradients, computed with its layer
  bool base_sync_ = false;
  int a2a_levels_ = 0;              // levels with all-to-all peers
  double a2a_chunk_messages_ = 0;   // one chunk of one direction: a message to each peer of every level
  bool raw_tokens_ = true;          // no token codec on any level

  std::vector<Route> bucket_;  // the dense buckets, in the order backward finishes them
  std::vector<double> bucket_sent_, bucket_messages_;  // what a worker sends for each bucket, all levels
  Route base_, norm_sum_;
  bool outer_base_bf16_ = false;  // the base crosses the outer stage in bf16 (all_reduce)

  double expert_fwd_ = 0, expert_bwd_ = 0, bwd_scale_ = 0, attention_fwd_ = 0, qkv_fwd_ = 0;

  // The timeline.
  std::vector<LinkPair> link_;
  std::vector<double> gathered_;  // when each layer's AG lands
  bool direct_ = false;           // chunks queued on the link as they start (a2a)
  double t_ = 0, to_experts_free_ = 0, to_sources_free_ = 0;
  double dense_done_ = 0, rs_done_ = 0, norm_done_ = -1;
  bool norm_in_backward_ = false;
};

}  // namespace

void StepTimeline::plan_levels(const std::vector<int>& domain_sizes) {
  double held_per_worker = 1;  // every worker computes the experts of its domains: n times their sizes
  for (int s : domain_sizes) held_per_worker *= s;
  // A measured F, else this candidate's from the routing probe: its domains
  // decide which rows cross which level.
  const std::vector<double> imbalance = a2a_imbalance_for(w_.a2a_imbalance, w_.routed_a2a_imbalance, domain_sizes);
  const std::vector<GatherHop> gather = expert_gather_hops(n_ * w_.expert_bytes, domain_sizes, link_codecs_);
  double relayed_origins = 0;  // blocks of lossy outer levels a raw inner level relays, per peer
  for (int l = 0; l < num_levels_; ++l) {
    const LinkModel& link = links_[l];
    const LinkCodecCost codec = link_codecs_.empty() ? LinkCodecCost{} : link_codecs_[l];
    const int sf = level_sizes_[l], s = domain_sizes[l];
    const int a2a_msgs = sf / s - 1;
    const double a2a_bytes = w_.token_bytes * (1.0 - double(s) / sf);
    const std::array<double, 2> share = grouped_row_share(w_, n_ * held_per_worker);
    const double to_experts_bytes = a2a_bytes * share[0], to_sources_bytes = a2a_bytes * share[1];
    raw_tokens_ = raw_tokens_ && codec.dispatch_fraction == 1 && codec.combine_fraction == 1 &&
                  codec.dispatch_s_per_byte == 0 && codec.combine_s_per_byte == 0;
    if (a2a_msgs > 0) {
      ++a2a_levels_;
      // Uneven routing: the pair's heavier egress carries (and codes) F
      // times the mean rows (LinkPair).
      const double f = l < static_cast<int>(imbalance.size()) ? std::min(2.0, imbalance[l]) : 1.0;
      const double dispatch_s =
          to_experts_bytes / r_ * (link.beta_s_per_byte * codec.dispatch_fraction + codec.dispatch_s_per_byte);
      const double combine_s =
          to_sources_bytes / r_ * (link.beta_s_per_byte * codec.combine_fraction + codec.combine_s_per_byte);
      to_experts_chunk_.push_back({l, dispatch_s, link.alpha_s, f, 2 - f});
      to_sources_chunk_.insert(to_sources_chunk_.begin(), Hop{l, combine_s, link.alpha_s, 2 - f, f});
      to_experts_chunk_bytes_ += to_experts_bytes / r_ * codec.dispatch_fraction;
      to_sources_chunk_bytes_ += to_sources_bytes / r_ * codec.combine_fraction;
    }
    // The replicas' raw bytes, through the AG and RS codecs of this level
    // (the AG's on the wire and its codec time: expert_gather_hops).
    const double ag_bytes = gather[l].raw_bytes * (s - 1);
    const double ag_wire = gather[l].wire_bytes * (s - 1), ag_codec_s = gather[l].codec_s * (s - 1);
    if (s > 1) {
      ag_layer_.push_back({l, ag_wire * link.beta_s_per_byte + ag_codec_s, link.alpha_s});
      rs_layer_.insert(rs_layer_.begin(),
          Hop{l, ag_bytes * (link.beta_s_per_byte * codec.grad_fraction + codec.grad_s_per_byte), link.alpha_s});
      base_sync_ = base_sync_ || codec.gather_against_base;
    }
    c_.level_bytes[l] += layers_ * (2 * (to_experts_bytes * codec.dispatch_fraction +
                                         to_sources_bytes * codec.combine_fraction) + ag_wire +
                                    ag_bytes * codec.grad_fraction);
    // Each token direction runs forward and backward; the AG's codec time
    // counts one encode per peer (exact at s = 2, the lossy outer level).
    c_.codec_cpu_s += layers_ * (2 * (to_experts_bytes * codec.dispatch_s_per_byte +
                                      to_sources_bytes * codec.combine_s_per_byte) + ag_codec_s +
                                 ag_bytes * codec.grad_s_per_byte);
    // A token exchange sends each peer of the level a message per chunk, r
    // a direction forward and rb backward. The AG sends each domain peer the
    // worker's block and, on a raw level below lossy ones, each lossy
    // block as it arrived (one per origin: ExpertCommunicator's relays);
    // the replica gradients go back a message per peer.
    const double relayed = codec.gather_coded() ? 0.0 : relayed_origins;
    const double ag_messages = (s - 1) * (1.0 + relayed), rs_messages = s - 1;
    a2a_chunk_messages_ += a2a_msgs;
    c_.level_messages[l] += layers_ * (2.0 * (r_ + rb_) * a2a_msgs + ag_messages + rs_messages);
    if (s > 1) relayed_origins = codec.gather_relayed() ? relayed_origins + (s - 1) : relayed_origins * s;
  }
  auto spanned = [this](Route route) {
    for (Hop& h : route) h.busy *= span_;
    return route;
  };
  to_experts_span_ = spanned(to_experts_chunk_);
  to_sources_span_ = spanned(to_sources_chunk_);
  held_ = n_ * held_per_worker;  // experts per layer incl. own
  // Late replica weight gradients need replicas and the overlapped backward
  // (MoeTransformer::BackwardHooks): their share of the weight gradients
  // moves after the embedding's bucket, each layer's sent when done.
  late_ = late_ && w_.overlapped && !rs_layer_.empty();
  c_.replica_weights_late = late_;
  c_.tokens_once_per_worker = w_.grouped_rows;
  kept_weights_ = late_ ? n_ / held_ : 1.0;
}

void StepTimeline::plan_memory(double memory_cap_bytes) {
  c_.gathered_bytes = (held_ - n_) * w_.expert_bytes * layers_;
  c_.feasible = c_.gathered_bytes <= memory_cap_bytes * (1 + 1e-12);
  if (!c_.feasible)
    c_.why_infeasible = "gathered experts need " + std::to_string(static_cast<long long>(c_.gathered_bytes)) +
                        " bytes per worker, above the memory cap of " +
                        std::to_string(static_cast<long long>(memory_cap_bytes));
}

// Hierarchical all-reduce of dense gradients: reduce-scatter inner level
// first, on the shard left by the inner levels, then all-gather back. Each
// phase is one round while the blocks are small, a ring of sf - 1 rounds
// from Communicator's ring threshold on; dense_grad codecs scale the bytes.
// The SR base (one expert per layer, base_syncs_per_step times) is its own
// all-reduce on the same links, in bf16 on the stage of a level whose AG
// codes against it, as the runtime sends it: the inner stage is the
// innermost level, the outer stage every other level.
// `bytes` of dense gradients, or of the base (`base`): a reduce-scatter
// hop per level, inner first, then the all-gathers back, or one hop where
// the runtime all-reduces in one round (dense_stage); adds its bytes, and
// its messages (sf - 1 a phase: one to each other member at once, or one
// to the next in each round of a ring) `times` over, per level, and their
// sums to *sent_total and *messages_total when given. (Blocks above the
// collectives' 4 MB message size and an outer stage spanning several levels
// send a few more than this counts.)
Route StepTimeline::all_reduce(double bytes, bool base, double times, double* sent_total, double* messages_total) {
  auto count = [&](int l, double sent, double messages) {
    c_.level_bytes[l] += sent;
    c_.level_messages[l] += times * messages;
    if (sent_total) *sent_total += sent;
    if (messages_total) *messages_total += messages;
  };
  Route up, down;
  double shard = bytes;
  for (int l = num_levels_ - 1; l >= 0; --l) {
    const int sf = level_sizes_[l];
    const bool bf16 = l == num_levels_ - 1 ? !link_codecs_.empty() && link_codecs_[l].gather_against_base
                                           : outer_base_bf16_;
    // base_codec: sign (outer stage): a sign bit a float, a fp32 scale per
    // 1024 and a bit per 1024, to every other member in one round.
    const bool sign = base && bf16 && l < num_levels_ - 1 && w_.base_outer_sign;
    const double fraction = sign ? (1.0 + 33.0 / 1024) / 32
                            : base ? (bf16 ? 0.5 : 1.0)
                                   : dense_wire_fraction(link_codecs_, l);
    if (sf > 1 && shard > 0) {
      const DenseStage stage = sign ? DenseStage::kOneRound : dense_stage(level_sizes_, l, shard);
      if (stage == DenseStage::kOneRound) {
        const double sent = (sf - 1) * shard * fraction;
        up.push_back({l, links_[l].beta_s_per_byte * sent, links_[l].alpha_s});
        count(l, sent, sf - 1);
        continue;  // every member holds the whole sum: nothing left to split
      }
      const double sent = 2.0 * (sf - 1) / sf * shard * fraction;
      const Hop half{l, links_[l].beta_s_per_byte * sent / 2,
                     (stage == DenseStage::kRing ? sf - 1 : 1) * links_[l].alpha_s};
      up.push_back(half);
      down.insert(down.begin(), half);
      count(l, sent, 2.0 * (sf - 1));
    }
    shard /= sf;
  }
  up.insert(up.end(), down.begin(), down.end());
  return up;
}

void StepTimeline::plan_dense() {
  for (int l = 0; l + 1 < num_levels_ && !link_codecs_.empty(); ++l)
    outer_base_bf16_ = outer_base_bf16_ || link_codecs_[l].gather_against_base;
  // The buckets backward finishes (model/param_layout.h): the LM head's, one
  // per layer, the embedding's (dense_bucket_of_group numbers them).
  std::vector<double> bucket_bytes(layers_ + 2, w_.dense_param_bytes / (layers_ + 2));
  if (w_.vocab_bytes > 0 && w_.dense_param_bytes > 2 * w_.vocab_bytes) {
    bucket_bytes.assign(layers_ + 2, (w_.dense_param_bytes - 2 * w_.vocab_bytes) / layers_);
    bucket_bytes.front() = bucket_bytes.back() = w_.vocab_bytes;
  }
  for (double bytes : bucket_bytes) {
    bucket_sent_.push_back(0);
    bucket_messages_.push_back(0);
    bucket_.push_back(all_reduce(bytes, false, 1.0, &bucket_sent_.back(), &bucket_messages_.back()));
    c_.allreduce_s += total(bucket_.back());
  }
  // base_bytes holds base_syncs_per_step already; its messages come that
  // many times a step.
  const double base_bytes = base_sync_ ? w_.base_syncs_per_step * w_.expert_bytes * layers_ : 0.0;
  if (base_bytes > 0) base_ = all_reduce(base_bytes, true, w_.base_syncs_per_step);
  c_.allreduce_s += total(base_);
  // The expert norm's sum: one round per level, inner first.
  for (int l = num_levels_ - 1; l >= 0; --l)
    if (level_sizes_[l] > 1) {
      norm_sum_.push_back({l, 0.0, links_[l].alpha_s});
      c_.level_messages[l] += level_sizes_[l] - 1;
    }
  c_.allreduce_s += total(norm_sum_);
}

void StepTimeline::plan_compute(const std::vector<int>& domain_sizes) {
  // Held experts cost GEMM calls: 3 forward, 6 backward each, per chunk.
  // Their flops are the busiest worker's, whom each layer's exchanges wait for.
  const ExpertLoad load = expert_load_for(w_.routed_expert_load, domain_sizes);
  c_.expert_imbalance = load.layers_busiest;
  c_.expert_wait_s = layers_ * (w_.expert_fwd_s + w_.expert_bwd_s) * (load.layers_busiest - load.busiest_worker);
  expert_fwd_ = w_.expert_fwd_s * c_.expert_imbalance / r_ + 3 * held_ * w_.gemm_overhead_s;
  expert_bwd_ = w_.expert_bwd_s * c_.expert_imbalance / r_ + 6 * held_ * w_.gemm_overhead_s;
  bwd_scale_ = w_.pre_expert_fwd_s > 0 ? w_.pre_expert_bwd_s / w_.pre_expert_fwd_s : 2.0;
  attention_fwd_ = std::max(0.0, w_.pre_expert_fwd_s - w_.shared_fwd_s);  // with the router
  qkv_fwd_ = std::min(w_.attention_qkv_fwd_s, attention_fwd_);
}

// Starts an A2A chunk now; returns when it lands. Not overlapped, compute
// waits for it at once, and then for the exchange's own packing, sending,
// receiving and unpacking of `bytes` in a message to each peer: it runs on
// the compute thread (the probe's transport CPU per message and per byte).
double StepTimeline::a2a(const Route& route, double bytes, double* free) {
  *free = direct_ ? std::max(*free, send(t_, route)) : send(std::max(t_, *free), route);
  c_.a2a_s += total(route);
  if (!w_.overlapped) {
    wait_for(*free);
    const double cpu = w_.exchange_cpu_s_per_byte * bytes + w_.exchange_cpu_s_per_message * a2a_chunk_messages_;
    wait_for(t_ + cpu);
    c_.exchange_cpu_s += cpu;
  }
  return *free;
}

// The iteration as a timeline of the compute stream. Every transfer crosses
// its levels' links hop by hop, each link a FIFO queue in wall time. The two
// A2A directions each run one chunk at a time, as the runtime's two exchange
// threads do (every chunk pays every level's alpha), but where the runtime
// exchanges direct (overlapped, one level of peers, raw rows:
// actors/hybrid_exchange.h): the compute thread queues every chunk on the
// link as it starts, so chunks leave back to back and their latencies
// overlap. Every layer's AG leaves at the start, the SR base behind them.
void StepTimeline::start_gathers() {
  direct_ = w_.overlapped && a2a_levels_ == 1 && raw_tokens_;
  link_.resize(num_levels_);
  gathered_.assign(layers_, 0.0);
  for (int k = 0; k < layers_ && !ag_layer_.empty(); ++k) gathered_[k] = send(0, ag_layer_);
  if (!base_.empty()) send(0, base_);
}

// Attention, router, Dispatch, experts and Combine, layer by layer, in the
// order of docs/overlap.md ("The forward schedule"), then the LM head.
void StepTimeline::forward() {
  double combined = 0;  // when the previous layer's Combine lands
  for (int k = 0; k < layers_; ++k) {
    const Connectivity conn = connectivity(k);
    if (!farskip_attention(conn)) wait_for(combined);
    compute(qkv_fwd_);                   // attention (a)
    // Work while waiting: attention (b) but its router runs while
    // Combine(k-1) is still in flight.
    double attention_b = attention_fwd_ - qkv_fwd_;  // with the router
    if (w_.overlapped && farskip_attention(conn) && combined > t_) {
      const double early = std::min(std::max(0.0, attention_b - w_.router_fwd_s), combined - t_);
      compute(early);
      attention_b -= early;
    }
    wait_for(combined);
    std::vector<double> dispatched(r_);
    auto route = [&] {
      for (int i = 0; i < r_; ++i) dispatched[i] = a2a(to_experts_chunk_, to_experts_chunk_bytes_, &to_experts_free_);
    };
    // The last layer under FarSkip MoE: the shared experts take Dispatch's
    // place, attention (b) but the router runs while Dispatch is still in
    // flight after them, and what is left of it hides the Combine.
    const bool last_experts_first = k + 1 == layers_ && farskip_moe(conn);
    double attention_late = 0;
    if (farskip_moe(conn)) route();
    if (last_experts_first) {
      const double router = std::min(attention_b, w_.router_fwd_s);
      compute(router);
      compute(w_.shared_fwd_s);
      const double rest = attention_b - router;
      const double early = w_.overlapped ? std::min(rest, std::max(0.0, dispatched[0] - t_)) : 0.0;
      compute(early);
      attention_late = rest - early;
    } else {
      compute(attention_b);  // attention (b), router
    }
    if (!farskip_moe(conn)) route();
    // The shared experts take the place of a Dispatch still in flight, but
    // in the last layer, whose Combine only they can hide (unless FarSkip
    // MoE has put them first, above).
    const bool shared_first = !last_experts_first && w_.overlapped && k + 1 < layers_ && dispatched[0] > t_;
    if (shared_first) compute(w_.shared_fwd_s);
    // The layer's experts must have landed.
    const double wait = std::max(0.0, gathered_[k] - t_);
    t_ += wait;
    c_.exposed_ag_s += wait;
    for (int i = 0; i < r_; ++i) {
      wait_for(dispatched[i]);
      compute(expert_fwd_);
      combined = a2a(to_sources_chunk_, to_sources_chunk_bytes_, &to_sources_free_);
    }
    compute(attention_late);
    if (!shared_first && !last_experts_first) compute(w_.shared_fwd_s);
  }
  wait_for(combined);
  compute(w_.post_s);
}

// The backward, last layer first (docs/overlap.md, "The backward
// schedule"): each dense bucket leaves as soon as backward has finished it
// (overlapped), each layer's replica gradients when its experts are done.
void StepTimeline::backward() {
  // Overlapped with no replicas, the norm's sum leaves as soon as layer 0's
  // experts are done (their gradients are final then), and layer 0's weight
  // gradients wait until the embedding's bucket has left, to hide the last
  // buckets' flight (MoeTransformer::BackwardHooks).
  norm_in_backward_ = w_.overlapped && rs_layer_.empty();
  release_bucket(layers_);  // the LM head's
  for (int k = layers_ - 1; k >= 0; --k) {
    const Connectivity conn = connectivity(k);
    // Each backward exchange carries `span` forward chunks: their bytes
    // leave as one transfer, paying the latency once.
    std::vector<double> to_experts(rb_);
    for (int i = 0; i < rb_; ++i)  // backward of Combine
      to_experts[i] = a2a(to_experts_span_, span_ * to_experts_chunk_bytes_, &to_experts_free_);
    // With replicas (HybridEP) the attention backward waits until their
    // gradients have left.
    const bool attention_after_experts = farskip_moe(conn) && !rs_layer_.empty();
    if (farskip_moe(conn) && !attention_after_experts) compute(attention_fwd_ * bwd_scale_);
    // The shared experts' backward takes the place of a Combine backward
    // still in flight.
    const bool shared_first = w_.overlapped && to_experts[0] > t_;
    if (shared_first) compute(w_.shared_fwd_s * bwd_scale_);
    double returned = t_;
    for (int i = 0; i < rb_; ++i) {
      wait_for(to_experts[i]);
      compute(span_ * expert_bwd_ / 2);    // input gradients, chunk by chunk
      returned = a2a(to_sources_span_, span_ * to_sources_chunk_bytes_, &to_sources_free_);  // backward of Dispatch
      if (k > 0 || !norm_in_backward_) compute(span_ * expert_bwd_ / 2 * kept_weights_);  // weight gradients
    }
    // This layer's replica gradients go home.
    if (!rs_layer_.empty() && !late_) rs_done_ = std::max(rs_done_, send(t_, rs_layer_));
    if (attention_after_experts) compute(attention_fwd_ * bwd_scale_);
    if (!shared_first) compute(w_.shared_fwd_s * bwd_scale_);
    wait_for(returned);
    if (!farskip_moe(conn)) compute(attention_fwd_ * bwd_scale_);
    release_bucket(k);
  }
  release_bucket(-1);  // the embedding's
  if (norm_in_backward_) {
    compute(rb_ * span_ * expert_bwd_ / 2 * kept_weights_);  // layer 0's weight gradients
    norm_done_ = send(t_, norm_sum_);
  }
  for (int k = layers_ - 1; k >= 0 && late_; --k) {
    compute(r_ * expert_bwd_ / 2 * (1 - kept_weights_));
    rs_done_ = std::max(rs_done_, send(t_, rs_layer_));
  }
}

// The step's tail: what backward left in flight, then the optimizer.
void StepTimeline::finish() {
  // Every replica gradient home, then the norm's sum beside the buckets:
  // those in flight (overlapped) or, simple, each in turn, each paying its
  // own latency.
  c_.exposed_rs_s = std::max(0.0, rs_done_ - t_);
  t_ += c_.exposed_rs_s;
  if (!norm_in_backward_) norm_done_ = send(t_, norm_sum_);
  if (!w_.overlapped)
    for (size_t b = 0; b < bucket_.size(); ++b) {
      const double cpu = w_.exchange_cpu_s_per_byte * bucket_sent_[b] +  // the bucket's exchange CPU, as an A2A's
                         w_.exchange_cpu_s_per_message * bucket_messages_[b];
      dense_done_ = send(std::max(t_, dense_done_), bucket_[b]) + cpu;
      c_.exchange_cpu_s += cpu;
    }
  const double end = std::max({t_, norm_done_, dense_done_});
  c_.exposed_allreduce_s = end - t_;
  t_ = end;
  compute(w_.optimizer_s);  // once every gradient is in
  c_.ag_s = total(ag_layer_) * layers_;
  c_.rs_s = total(rs_layer_) * layers_;
  c_.iteration_s = t_;
}

PlanCandidate evaluate_with_degree(const Workload& w, const std::vector<int>& level_sizes,
                                   const std::vector<LinkModel>& links, const std::vector<int>& domain_sizes,
                                   double memory_cap_bytes, const std::vector<LinkCodecCost>& link_codecs, int r,
                                   int rb, bool late) {
  return StepTimeline(w, level_sizes, links, domain_sizes, memory_cap_bytes, link_codecs, r, rb, late).run();
}

}  // namespace xd::detail
