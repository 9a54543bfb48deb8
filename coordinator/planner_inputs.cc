// The planner's inputs (coordinator/planner.h): the job's figures turned
// into a Workload, their checks, and the domain candidates.
#include <algorithm>
#include <cmath>

#include "cluster/topology.h"
#include "coordinator/planner.h"
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
  // A compute figure that must be finite and at least `floor` ("0" or "1").
  auto finite_at_least = [&](double value, double floor, const char* name, const char* floor_text) {
    return value >= floor && std::isfinite(value)
               ? Status::ok()
               : bad(std::string("compute.") + name + " must be finite and >= " + floor_text);
  };
  XD_RETURN_IF_ERROR(finite_at_least(compute.non_gemm_factor, 1, "non_gemm_factor", "1"));
  XD_RETURN_IF_ERROR(finite_at_least(compute.optimizer_s_per_param, 0, "optimizer_s_per_param", "0"));
  XD_RETURN_IF_ERROR(finite_at_least(compute.transport_cpu_s_per_byte, 0, "transport_cpu_s_per_byte", "0"));
  XD_RETURN_IF_ERROR(finite_at_least(compute.exchange_cpu_s_per_byte, 0, "exchange_cpu_s_per_byte", "0"));
  XD_RETURN_IF_ERROR(finite_at_least(compute.transport_cpu_s_per_message, 0, "transport_cpu_s_per_message", "0"));
  XD_RETURN_IF_ERROR(finite_at_least(compute.exchange_cpu_s_per_message, 0, "exchange_cpu_s_per_message", "0"));
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

}  // namespace xd
