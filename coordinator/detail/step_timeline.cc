#include "coordinator/detail/step_timeline.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>

#include "cluster/topology.h"
#include "common/check.h"
#include "model/param_layout.h"
#include "transport/communicator.h"

namespace xd::detail {

namespace {

// A link's egress as the runtime's token bucket runs it, one transfer after
// another. A transfer released at `at` takes the first gap from then on that
// holds it (transfers are priced route by route, so a later hop may be
// placed before an earlier-released one's), holds the link for `busy`
// seconds and lands `alpha` after its last byte left: the latencies of
// transfers queued behind each other overlap.
class LinkQueue {
 public:
  double send(double at, double busy, double alpha) {
    double start = at;
    auto it = busy_.upper_bound(start);
    if (it != busy_.begin() && std::prev(it)->second > start) start = std::prev(it)->second;
    for (; it != busy_.end() && it->first < start + busy; ++it) start = std::max(start, it->second);
    if (busy > 0) busy_.emplace(start, start + busy);
    return start + busy + alpha;
  }

 private:
  std::map<double, double> busy_;  // [start, end) of each transfer, disjoint
};

// One hop of a transfer: the link of `level` busy for `busy` seconds (bytes
// over its rate, and codec time), then `alpha` (its rounds' latency).
// A token A2A's hop is uneven (the routing's imbalance F): of a pair of
// peers, one sends F times the mean rows and the other 2 - F times, and the
// hop lands when the larger side has. `first` and `second` are the shares
// of the pair's two egresses: (F, 2 - F) toward the experts, and (2 - F, F)
// back to the sources, since the rows return the way they came. Everything
// else is even (1, 1).
struct Hop {
  int level = 0;
  double busy = 0, alpha = 0;
  double first = 1, second = 1;
  double longest() const { return busy * std::max(first, second); }
};
using Route = std::vector<Hop>;  // the hops of one transfer, in order

double total(const Route& route) {
  double s = 0;
  for (const Hop& h : route) s += h.longest() + h.alpha;
  return s;
}

// The egresses on one level of a pair of peers: the planner prices one
// worker, but with uneven routing its hops run as long as the peer's side,
// and a pipelined Combine queues on the peer's egress, not behind this
// worker's heavier Dispatch.
struct LinkPair {
  LinkQueue first, second;
  double send(double at, const Hop& h) {
    return std::max(first.send(at, h.busy * h.first, h.alpha), second.send(at, h.busy * h.second, h.alpha));
  }
};

}  // namespace

PlanCandidate evaluate_with_degree(const Workload& w, const std::vector<int>& level_sizes,
                                   const std::vector<LinkModel>& links, const std::vector<int>& domain_sizes,
                                   double memory_cap_bytes, const std::vector<LinkCodecCost>& link_codecs, int r,
                                   int rb, bool late) {
  XD_CHECK(Topology::check(level_sizes, domain_sizes).is_ok());
  XD_CHECK(r >= 1 && rb >= 1 && r % rb == 0);
  const int span = r / rb;  // forward chunks per backward exchange
  XD_CHECK(links.size() == level_sizes.size());
  const int num_levels = static_cast<int>(level_sizes.size());
  const int layers = w.num_moe_layers;
  const double n = w.experts_per_worker;
  double held_per_worker = 1;  // every worker computes the experts of its domains: n times their sizes
  for (int s : domain_sizes) held_per_worker *= s;
  // A measured F, else this candidate's from the routing probe: its domains
  // decide which rows cross which level.
  const std::vector<double> imbalance = a2a_imbalance_for(w.a2a_imbalance, w.routed_a2a_imbalance, domain_sizes);

  PlanCandidate c;
  c.domain_sizes = domain_sizes;
  c.pipeline_degree = r;
  c.backward_pipeline_degree = rb;
  c.level_bytes.assign(num_levels, 0.0);
  c.level_messages.assign(num_levels, 0.0);

  // One A2A toward the experts (Dispatch, backward of Combine) and one back
  // to the sources (Combine, backward of Dispatch) of one MoE layer, level by
  // level (outer first toward the experts), each through its token codec;
  // one layer's AG (outer level first, forwarding what the outer levels
  // gathered) and its RS (inner level first). Codec time rides on the hop.
  Route to_experts_chunk, to_sources_chunk, ag_layer, rs_layer;
  double to_experts_chunk_bytes = 0, to_sources_chunk_bytes = 0;  // sent per chunk, all levels
  double gathered_per_layer_experts = 1;
  const std::vector<GatherHop> gather = expert_gather_hops(n * w.expert_bytes, domain_sizes, link_codecs);
  bool base_sync = false;
  int a2a_levels = 0;     // levels with all-to-all peers
  double a2a_chunk_messages = 0;  // one chunk of one direction: a message to each peer of every level
  double relayed_origins = 0;     // blocks of lossy outer levels a raw inner level relays, per peer
  bool raw_tokens = true;  // no token codec on any level
  for (int l = 0; l < num_levels; ++l) {
    const LinkModel& link = links[l];
    const LinkCodecCost codec = link_codecs.empty() ? LinkCodecCost{} : link_codecs[l];
    const int sf = level_sizes[l], s = domain_sizes[l];
    const int a2a_msgs = sf / s - 1;
    const double a2a_bytes = w.token_bytes * (1.0 - double(s) / sf);
    const std::array<double, 2> share = grouped_row_share(w, n * held_per_worker);
    const double to_experts_bytes = a2a_bytes * share[0], to_sources_bytes = a2a_bytes * share[1];
    raw_tokens = raw_tokens && codec.dispatch_fraction == 1 && codec.combine_fraction == 1 &&
                 codec.dispatch_s_per_byte == 0 && codec.combine_s_per_byte == 0;
    if (a2a_msgs > 0) {
      ++a2a_levels;
      // Uneven routing: the pair's heavier egress carries (and codes) F
      // times the mean rows (LinkPair).
      const double f = l < static_cast<int>(imbalance.size()) ? std::min(2.0, imbalance[l]) : 1.0;
      const double dispatch_s =
          to_experts_bytes / r * (link.beta_s_per_byte * codec.dispatch_fraction + codec.dispatch_s_per_byte);
      const double combine_s =
          to_sources_bytes / r * (link.beta_s_per_byte * codec.combine_fraction + codec.combine_s_per_byte);
      to_experts_chunk.push_back({l, dispatch_s, link.alpha_s, f, 2 - f});
      to_sources_chunk.insert(to_sources_chunk.begin(), Hop{l, combine_s, link.alpha_s, 2 - f, f});
      to_experts_chunk_bytes += to_experts_bytes / r * codec.dispatch_fraction;
      to_sources_chunk_bytes += to_sources_bytes / r * codec.combine_fraction;
    }
    // The replicas' raw bytes, through the AG and RS codecs of this level
    // (the AG's on the wire and its codec time: expert_gather_hops).
    const double ag_bytes = gather[l].raw_bytes * (s - 1);
    const double ag_wire = gather[l].wire_bytes * (s - 1), ag_codec_s = gather[l].codec_s * (s - 1);
    if (s > 1) {
      ag_layer.push_back({l, ag_wire * link.beta_s_per_byte + ag_codec_s, link.alpha_s});
      rs_layer.insert(rs_layer.begin(),
          Hop{l, ag_bytes * (link.beta_s_per_byte * codec.grad_fraction + codec.grad_s_per_byte), link.alpha_s});
      base_sync = base_sync || codec.gather_against_base;
    }
    c.level_bytes[l] += layers * (2 * (to_experts_bytes * codec.dispatch_fraction +
                                       to_sources_bytes * codec.combine_fraction) + ag_wire +
                                  ag_bytes * codec.grad_fraction);
    // Each token direction runs forward and backward; the AG's codec time
    // counts one encode per peer (exact at s = 2, the lossy outer level).
    c.codec_cpu_s += layers * (2 * (to_experts_bytes * codec.dispatch_s_per_byte +
                                    to_sources_bytes * codec.combine_s_per_byte) + ag_codec_s +
                               ag_bytes * codec.grad_s_per_byte);
    // A token exchange sends each peer of the level a message per chunk, r
    // a direction forward and rb backward. The AG sends each domain peer the
    // worker's block and, on a raw level below lossy ones, each lossy
    // block as it arrived (one per origin: ExpertCommunicator's relays);
    // the replica gradients go back a message per peer.
    const double relayed = codec.gather_lossy() ? 0.0 : relayed_origins;
    const double ag_messages = (s - 1) * (1.0 + relayed), rs_messages = s - 1;
    a2a_chunk_messages += a2a_msgs;
    c.level_messages[l] += layers * (2.0 * (r + rb) * a2a_msgs + ag_messages + rs_messages);
    if (s > 1) relayed_origins = codec.gather_lossy() ? relayed_origins + (s - 1) : relayed_origins * s;
    gathered_per_layer_experts *= s;
  }
  // A backward exchange of `span` chunks: the bytes (and codec time) of
  // `span` chunks on each hop, one latency.
  auto spanned = [span](Route route) {
    for (Hop& h : route) h.busy *= span;
    return route;
  };
  const Route to_experts_span = spanned(to_experts_chunk), to_sources_span = spanned(to_sources_chunk);
  const double held = n * gathered_per_layer_experts;  // experts per layer incl. own
  // Late replica weight gradients need replicas and the overlapped backward
  // (MoeTransformer::BackwardHooks): their share of the weight gradients
  // moves after the embedding's bucket, each layer's sent when done.
  late = late && w.overlapped && !rs_layer.empty();
  c.replica_weights_late = late;
  c.tokens_once_per_worker = w.grouped_rows;
  const double kept_weights = late ? n / held : 1.0;  // of each layer's weight gradients
  c.gathered_bytes = (held - n) * w.expert_bytes * layers;
  c.feasible = c.gathered_bytes <= memory_cap_bytes * (1 + 1e-12);
  if (!c.feasible)
    c.why_infeasible = "gathered experts need " + std::to_string(static_cast<long long>(c.gathered_bytes)) +
                       " bytes per worker, above the memory cap of " +
                       std::to_string(static_cast<long long>(memory_cap_bytes));

  // Hierarchical all-reduce of dense gradients: reduce-scatter inner level
  // first, on the shard left by the inner levels, then all-gather back. Each
  // phase is one round while the blocks are small, a ring of sf - 1 rounds
  // from Communicator's ring threshold on; dense_grad codecs scale the bytes.
  // The SR base (one expert per layer, base_syncs_per_step times) is its own
  // all-reduce on the same links, in bf16 on the stage of a level whose AG
  // codes against it, as the runtime sends it: the inner stage is the
  // innermost level, the outer stage every other level.
  const double base_bytes = base_sync ? w.base_syncs_per_step * w.expert_bytes * layers : 0.0;
  bool outer_base_bf16 = false;
  for (int l = 0; l + 1 < num_levels && !link_codecs.empty(); ++l)
    outer_base_bf16 = outer_base_bf16 || link_codecs[l].gather_against_base;
  // `bytes` of dense gradients, or of the base (`base`): a reduce-scatter
  // hop per level, inner first, then the all-gathers back, or one hop where
  // the runtime all-reduces in one round (dense_stage); adds its bytes, and
  // its messages (sf - 1 a phase: one to each other member at once, or one
  // to the next in each round of a ring) `times` over, per level, and their
  // sums to *sent and *messages when given. (Blocks above the collectives'
  // 4 MB message size and an outer stage spanning several levels send a few
  // more than this counts.)
  auto all_reduce = [&](double bytes, bool base, double times, double* sent_total = nullptr,
                        double* messages_total = nullptr) {
    auto count = [&](int l, double sent, double messages) {
      c.level_bytes[l] += sent;
      c.level_messages[l] += times * messages;
      if (sent_total) *sent_total += sent;
      if (messages_total) *messages_total += messages;
    };
    Route up, down;
    double shard = bytes;
    for (int l = num_levels - 1; l >= 0; --l) {
      const int sf = level_sizes[l];
      const bool bf16 = l == num_levels - 1 ? !link_codecs.empty() && link_codecs[l].gather_against_base
                                            : outer_base_bf16;
      // base_codec: sign (outer stage): a sign bit a float, a fp32 scale per
      // 1024 and a bit per 1024, to every other member in one round.
      const bool sign = base && bf16 && l < num_levels - 1 && w.base_outer_sign;
      const double fraction = sign ? (1.0 + 33.0 / 1024) / 32
                              : base ? (bf16 ? 0.5 : 1.0) : link_codecs.empty() ? 1.0 : link_codecs[l].dense_fraction;
      if (sf > 1 && shard > 0) {
        const DenseStage stage = sign ? DenseStage::kOneRound : dense_stage(level_sizes, l, shard);
        if (stage == DenseStage::kOneRound) {
          const double sent = (sf - 1) * shard * fraction;
          up.push_back({l, links[l].beta_s_per_byte * sent, links[l].alpha_s});
          count(l, sent, sf - 1);
          continue;  // every member holds the whole sum: nothing left to split
        }
        const double sent = 2.0 * (sf - 1) / sf * shard * fraction;
        const Hop half{l, links[l].beta_s_per_byte * sent / 2,
                       (stage == DenseStage::kRing ? sf - 1 : 1) * links[l].alpha_s};
        up.push_back(half);
        down.insert(down.begin(), half);
        count(l, sent, 2.0 * (sf - 1));
      }
      shard /= sf;
    }
    up.insert(up.end(), down.begin(), down.end());
    return up;
  };
  // The buckets backward finishes (model/param_layout.h): the LM head's, one
  // per layer, the embedding's (dense_bucket_of_group numbers them).
  std::vector<double> bucket_bytes(layers + 2, w.dense_param_bytes / (layers + 2));
  if (w.vocab_bytes > 0 && w.dense_param_bytes > 2 * w.vocab_bytes) {
    bucket_bytes.assign(layers + 2, (w.dense_param_bytes - 2 * w.vocab_bytes) / layers);
    bucket_bytes.front() = bucket_bytes.back() = w.vocab_bytes;
  }
  std::vector<Route> bucket;
  std::vector<double> bucket_sent, bucket_messages;  // what a worker sends for each bucket, all levels
  for (double bytes : bucket_bytes) {
    bucket_sent.push_back(0);
    bucket_messages.push_back(0);
    bucket.push_back(all_reduce(bytes, false, 1.0, &bucket_sent.back(), &bucket_messages.back()));
    c.allreduce_s += total(bucket.back());
  }
  // base_bytes holds base_syncs_per_step already; its messages come that
  // many times a step.
  const Route base = base_bytes > 0 ? all_reduce(base_bytes, true, w.base_syncs_per_step) : Route{};
  c.allreduce_s += total(base);
  // The expert norm's sum: one round per level, inner first.
  Route norm_sum;
  for (int l = num_levels - 1; l >= 0; --l)
    if (level_sizes[l] > 1) {
      norm_sum.push_back({l, 0.0, links[l].alpha_s});
      c.level_messages[l] += level_sizes[l] - 1;
    }
  c.allreduce_s += total(norm_sum);

  // Held experts cost GEMM calls: 3 forward, 6 backward each, per chunk.
  // Their flops are the busiest worker's, whom each layer's exchanges wait for.
  const ExpertLoad load = expert_load_for(w.routed_expert_load, domain_sizes);
  c.expert_imbalance = load.layers_busiest;
  c.expert_wait_s = layers * (w.expert_fwd_s + w.expert_bwd_s) * (load.layers_busiest - load.busiest_worker);
  const double expert_fwd = w.expert_fwd_s * c.expert_imbalance / r + 3 * held * w.gemm_overhead_s;
  const double expert_bwd = w.expert_bwd_s * c.expert_imbalance / r + 6 * held * w.gemm_overhead_s;
  const double bwd_scale = w.pre_expert_fwd_s > 0 ? w.pre_expert_bwd_s / w.pre_expert_fwd_s : 2.0;
  const double attention_fwd = std::max(0.0, w.pre_expert_fwd_s - w.shared_fwd_s);  // with the router
  const double qkv_fwd = std::min(w.attention_qkv_fwd_s, attention_fwd);

  // The iteration as a timeline of the compute stream. Every transfer
  // crosses its levels' links hop by hop, each link a FIFO queue in wall
  // time. The two A2A directions each run one chunk at a time, as the
  // runtime's two exchange threads do (every chunk pays every level's
  // alpha), but where the runtime exchanges direct (overlapped, one level of
  // peers, raw rows: actors/hybrid_exchange.h): the compute thread queues
  // every chunk on the link as it starts, so chunks leave back to back and
  // their latencies overlap.
  const bool direct = w.overlapped && a2a_levels == 1 && raw_tokens;
  std::vector<LinkPair> link(num_levels);
  auto send = [&](double at, const Route& route) {
    for (const Hop& h : route) at = link[h.level].send(at, h);
    return at;
  };
  std::vector<double> gathered(layers, 0.0);
  for (int k = 0; k < layers && !ag_layer.empty(); ++k)  // every layer's AG leaves at the start
    gathered[k] = send(0, ag_layer);
  if (!base.empty()) send(0, base);  // behind the AGs
  double t = 0, to_experts_free = 0, to_sources_free = 0;
  auto compute = [&](double dt) {
    t += dt;
    c.compute_s += dt;
  };
  auto wait_for = [&](double done) {
    if (done <= t) return;
    c.exposed_a2a_s += done - t;
    t = done;
  };
  // Starts an A2A chunk now; returns when it lands. Not overlapped, compute
  // waits for it at once, and then for the exchange's own packing, sending,
  // receiving and unpacking of `bytes` in a message to each peer: it runs on
  // the compute thread (the probe's transport CPU per message and per byte).
  auto a2a = [&](const Route& route, double bytes, double* free) {
    *free = direct ? std::max(*free, send(t, route)) : send(std::max(t, *free), route);
    c.a2a_s += total(route);
    if (!w.overlapped) {
      wait_for(*free);
      const double cpu = w.exchange_cpu_s_per_byte * bytes + w.exchange_cpu_s_per_message * a2a_chunk_messages;
      wait_for(t + cpu);
      c.exchange_cpu_s += cpu;
    }
    return *free;
  };
  auto connectivity = [&](int k) {
    return w.connectivity.empty() ? Connectivity::kRegular : w.connectivity[std::min<size_t>(k, w.connectivity.size() - 1)];
  };
  auto farskip_attention = [](Connectivity x) { return x == Connectivity::kFarSkip || x == Connectivity::kFarSkipAttention; };
  auto farskip_moe = [](Connectivity x) { return x == Connectivity::kFarSkip || x == Connectivity::kFarSkipMoe; };

  double combined = 0;  // when the previous layer's Combine lands
  for (int k = 0; k < layers; ++k) {
    const Connectivity conn = connectivity(k);
    if (!farskip_attention(conn)) wait_for(combined);
    compute(qkv_fwd);                   // attention (a)
    // Work while waiting: attention (b) but its router runs while
    // Combine(k-1) is still in flight.
    double attention_b = attention_fwd - qkv_fwd;  // with the router
    if (w.overlapped && farskip_attention(conn) && combined > t) {
      const double early = std::min(std::max(0.0, attention_b - w.router_fwd_s), combined - t);
      compute(early);
      attention_b -= early;
    }
    wait_for(combined);
    std::vector<double> dispatched(r);
    auto route = [&] {
      for (int i = 0; i < r; ++i) dispatched[i] = a2a(to_experts_chunk, to_experts_chunk_bytes, &to_experts_free);
    };
    // The last layer under FarSkip MoE: the shared experts take Dispatch's
    // place, attention (b) but the router runs while Dispatch is still in
    // flight after them, and what is left of it hides the Combine.
    const bool last_experts_first = k + 1 == layers && farskip_moe(conn);
    double attention_late = 0;
    if (farskip_moe(conn)) route();
    if (last_experts_first) {
      const double router = std::min(attention_b, w.router_fwd_s);
      compute(router);
      compute(w.shared_fwd_s);
      const double rest = attention_b - router;
      const double early = w.overlapped ? std::min(rest, std::max(0.0, dispatched[0] - t)) : 0.0;
      compute(early);
      attention_late = rest - early;
    } else {
      compute(attention_b);  // attention (b), router
    }
    if (!farskip_moe(conn)) route();
    // The shared experts take the place of a Dispatch still in flight, but
    // in the last layer, whose Combine only they can hide (unless FarSkip
    // MoE has put them first, above).
    const bool shared_first = !last_experts_first && w.overlapped && k + 1 < layers && dispatched[0] > t;
    if (shared_first) compute(w.shared_fwd_s);
    // The layer's experts must have landed.
    const double wait = std::max(0.0, gathered[k] - t);
    t += wait;
    c.exposed_ag_s += wait;
    for (int i = 0; i < r; ++i) {
      wait_for(dispatched[i]);
      compute(expert_fwd);
      combined = a2a(to_sources_chunk, to_sources_chunk_bytes, &to_sources_free);
    }
    compute(attention_late);
    if (!shared_first && !last_experts_first) compute(w.shared_fwd_s);
  }
  wait_for(combined);
  compute(w.post_s);
  // Overlapped, a dense bucket leaves as soon as backward has finished it.
  double dense_done = 0, rs_done = 0, norm_done = -1;
  // Overlapped with no replicas, the norm's sum leaves as soon as layer 0's
  // experts are done (their gradients are final then), and layer 0's weight
  // gradients wait until the embedding's bucket has left, to hide the last
  // buckets' flight (MoeTransformer::BackwardHooks).
  const bool norm_in_backward = w.overlapped && rs_layer.empty();
  auto release_bucket = [&](int group) {  // MoeTransformer's grads_ready(group)
    if (w.overlapped) dense_done = std::max(dense_done, send(t, bucket[dense_bucket_of_group(layers, group)]));
  };
  release_bucket(layers);  // the LM head's
  for (int k = layers - 1; k >= 0; --k) {
    const Connectivity conn = connectivity(k);
    // Each backward exchange carries `span` forward chunks: their bytes
    // leave as one transfer, paying the latency once.
    std::vector<double> to_experts(rb);
    for (int i = 0; i < rb; ++i)  // backward of Combine
      to_experts[i] = a2a(to_experts_span, span * to_experts_chunk_bytes, &to_experts_free);
    // With replicas (HybridEP) the attention backward waits until their
    // gradients have left.
    const bool attention_after_experts = farskip_moe(conn) && !rs_layer.empty();
    if (farskip_moe(conn) && !attention_after_experts) compute(attention_fwd * bwd_scale);
    // The shared experts' backward takes the place of a Combine backward
    // still in flight.
    const bool shared_first = w.overlapped && to_experts[0] > t;
    if (shared_first) compute(w.shared_fwd_s * bwd_scale);
    double returned = t;
    for (int i = 0; i < rb; ++i) {
      wait_for(to_experts[i]);
      compute(span * expert_bwd / 2);    // input gradients, chunk by chunk
      returned = a2a(to_sources_span, span * to_sources_chunk_bytes, &to_sources_free);  // backward of Dispatch
      if (k > 0 || !norm_in_backward) compute(span * expert_bwd / 2 * kept_weights);  // weight gradients
    }
    // This layer's replica gradients go home.
    if (!rs_layer.empty() && !late) rs_done = std::max(rs_done, send(t, rs_layer));
    if (attention_after_experts) compute(attention_fwd * bwd_scale);
    if (!shared_first) compute(w.shared_fwd_s * bwd_scale);
    wait_for(returned);
    if (!farskip_moe(conn)) compute(attention_fwd * bwd_scale);
    release_bucket(k);
  }
  release_bucket(-1);  // the embedding's
  if (norm_in_backward) {
    compute(rb * span * expert_bwd / 2 * kept_weights);  // layer 0's weight gradients
    norm_done = send(t, norm_sum);
  }
  for (int k = layers - 1; k >= 0 && late; --k) {
    compute(r * expert_bwd / 2 * (1 - kept_weights));
    rs_done = std::max(rs_done, send(t, rs_layer));
  }
  // Every replica gradient home, then the norm's sum beside the buckets:
  // those in flight (overlapped) or, simple, each in turn, each paying its
  // own latency.
  c.exposed_rs_s = std::max(0.0, rs_done - t);
  t += c.exposed_rs_s;
  if (!norm_in_backward) norm_done = send(t, norm_sum);
  if (!w.overlapped)
    for (size_t b = 0; b < bucket.size(); ++b) {
      const double cpu = w.exchange_cpu_s_per_byte * bucket_sent[b] +  // the bucket's exchange CPU, as an A2A's
                         w.exchange_cpu_s_per_message * bucket_messages[b];
      dense_done = send(std::max(t, dense_done), bucket[b]) + cpu;
      c.exchange_cpu_s += cpu;
    }
  const double end = std::max({t, norm_done, dense_done});
  c.exposed_allreduce_s = end - t;
  t = end;
  compute(w.optimizer_s);  // once every gradient is in
  c.ag_s = total(ag_layer) * layers;
  c.rs_s = total(rs_layer) * layers;
  c.iteration_s = t;
  return c;
}

}  // namespace xd::detail
