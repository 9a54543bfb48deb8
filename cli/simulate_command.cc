// xdmoe simulate: a job's training steps on SimGrid, at the job's scale or
// at any other (--dcs, --workers-per-dc), beside the planner's prediction
// (simulation/simulator.h, docs/simulation.md).
#include <algorithm>
#include <cmath>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cluster/job_config.h"
#include "cluster/topology.h"
#include "common/units.h"
#include "coordinator/job_planner.h"
#include "model/param_layout.h"
#include "simulation/simulator.h"
#include "simulation/step_schedule.h"

namespace xd::cli {

namespace {

struct SimulateOptions {
  std::string config, mode, flows = "auto", uplink, backbone;
  std::vector<int> domains;
  int dcs = 0, workers_per_dc = 0, experts_per_worker = 0, steps = 3, simulated_dcs = 0, machine_cores = 0;
  std::vector<std::string> bandwidths, latencies, imbalances, hop_overheads, simgrid_config;
  double flops_per_s = 0, compute_scale = 1, measured_compute_s = 0;
  bool json = false, show_schedule = false, probe_links = false;
  ScheduleOverrides schedule;
};

int fail(const std::string& what) {
  std::fprintf(stderr, "xdmoe simulate: %s\n", what.c_str());
  return 2;
}

// "LEVEL=VALUE", LEVEL a level's name or index: the level and the value.
Expected<std::pair<int, std::string>> level_and_value(const JobConfig& job, const std::string& item) {
  const size_t eq = item.find('=');
  if (eq == std::string::npos) return Status::invalid_argument("expected LEVEL=VALUE, got '" + item + "'");
  const std::string name = item.substr(0, eq);
  for (size_t l = 0; l < job.cluster.levels.size(); ++l)
    if (job.cluster.levels[l].name == name || std::to_string(l) == name)
      return std::make_pair(static_cast<int>(l), item.substr(eq + 1));
  return Status::invalid_argument("no level named '" + name + "'");
}

// The "LEVEL=VALUE" items of `option`, one value per level (`fill` where
// not given; empty when no item is): `parse` reads each VALUE.
template <typename Parse>
Expected<std::vector<double>> per_level(const JobConfig& job, const std::vector<std::string>& items,
                                        const std::string& option, double fill, Parse parse) {
  std::vector<double> out;
  if (items.empty()) return out;
  out.assign(job.cluster.levels.size(), fill);
  for (const std::string& item : items) {
    auto lv = level_and_value(job, item);
    if (!lv) return lv.status().with_context(option);
    Expected<double> v = parse(lv->second);
    if (!v) return v.status().with_context(option + " " + item);
    out[lv->first] = *v;
  }
  return out;
}

Expected<double> parse_number(const std::string& value) {
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0') return Status::invalid_argument("'" + value + "' is not a number");
  return v;
}

// "LEVEL=FACTOR" items: the A2A imbalance per level (1 where not given).
Expected<std::vector<double>> level_imbalances(const JobConfig& job, const std::vector<std::string>& items) {
  return per_level(job, items, "--a2a-imbalance", 1.0, parse_number);
}

// "LEVEL=TIME" items: the per-hop overhead per level (0 where not given).
Expected<std::vector<double>> level_hop_overheads(const JobConfig& job, const std::vector<std::string>& items) {
  return per_level(job, items, "--hop-overhead", 0.0, parse_duration);
}

// --bandwidth and --latency items onto the links.
Status apply_level_values(const JobConfig& job, const std::vector<std::string>& items, bool bandwidth,
                          std::vector<LinkModel>* links) {
  for (const std::string& item : items) {
    auto lv = level_and_value(job, item);
    if (!lv) return lv.status();
    auto& [level, value] = *lv;
    if (bandwidth) {
      auto v = parse_bandwidth(value);
      if (!v) return v.status().with_context("--bandwidth " + item);
      (*links)[level].beta_s_per_byte = 1.0 / *v;
    } else {
      auto v = parse_duration(value);
      if (!v) return v.status().with_context("--latency " + item);
      (*links)[level].alpha_s = *v;
    }
  }
  return Status::ok();
}

int run_simulate(const SimulateOptions& o) {
  JobConfig job = default_job_config();
  std::string source = "the built-in default";
  if (!o.config.empty()) {
    auto loaded = load_job_config(o.config);
    if (!loaded) return fail(loaded.status().message());
    job = std::move(*loaded);
    source = o.config;
  }
  if (Status st = override_schedule(&job, o.schedule); !st.is_ok()) return fail(st.message());
  auto flows = parse_flow_granularity(o.flows);
  if (!flows) return fail(flows.status().message());
  if (o.steps < 1) return fail("--steps must be >= 1");
  if (!(o.compute_scale > 0)) return fail("--compute-scale must be positive");

  // The compute model is calibrated on the job as configured (its model runs
  // here); the links come from the spec unless --probe-links.
  ComputeModel compute{o.flops_per_s, 0, 1};
  std::vector<LinkCodecCost> codecs;
  std::vector<LinkModel> links = spec_link_models(job.cluster);
  if (o.flops_per_s <= 0 || o.probe_links) {
    JobPlanOptions po;
    po.probe_links = o.probe_links;
    if (!o.json) po.progress = [](const std::string& what) { std::fprintf(stderr, "%s ...\n", what.c_str()); };
    auto planned = plan_job(job, po);
    if (!planned) return fail(source + ": " + planned.status().message());
    if (o.flops_per_s <= 0) compute = planned->compute;
    links = planned->inputs.links;
    codecs = planned->inputs.link_codecs;
  }
  // The scale: the outermost level is the datacenters, the innermost the
  // workers in one; the experts grow with the world.
  const int L = static_cast<int>(job.cluster.levels.size());
  if (o.dcs > 0) job.cluster.levels[0].size = o.dcs;
  if (o.workers_per_dc > 0) {
    if (L < 2) return fail("--workers-per-dc needs a cluster of two or more levels");
    job.cluster.levels[L - 1].size = o.workers_per_dc;
  }
  if (o.experts_per_worker > 0) job.train.model.num_experts = o.experts_per_worker * job.cluster.world_size();
  if (Status st = apply_level_values(job, o.bandwidths, true, &links); !st.is_ok()) return fail(st.message());
  if (Status st = apply_level_values(job, o.latencies, false, &links); !st.is_ok()) return fail(st.message());
  if (Status st = override_expert_parallel(&job, o.mode, o.domains); !st.is_ok()) return fail(st.message());
  job.cluster.expert_parallel.memory_cap_bytes =
      o.dcs > 0 || o.workers_per_dc > 0 ? INFINITY : job.cluster.expert_parallel.memory_cap_bytes;

  PlannerInputs in = planner_inputs_for(job, links, compute);
  // Codec wire fractions are per link class, whatever the scale.
  if (!codecs.empty()) {
    in.link_codecs = codecs;
  } else {
    bool compressed = false;
    for (const LevelSpec& l : job.cluster.levels)
      for (const auto& [kind, spec] : l.link.codecs.by_kind()) compressed = compressed || *spec != "raw";
    if (compressed)
      std::fprintf(stderr,
                   "note: the job's codecs are measured only without --flops-per-s; this simulation sends raw "
                   "bytes\n");
  }
  auto imbalance = level_imbalances(job, o.imbalances);
  if (!imbalance) return fail(imbalance.status().message());
  // The planner beside the simulation prices the same skewed hops.
  if (!o.imbalances.empty()) in.a2a_imbalance = *imbalance;
  if (Status st = in.validate(); !st.is_ok()) return fail(st.message());
  Workload workload = with_compute_scaled(workload_of(in), o.compute_scale);
  // The schedule of a plan's choice (its r, whether it gathers experts).
  auto shape_of = [&](const PlanCandidate& c) {
    ScheduleShape shape{job.train.model, c.pipeline_degree, job.train.farskip.overlapped, false};
    shape.backward_pipeline_degree = c.backward_pipeline_degree;
    int levels = 0;  // of gathered replicas
    for (int s : c.domain_sizes) levels += s > 1 ? 1 : 0;
    shape.gathers_experts = levels > 0;
    shape.defers_owned_expert_weights = shape.overlapped;  // as DistributedTrainer's hooks
    shape.defers_replica_expert_weights = c.replica_weights_late;
    return shape;
  };
  Plan plan = plan_workload(workload, in.level_sizes, in.links, in.expert_parallel, in.link_codecs);
  ScheduleShape shape = shape_of(plan.choice());
  auto schedule = record_step_schedule(shape);
  if (!schedule) return fail(schedule.status().message());
  if (o.measured_compute_s > 0) {
    // Scale every span so that a step computes what the run measured, then
    // plan again: in auto mode the choice may move.
    SimulationInputs probe;
    probe.workload = workload;
    probe.level_sizes = in.level_sizes;
    probe.domain_sizes = plan.choice().domain_sizes;
    const double c = schedule_compute_seconds(*schedule, probe);
    if (c > 0) workload = with_compute_scaled(workload, o.measured_compute_s / c);
    drop_core_sharing(&workload);  // the measured compute holds it
    plan = plan_workload(workload, in.level_sizes, in.links, in.expert_parallel, in.link_codecs);
    const ScheduleShape again = shape_of(plan.choice());
    if (again.pipeline_degree != shape.pipeline_degree ||
        again.backward_pipeline_degree != shape.backward_pipeline_degree ||
        again.gathers_experts != shape.gathers_experts ||
        again.defers_owned_expert_weights != shape.defers_owned_expert_weights ||
        again.defers_replica_expert_weights != shape.defers_replica_expert_weights) {
      shape = again;
      schedule = record_step_schedule(shape);
      if (!schedule) return fail(schedule.status().message());
    }
  }
  const PlanCandidate& choice = plan.choice();
  if (o.show_schedule) std::fprintf(o.json ? stderr : stdout, "%s", schedule->describe().c_str());

  SimulationInputs si;
  si.workload = workload;
  si.workload.grouped_rows = choice.tokens_once_per_worker;  // the flows carry the plan's rows
  si.level_sizes = in.level_sizes;
  si.domain_sizes = choice.domain_sizes;
  si.links = in.links;
  si.link_codecs = in.link_codecs;
  {
    // Bucket sizes from a worker's layout (one expert held: buckets hold
    // every tensor but the routed experts).
    const ParamLayout layout(job.train.model, 0, 1);
    for (const auto& ranges : dense_gradient_buckets(layout)) {
      double elements = 0;
      for (auto [b, e] : ranges) elements += double(e - b);
      si.dense_bucket_bytes.push_back(elements * in.bytes_per_element);
    }
  }
  if (!o.uplink.empty()) {
    auto v = parse_bandwidth(o.uplink);
    if (!v) return fail(v.status().with_context("--uplink").message());
    si.uplink_bytes_per_s = *v;
  }
  if (!o.backbone.empty()) {
    auto v = parse_bandwidth(o.backbone);
    if (!v) return fail(v.status().with_context("--backbone").message());
    si.backbone_bytes_per_s = *v;
  }
  {
    si.a2a_imbalance = *imbalance;
    auto overhead = level_hop_overheads(job, o.hop_overheads);
    if (!overhead) return fail(overhead.status().message());
    si.hop_overhead_s = *overhead;
  }
  si.steps = o.steps;
  si.flows = *flows;
  si.simulated_dcs = o.simulated_dcs;
  si.machine_cores = o.machine_cores;
  si.simgrid_config = o.simgrid_config;
  if (!o.json)
    std::fprintf(stderr, "simulating %d step(s) of %d workers (%s%s) ...\n", o.steps,
                 in.level_sizes.empty() ? 0 : job.cluster.world_size(),
                 Topology(in.level_sizes, choice.domain_sizes).describe().c_str(),
                 choice.tokens_once_per_worker ? "; a token once per worker" : "");
  auto result = simulate_steps(*schedule, si);
  if (!result) return fail(result.status().message());
  const SimulationResult& r = *result;
  const SimulatedStep& last = r.steps.back();
  std::string domains;
  for (int s : choice.domain_sizes) domains += (domains.empty() ? "" : "x") + std::to_string(s);

  if (o.json) {
    nlohmann::json j;
    j["config"] = source;
    j["world_size"] = job.cluster.world_size();
    j["level_sizes"] = in.level_sizes;
    j["a2a_imbalance"] = si.a2a_imbalance;
    j["hop_overhead_s"] = si.hop_overhead_s;
    j["domain_sizes"] = choice.domain_sizes;
    j["pipeline_degree"] = choice.pipeline_degree;
    j["backward_pipeline_degree"] = choice.backward_pipeline_degree;
    j["overlapped"] = shape.overlapped;
    j["tokens_once_per_worker"] = choice.tokens_once_per_worker;
    j["planner_step_s"] = choice.iteration_s;
    j["simulated_step_s"] = r.mean_step_s();
    j["flows"] = flow_granularity_name(r.flows);
    j["simulated_dcs"] = r.simulated_dcs;
    j["simulated_workers"] = r.simulated_workers;
    j["flow_count"] = r.flow_count;
    j["actors"] = r.actors;
    j["wall_s"] = r.wall_s;
    j["peak_rss_bytes"] = r.peak_rss_bytes;
    j["steps"] = nlohmann::json::array();
    for (const SimulatedStep& st : r.steps)
      j["steps"].push_back({{"step_s", st.step_s},
                            {"compute_s", st.compute_s},
                            {"busiest_link_s", st.busiest_link_s},
                            {"bound_s", st.bound_s},
                            {"fwd_exposed_s", st.fwd_exposed_s},
                            {"bwd_exposed_s", st.bwd_exposed_s},
                            {"overlap_percent", st.overlap_percent}});
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("job: %s; %d workers, domains %s, r = %s, %s\n", source.c_str(), job.cluster.world_size(),
              domains.c_str(), pipeline_degrees_text(choice.pipeline_degree, choice.backward_pipeline_degree).c_str(),
              shape.overlapped ? "overlapped" : "not overlapped");
  std::printf("%-6s %12s %12s %12s %10s %10s %10s\n", "step", "simulated", "compute", "busiest link", "step/bound",
              "exposed", "overlap");
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const SimulatedStep& st = r.steps[i];
    std::printf("%-6zu %9.1f ms %9.1f ms %9.1f ms %10.2f %7.1f ms %9.0f%%\n", i + 1, st.step_s * 1e3,
                st.compute_s * 1e3, st.busiest_link_s * 1e3, st.bound_s > 0 ? st.step_s / st.bound_s : 0.0,
                (st.fwd_exposed_s + st.bwd_exposed_s) * 1e3, st.overlap_percent);
  }
  std::printf("simulated step %.1f ms (mean after the first), planner %.1f ms; step/bound %.2f\n",
              r.mean_step_s() * 1e3, choice.iteration_s * 1e3, last.bound_s > 0 ? r.mean_step_s() / last.bound_s : 0.0);
  std::printf("simulator: %d of %d datacenters simulated (%d workers; the rest by symmetry), %s flows (%lld), "
              "%lld actors, %.2f s, peak memory %.0f MB\n",
              r.simulated_dcs, in.level_sizes[0], r.simulated_workers, flow_granularity_name(r.flows),
              (long long)r.flow_count, (long long)r.actors, r.wall_s, r.peak_rss_bytes / 1e6);
  return 0;
}

}  // namespace

void add_simulate_command(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<SimulateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "simulate",
      "Replay a job's training steps on SimGrid's network model, at its own scale or another (--dcs, "
      "--workers-per-dc), beside the planner's prediction");
  cmd->add_option("--config", o->config, "job YAML (default: the built-in demo job)");
  cmd->add_option("--mode", o->mode, "ep | hybrid | auto (default: the config's)");
  cmd->add_option("--domains", o->domains, "hybrid domain sizes, one per level")->delimiter(',');
  cmd->add_option("--dcs", o->dcs, "datacenters: the outermost level's size");
  cmd->add_option("--workers-per-dc", o->workers_per_dc, "workers per datacenter: the innermost level's size");
  cmd->add_option("--experts-per-worker", o->experts_per_worker,
                  "routed experts per worker (num_experts = this x world size); needed when the scale changes "
                  "and num_experts is no longer a multiple of the world");
  cmd->add_option("--bandwidth", o->bandwidths, "LEVEL=RATE, a level's egress bandwidth per worker (e.g. dc=1gbit)");
  cmd->add_option("--latency", o->latencies, "LEVEL=TIME, a level's latency (e.g. dc=20ms)");
  cmd->add_option("--uplink", o->uplink, "each datacenter's uplink, each way (default: unlimited)");
  cmd->add_option("--backbone", o->backbone, "one backbone all inter-DC flows share (default: unlimited)");
  cmd->add_option("--a2a-imbalance", o->imbalances,
                  "LEVEL=FACTOR: a real run's token A2A hops on that level last as if every worker moved FACTOR "
                  "times the mean rows (routing is not uniform; a run's summary gives LINK/moe_peak_raw over "
                  "LINK/moe_dispatch_raw + LINK/moe_combine_raw), from 1 to 2; the planner's prediction printed beside "
                  "takes it too. Default 1: uniform routing");
  cmd->add_option("--hop-overhead", o->hop_overheads,
                  "LEVEL=TIME: what each hop of a collective on that level costs beyond its bytes and latency "
                  "(packing, copies, thread wake-ups; a traced run's hop span less both). Default 0");
  cmd->add_option("--steps", o->steps, "steps to simulate (default 3; the mean skips the first)");
  cmd->add_option("--flows", o->flows, "auto | pairs (a flow per message) | aggregate (a flow per worker and phase)");
  cmd->add_option("--simulated-dcs", o->simulated_dcs,
                  "datacenters simulated, the rest being identical by symmetry (default: all up to 64, else 16)");
  cmd->add_option("--machine-cores", o->machine_cores,
                  "every worker computes on one machine with this many cores, shared (as when a job runs on one "
                  "machine; default: each worker computes on its own)");
  cmd->add_option("--flops-per-s", o->flops_per_s,
                  "compute model: GEMM flop/s, without probing this machine (default: probe as `xdmoe plan` does)");
  cmd->add_option("--compute-scale", o->compute_scale,
                  "multiply every compute span (for example measured / probed compute of a real run)");
  cmd->add_option("--measured-compute-s", o->measured_compute_s,
                  "scale every compute span so that a step computes this many seconds (a real run's measured "
                  "compute), leaving the network and the schedule to the simulation");
  cmd->add_flag("--probe-links", o->probe_links, "probe shaped link classes instead of taking the spec's figures");
  cmd->add_option("--cfg", o->simgrid_config, "a SimGrid setting key:value (e.g. network/model:LV08)");
  cmd->add_flag("--show-schedule", o->show_schedule, "print one worker's recorded step schedule first");
  cmd->add_flag("--json", o->json, "machine-readable output");
  add_schedule_options(cmd, &o->schedule);
  cmd->callback([o, exit_code] { *exit_code = run_simulate(*o); });
}

}  // namespace xd::cli
