// xdmoe plan: every expert-domain candidate of a job with its predicted
// per-stream times, and the planner's choice (coordinator/planner.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "common/check.h"
#include "cluster/job_config.h"
#include "coordinator/job_planner.h"

namespace xd::cli {

namespace {

struct PlanOptions {
  std::string config, mode;
  std::vector<int> domains;
  bool json = false;
  bool probe = true;  // as the coordinator
  ScheduleOverrides schedule;
};

std::string fmt_bytes(double b) {
  char buf[64];
  if (std::isinf(b)) return "unlimited";
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.2f MB", b / 1e6);
  else if (b >= 1e3) std::snprintf(buf, sizeof buf, "%.1f KB", b / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

std::string fmt_seconds(double s) {
  char buf[64];
  if (std::abs(s) >= 1) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (std::abs(s) >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  return buf;
}

std::string fmt_list(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

int run_plan(const PlanOptions& o) {
  JobConfig job = default_job_config();
  std::string source = "the built-in default";
  if (!o.config.empty()) {
    auto loaded = load_job_config(o.config);
    if (!loaded) {
      std::fprintf(stderr, "xdmoe plan: %s\n", loaded.status().message().c_str());
      return 2;
    }
    job = std::move(*loaded);
    source = o.config;
  }
  if (Status st = override_schedule(&job, o.schedule); !st.is_ok()) {
    std::fprintf(stderr, "xdmoe plan: %s\n", st.message().c_str());
    return 2;
  }
  if (Status st = override_expert_parallel(&job, o.mode, o.domains); !st.is_ok()) {
    std::fprintf(stderr, "xdmoe plan: %s\n", st.message().c_str());
    return 2;
  }
  JobPlanOptions po;
  po.probe_links = o.probe;
  if (!o.json)
    po.progress = [](const std::string& what) {
      std::fprintf(stderr, "%s ...\n", what.c_str());
      std::fflush(stderr);
    };
  auto planned = plan_job(job, po);
  if (!planned) {
    std::fprintf(stderr, "xdmoe plan: %s: %s\n", source.c_str(), planned.status().message().c_str());
    return 2;
  }
  const PlannerInputs& in = planned->inputs;
  const ComputeModel& compute = planned->compute;
  const LinearFit& gemm_fit = planned->gemm_fit;
  const StepProbe& step_probe = planned->step_probe;
  const std::vector<LinkEstimate>& links = planned->links;
  if (!o.json) {
    if (gemm_fit.r2 < 0.9)
      std::fprintf(stderr, "note: the GEMM probe was noisy (r2 %.3f); is the machine busy?\n", gemm_fit.r2);
    if (!planned->compute_note.empty()) std::fprintf(stderr, "note: %s\n", planned->compute_note.c_str());
    for (const LinkEstimate& e : links)
      if (!e.note.empty()) std::fprintf(stderr, "note: level '%s': %s; its figures come from the spec\n",
                                        e.name.c_str(), e.note.c_str());
    for (const std::string& s : settings_without_effect(job)) std::fprintf(stderr, "note: %s\n", s.c_str());
    if (!planned->routing_note.empty())
      std::fprintf(stderr, "note: routing not probed (%s); uniform routing (F = 1) until the run measures it\n",
                   planned->routing_note.c_str());
  }
  const Workload w = workload_of(in);
  const Plan& plan = planned->plan;
  // The chosen domains again with every worker computing as many routed
  // rows: what the routing's imbalance costs the step.
  double even_load_s = plan.choice().iteration_s;
  if (!planned->inputs.routed_expert_load.empty()) {
    PlannerInputs even = planned->inputs;
    even.routed_expert_load.clear();
    const Plan again = plan_iteration(even);
    const auto same = std::find_if(again.candidates.begin(), again.candidates.end(), [&](const PlanCandidate& c) {
      return c.domain_sizes == plan.choice().domain_sizes;
    });
    XD_CHECK(same != again.candidates.end());  // the same inputs but the loads: the same candidates
    even_load_s = same->iteration_s;
  }
  const PlanCandidate& choice = plan.choice();
  const ExpertParallelSpec& ep = job.cluster.expert_parallel;

  if (o.json) {
    nlohmann::json j;
    j["config"] = source;
    j["world_size"] = job.cluster.world_size();
    j["levels"] = nlohmann::json::array();
    for (size_t l = 0; l < links.size(); ++l)
      j["levels"].push_back({{"name", links[l].name},
                             {"size", job.cluster.levels[l].size},
                             {"alpha_s", links[l].model.alpha_s},
                             {"beta_s_per_byte", links[l].model.beta_s_per_byte},
                             {"configured_alpha_s", links[l].configured.alpha_s},
                             {"configured_beta_s_per_byte", links[l].configured.beta_s_per_byte},
                             {"source", links[l].source},
                             {"codecs", link_codecs_to_json(links[l].codecs)},
                             {"codec_wire_fraction", {{"dispatch", links[l].codec_cost.dispatch_fraction},
                                                      {"combine", links[l].codec_cost.combine_fraction},
                                                      {"expert_gather", links[l].codec_cost.gather_fraction},
                                                      {"expert_grad", links[l].codec_cost.grad_fraction},
                                                      {"dense_grad", links[l].codec_cost.dense_fraction}}},
                             {"codec_s_per_byte", {{"dispatch", links[l].codec_cost.dispatch_s_per_byte},
                                                   {"combine", links[l].codec_cost.combine_s_per_byte},
                                                   {"expert_gather", links[l].codec_cost.gather_s_per_byte},
                                                   {"expert_grad", links[l].codec_cost.grad_s_per_byte}}},
                             {"r2", links[l].r2},
                             {"cpu_s_per_byte", links[l].cpu_s_per_byte},
                             {"cpu_s_per_message", links[l].cpu_s_per_message}});
    j["compute"] = {{"flops_per_s", compute.flops_per_s},
                    {"gemm_overhead_s", compute.gemm_overhead_s},
                    {"r2", gemm_fit.r2},
                    {"non_gemm_factor", compute.non_gemm_factor},
                    {"optimizer_s_per_param", compute.optimizer_s_per_param},
                    {"transport_cpu_s_per_byte", compute.transport_cpu_s_per_byte},
                    {"transport_cpu_s_per_message", compute.transport_cpu_s_per_message},
                    {"exchange_cpu_s_per_byte", compute.exchange_cpu_s_per_byte},
                    {"exchange_cpu_s_per_message", compute.exchange_cpu_s_per_message},
                    {"codecs_share_compute_cores", compute.codecs_share_compute_cores},
                    {"step_probe_tokens", step_probe.tokens},
                    {"step_probe_copies", step_probe.copies},
                    {"step_probe_s", step_probe.seconds},
                    {"step_probe_windows_s", planned->step_probe_windows}};
    if (planned->routing.workers > 0)
      j["routing_probe"] = {{"tokens_per_worker", planned->routing.tokens_per_worker},
                            {"seconds", planned->routing.seconds}};
    else
      j["routing_probe"] = {{"note", planned->routing_note}};
    j["workload"] = {{"num_moe_layers", w.num_moe_layers},
                     {"experts_per_worker", w.experts_per_worker},
                     {"expert_bytes", w.expert_bytes},
                     {"token_bytes", w.token_bytes},
                     {"dense_param_bytes", w.dense_param_bytes},
                     {"pre_expert_fwd_s", w.pre_expert_fwd_s},
                     {"pre_expert_bwd_s", w.pre_expert_bwd_s},
                     {"expert_fwd_s", w.expert_fwd_s},
                     {"expert_bwd_s", w.expert_bwd_s},
                     {"post_s", w.post_s}};
    j["mode"] = ep_mode_name(plan.mode);
    j["memory_cap_bytes"] = std::isinf(ep.memory_cap_bytes) ? nlohmann::json(nullptr)
                                                            : nlohmann::json(ep.memory_cap_bytes);
    j["chosen"] = plan.chosen;
    j["even_expert_load_iteration_s"] = even_load_s;
    j["chosen_domain_sizes"] = choice.domain_sizes;
    j["chosen_pipeline_degree"] = choice.pipeline_degree;
    j["chosen_backward_pipeline_degree"] = choice.backward_pipeline_degree;
    j["chosen_replica_weight_gradients"] =
        replica_weight_gradients_name(replica_weight_gradients_of(choice.replica_weights_late));
    j["overlapped"] = w.overlapped;
    j["tokens_once_per_worker"] = tokens_once_per_worker_name(in.expert_parallel.tokens_once_per_worker);
    j["chosen_tokens_once_per_worker"] = choice.tokens_once_per_worker;
    j["candidates"] = nlohmann::json::array();
    for (const PlanCandidate& c : plan.candidates)
      j["candidates"].push_back({{"domain_sizes", c.domain_sizes},
                                 {"compute_s", c.compute_s},
                                 {"transport_cpu_s", c.transport_cpu_s},
                                 {"codec_cpu_s", c.codec_cpu_s},
                                 {"codec_stretch_s", c.codec_stretch_s},
                                 {"exchange_cpu_s", c.exchange_cpu_s},
                                 {"a2a_s", c.a2a_s},
                                 {"exposed_a2a_s", c.exposed_a2a_s},
                                 {"pipeline_degree", c.pipeline_degree},
                                 {"backward_pipeline_degree", c.backward_pipeline_degree},
                                 {"replica_weights_late", c.replica_weights_late},
                                 {"tokens_once_per_worker", c.tokens_once_per_worker},
                                 {"exposed_allreduce_s", c.exposed_allreduce_s},
                                 {"ag_s", c.ag_s},
                                 {"rs_s", c.rs_s},
                                 {"allreduce_s", c.allreduce_s},
                                 {"exposed_ag_s", c.exposed_ag_s},
                                 {"exposed_rs_s", c.exposed_rs_s},
                                 {"iteration_s", c.iteration_s},
                                 {"gathered_bytes", c.gathered_bytes},
                                 {"level_bytes", c.level_bytes},
                                 {"level_messages", c.level_messages},
                                 {"a2a_imbalance", c.a2a_imbalance},
                                 {"expert_imbalance", c.expert_imbalance},
                                 {"expert_wait_s", c.expert_wait_s},
                                 {"feasible", c.feasible},
                                 {"why_infeasible", c.why_infeasible}});
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::string layout;
    for (const LevelSpec& l : job.cluster.levels)
      layout += (layout.empty() ? "" : " x ") + l.name + " " + std::to_string(l.size);
    std::printf("plan for %s: %d workers = %s; mode %s; memory cap %s\n", source.c_str(),
                job.cluster.world_size(), layout.c_str(), ep_mode_name(plan.mode),
                fmt_bytes(ep.memory_cap_bytes).c_str());
    std::printf("per worker: %d MoE layers, %g experts per layer, P_E %s per expert, D %s per A2A, "
                "%lld tokens/step, dense params %s\n",
                w.num_moe_layers, w.experts_per_worker, fmt_bytes(w.expert_bytes).c_str(),
                fmt_bytes(w.token_bytes).c_str(), in.tokens_per_worker,
                fmt_bytes(w.dense_param_bytes).c_str());
    std::string windows;  // the step probe's windows, when more than one ran
    if (planned->step_probe_windows.size() > 1) {
      windows = ", the median of " + std::to_string(planned->step_probe_windows.size()) + " windows: ";
      windows += fmt_seconds(planned->step_probe_windows.front());
      windows += " to ";
      windows += fmt_seconds(planned->step_probe_windows.back());
    }
    std::printf("compute: %.2f GFLOP/s + %s per GEMM call (local sgemm probe, r2 %.4f), x %.2f for "
                "the non-GEMM work (a model step of %lld tokens took %s%s, %s); the optimizer "
                "%s per step (%.1f ns per parameter)\n",
                compute.flops_per_s / 1e9, fmt_seconds(compute.gemm_overhead_s).c_str(), gemm_fit.r2,
                compute.non_gemm_factor, step_probe.tokens, fmt_seconds(step_probe.seconds).c_str(),
                windows.c_str(),
                step_probe.copies > 1 ? (std::to_string(step_probe.copies) + " copies at once").c_str()
                                      : "one copy",
                fmt_seconds(w.optimizer_s).c_str(), compute.optimizer_s_per_param * 1e9);
    if (w.transport_cpu_s_per_byte > 0 || w.transport_cpu_s_per_message > 0)
      std::printf("the transport's threads share the compute's cores (workers fill this machine): overlapped, "
                  "compute stretches by %s per message and %.2f ns per byte sent (the chosen plan: %.0f "
                  "messages, %s a step)\n",
                  fmt_seconds(w.transport_cpu_s_per_message).c_str(), w.transport_cpu_s_per_byte * 1e9,
                  std::accumulate(choice.level_messages.begin(), choice.level_messages.end(), 0.0),
                  fmt_seconds(choice.transport_cpu_s).c_str());
    if (choice.codec_stretch_s > 0)
      std::printf("the codecs' encode and decode share the compute's cores (workers fill this machine): "
                  "overlapped, compute stretches by their %s a step (the chosen plan's, at the measured seconds "
                  "per byte)\n",
                  fmt_seconds(choice.codec_stretch_s).c_str());
    if (!w.overlapped && (w.exchange_cpu_s_per_byte > 0 || w.exchange_cpu_s_per_message > 0))
      std::printf("not overlapped, each token exchange and dense bucket runs on the compute thread: %s per "
                  "message and %.2f ns per byte sent of transport CPU that compute waits out (the chosen "
                  "plan: %s a step, in the exposed columns)\n",
                  fmt_seconds(w.exchange_cpu_s_per_message).c_str(), w.exchange_cpu_s_per_byte * 1e9,
                  fmt_seconds(choice.exchange_cpu_s).c_str());
    std::printf("links:\n");
    std::string relayed_gather;  // the outer link classes whose all-gather the raw levels inside relay
    for (const LinkEstimate& ls : links) {
      std::printf("  %-10s alpha %-10s beta %.3g s/B (%s/s)  [%s", ls.name.c_str(),
                  fmt_seconds(ls.model.alpha_s).c_str(), ls.model.beta_s_per_byte,
                  fmt_bytes(1.0 / ls.model.beta_s_per_byte).c_str(), ls.source.c_str());
      if (ls.source == "probe")
        std::printf(", r2 %.4f; configured alpha %s, %s/s; transport CPU %s a message + %.2f ns/B", ls.r2,
                    fmt_seconds(ls.configured.alpha_s).c_str(), fmt_bytes(1.0 / ls.configured.beta_s_per_byte).c_str(),
                    fmt_seconds(ls.cpu_s_per_message).c_str(), ls.cpu_s_per_byte * 1e9);
      std::printf("]\n");
      const LinkCodecCost& cc = ls.codec_cost;
      if (ls.codecs.dispatch != "raw" || ls.codecs.combine != "raw")
        std::printf("  %-10s token codecs: dispatch %s (%.2f of the bytes, %.2f ns/B), combine %s (%.2f, %.2f ns/B)\n",
                    "", ls.codecs.dispatch.c_str(), cc.dispatch_fraction, cc.dispatch_s_per_byte * 1e9,
                    ls.codecs.combine.c_str(), cc.combine_fraction, cc.combine_s_per_byte * 1e9);
      if (ls.codecs.expert_gather != "raw" || ls.codecs.expert_grad != "raw")
        std::printf("  %-10s expert codecs: gather %s (%.3f of the bytes, %.2f ns/B), grad %s (%.3f, %.2f ns/B)\n",
                    "", ls.codecs.expert_gather.c_str(), cc.gather_fraction, cc.gather_s_per_byte * 1e9,
                    ls.codecs.expert_grad.c_str(), cc.grad_fraction, cc.grad_s_per_byte * 1e9);
      if (ls.codecs.dense_grad != "raw")
        std::printf("  %-10s dense gradients: %s (%.2f of the bytes)\n", "", ls.codecs.dense_grad.c_str(),
                    cc.dense_fraction);
      if (cc.gather_relayed())  // as the planner prices it (expert_gather_hops)
        relayed_gather += (relayed_gather.empty() ? "" : ", ") + ls.name;
      else if (!cc.gather_coded() && !relayed_gather.empty())
        std::printf("  %-10s expert all-gather: relays what crossed %s as it arrived (docs/compression.md, Relays)\n",
                    "", relayed_gather.c_str());
    }
    const std::string backward = w.backward_pipeline_degree > 0   ? std::to_string(w.backward_pipeline_degree)
                                 : w.backward_pipeline_degree == 0 ? "auto (the best divisor of r)"
                                                                   : "r";
    std::printf("schedule: %s (farskip.overlapped), pipeline degree r %s, backward %s, connectivity %s, "
                "replica weight gradients %s, %s\n",
                w.overlapped ? "overlapped" : "simple, token exchanges and dense all-reduce in series",
                w.pipeline_degree > 0 ? std::to_string(w.pipeline_degree).c_str() : "auto (best of 1, 2, 4, 8)",
                backward.c_str(), connectivity_name(in.model.layer_connectivity(0)),
                replica_weight_gradients_name(w.replica_weight_gradients),
                w.grouped_rows        ? "a token once per worker"
                : w.grouped_rows_auto ? "a token once per worker where clearly faster (auto)"
                                      : "a token row per expert");
    if (planned->routing.workers > 0) {
      std::string fs;
      for (const PlanCandidate& c : plan.candidates) {
        fs += (fs.empty() ? " " : ", ") + fmt_list(c.domain_sizes);
        for (double f : c.a2a_imbalance) {
          char one[32];
          std::snprintf(one, sizeof one, " %.2f", f);
          fs += one;
        }
      }
      std::string names, loads;
      for (const LinkEstimate& ls : links) names += (names.empty() ? "" : ", ") + ls.name;
      for (const PlanCandidate& c : plan.candidates) {
        char one[64];
        std::snprintf(one, sizeof one, "%s%s %.2f", loads.empty() ? " " : ", ", fmt_list(c.domain_sizes).c_str(),
                      c.expert_imbalance);
        loads += one;
      }
      std::printf("routing: each worker's first %lld tokens through the initial weights (%s): a token A2A hop lasts "
                  "F times the mean rows' time, F per level (%s):%s; the run re-fits F from what it measures\n",
                  planned->routing.tokens_per_worker, fmt_seconds(planned->routing.seconds).c_str(), names.c_str(),
                  fs.c_str());
      std::printf("routed experts: the busiest worker computes this many times the mean worker's rows, and every "
                  "layer's exchanges wait for it:%s; with even loads the chosen plan would take %s a step\n",
                  loads.c_str(), fmt_seconds(even_load_s).c_str());
    }
    std::printf("\n  %-10s %10s %5s %9s %9s %9s %9s %9s %9s %9s %9s %9s %10s\n", "domains", "gathered", "r",
                "compute", "a2a", "exp.a2a", "ag", "rs", "exp.ag", "exp.rs", "allreduce", "exp.ar", "iteration");
    std::printf("  %-10s %10s %5s %9s %9s %9s %9s %9s %9s %9s %9s %9s %10s\n", "", "", "f/b", "ms", "ms", "ms", "ms",
                "ms", "ms", "ms", "ms", "ms", "ms");
    for (size_t i = 0; i < plan.candidates.size(); ++i) {
      const PlanCandidate& c = plan.candidates[i];
      std::printf("%c %-10s %10s %5s %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %10.2f%s\n",
                  int(i) == plan.chosen ? '*' : ' ', fmt_list(c.domain_sizes).c_str(),
                  fmt_bytes(c.gathered_bytes).c_str(),
                  pipeline_degrees_text(c.pipeline_degree, c.backward_pipeline_degree).c_str(), c.compute_s * 1e3, c.a2a_s * 1e3,
                  c.exposed_a2a_s * 1e3, c.ag_s * 1e3, c.rs_s * 1e3, c.exposed_ag_s * 1e3, c.exposed_rs_s * 1e3,
                  c.allreduce_s * 1e3, c.exposed_allreduce_s * 1e3, c.iteration_s * 1e3,
                  c.feasible ? (std::string(c.replica_weights_late ? "  late" : "") +
                                (c.tokens_once_per_worker ? "  once" : ""))
                                   .c_str()
                             : "  (over the cap)");
    }
    double fastest = choice.iteration_s;
    for (const PlanCandidate& c : plan.candidates)
      if (c.feasible) fastest = std::min(fastest, c.iteration_s);
    char tie[128];
    std::snprintf(tie, sizeof tie, "the fewest gathered bytes within %.0f%% of the least predicted iteration time",
                  100 * kPlanTieMargin);
    const char* why = plan.mode == EpMode::kEp     ? "mode ep: every domain size 1"
                      : plan.mode != EpMode::kAuto ? "mode hybrid: the configured domain sizes"
                      : choice.iteration_s > fastest ? tie
                                                   : "the least predicted iteration time";
    std::printf("\nchosen: domains %s (%s), pipeline degree %d forward, %d backward, predicted %s per iteration\n",
                fmt_list(choice.domain_sizes).c_str(), why, choice.pipeline_degree, choice.backward_pipeline_degree,
                fmt_seconds(choice.iteration_s).c_str());
    if (choice.tokens_once_per_worker)
      std::printf("a token crosses once to each worker computing some of its experts (\"once\" above)\n");
    if (choice.replica_weights_late)
      std::printf("the replicas' weight gradients come late (\"late\" above): after the embedding's, so the last "
                  "dense buckets leave sooner\n");
  }
  if (!choice.feasible) {
    std::fprintf(stderr, "xdmoe plan: the configured hybrid domain sizes %s are infeasible: %s\n",
                 fmt_list(choice.domain_sizes).c_str(), choice.why_infeasible.c_str());
    return 1;
  }
  return 0;
}
}  // namespace

void add_plan_command(CLI::App& app, int* exit_code) {
  auto opts = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Predict one training iteration for every expert-domain candidate and pick one");
  cmd->footer(
      "The same path as the coordinator's at start-up (coordinator/job_planner.h), so the\n"
      "choice shown is the one `xdmoe launch` makes from the same measurements: compute\n"
      "from a short GEMM probe and timed steps (and optimizer updates) of the job's\n"
      "model on this machine, the median of three windows spread over the probes (about\n"
      "0.5-2 s; as many copies at once as workers will share its cores); shaped links\n"
      "from loopback probes, unshaped ones from the config. The link probes also\n"
      "measure the transport's CPU time per message and per byte, which an overlapped\n"
      "schedule takes from compute when the workers fill this machine's cores (for each\n"
      "message and byte a candidate sends a step), with the codecs' encode and decode\n"
      "time. The routing probe runs each worker's first batch through the initial\n"
      "weights for the token A2As' imbalance F under each candidate's domains (the run\n"
      "re-fits it) and the busiest worker's share of the routed experts' rows.\n"
      "Probes measure: two runs on a busy machine can differ. The cost model: docs/planner.md.");
  cmd->add_option("--config", opts->config, "Job YAML with a cluster section (default: built-in)")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--json", opts->json, "Print JSON");
  cmd->add_option("--mode", opts->mode, "Override cluster.expert_parallel.mode: ep, hybrid, auto (as the coordinator's)");
  cmd->add_option("--domains", opts->domains, "Override the domain sizes (one per level), e.g. --domains 2,1")
      ->delimiter(',');
  add_schedule_options(cmd, &opts->schedule);
  cmd->add_flag("--probe,!--no-probe", opts->probe,
                "Fit each shaped link class's alpha/beta with a short loopback probe (~1.5 s each), "
                "as the coordinator does (default); --no-probe plans with the config's figures")
      ->capture_default_str();
  cmd->callback([opts, exit_code] { *exit_code = run_plan(*opts); });
}

}  // namespace xd::cli
