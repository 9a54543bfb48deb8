// xdmoe launch: a whole job on this machine -- the coordinator and G workers
// as real processes over loopback, links shaped as the config says. Without a
// config it runs the built-in 2 DC x 2 worker demo three times -- EP and
// HybridEP with the simple schedule, then HybridEP with FarSkip overlapped --
// and ends with a side-by-side table. A run is MODE[+farskip][+simple][+rN[/M]].
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/launch_run.h"
#include "cluster/hostfile.h"
#include "cluster/job_config.h"
#include "coordinator/planner.h"
#include "model/distributed_checkpoint.h"
#include "transport/endpoint.h"

namespace xd::cli {

namespace {
namespace fs = std::filesystem;

struct LaunchFlags {
  std::string config, run_dir = "runs/launch", cli_bind = "tcp://127.0.0.1:7370";
  std::vector<std::string> modes;
  std::vector<int64_t> trace_steps;
  int64_t steps = 0;
  bool flat_ep = false, no_probe = false, no_replan = false;
  // Workers on other hosts (launch_run.h).
  std::string hostfile, ssh = "ssh -n -o BatchMode=yes", remote_exe, coordinator_host, launcher;
  bool netns = false;
  std::string netns_state = "/run/xdmoe-netns/cluster.json";
  // Checkpoints and restarts (docs/operations.md); -1: the config's.
  std::string resume, checkpoint_dir;
  int64_t checkpoint_every = -1;
  int max_restarts = -1;
};

std::string cell(const nlohmann::json& s, const char* key, const char* fmt, double scale = 1.0) {
  if (!s.contains(key) || !s[key].is_number()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, s[key].get<double>() * scale);
  return buf;
}

// s[field][key], printed with `fmt` after scaling; "-" when missing.
std::string keyed_cell(const nlohmann::json& s, const char* field, const std::string& key, const char* fmt,
                       double scale) {
  if (!s.contains(field) || !s[field].is_object()) return "-";
  return cell(s[field], key.c_str(), fmt, scale);
}

void print_table(const std::vector<RunResult>& runs, const ClusterSpec& cluster) {
  std::printf("\n%-26s", "");
  for (const auto& r : runs) std::printf(" %16s", r.mode.c_str());
  std::printf("\n");
  auto row = [&](const char* label, auto fn) {
    std::printf("%-26s", label);
    for (const auto& r : runs) std::printf(" %16s", fn(r).c_str());
    std::printf("\n");
  };
  row("status", [](const RunResult& r) { return std::string(r.ok ? "ok" : "FAILED"); });
  row("domain sizes", [](const RunResult& r) { return r.summary.contains("domain_sizes") ? r.summary["domain_sizes"].dump() : "-"; });
  row("connectivity", [](const RunResult& r) { return r.summary.value("connectivity", std::string("-")); });
  row("schedule (r)", [](const RunResult& r) {
    if (!r.summary.contains("overlapped")) return std::string("-");
    return std::string(r.summary["overlapped"].get<bool>() ? "overlapped" : "simple") + " (" +
           pipeline_degrees_text(r.summary.value("pipeline_degree", 1),
                                 r.summary.value("backward_pipeline_degree", r.summary.value("pipeline_degree", 1)),
                                 r.summary.value("replica_weight_gradients", std::string()) == "late") +
           ")";
  });
  row("token rows", [](const RunResult& r) {
    if (!r.summary.contains("tokens_once_per_worker") || !r.summary["tokens_once_per_worker"].is_boolean())
      return std::string("-");
    return std::string(r.summary["tokens_once_per_worker"].get<bool>() ? "once per worker" : "one per expert");
  });
  row("steps", [](const RunResult& r) { return r.summary.contains("steps_complete") ? r.summary["steps_complete"].dump() : "-"; });
  row("final loss", [](const RunResult& r) { return cell(r.summary, "final_loss", "%.4f"); });
  row("tokens/s", [](const RunResult& r) { return cell(r.summary, "mean_tokens_per_s", "%.0f"); });
  row("step time (ms)", [](const RunResult& r) { return cell(r.summary, "mean_step_s", "%.1f", 1e3); });
  row("  compute (ms)", [](const RunResult& r) { return cell(r.summary, "mean_compute_s", "%.1f", 1e3); });
  row("  exposed comm (ms)", [](const RunResult& r) { return cell(r.summary, "mean_exposed_comm_s", "%.1f", 1e3); });
  row("  compute spread (ms)", [](const RunResult& r) { return cell(r.summary, "mean_compute_spread_s", "%.1f", 1e3); });
  row("  overlap (%)", [](const RunResult& r) { return cell(r.summary, "overlap_percent", "%.0f"); });
  row("  overlap fwd / bwd (%)", [](const RunResult& r) {
    return cell(r.summary, "fwd_overlap_percent", "%.0f") + " / " + cell(r.summary, "bwd_overlap_percent", "%.0f");
  });
  // The slowest worker's (the critical path's): what the schedule left exposed, without the spread.
  row("    slowest worker's", [](const RunResult& r) {
    return cell(r.summary, "critical_fwd_overlap_percent", "%.0f") + " / " +
           cell(r.summary, "critical_bwd_overlap_percent", "%.0f");
  });
  row("bound (ms)", [](const RunResult& r) { return cell(r.summary, "bound_s", "%.1f", 1e3); });
  row("step / bound", [](const RunResult& r) { return cell(r.summary, "step_over_bound", "%.2f"); });
  // Each phase's own bound, summed: what no schedule of this job can beat (docs/overlap.md).
  row("phase floor (ms)", [](const RunResult& r) { return cell(r.summary, "phase_floor_s", "%.1f", 1e3); });
  row("step / phase floor", [](const RunResult& r) { return cell(r.summary, "step_over_phase_floor", "%.2f"); });
  // The workers' CPU time on their busiest machine over the cores they share there: where workers share cores, the step
  // cannot be shorter than this, however it overlaps (docs/overlap.md).
  row("CPU floor (ms)", [](const RunResult& r) { return cell(r.summary, "cpu_floor_s", "%.1f", 1e3); });
  row("step / CPU floor", [](const RunResult& r) { return cell(r.summary, "step_over_cpu_floor", "%.2f"); });
  // The steps' predictions as they ran (the compute re-fitted, docs/planner.md), as the summary line gives them.
  row("predicted step (ms)", [](const RunResult& r) {
    return cell(r.summary, r.summary.contains("mean_predicted_step_s") ? "mean_predicted_step_s" : "predicted_step_s",
                "%.1f", 1e3);
  });
  row("  with measured compute", [](const RunResult& r) {
    return cell(r.summary, "predicted_with_measured_compute_s", "%.1f", 1e3);
  });
  for (const LevelSpec& l : cluster.levels) {
    const std::string key = l.link.name + "/total";
    row(("MB/step on " + l.link.name).c_str(), [&](const RunResult& r) {
      if (!r.summary.contains("bytes_per_step") || !r.summary["bytes_per_step"].contains(key)) return std::string("-");
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2f", r.summary["bytes_per_step"][key].get<double>() / 1e6);
      return std::string(buf);
    });
  }
  // Encoding and decoding, the busiest worker's, mean over steps: what the codecs cost the cores.
  row("codec time (ms)", [](const RunResult& r) { return cell(r.summary, "mean_codec_s", "%.1f", 1e3); });
  // One row per key any run's summary has in `field` (per link class and
  // traffic kind), mean over steps, each followed by `then(key)`'s rows.
  auto rows_per_key = [&](const char* field, const std::string& prefix, const char* fmt, double scale,
                          const std::function<void(const std::string&)>& then = nullptr) {
    std::set<std::string> keys;
    for (const auto& r : runs)
      if (r.summary.contains(field))
        for (const auto& [k, v] : r.summary[field].items()) keys.insert(k);
    for (const std::string& k : keys) {
      row((prefix + k).c_str(), [&](const RunResult& r) { return keyed_cell(r.summary, field, k, fmt, scale); });
      if (then) then(k);
    }
  };
  // Each key's time, then its parts: encoding (the busiest encoder) and
  // decoding (the busiest decoder).
  rows_per_key("mean_codec_seconds", "codec ms ", "%.1f", 1e3, [&](const std::string& k) {
    row("  encode + decode", [&](const RunResult& r) {
      const std::string e = keyed_cell(r.summary, "mean_codec_encode_seconds", k, "%.1f", 1e3),
                        d = keyed_cell(r.summary, "mean_codec_decode_seconds", k, "%.1f", 1e3);
      return e == "-" && d == "-" ? std::string("-") : e + " + " + d;
    });
  });
  // Lossy codecs: the reconstruction error.
  rows_per_key("mean_nmse", "NMSE ", "%.3g", 1.0);
  row("restarts", [](const RunResult& r) { return std::to_string(r.restarts.size()); });
  row("peak RSS/worker (MB)", [](const RunResult& r) { return cell(r.summary, "peak_rss_bytes", "%.0f", 1e-6); });
  // Each run against the one before it and against the first.
  std::printf("\n");
  auto speedup = [&](const RunResult& later, const RunResult& earlier) {
    if (!later.summary.contains("mean_step_s") || !earlier.summary.contains("mean_step_s")) return;
    const double a = earlier.summary["mean_step_s"].get<double>(), b = later.summary["mean_step_s"].get<double>();
    std::printf("%s vs %s: %.2fx step-time speedup\n", later.mode.c_str(), earlier.mode.c_str(), a / b);
  };
  for (size_t j = 1; j < runs.size(); ++j) {
    speedup(runs[j], runs[j - 1]);
    if (j > 1) speedup(runs[j], runs[0]);
  }
}

std::vector<std::string> split_words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// Workers in the namespaces of scripts/netns-cluster.sh, rank r in the r-th
// (DC-major, like ranks), the coordinator on this machine's side of the router.
Expected<WorkerPlacement> place_in_namespaces(const LaunchFlags& f, const JobConfig& job, WorkerPlacement p) {
  std::ifstream in(f.netns_state);
  if (!in)
    return Status::not_found("no namespace cluster (" + f.netns_state + " is missing): start one with "
                             "scripts/netns-cluster.sh up --dcs N --workers-per-dc M --inter-dc-rate R");
  nlohmann::json state;
  try {
    in >> state;
    const int dcs = state.at("dcs").get<int>(), per_dc = state.at("workers_per_dc").get<int>();
    const int g0 = job.cluster.levels[0].size, g = job.cluster.world_size();
    if (dcs != g0 || dcs * per_dc != g)
      return Status::invalid_argument("the namespace cluster has " + std::to_string(dcs) + " DCs of " +
                                      std::to_string(per_dc) + " workers, but the job needs " + std::to_string(g0) +
                                      " of " + std::to_string(g / g0) + ": scripts/netns-cluster.sh up --dcs " +
                                      std::to_string(g0) + " --workers-per-dc " + std::to_string(g / g0));
    for (const auto& w : state.at("workers")) {
      p.host.push_back(w.at("ns").get<std::string>());
      p.address.push_back(w.at("address").get<std::string>());
    }
    p.coordinator_bind = p.coordinator_host = state.at("coordinator_address").get<std::string>();
    const double tbf = state.at("inter_dc_rate_bits_per_s").get<double>() / 8;
    const LinkClassSpec& link = job.cluster.levels[0].link;
    std::printf("xdmoe launch: %d namespaces from %s; link class '%s' shaped by the kernel's tbf at %.4g Mbit/s, "
                "its %.3g ms latency added in the process (no netem here)\n",
                g, f.netns_state.c_str(), link.name.c_str(), tbf * 8 / 1e6, link.latency_s * 1e3);
    if (std::abs(tbf - link.bandwidth_bytes_per_s) > 0.01 * link.bandwidth_bytes_per_s)
      std::printf("xdmoe launch: note: the config says %.4g Mbit/s for '%s'; the planner plans with that figure\n",
                  link.bandwidth_bytes_per_s * 8 / 1e6, link.name.c_str());
    p.worker_args = {"--kernel-shaped", link.name};
  } catch (const std::exception& e) {
    return Status::corruption(f.netns_state + ": " + e.what());
  }
  if (static_cast<int>(p.host.size()) != p.world) return Status::corruption(f.netns_state + ": wrong worker count");
  p.kind = WorkerPlacement::Kind::kNetns;
  p.coordinator_args = {"--netns", f.netns_state};
  return p;
}

// Where this launch starts its workers: here, or over ssh on a hostfile's hosts.
Expected<WorkerPlacement> place_workers(const LaunchFlags& f, JobConfig* job) {
  WorkerPlacement p;
  p.world = job->cluster.world_size();
  if (int(!f.launcher.empty()) + int(!f.hostfile.empty()) + int(f.netns) > 1)
    return Status::invalid_argument("--launcher, --hostfile and --netns exclude each other (give mpirun its hosts "
                                    "with --launcher 'mpirun --hostfile FILE')");
  if (!f.launcher.empty()) {
    p.kind = WorkerPlacement::Kind::kLauncher;
    p.launcher = split_words(f.launcher);
    const std::string name = p.launcher.empty() ? "" : fs::path(p.launcher[0]).filename().string();
    // Each gets its own flags (srun: -n, --label; Open MPI's mpirun: -np, --tag-output, -x).
    if (name != "srun" && name != "mpirun")
      return Status::invalid_argument("--launcher must start with srun or mpirun (Open MPI), not '" + name + "'");
    // Workers on other nodes must reach the coordinator: every interface.
    p.coordinator_bind = "0.0.0.0";
    if (!f.coordinator_host.empty()) {
      p.coordinator_host = f.coordinator_host;
    } else {
      char host[256] = {0};
      ::gethostname(host, sizeof host - 1);
      p.coordinator_host = host;
    }
    return p;
  }
  if (f.netns) return place_in_namespaces(f, *job, p);
  if (f.hostfile.empty()) return p;
  auto hosts = load_hostfile(f.hostfile);
  if (!hosts) return hosts.status();
  job->cluster.hosts = *hosts;
  if (Status st = job->cluster.validate(); !st.is_ok()) return st.with_context("hostfile " + f.hostfile);
  p.kind = WorkerPlacement::Kind::kSsh;
  p.host = hosts_by_rank(job->cluster);
  p.ssh = split_words(f.ssh);
  if (p.ssh.empty()) return Status::invalid_argument("--ssh is empty");
  p.remote_exe = f.remote_exe.empty() ? self_exe() : f.remote_exe;
  bool all_loopback = true;
  for (const std::string& h : p.host) all_loopback = all_loopback && is_loopback_host(h);
  p.coordinator_bind = all_loopback ? "127.0.0.1" : "0.0.0.0";
  if (!f.coordinator_host.empty()) {
    p.coordinator_host = f.coordinator_host;
  } else if (!all_loopback) {
    char name[256] = {0};
    ::gethostname(name, sizeof name - 1);
    p.coordinator_host = name;
  }
  // A loopback host among remote ones is this machine, under the name the others reach it at.
  if (!all_loopback) p.loopback_advertised = p.coordinator_host;
  p.coordinator_args = {"--hostfile", f.hostfile};
  std::printf("xdmoe launch: hosts from %s:", f.hostfile.c_str());
  for (size_t r = 0; r < p.host.size(); ++r) std::printf(" %zu=%s", r, p.host[r].c_str());
  std::printf("; the coordinator at %s\n", p.coordinator_host.c_str());
  return p;
}

int run_launch(const LaunchFlags& f) {
  JobConfig job = default_job_config();
  if (!f.config.empty()) {
    auto parsed = load_job_config(f.config);
    if (!parsed) {
      std::fprintf(stderr, "xdmoe launch: %s\n", parsed.status().message().c_str());
      return 2;
    }
    job = *parsed;
  }
  std::vector<std::string> modes = f.modes;
  int64_t steps = f.steps;
  if (modes.empty()) {
    // The built-in demo: the simple schedule, EP and HybridEP, then
    // HybridEP with FarSkip connectivity, overlapped, with the inter-DC link
    // raw and then compressed.
    if (f.config.empty()) modes = {"ep+simple", "auto+simple", "auto+farskip", "auto+farskip+sr"};
    else modes = {ep_mode_name(job.cluster.expert_parallel.mode)};
  }
  if (f.config.empty() && steps == 0) steps = 30;
  for (const std::string& m : modes)
    if (auto spec = parse_run(m); !spec) {
      std::fprintf(stderr, "xdmoe launch: %s\n", spec.status().message().c_str());
      return 2;
    }
  const int world = job.cluster.world_size();
  std::string levels;
  for (const LevelSpec& l : job.cluster.levels) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s%d %s (%.3g Mbit/s, %.3g ms)", levels.empty() ? "" : " x ", l.size,
                  l.name.c_str(), l.link.bandwidth_bytes_per_s * 8 / 1e6, l.link.latency_s * 1e3);
    levels += buf;
  }
  std::printf("xdmoe launch: %s, %d workers: %s\n", f.config.empty() ? "built-in demo" : f.config.c_str(),
              world, levels.c_str());
  auto placement = place_workers(f, &job);
  if (!placement) {
    std::fprintf(stderr, "xdmoe launch: %s\n", placement.status().message().c_str());
    return 2;
  }
  // CURVE: every worker gets the workers' key and the coordinator's public key.
  if (const SecuritySpec& s = job.cluster.security; s.curve()) {
    if (s.worker_key.empty()) {
      std::fprintf(stderr, "xdmoe launch: cluster.security.worker_key: the workers' secret key file is needed\n");
      return 2;
    }
    placement->worker_args.insert(placement->worker_args.end(),
                                  {"--key", s.worker_key, "--coordinator-key", s.coordinator_public_key});
  }
  if (!f.checkpoint_dir.empty()) job.train.checkpoint_dir = f.checkpoint_dir;
  // Workers started elsewhere (ssh, srun) do not share this working directory.
  if (!job.train.checkpoint_dir.empty()) job.train.checkpoint_dir = fs::absolute(job.train.checkpoint_dir).string();
  if (f.checkpoint_every >= 0) job.train.checkpoint_every = f.checkpoint_every;
  if (f.max_restarts >= 0) job.train.max_restarts = f.max_restarts;
  std::string resume;
  if (!f.resume.empty()) {
    std::vector<std::string> skipped;
    auto dir = resolve_checkpoint(f.resume, &skipped);
    for (const std::string& s : skipped) std::printf("xdmoe launch: skipping checkpoint %s\n", s.c_str());
    if (!dir) {
      std::fprintf(stderr, "xdmoe launch: --resume: %s\n", dir.status().message().c_str());
      return 2;
    }
    resume = fs::absolute(*dir).string();
  }
  if (job.train.max_restarts > 0 && job.train.checkpoint_dir.empty())
    std::printf("xdmoe launch: note: %d restarts allowed but no train.checkpoint_dir: a restart starts from step 0\n",
                job.train.max_restarts);
  std::vector<RunResult> runs;
  for (const std::string& m : modes) {
    LaunchRun run;
    run.config = f.config;
    run.run_dir = f.run_dir;
    run.cli_bind = f.cli_bind;
    run.name = m;
    run.spec = *parse_run(m);
    run.steps = steps;
    run.flat_ep = f.flat_ep;
    run.no_probe = f.no_probe;
    run.no_replan = f.no_replan;
    run.trace_steps = f.trace_steps;
    run.world = world;
    // Several runs keep their checkpoints apart.
    run.checkpoint_dir = job.train.checkpoint_dir.empty() || modes.size() == 1
                             ? job.train.checkpoint_dir
                             : (fs::path(job.train.checkpoint_dir) / m).string();
    run.checkpoint_every = f.checkpoint_every;
    run.resume = resume;
    run.max_restarts = job.train.max_restarts;
    runs.push_back(run_with_restarts(run, *placement));
    if (!runs.back().ok) std::fprintf(stderr, "xdmoe launch: %s run failed: %s\n", m.c_str(), runs.back().error.c_str());
    if (runs.back().interrupted) break;
  }
  print_table(runs, job.cluster);
  for (const auto& r : runs)
    if (!r.trace_dir.empty() && fs::exists(r.trace_dir))
      std::printf("%s: step traces in %s (Perfetto opens them; a PNG of step %lld: python3 scripts/trace_png.py %s "
                  "--step %lld)\n",
                  r.mode.c_str(), r.trace_dir.c_str(), (long long)f.trace_steps.front(), r.trace_dir.c_str(),
                  (long long)f.trace_steps.front());
  for (const auto& r : runs)
    if (!r.ok) return 1;
  return 0;
}
}  // namespace

void add_launch_command(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<LaunchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "launch", "Run a whole job: the coordinator here, workers here (loopback), over ssh (--hostfile), by "
                "srun or mpirun (--launcher), or in network namespaces (--netns); docs/launch.md");
  cmd->add_option("--config", f->config,
                  "Job YAML (default: the built-in 2 DC x 2 worker demo: ep+simple, auto+simple, auto+farskip, "
                  "auto+farskip+sr)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--mode", f->modes,
                  "Runs, one after another: "
                  "MODE[+farskip][+simple][+rN[/M]][+dAxB][+late|+early][+sr|+delta][+once|+perexpert] with MODE ep, "
                  "ep_flat, hybrid or auto; +farskip turns FarSkip connectivity on, +simple runs the simple schedule "
                  "(token exchanges and the dense all-reduce in series), +r4 splits each A2A into 4 chunks (r0: the "
                  "planner's choice), +r4/2 the forward's into 4 and the backward's into 2 (r4/0: the planner's "
                  "backward), +d2x1 runs hybrid with domains 2 x 1, +late computes the replicas' weight gradients "
                  "after the embedding's (+early with their layer; neither: the config's, auto by default), +sr "
                  "compresses the outermost link's expert weights (SR residuals), replica gradients and dense "
                  "gradients (the coordinator's --sr-codecs), +delta sends the outermost link's expert weights as "
                  "exact bit differences (--delta-weights), +once sends a token once to each worker computing some of "
                  "its experts, +perexpert once per expert (--tokens-once-per-worker=true or false; neither: the "
                  "config's, auto by default) (repeatable)");
  add_trace_steps_option(cmd, &f->trace_steps,
                         "Trace these steps of every run (Chrome trace JSON per worker in <run-dir>/<run>/trace; "
                         "scripts/trace_png.py draws them)");
  cmd->add_option("--steps", f->steps, "Override train.steps");
  cmd->add_option("--run-dir", f->run_dir, "Where logs and summaries go")->capture_default_str();
  cmd->add_option("--cli-bind", f->cli_bind, "Coordinator CLI endpoint (for xdmoe status/top)")->capture_default_str();
  cmd->add_flag("--flat-ep", f->flat_ep, "EP sends tokens to their owner in one hop");
  cmd->add_flag("--no-probe", f->no_probe, "The coordinator plans with the config's link figures (no link probes)");
  cmd->add_flag("--no-replan", f->no_replan, "The coordinator keeps its start-up plan and its prediction for the whole run");
  cmd->add_option("--hostfile", f->hostfile,
                  "Start the workers over ssh on these hosts: lines 'HOST slots=N [dc=NAME]' (docs/launch.md); "
                  "the coordinator runs here")
      ->check(CLI::ExistingFile);
  if (const char* ssh = std::getenv("XDMOE_SSH")) f->ssh = ssh;
  cmd->add_option("--ssh", f->ssh, "The ssh command for --hostfile (default: $XDMOE_SSH, else this)")
      ->capture_default_str();
  cmd->add_flag("--netns", f->netns,
                "Run each worker in its own network namespace, the inter-DC link shaped by the kernel "
                "(start them with scripts/netns-cluster.sh up; needs root)");
  cmd->add_option("--netns-state", f->netns_state, "The namespace cluster's state file")->capture_default_str();
  cmd->add_option("--launcher", f->launcher,
                  "Start every worker with one launcher command instead: 'srun' (inside an allocation, e.g. from "
                  "sbatch) or 'mpirun [flags]' (Open MPI); ranks come from its environment");
  cmd->add_option("--checkpoint-dir", f->checkpoint_dir,
                  "Override train.checkpoint_dir: each worker writes its shard of every checkpoint there (a shared "
                  "filesystem across hosts), the coordinator the manifest (docs/operations.md)");
  cmd->add_option("--checkpoint-every", f->checkpoint_every, "Override train.checkpoint_every (steps; 0: only at the end)");
  cmd->add_option("--max-restarts", f->max_restarts,
                  "Override train.max_restarts: relaunch a job that lost or failed a worker from its newest complete "
                  "checkpoint, at most this many times");
  cmd->add_option("--resume", f->resume,
                  "Start from a checkpoint: a step_<N> directory, or a directory of them (the newest complete one; "
                  "torn or corrupt ones are skipped). Any number of workers may resume it");
  cmd->add_option("--remote-exe", f->remote_exe, "The xdmoe binary on the hosts (default: this binary's path)");
  cmd->add_option("--coordinator-host", f->coordinator_host,
                  "The address the hosts reach this machine at (default: its hostname; 127.0.0.1 when every host "
                  "is local)");
  cmd->callback([f, exit_code] { *exit_code = run_launch(*f); });
}

}  // namespace xd::cli
