// The coordinator's run summary (coordinator/detail/coordinator_impl.h):
// summary.json and the figures printed at the end of a run.
#include <cstdio>
#include <fstream>

#include "common/clock.h"
#include "common/log.h"
#include "coordinator/detail/coordinator_impl.h"

namespace xd {

void Coordinator::Impl::write_summary() {
  const StepSummary mean = metrics.mean(2);
  nlohmann::json j = {{"job", opts.job_name},
                      {"ok", outcome.is_ok() && state == JobState::kDone},
                      {"mode", ep_mode_name(plan.mode)},
                      {"domain_sizes", plan.choice().domain_sizes},
                      {"pipeline_degree", forward_degree()},
                      {"backward_pipeline_degree", backward_degree()},
                      {"replica_weight_gradients", replica_weight_gradients_name(replica_weight_gradients())},
                      {"tokens_once_per_worker", plan.choice().tokens_once_per_worker},
                      {"overlapped", job.train.farskip.overlapped},
                      {"connectivity", connectivity_name(job.train.model.layer_connectivity(0))},
                      {"world", registry.world_size()},
                      {"steps_complete", metrics.complete_steps().size()},
                      {"predicted_step_s", plan.choice().iteration_s},
                      {"startup_predicted_step_s", startup_predicted_s}};
  if (!startup_a2a_imbalance.empty()) j["startup_a2a_imbalance"] = startup_a2a_imbalance;
  j["startup_expert_imbalance"] = startup_expert_imbalance;
  if (!outcome.is_ok()) j["error"] = outcome.message();
  nlohmann::json losses = nlohmann::json::array(), step_times = nlohmann::json::array(),
                 step_numbers = nlohmann::json::array();
  int64_t skipped = 0;
  for (const StepSummary& s : metrics.complete_steps()) {
    losses.push_back(s.loss);
    step_times.push_back(s.step_s);
    step_numbers.push_back(s.step);
    skipped += s.skipped;
  }
  j["losses"] = losses;
  j["steps"] = step_numbers;  // the step each loss belongs to (a resumed run starts after its checkpoint)
  j["skipped_steps"] = skipped;
  j["started"] = running_since > 0;
  if (first_step_wall_s > 0) j["first_step_wall_s"] = first_step_wall_s;
  if (!resume_dir.empty()) j["resumed_from"] = {{"dir", resume_dir}, {"step", resume_step}};
  nlohmann::json cks = nlohmann::json::array();
  for (const CompletedCheckpoint& c : checkpoints->completed())
    cks.push_back({{"step", c.step}, {"dir", c.dir}, {"bytes", c.bytes}, {"write_s", c.write_s}});
  j["checkpoints"] = cks;
  j["step_times_s"] = step_times;
  j["plan_changes"] = plan_changes_json();
  if (replanner) j["compute_refits"] = replanner->compute_refits();
  if (replanner) j["a2a_imbalance_refits"] = replanner->imbalance_refits();
  if (replanner) j["codec_refits"] = replanner->codec_refits();
  if (replanner && !replanner->inputs().link_codecs.empty()) {
    // Per level, the codec fractions the planner holds now (measured at
    // start-up, as the last re-fit took them).
    nlohmann::json fractions = nlohmann::json::array();
    for (const LinkCodecCost& c : replanner->inputs().link_codecs)
      fractions.push_back({{"dispatch", c.dispatch_fraction}, {"combine", c.combine_fraction},
                           {"expert_gather", c.gather_fraction}, {"expert_grad", c.grad_fraction}});
    j["codec_fractions"] = fractions;
  }
  if (replanner && !replanner->inputs().a2a_imbalance.empty())
    j["a2a_imbalance"] = replanner->inputs().a2a_imbalance;  // per level, as the last re-fit took it
  // The last fit of each link class (docs/launch.md), bytes/s.
  if (replanner) j["measured_link_bytes_per_s"] = replanner->measured();
  if (const StepSummary* last = metrics.last_complete()) {
    j["final_loss"] = last->loss;
    j["final_ce_loss"] = last->ce_loss;
    j["mean_tokens_per_s"] = mean.tokens_per_s;
    j["mean_step_s"] = mean.step_s;
    j["mean_predicted_step_s"] = mean.predicted_step_s;  // each step's prediction as it ran (re-fits included)
    j["mean_compute_s"] = mean.compute_s;
    j["mean_compute_spread_s"] = mean.compute_spread_s();
    j["mean_comm_s"] = mean.comm_s;
    j["mean_exposed_comm_s"] = mean.exposed_comm_s;
    j["overlap_percent"] = mean.overlap_percent();
    j["mean_fwd_compute_s"] = mean.fwd_compute_s;
    j["mean_fwd_comm_s"] = mean.fwd_comm_s;
    j["mean_fwd_exposed_s"] = mean.fwd_exposed_s;
    j["fwd_overlap_percent"] = mean.fwd_overlap_percent();
    j["mean_bwd_compute_s"] = mean.bwd_compute_s;
    j["mean_bwd_comm_s"] = mean.bwd_comm_s;
    j["mean_bwd_exposed_s"] = mean.bwd_exposed_s;
    j["bwd_overlap_percent"] = mean.bwd_overlap_percent();
    j["mean_critical_fwd_exposed_s"] = mean.critical_fwd_exposed_s;
    j["critical_fwd_overlap_percent"] = mean.critical_fwd_overlap_percent();
    j["mean_critical_bwd_exposed_s"] = mean.critical_bwd_exposed_s;
    j["critical_bwd_overlap_percent"] = mean.critical_bwd_overlap_percent();
    j["mean_critical_waits_s"] = mean.critical_waits_s;
    j["step_over_bound"] = mean.step_over_bound();
    // The prediction again with the compute this run measured, so what is
    // left of the error is the communication and overlap model's. The
    // measured compute holds the transport's CPU time already.
    const PlanCandidate& choice = plan.choice();
    const double predicted_compute = choice.run_compute_s();
    if (predicted_compute > 0 && mean.compute_s > 0) {
      Workload w = with_compute_scaled(workload_of(plan_inputs), mean.compute_s / predicted_compute);
      drop_core_sharing(&w);
      w.pipeline_degree = choice.pipeline_degree;
      w.backward_pipeline_degree = choice.backward_pipeline_degree;
      w.replica_weight_gradients = replica_weight_gradients();
      const std::vector<int> levels = job.cluster.level_sizes();
      const PlanCandidate again = evaluate_candidate(w, levels, plan_inputs.links, choice.domain_sizes, 1e300,
                                                     plan_inputs.link_codecs);
      j["predicted_with_measured_compute_s"] = again.iteration_s;
    }
    j["mean_link_busy_s"] = mean.link_busy_s;
    j["mean_codec_s"] = mean.codec_s;
    j["bound_s"] = mean.bound_s();  // max(mean compute, mean busiest-link transmit time)
    // Each phase's own bound, summed (docs/overlap.md, "Measuring it").
    j["phase_floor_s"] = mean.phase_floor_s;
    j["step_over_phase_floor"] = mean.step_over_phase_floor();
    // The workers' CPU time on their busiest machine over the cores they share.
    j["cpu_floor_s"] = mean.cpu_floor_s;
    j["step_over_cpu_floor"] = mean.step_over_cpu_floor();
    j["bytes_per_step"] = mean.bytes;
    j["mean_nmse"] = mean.nmse;
    j["mean_codec_seconds"] = mean.codec_seconds;  // per link class and traffic kind
    j["mean_codec_encode_seconds"] = mean.codec_encode_seconds;
    j["mean_codec_decode_seconds"] = mean.codec_decode_seconds;
    j["gather_wait_s_per_layer"] = mean.gather_wait_s;
    j["peak_rss_bytes"] = mean.peak_rss_bytes;
  }
  if (!opts.summary_path.empty()) {
    std::ofstream out(opts.summary_path);
    out << j.dump(2) << "\n";
  }
  if (const StepSummary* last = metrics.last_complete()) {
    progress.clear();
    std::printf("summary: %zu steps | final loss %.4f | %.0f tok/s | step %.1f ms = compute %.1f + exposed comm %.1f (overlap %.0f%%) | bound %.1f ms (step / bound %.2f) | predicted %.1f ms | peak RSS %.0f MB\n",
                metrics.complete_steps().size(), last->loss, mean.tokens_per_s, mean.step_s * 1e3,
                mean.compute_s * 1e3, mean.exposed_comm_s * 1e3, mean.overlap_percent(), mean.bound_s() * 1e3,
                mean.bound_s() > 0 ? mean.step_s / mean.bound_s() : 0.0, mean.predicted_step_s * 1e3,
                mean.peak_rss_bytes / 1e6);
    if (j.contains("predicted_with_measured_compute_s"))
      std::printf("  predicted with the measured compute: %.1f ms (measured %.1f ms)\n",
                  j["predicted_with_measured_compute_s"].get<double>() * 1e3, mean.step_s * 1e3);
    std::printf("  forward:  compute %.1f ms, comm %.1f ms, exposed %.1f ms, overlap %.0f%% (the slowest worker's: "
                "exposed %.1f ms, overlap %.0f%%)\n",
                mean.fwd_compute_s * 1e3, mean.fwd_comm_s * 1e3, mean.fwd_exposed_s * 1e3,
                mean.fwd_overlap_percent(), mean.critical_fwd_exposed_s * 1e3, mean.critical_fwd_overlap_percent());
    std::printf("  backward: compute %.1f ms, comm %.1f ms, exposed %.1f ms, overlap %.0f%% (the slowest worker's: "
                "exposed %.1f ms, overlap %.0f%%)\n",
                mean.bwd_compute_s * 1e3, mean.bwd_comm_s * 1e3, mean.bwd_exposed_s * 1e3,
                mean.bwd_overlap_percent(), mean.critical_bwd_exposed_s * 1e3, mean.critical_bwd_overlap_percent());
    if (const std::string waits = waits_text(mean.critical_waits_s); !waits.empty())
      std::printf("  the slowest worker waited for (ms): %s\n", waits.c_str());
    std::printf("  compute spread %.1f ms: the slowest worker's compute minus the fastest's, which the others "
                "wait out as exposed communication\n",
                mean.compute_spread_s() * 1e3);
    std::printf("  phase floor %.1f ms (step / phase floor %.2f): each phase's own max(compute, link), summed; "
                "a phase's traffic cannot use the other's idle link\n",
                mean.phase_floor_s * 1e3, mean.step_over_phase_floor());
    if (mean.cpu_floor_s > 0)
      std::printf("  CPU floor %.1f ms (step / CPU floor %.2f): the workers' CPU time on their busiest machine over "
                  "the cores they share; above the bound when more threads share the cores than they have\n",
                  mean.cpu_floor_s * 1e3, mean.step_over_cpu_floor());
    for (const auto& [k, v] : mean.bytes) std::printf("  bytes/step %-24s %12.0f\n", k.c_str(), v);
    for (const auto& [k, v] : mean.nmse) std::printf("  codec NMSE %-24s %12.4g\n", k.c_str(), v);
    for (const auto& [k, v] : mean.codec_seconds) {
      auto part = [&](const std::map<std::string, double>& m) { return m.count(k) ? m.at(k) * 1e3 : 0.0; };
      std::printf("  codec ms   %-24s %12.2f  (encode %.2f, decode %.2f)\n", k.c_str(), v * 1e3,
                  part(mean.codec_encode_seconds), part(mean.codec_decode_seconds));
    }
    if (!mean.gather_wait_s.empty()) {
      std::printf("  wait for gathered experts per layer (ms):");
      for (double w : mean.gather_wait_s) std::printf(" %.1f", w * 1e3);
      std::printf("\n");
    }
    std::fflush(stdout);
  }
}

}  // namespace xd
