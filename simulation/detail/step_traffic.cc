#include "simulation/detail/step_traffic.h"

#include <algorithm>

#include "common/check.h"

namespace xd::detail {

StepTraffic::StepTraffic(const SimulationInputs& in, const StepSchedule& schedule)
    : in_(in), topo_(in.level_sizes, in.domain_sizes), r_(schedule.pipeline_degree) {
  double gathered = 1;
  for (int s : in.domain_sizes) gathered *= s;
  held_ = in.workload.experts_per_worker * gathered;
  token_share_ = grouped_row_share(in.workload, held_);
  gathered_ = gathered;
  defers_owned_ = schedule.defers_owned_expert_weights;
  defers_replicas_ = schedule.defers_replica_expert_weights;
  defers_first_layer_ = schedule.defers_first_layer_expert_weights;
}

double StepTraffic::compute_seconds(ComputeKind kind) const {
  const Workload& w = in_.workload;
  // As the planner splits a layer: attention (a) is the q/k/v part, the
  // router its GEMMs, attention (b) the rest before the shared experts;
  // backward costs what the planner's backward/forward ratio says.
  const double bwd_scale = w.pre_expert_fwd_s > 0 ? w.pre_expert_bwd_s / w.pre_expert_fwd_s : 2.0;
  const double attention = std::max(0.0, w.pre_expert_fwd_s - w.shared_fwd_s);
  const double router = std::min(w.router_fwd_s, attention);
  const double qkv = std::min(w.attention_qkv_fwd_s, attention - router);
  const double expert_fwd = w.expert_fwd_s / r_ + 3 * held_ * w.gemm_overhead_s;
  const double expert_bwd = w.expert_bwd_s / r_ + 6 * held_ * w.gemm_overhead_s;
  switch (kind) {
    case ComputeKind::kAttentionA: return qkv;
    case ComputeKind::kRouter: return router;
    case ComputeKind::kAttentionB: return attention - router - qkv;
    case ComputeKind::kRoutedExperts: return expert_fwd;
    case ComputeKind::kSharedExperts: return w.shared_fwd_s;
    case ComputeKind::kHead: return w.post_s / 3;
    case ComputeKind::kHeadBackward: return w.post_s * 2 / 3;
    case ComputeKind::kAttentionBackward: return (attention - router) * bwd_scale;
    case ComputeKind::kRouterBackward: return router * bwd_scale;
    case ComputeKind::kExpertsInputBackward: return expert_bwd / 2;
    // Deferring, a layer's chunk keeps the replicas' share of its weight
    // half (the owned experts are 1 / gathered of those held), and the
    // owned share of every layer's chunks runs at the end; late, the
    // replicas' share of every layer's chunks runs there too, first.
    case ComputeKind::kExpertsWeightBackward:
      return defers_replicas_ ? 0.0 : expert_bwd / 2 * (defers_owned_ ? 1 - 1 / gathered_ : 1);
    case ComputeKind::kOwnedExpertsWeightBackward:
      if (defers_first_layer_) return r_ * expert_bwd / 2;  // EP: layer 0's, every chunk
      return defers_owned_ ? w.num_moe_layers * r_ * expert_bwd / 2 / gathered_ : 0;
    case ComputeKind::kReplicaExpertsWeightBackward:  // one layer's, before its send
      return defers_replicas_ ? r_ * expert_bwd / 2 * (1 - 1 / gathered_) : 0;
    case ComputeKind::kSharedBackward: return w.shared_fwd_s * bwd_scale;
    case ComputeKind::kOptimizer: return w.optimizer_s;
  }
  return 0;
}

double StepTraffic::fraction(int level, CommKind kind) const {
  if (in_.link_codecs.empty()) return 1;
  const LinkCodecCost& c = in_.link_codecs[level];
  switch (kind) {
    case CommKind::kDispatch:
    case CommKind::kCombineBackward: return c.dispatch_fraction;  // the to-experts pipeline
    case CommKind::kCombine:
    case CommKind::kDispatchBackward: return c.combine_fraction;
    case CommKind::kExpertGather: return c.gather_fraction;
    case CommKind::kReplicaGradients: return c.grad_fraction;
    case CommKind::kDenseBucket: return dense_wire_fraction(in_.link_codecs, level);
    case CommKind::kNormSum: return 1;
  }
  return 1;
}

std::vector<CommPhase> StepTraffic::phases(const ScheduledComm& comm, int rank) const {
  std::vector<CommPhase> out;
  const double chunk_bytes = in_.workload.token_bytes / r_ * comm.span;
  switch (comm.kind) {
    case CommKind::kDispatch: a2a_phases(rank, chunk_bytes, true, true, &out); break;
    case CommKind::kCombineBackward: a2a_phases(rank, chunk_bytes, true, true, &out); break;
    case CommKind::kCombine: a2a_phases(rank, chunk_bytes, false, false, &out); break;
    case CommKind::kDispatchBackward: a2a_phases(rank, chunk_bytes, false, false, &out); break;
    case CommKind::kExpertGather: expert_phases(rank, true, &out); break;
    case CommKind::kReplicaGradients: expert_phases(rank, false, &out); break;
    case CommKind::kDenseBucket:
      XD_CHECK(comm.chunk >= 0 && comm.chunk < (int)in_.dense_bucket_bytes.size());
      dense_phases(rank, in_.dense_bucket_bytes[comm.chunk], &out);
      break;
    case CommKind::kNormSum: norm_phases(rank, &out); break;
  }
  for (CommPhase& p : out) {
    for (auto& [peer, bytes] : p.sends) p.bytes += bytes;
    if (p.mean_bytes == 0) p.mean_bytes = p.bytes;  // not an A2A: no imbalance
  }
  return out;
}

// Toward the experts the rows cross the outer level first (HybridExpertExchange
// moves level 0 first); back to the sources the inner level first. At level
// l a worker sends D S^l / SF^l bytes to each of its SF^l / S^l - 1 A2A peers
// (tokens routed uniformly, as the planner assumes); with a token once per
// worker, the planner's share of them (grouped_row_share).
void StepTraffic::a2a_phases(int rank, double bytes, bool outer_first, bool dispatch_codec,
                             std::vector<CommPhase>* out) const {
  const int levels = topo_.num_levels();
  bytes *= token_share_[outer_first ? 0 : 1];
  for (int i = 0; i < levels; ++i) {
    const int l = outer_first ? i : levels - 1 - i;
    const std::vector<int> peers = topo_.a2a_peers(rank, l);
    if (peers.empty()) continue;
    const int sf = topo_.level_sizes()[l], s = topo_.domain_sizes()[l];
    const double per_peer =
        bytes * s / sf * fraction(l, dispatch_codec ? CommKind::kDispatch : CommKind::kCombine);
    const double imbalance = l < (int)in_.a2a_imbalance.size() ? in_.a2a_imbalance[l] : 1.0;
    CommPhase p;
    p.level = l;
    for (int peer : peers) p.sends.emplace_back(peer, per_peer * imbalance);
    p.mean_bytes = per_peer * double(peers.size());
    p.group_root = topo_.with_coordinate(rank, l, topo_.offset(rank, l));
    p.group_size = sf / s;
    p.group_first = topo_.offset(rank, l);
    p.group_stride = s;
    out->push_back(std::move(p));
  }
}

// The AG of one layer, outer level first: at level l a worker sends the
// experts it holds after the outer levels, n P_E prod_{j<l} S^j raw bytes
// (through the level's codec, or relayed: expert_gather_hops), to each of its
// S^l - 1 domain peers. Replica gradients go back inner level first.
void StepTraffic::expert_phases(int rank, bool gather, std::vector<CommPhase>* out) const {
  const int levels = topo_.num_levels();
  std::vector<CommPhase> by_level;
  // Per peer and level, what the worker holds and what crosses (relays included).
  const std::vector<GatherHop> hops = expert_gather_hops(in_.workload.experts_per_worker * in_.workload.expert_bytes,
                                                         topo_.domain_sizes(), in_.link_codecs);
  for (int l = 0; l < levels; ++l) {
    const int s = topo_.domain_sizes()[l];
    if (s > 1) {
      CommPhase p;
      p.level = l;
      const double per_peer =
          gather ? hops[l].wire_bytes : hops[l].raw_bytes * fraction(l, CommKind::kReplicaGradients);
      for (int peer : topo_.ag_peers(rank, l)) p.sends.emplace_back(peer, per_peer);
      p.group_root = topo_.with_coordinate(rank, l, topo_.domain(rank, l) * s);
      p.group_size = s;
      p.group_first = topo_.domain(rank, l) * s;
      by_level.push_back(std::move(p));
    }
  }
  if (!gather) std::reverse(by_level.begin(), by_level.end());
  for (CommPhase& p : by_level) out->push_back(std::move(p));
}

// DistributedTrainer::sum_over_world: one double to every other member of the
// innermost level's group, then to every other member of each outer level's
// (the runtime's outer group spans the outer levels at once: with more than
// two levels this prices one round per outer level).
void StepTraffic::norm_phases(int rank, std::vector<CommPhase>* out) const {
  for (int l = topo_.num_levels() - 1; l >= 0; --l) {
    const std::vector<int> group = topo_.level_group(rank, l);
    if (group.size() < 2) continue;
    CommPhase p;
    p.level = l;
    p.group_root = group.front();
    p.group_size = static_cast<int>(group.size());
    for (int peer : group)
      if (peer != rank) p.sends.emplace_back(peer, double(sizeof(double)));
    out->push_back(std::move(p));
  }
}

// The hierarchical all-reduce of one bucket (Communicator, as the planner
// prices it): a reduce-scatter per level, inner level first, each on the
// shard the inner levels left; then the all-gathers in reverse. A phase sends
// a 1/SF^l block to every other member of the level group, or, from the
// Communicator's ring threshold on, goes round a ring in SF^l - 1 rounds.
// Where the runtime all-reduces in one round (dense_stage, coordinator/
// planner.h), one phase sends the whole shard to every other member, between
// the reduce-scatters and the all-gathers.
void StepTraffic::dense_phases(int rank, double bytes, std::vector<CommPhase>* out) const {
  const int levels = topo_.num_levels();
  std::vector<CommPhase> reduce, one_shot;
  double shard = bytes;
  for (int l = levels - 1; l >= 0; --l) {
    const int sf = topo_.level_sizes()[l];
    if (sf > 1 && shard > 0) {
      const double block = shard / sf * fraction(l, CommKind::kDenseBucket);
      const std::vector<int> group = topo_.level_group(rank, l);
      const int me = topo_.coordinate(rank, l);
      const DenseStage stage = dense_stage(topo_.level_sizes(), l, shard);
      CommPhase p;
      p.level = l;
      p.group_root = group.front();
      p.group_size = sf;
      if (stage == DenseStage::kOneRound) {
        // One round: the whole shard to every other member, then no split.
        for (int peer : group)
          if (peer != rank) p.sends.emplace_back(peer, block * sf);
        one_shot.push_back(std::move(p));
        continue;
      }
      if (stage == DenseStage::kRing) {
        p.sends.emplace_back(group[(me + 1) % sf], block);
        for (int round = 0; round < sf - 1; ++round) reduce.push_back(p);
      } else {
        for (int peer : group)
          if (peer != rank) p.sends.emplace_back(peer, block);
        reduce.push_back(std::move(p));
      }
    }
    shard /= sf;
  }
  for (const CommPhase& p : reduce) out->push_back(p);
  for (const CommPhase& p : one_shot) out->push_back(p);
  for (auto it = reduce.rbegin(); it != reduce.rend(); ++it) out->push_back(*it);
}

}  // namespace xd::detail
