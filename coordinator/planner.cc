#include "coordinator/planner.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>

#include "cluster/topology.h"
#include "model/param_layout.h"
#include "transport/communicator.h"

namespace xd {

std::vector<double> a2a_imbalance_for(const std::vector<double>& measured, const RoutedImbalance& routed,
                                      const std::vector<int>& domain_sizes) {
  if (!measured.empty()) return measured;
  const auto it = routed.find(domain_sizes);
  return it == routed.end() ? std::vector<double>{} : it->second;
}

ExpertLoad expert_load_for(const RoutedExpertLoad& routed, const std::vector<int>& domain_sizes) {
  const auto it = routed.find(domain_sizes);
  return it == routed.end() ? ExpertLoad{} : it->second;
}

std::vector<double> PlannerInputs::a2a_imbalance_for(const std::vector<int>& domain_sizes) const {
  return xd::a2a_imbalance_for(a2a_imbalance, routed_a2a_imbalance, domain_sizes);
}

Status PlannerInputs::validate() const {
  XD_RETURN_IF_ERROR(model.validate());
  auto bad = [](const std::string& why) { return Status::invalid_argument("planner: " + why); };
  if (tokens_per_worker <= 0) return bad("tokens_per_worker must be positive");
  if (seq_len < 0) return bad("seq_len must be >= 0");
  if (bytes_per_element <= 0) return bad("bytes_per_element must be positive");
  XD_RETURN_IF_ERROR(Topology::check(level_sizes, std::vector<int>(level_sizes.size(), 1)));
  if (links.size() != level_sizes.size()) return bad("need one link model per level");
  if (!link_codecs.empty() && link_codecs.size() != level_sizes.size())
    return bad("need one token codec cost per level (or none)");
  for (const LinkCodecCost& c : link_codecs)
    if (!(c.dispatch_fraction > 0) || !(c.combine_fraction > 0) || !(c.dispatch_s_per_byte >= 0) ||
        !(c.combine_s_per_byte >= 0) || !(c.gather_fraction > 0) || !(c.gather_s_per_byte >= 0) ||
        !(c.grad_fraction > 0) || !(c.grad_s_per_byte >= 0) || !(c.dense_fraction > 0))
      return bad("codec fractions must be positive and their times >= 0");
  for (const LinkModel& l : links)
    if (!(l.alpha_s >= 0) || !(l.beta_s_per_byte >= 0) || !std::isfinite(l.alpha_s) ||
        !std::isfinite(l.beta_s_per_byte))
      return bad("link alpha and beta must be finite and >= 0");
  if (!(compute.flops_per_s > 0) || !std::isfinite(compute.flops_per_s))
    return bad("compute.flops_per_s must be positive");
  if (!(compute.gemm_overhead_s >= 0)) return bad("compute.gemm_overhead_s must be >= 0");
  if (!(compute.non_gemm_factor >= 1) || !std::isfinite(compute.non_gemm_factor))
    return bad("compute.non_gemm_factor must be finite and >= 1");
  if (!(compute.optimizer_s_per_param >= 0) || !std::isfinite(compute.optimizer_s_per_param))
    return bad("compute.optimizer_s_per_param must be finite and >= 0");
  if (!(compute.transport_cpu_s_per_byte >= 0) || !std::isfinite(compute.transport_cpu_s_per_byte))
    return bad("compute.transport_cpu_s_per_byte must be finite and >= 0");
  if (!(compute.exchange_cpu_s_per_byte >= 0) || !std::isfinite(compute.exchange_cpu_s_per_byte))
    return bad("compute.exchange_cpu_s_per_byte must be finite and >= 0");
  if (!(compute.transport_cpu_s_per_message >= 0) || !std::isfinite(compute.transport_cpu_s_per_message))
    return bad("compute.transport_cpu_s_per_message must be finite and >= 0");
  if (!(compute.exchange_cpu_s_per_message >= 0) || !std::isfinite(compute.exchange_cpu_s_per_message))
    return bad("compute.exchange_cpu_s_per_message must be finite and >= 0");
  if (!a2a_imbalance.empty() && a2a_imbalance.size() != level_sizes.size())
    return bad("need one A2A imbalance per level, or none");
  for (double f : a2a_imbalance)
    if (!a2a_imbalance_in_range(f)) return bad(kA2aImbalanceRange);
  for (const auto& [domains, fs] : routed_a2a_imbalance) {
    if (domains.size() != level_sizes.size() || fs.size() != level_sizes.size())
      return bad("a routed A2A imbalance needs a domain size and an F per level");
    for (double f : fs)
      if (!a2a_imbalance_in_range(f)) return bad(kA2aImbalanceRange);
  }
  for (const auto& [domains, load] : routed_expert_load)
    if (domains.size() != level_sizes.size() || !(load.busiest_worker >= 1) ||
        !(load.layers_busiest >= load.busiest_worker) || !std::isfinite(load.layers_busiest))
      return bad("a routed expert load needs a domain size per level and 1 <= busiest_worker <= layers_busiest, "
                 "finite");
  int g = 1;
  for (int s : level_sizes) g *= s;
  if (model.num_experts % g != 0)
    return bad("num_experts (" + std::to_string(model.num_experts) +
               ") must be a multiple of the world size (" + std::to_string(g) + ")");
  if (expert_parallel.mode == EpMode::kHybrid)
    XD_RETURN_IF_ERROR(Topology::check(level_sizes, expert_parallel.domain_sizes)
                           .with_context("planner: hybrid domain sizes"));
  if (!(expert_parallel.memory_cap_bytes >= 0)) return bad("memory cap must be >= 0");
  if (expert_parallel.pipeline_degree < 0) return bad("pipeline_degree must be >= 0 (0: chosen)");
  const int rb = expert_parallel.backward_pipeline_degree;
  if (rb < -1) return bad("backward_pipeline_degree must be >= -1 (-1: the forward's, 0: chosen)");
  if (rb > 0 && expert_parallel.pipeline_degree > 0 && expert_parallel.pipeline_degree % rb != 0)
    return bad("backward_pipeline_degree must divide pipeline_degree");
  return Status::ok();
}

std::vector<LinkModel> spec_link_models(const ClusterSpec& spec) {
  std::vector<LinkModel> out;
  for (const LevelSpec& l : spec.levels)
    out.push_back({l.link.latency_s, 1.0 / l.link.bandwidth_bytes_per_s});
  return out;
}

DenseStage dense_stage(const std::vector<int>& level_sizes, int level, double shard_bytes) {
  const int levels = static_cast<int>(level_sizes.size()), sf = level_sizes[level];
  int outer_members = 1;
  for (int l = 0; l + 1 < levels; ++l) outer_members *= level_sizes[l];
  if ((level + 1 < levels || outer_members == 1) &&
      Communicator::one_shot_all_reduce(sf, static_cast<size_t>(shard_bytes)))
    return DenseStage::kOneRound;
  return sf > 2 && shard_bytes / sf >= double(Communicator::kDefaultRingMinBlockBytes) ? DenseStage::kRing
                                                                                      : DenseStage::kDirect;
}

PlannerInputs planner_inputs_for(const JobConfig& job, std::vector<LinkModel> links,
                                 ComputeModel compute) {
  PlannerInputs in;
  in.model = job.train.model;
  in.tokens_per_worker = static_cast<long long>(job.train.batch_size) * job.train.seq_len;
  in.seq_len = job.train.seq_len;
  in.level_sizes = job.cluster.level_sizes();
  in.links = std::move(links);
  in.compute = compute;
  in.expert_parallel = job.cluster.expert_parallel;
  // auto stays off where grouped rows cannot travel (soft_moe, lossy token codecs).
  if (in.expert_parallel.tokens_once_per_worker == TokensOncePerWorker::kAuto &&
      !job.can_send_tokens_once_per_worker().is_ok())
    in.expert_parallel.tokens_once_per_worker = TokensOncePerWorker::kOff;
  in.overlapped = job.train.farskip.overlapped;
  return in;
}

Workload workload_of(const PlannerInputs& in) {
  const ModelConfig& m = in.model;
  const double t = double(in.tokens_per_worker), d = m.hidden_size, hd = m.head_dim();
  const double q_width = double(m.num_heads) * hd, kv_width = double(m.num_kv_heads) * hd;
  const double rate = in.compute.flops_per_s, ovh = in.compute.gemm_overhead_s;
  const double bytes = in.bytes_per_element;
  int g = 1;
  for (int s : in.level_sizes) g *= s;

  // Forward flops of one layer before its routed experts (a GEMM of
  // (a, b) x (b, c) is 2abc flops); backward costs twice the forward.
  const double qkv_flops = 2 * t * d * q_width + 2 * t * d * kv_width * 2;  // q_proj, k_proj, v_proj
  const double shared_flops = double(m.num_shared_experts) * 3 * 2 * t * d * m.shared_intermediate_size;
  double router_flops = 2 * t * d * m.router_rows();  // x gate.weightᵀ
  if (m.gating == Gating::kGShardNoisyTopK) router_flops *= 2;  // and x gate_noise.weightᵀ
  if (m.gating == Gating::kXMoe) router_flops += 2 * t * m.router_rows() * m.num_experts;  // cosines
  double pre_flops = qkv_flops + 2 * t * d * q_width  // o_proj
                     + router_flops + shared_flops;
  double pre_gemms = 4 + 1 + 3.0 * m.num_shared_experts;
  if (in.seq_len > 0) {
    const double seqs = t / in.seq_len, s = in.seq_len;
    pre_flops += 2 * (2 * seqs * m.num_heads * s * s * hd);  // scores and probs x values
    pre_gemms += 2 * seqs * m.num_heads;
    if (m.gating == Gating::kSoftMoe) {  // causal slot mixing: (T, T) x (T, d) per sequence and slot
      pre_flops += 2 * seqs * m.router_rows() * s * s * d;
      pre_gemms += seqs * m.router_rows();
    }
  }
  const double expert_flops = t * m.routed_rows_per_token() * 3 * 2 * d * m.expert_intermediate_size;
  const double head_flops = 2 * t * d * m.vocab_size;

  Workload w;
  w.num_moe_layers = m.num_layers;
  w.experts_per_worker = double(m.num_experts) / g;
  w.expert_bytes = 3 * d * m.expert_intermediate_size * bytes;
  w.token_bytes = t * m.routed_rows_per_token() * d * bytes;
  w.grouped_rows = in.expert_parallel.tokens_once_per_worker == TokensOncePerWorker::kOn;
  w.grouped_rows_auto = in.expert_parallel.tokens_once_per_worker == TokensOncePerWorker::kAuto;
  w.routed_rows_per_token = m.routed_rows_per_token();
  w.num_experts = m.num_experts;
  w.expert_choice = m.gating == Gating::kExpertChoice;
  w.hidden = d;
  const double per_layer_dense = 2 * d + d * q_width + 2 * d * kv_width + q_width * d +
                                 double(m.router_rows()) * d + (m.gating == Gating::kGShardNoisyTopK ? double(m.num_experts) * d : 0.0) +
                                 (m.gating == Gating::kXMoe ? double(m.num_experts) * m.router_rows() + 1 : 0.0) +
                                 double(m.num_shared_experts) * 3 * d * m.shared_intermediate_size;
  w.dense_param_bytes = (2 * double(m.vocab_size) * d + d + m.num_layers * per_layer_dense) * bytes;
  w.vocab_bytes = double(m.vocab_size) * d * bytes;
  const double f = in.compute.non_gemm_factor;
  w.pre_expert_fwd_s = f * (pre_flops / rate + pre_gemms * ovh);
  w.pre_expert_bwd_s = f * (2 * pre_flops / rate + 2 * pre_gemms * ovh);
  w.attention_qkv_fwd_s = f * (qkv_flops / rate + 3 * ovh);
  w.shared_fwd_s = f * (shared_flops / rate + 3.0 * m.num_shared_experts * ovh);
  w.router_fwd_s = f * (router_flops / rate + ovh);
  w.overlapped = in.overlapped;
  w.pipeline_degree = in.expert_parallel.pipeline_degree;
  w.backward_pipeline_degree = in.expert_parallel.backward_pipeline_degree;
  if (w.backward_pipeline_degree < 0) w.backward_pipeline_degree = w.pipeline_degree;  // auto follows auto
  w.replica_weight_gradients = in.expert_parallel.replica_weight_gradients;
  w.connectivity = m.connectivity;
  w.expert_fwd_s = f * expert_flops / rate;
  w.expert_bwd_s = f * 2 * expert_flops / rate;
  w.post_s = f * (3 * head_flops / rate + 3 * ovh);
  w.gemm_overhead_s = f * ovh;
  w.optimizer_s = in.compute.optimizer_s_per_param *
                  (w.dense_param_bytes / bytes + w.experts_per_worker * m.num_layers * w.expert_bytes / bytes);
  w.transport_cpu_s_per_byte = in.compute.transport_cpu_s_per_byte;
  w.transport_cpu_s_per_message = in.compute.transport_cpu_s_per_message;
  w.exchange_cpu_s_per_byte = in.compute.exchange_cpu_s_per_byte;
  w.exchange_cpu_s_per_message = in.compute.exchange_cpu_s_per_message;
  w.codecs_share_compute_cores = in.compute.codecs_share_compute_cores;
  w.a2a_imbalance = in.a2a_imbalance;
  w.routed_a2a_imbalance = in.routed_a2a_imbalance;
  w.routed_expert_load = in.routed_expert_load;
  const int every = in.expert_parallel.base_sync_every;
  w.base_syncs_per_step = every > 0 ? 1.0 / every : 0.0;
  w.base_outer_sign = in.expert_parallel.base_codec == "sign";
  return w;
}

Workload with_compute_scaled(Workload w, double factor) {
  for (double* t : {&w.pre_expert_fwd_s, &w.pre_expert_bwd_s, &w.expert_fwd_s, &w.expert_bwd_s, &w.post_s,
                    &w.gemm_overhead_s, &w.attention_qkv_fwd_s, &w.shared_fwd_s, &w.router_fwd_s, &w.optimizer_s})
    *t *= factor;
  return w;
}

void drop_core_sharing(ComputeModel* compute) {
  compute->transport_cpu_s_per_byte = 0;
  compute->transport_cpu_s_per_message = 0;
  compute->codecs_share_compute_cores = false;
}

void drop_core_sharing(Workload* workload) {
  workload->transport_cpu_s_per_byte = 0;
  workload->transport_cpu_s_per_message = 0;
  workload->codecs_share_compute_cores = false;
}

std::vector<std::vector<int>> domain_candidates(const std::vector<int>& level_sizes) {
  std::vector<std::vector<int>> out = {{}};
  for (int sf : level_sizes) {
    std::vector<std::vector<int>> next;
    for (const auto& prefix : out)
      for (int s = 1; s <= sf; ++s)
        if (sf % s == 0) {
          next.push_back(prefix);
          next.back().push_back(s);
        }
    out = std::move(next);
  }
  return out;
}

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

// A token once per worker, routing uniform: the rows toward one destination
// holding m of the E experts, over one row per expert. A token has k rows
// there on average k m / E, and one row when any of its k experts is there.
// Then the widths (model/detail/moe_grouped.h): Dispatch carries 2K - 1
// more columns and the backward of Dispatch K, K the group's slots; the
// second of each direction's two exchanges carries none. {toward the
// experts, back to the sources}.
std::array<double, 2> grouped_row_share(const Workload& w, double m) {
  if (!w.grouped_rows) return {1.0, 1.0};
  const double E = w.num_experts, k = w.routed_rows_per_token;
  m = std::min(m, E);
  double none_there = 1;  // P(none of the token's experts is there)
  if (w.expert_choice) {
    none_there = std::pow(1 - k / E, m);
  } else {
    for (int i = 0; i < w.routed_rows_per_token; ++i) none_there *= std::max(0.0, (E - m - i) / (E - i));
  }
  const double rows = (1 - none_there) / (k * m / E);
  const double slots = std::min(w.expert_choice ? E : k, m);
  return {rows * (w.hidden + slots - 0.5) / w.hidden, rows * (w.hidden + slots / 2) / w.hidden};
}

namespace {

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

// Overlapped, the transport's threads run beside the compute and take its
// cores for their CPU time per message and per byte sent (a worker receives
// about as much), and so do the codecs where they share the cores: the
// compute stretches by that much, spread over the step.
PlanCandidate evaluate_dilated(const Workload& w, const std::vector<int>& level_sizes,
                               const std::vector<LinkModel>& links, const std::vector<int>& domain_sizes,
                               double memory_cap_bytes, const std::vector<LinkCodecCost>& link_codecs, int r,
                               int rb, bool late) {
  PlanCandidate c =
      evaluate_with_degree(w, level_sizes, links, domain_sizes, memory_cap_bytes, link_codecs, r, rb, late);
  const double codec_cpu = w.codecs_share_compute_cores ? c.codec_cpu_s : 0.0;
  if (!w.overlapped || !(w.transport_cpu_s_per_byte > 0 || w.transport_cpu_s_per_message > 0 || codec_cpu > 0) ||
      !(c.compute_s > 0))
    return c;
  double bytes = 0, messages = 0;
  for (double b : c.level_bytes) bytes += b;
  for (double m : c.level_messages) messages += m;
  const double transport = w.transport_cpu_s_per_byte * bytes + w.transport_cpu_s_per_message * messages;
  c = evaluate_with_degree(with_compute_scaled(w, 1 + (transport + codec_cpu) / c.compute_s), level_sizes, links,
                           domain_sizes, memory_cap_bytes, link_codecs, r, rb, late);
  c.transport_cpu_s = transport;
  c.codec_stretch_s = codec_cpu;
  return c;
}

}  // namespace

PlanCandidate evaluate_candidate(const Workload& w, const std::vector<int>& level_sizes,
                                 const std::vector<LinkModel>& links, const std::vector<int>& domain_sizes,
                                 double memory_cap_bytes, const std::vector<LinkCodecCost>& link_codecs) {
  // Forward degrees: the given one, or 1, 2, 4, 8 (those a given backward
  // degree divides, or that degree itself); backward: the given one, the
  // forward's where it follows, or each divisor of the forward's among 1, 2,
  // 4, 8 and the forward's. Ties go to the fewer chunks.
  std::vector<int> forward;
  if (w.pipeline_degree > 0) forward = {w.pipeline_degree};
  else
    for (int r : {1, 2, 4, 8})
      if (w.backward_pipeline_degree <= 0 || r % w.backward_pipeline_degree == 0) forward.push_back(r);
  if (forward.empty()) forward = {w.backward_pipeline_degree};
  PlanCandidate best;
  bool first = true;
  const bool late = w.replica_weight_gradients == ReplicaWeightGradients::kLate;
  for (int r : forward) {
    std::vector<int> backward;
    if (w.backward_pipeline_degree > 0) backward = {w.backward_pipeline_degree};
    else if (w.backward_pipeline_degree < 0) backward = {r};
    else
      for (int rb : {1, 2, 4, 8, r})
        if (rb <= r && r % rb == 0 && (backward.empty() || rb > backward.back())) backward.push_back(rb);
    for (int rb : backward) {  // evaluate_with_degree checks that rb divides r
      PlanCandidate c =
          evaluate_dilated(w, level_sizes, links, domain_sizes, memory_cap_bytes, link_codecs, r, rb, late);
      if (first || c.iteration_s < best.iteration_s * (1 - 1e-9)) best = std::move(c);
      first = false;
    }
  }
  // auto: late at the chosen degrees when clearly faster. Early stays the
  // default: late holds every replica gradient back until backward ends,
  // which costs a step whose link is busy all backward (the README demo's,
  // +12% measured) what it gains one whose tail is the dense buckets'
  // latency (bench/README.md).
  if (w.replica_weight_gradients == ReplicaWeightGradients::kAuto) {
    PlanCandidate held_back = evaluate_dilated(w, level_sizes, links, domain_sizes, memory_cap_bytes, link_codecs,
                                               best.pipeline_degree, best.backward_pipeline_degree, true);
    if (held_back.replica_weights_late && held_back.iteration_s < best.iteration_s * (1 - kPlanTieMargin))
      best = std::move(held_back);
  }
  // auto: grouped rows where clearly faster. Where no token crosses a link
  // (every level gathered) they tie, and a row per expert stays.
  if (w.grouped_rows_auto) {
    Workload grouped = w;
    grouped.grouped_rows = true;
    grouped.grouped_rows_auto = false;
    PlanCandidate once = evaluate_candidate(grouped, level_sizes, links, domain_sizes, memory_cap_bytes, link_codecs);
    if (once.iteration_s < best.iteration_s * (1 - kPlanTieMargin)) best = std::move(once);
  }
  best.a2a_imbalance = a2a_imbalance_for(w.a2a_imbalance, w.routed_a2a_imbalance, domain_sizes);
  return best;
}

std::vector<GatherHop> expert_gather_hops(double own_bytes, const std::vector<int>& domain_sizes,
                                          const std::vector<LinkCodecCost>& link_codecs) {
  // What the worker holds as the AG goes outer to inner: the bytes it got
  // exactly (its own, raw levels), and groups that crossed a lossy level.
  struct LossyGroup {
    double bytes, fraction, s_per_byte;
  };
  double exact = own_bytes;
  std::vector<LossyGroup> lossy_groups;
  std::vector<GatherHop> out;
  for (size_t l = 0; l < domain_sizes.size(); ++l) {
    const LinkCodecCost codec = link_codecs.empty() ? LinkCodecCost{} : link_codecs[l];
    const int s = domain_sizes[l];
    GatherHop hop;
    hop.raw_bytes = exact;
    for (const LossyGroup& g : lossy_groups) hop.raw_bytes += g.bytes;
    if (codec.gather_lossy() || lossy_groups.empty()) {
      hop.wire_bytes = hop.raw_bytes * codec.gather_fraction;
      hop.codec_s = hop.raw_bytes * codec.gather_s_per_byte;
    } else {
      hop.wire_bytes = exact;
      for (const LossyGroup& g : lossy_groups) {
        hop.wire_bytes += g.bytes * g.fraction;
        hop.codec_s += g.bytes * g.s_per_byte / 3;
      }
    }
    out.push_back(hop);
    if (s > 1 && codec.gather_lossy()) {
      lossy_groups.push_back({hop.raw_bytes * (s - 1), codec.gather_fraction, codec.gather_s_per_byte});
    } else if (s > 1) {
      exact *= s;
      for (LossyGroup& g : lossy_groups) g.bytes *= s;
    }
  }
  return out;
}

std::string pipeline_degrees_text(int forward, int backward, bool replicas_late) {
  return (forward == backward ? std::to_string(forward) : std::to_string(forward) + "/" + std::to_string(backward)) +
         (replicas_late ? ", late" : "");
}

int choose_candidate(const std::vector<PlanCandidate>& candidates) {
  int fastest = -1;
  for (int i = 0; i < static_cast<int>(candidates.size()); ++i)
    if (candidates[i].feasible && (fastest < 0 || candidates[i].iteration_s < candidates[fastest].iteration_s))
      fastest = i;
  if (fastest < 0) return -1;
  // Within kPlanTieMargin of the fastest the prediction cannot tell the
  // candidates apart: the one holding the fewest replicas wins (it uses the
  // least memory), then the faster.
  const double limit = candidates[fastest].iteration_s * (1 + kPlanTieMargin);
  int chosen = fastest;
  for (int i = 0; i < static_cast<int>(candidates.size()); ++i) {
    const PlanCandidate& c = candidates[i];
    if (!c.feasible || !(c.iteration_s <= limit)) continue;
    const PlanCandidate& best = candidates[chosen];
    if (c.gathered_bytes < best.gathered_bytes ||
        (c.gathered_bytes == best.gathered_bytes && c.iteration_s < best.iteration_s))
      chosen = i;
  }
  return chosen;
}

Plan plan_workload(const Workload& w, const std::vector<int>& level_sizes,
                   const std::vector<LinkModel>& links, const ExpertParallelSpec& ep,
                   const std::vector<LinkCodecCost>& link_codecs) {
  Plan plan;
  plan.mode = ep.mode;
  plan.chosen = -1;
  std::vector<int> wanted;
  if (ep.mode == EpMode::kEp) wanted.assign(level_sizes.size(), 1);
  if (ep.mode == EpMode::kHybrid) wanted = ep.domain_sizes;
  for (const auto& s : domain_candidates(level_sizes)) {
    plan.candidates.push_back(
        evaluate_candidate(w, level_sizes, links, s, ep.memory_cap_bytes, link_codecs));
    if (ep.mode != EpMode::kAuto && s == wanted) plan.chosen = static_cast<int>(plan.candidates.size()) - 1;
  }
  if (ep.mode == EpMode::kAuto) plan.chosen = choose_candidate(plan.candidates);
  XD_CHECK_MSG(plan.chosen >= 0, "no candidate chosen (hybrid domain sizes not a candidate?)");
  return plan;
}

Plan plan_iteration(const PlannerInputs& in) {
  const Status st = in.validate();
  XD_CHECK_MSG(st.is_ok(), st.message().c_str());
  return plan_workload(workload_of(in), in.level_sizes, in.links, in.expert_parallel, in.link_codecs);
}

}  // namespace xd
