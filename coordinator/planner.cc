#include "coordinator/planner.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "coordinator/detail/step_timeline.h"

namespace xd {

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

// Overlapped, the transport's threads run beside the compute and take its
// cores for their CPU time per message and per byte sent (a worker receives
// about as much), and so do the codecs where they share the cores: the
// compute stretches by that much, spread over the step.
PlanCandidate evaluate_dilated(const Workload& w, const std::vector<int>& level_sizes,
                               const std::vector<LinkModel>& links, const std::vector<int>& domain_sizes,
                               double memory_cap_bytes, const std::vector<LinkCodecCost>& link_codecs, int r,
                               int rb, bool late) {
  PlanCandidate c =
      detail::evaluate_with_degree(w, level_sizes, links, domain_sizes, memory_cap_bytes, link_codecs, r, rb, late);
  const double codec_cpu = w.codecs_share_compute_cores ? c.codec_cpu_s : 0.0;
  if (!w.overlapped || !(w.transport_cpu_s_per_byte > 0 || w.transport_cpu_s_per_message > 0 || codec_cpu > 0) ||
      !(c.compute_s > 0))
    return c;
  double bytes = 0, messages = 0;
  for (double b : c.level_bytes) bytes += b;
  for (double m : c.level_messages) messages += m;
  const double transport = w.transport_cpu_s_per_byte * bytes + w.transport_cpu_s_per_message * messages;
  c = detail::evaluate_with_degree(with_compute_scaled(w, 1 + (transport + codec_cpu) / c.compute_s), level_sizes, links,
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

double dense_wire_fraction(const std::vector<LinkCodecCost>& link_codecs, int level) {
  if (link_codecs.empty()) return 1;
  const int innermost = static_cast<int>(link_codecs.size()) - 1;
  if (level == innermost) return link_codecs[level].dense_fraction;
  double outer = 1;
  for (int l = 0; l < innermost; ++l) outer = std::min(outer, link_codecs[l].dense_fraction);
  return outer;
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
    if (codec.gather_coded() || lossy_groups.empty()) {
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
    if (s > 1 && codec.gather_relayed()) {
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
