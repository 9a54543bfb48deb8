// xdmoe launch: a whole job on this machine -- the coordinator and G workers
// as real processes over loopback, links shaped as the config says. Without a
// config it runs the built-in 2 DC x 2 worker demo three times -- EP and
// HybridEP with the simple schedule, then HybridEP with FarSkip overlapped --
// and ends with a side-by-side table. A run is MODE[+farskip][+simple][+rN].
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "common/subprocess.h"
#include "cluster/job_config.h"

namespace xd::cli {

namespace {
namespace fs = std::filesystem;

struct LaunchFlags {
  std::string config, run_dir = "runs/launch", cli_bind = "tcp://127.0.0.1:7370";
  std::vector<std::string> modes;
  std::vector<int64_t> trace_steps;
  int64_t steps = 0;
  bool flat_ep = false;
};

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "xdmoe";
  buf[n] = 0;
  return buf;
}

struct RunResult {
  std::string mode;
  bool ok = false;
  nlohmann::json summary;
  std::string error;
};

// "auto+farskip+simple" -> the mode and the schedule flags of the coordinator.
struct RunSpec {
  std::string mode;
  bool farskip = false, simple = false;
  int pipeline_degree = -1;  // -1: the config's
};
Expected<RunSpec> parse_run(const std::string& run) {
  RunSpec spec;
  std::stringstream in(run);
  std::string part;
  std::getline(in, spec.mode, '+');
  if (spec.mode != "ep" && spec.mode != "ep_flat" && spec.mode != "hybrid" && spec.mode != "auto")
    return Status::invalid_argument("unknown mode '" + spec.mode + "' in run '" + run + "' (ep, ep_flat, hybrid, auto)");
  while (std::getline(in, part, '+')) {
    if (part == "farskip") spec.farskip = true;
    else if (part == "simple") spec.simple = true;
    else if (part.size() > 1 && part[0] == 'r' && part.find_first_not_of("0123456789", 1) == std::string::npos &&
             part.size() < 4)
      spec.pipeline_degree = std::stoi(part.substr(1));
    else return Status::invalid_argument("unknown run option '" + part + "' in '" + run + "' (farskip, simple, rN)");
  }
  return spec;
}

RunResult run_one(const LaunchFlags& f, const std::string& run, int world, int64_t steps) {
  RunResult r;
  r.mode = run;
  const RunSpec spec = *parse_run(run);
  const std::string& mode = spec.mode;
  const fs::path dir = fs::path(f.run_dir) / run;
  fs::create_directories(dir);
  const fs::path endpoints = dir / "endpoints.json", summary = dir / "summary.json";
  fs::remove(endpoints);
  fs::remove(summary);
  const std::string exe = self_exe();
  // The coordinator shares this terminal: only its progress lines and
  // warnings, unless a level was asked for. Workers log to files, at info.
  const std::string coordinator_level = log_level_flag().empty() ? "warn" : log_level_flag();
  const std::string worker_level = log_level_flag().empty() ? "info" : log_level_flag();
  std::vector<std::string> args = {exe, "--log-level", coordinator_level, "coordinator", "--mode", mode == "ep_flat" ? "ep" : mode,
                                   "--bind", "tcp://127.0.0.1:*", "--cli-bind", f.cli_bind,
                                   "--http-port", "0", "--name", run, "--summary", summary.string(),
                                   "--endpoints-file", endpoints.string()};
  if (mode == "ep_flat" || f.flat_ep) args.push_back("--flat-ep");
  if (!f.config.empty()) args.insert(args.end(), {"--config", f.config});
  if (steps > 0) args.insert(args.end(), {"--steps", std::to_string(steps)});
  if (spec.farskip) args.push_back("--farskip");
  if (spec.simple) args.push_back("--no-overlap");
  if (spec.pipeline_degree >= 0) args.insert(args.end(), {"--pipeline-degree", std::to_string(spec.pipeline_degree)});
  if (!f.trace_steps.empty()) {
    std::string list;
    for (int64_t s : f.trace_steps) list += (list.empty() ? "" : ",") + std::to_string(s);
    args.insert(args.end(), {"--trace-steps", list, "--trace-dir", (dir / "trace").string()});
  }
  std::printf("\n=== %s: coordinator + %d workers (logs in %s) ===\n", run.c_str(), world, dir.c_str());
  std::fflush(stdout);
  subprocess::Child coordinator = subprocess::spawn(args, "");
  std::string worker_ep;
  for (int i = 0; i < 300 && worker_ep.empty(); ++i) {
    if (subprocess::try_wait(coordinator) != -2000) {
      r.error = "the coordinator exited during start-up";
      return r;
    }
    std::ifstream in(endpoints);
    if (in) {
      try {
        nlohmann::json j;
        in >> j;
        worker_ep = j.at("workers").get<std::string>();
        std::printf("monitor with: xdmoe status --coordinator %s   (Prometheus: http://127.0.0.1:%d/metrics)\n",
                    j.at("cli").get<std::string>().c_str(), j.at("http_port").get<int>());
        std::fflush(stdout);
      } catch (const std::exception&) {
        worker_ep.clear();  // half-written; read again
      }
    }
    if (worker_ep.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (worker_ep.empty()) {
    subprocess::wait_for(coordinator, std::chrono::seconds(0));
    r.error = "the coordinator did not start within 30 s";
    return r;
  }
  std::vector<subprocess::Child> workers;
  for (int rank = 0; rank < world; ++rank)
    workers.push_back(subprocess::spawn({exe, "--log-level", worker_level, "worker", "--coordinator", worker_ep, "--rank", std::to_string(rank),
                                         "--host-label", "local"},
                                        (dir / ("worker" + std::to_string(rank) + ".log")).string(),
                                        {"OPENBLAS_NUM_THREADS=1"}));
  const int code = subprocess::wait_for(coordinator, std::chrono::hours(24 * 365));
  int worker_failures = 0;
  for (int rank = 0; rank < world; ++rank) {
    const int wc = subprocess::wait_for(workers[rank], std::chrono::seconds(15));
    if (wc != 0) {
      ++worker_failures;
      std::fprintf(stderr, "worker %d exited with %d; last lines of its log:\n", rank, wc);
      std::string log = subprocess::read_text(workers[rank].log_path);
      std::fprintf(stderr, "%s\n", log.substr(log.size() > 1500 ? log.size() - 1500 : 0).c_str());
    }
  }
  std::ifstream in(summary);
  if (in) {
    try {
      in >> r.summary;
    } catch (const std::exception&) {
    }
  }
  r.ok = code == 0 && worker_failures == 0 && r.summary.value("ok", false);
  if (!r.ok) r.error = r.summary.value("error", "coordinator exit code " + std::to_string(code));
  return r;
}

std::string cell(const nlohmann::json& s, const char* key, const char* fmt, double scale = 1.0) {
  if (!s.contains(key) || !s[key].is_number()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, s[key].get<double>() * scale);
  return buf;
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
           std::to_string(r.summary.value("pipeline_degree", 1)) + ")";
  });
  row("steps", [](const RunResult& r) { return r.summary.contains("steps_complete") ? r.summary["steps_complete"].dump() : "-"; });
  row("final loss", [](const RunResult& r) { return cell(r.summary, "final_loss", "%.4f"); });
  row("tokens/s", [](const RunResult& r) { return cell(r.summary, "mean_tokens_per_s", "%.0f"); });
  row("step time (ms)", [](const RunResult& r) { return cell(r.summary, "mean_step_s", "%.1f", 1e3); });
  row("  compute (ms)", [](const RunResult& r) { return cell(r.summary, "mean_compute_s", "%.1f", 1e3); });
  row("  exposed comm (ms)", [](const RunResult& r) { return cell(r.summary, "mean_exposed_comm_s", "%.1f", 1e3); });
  row("  overlap (%)", [](const RunResult& r) { return cell(r.summary, "overlap_percent", "%.0f"); });
  row("  overlap fwd / bwd (%)", [](const RunResult& r) {
    return cell(r.summary, "fwd_overlap_percent", "%.0f") + " / " + cell(r.summary, "bwd_overlap_percent", "%.0f");
  });
  row("bound (ms)", [](const RunResult& r) { return cell(r.summary, "bound_s", "%.1f", 1e3); });
  row("step / bound", [](const RunResult& r) {
    if (!r.summary.contains("bound_s") || !(r.summary["bound_s"].get<double>() > 0)) return std::string("-");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", r.summary["mean_step_s"].get<double>() / r.summary["bound_s"].get<double>());
    return std::string(buf);
  });
  row("predicted step (ms)", [](const RunResult& r) { return cell(r.summary, "predicted_step_s", "%.1f", 1e3); });
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
  // Lossy expert codecs: the reconstruction error, mean over steps.
  std::set<std::string> lossy;
  for (const auto& r : runs)
    if (r.summary.contains("mean_nmse"))
      for (const auto& [k, v] : r.summary["mean_nmse"].items()) lossy.insert(k);
  for (const std::string& k : lossy)
    row(("NMSE " + k).c_str(), [&](const RunResult& r) {
      if (!r.summary.contains("mean_nmse") || !r.summary["mean_nmse"].contains(k)) return std::string("-");
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.4f", r.summary["mean_nmse"][k].get<double>());
      return std::string(buf);
    });
  row("peak RSS/worker (MB)", [](const RunResult& r) { return cell(r.summary, "peak_rss_bytes", "%.0f", 1e-6); });
  // The last run against each earlier one.
  std::printf("\n");
  for (size_t i = 0; i + 1 < runs.size(); ++i)
    if (runs[i].summary.contains("mean_step_s") && runs.back().summary.contains("mean_step_s")) {
      const double a = runs[i].summary["mean_step_s"].get<double>(), b = runs.back().summary["mean_step_s"].get<double>();
      std::printf("%s vs %s: %.2fx step-time speedup\n", runs.back().mode.c_str(), runs[i].mode.c_str(), a / b);
    }
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
    // The built-in demo: today's simple schedule, EP and HybridEP, then
    // HybridEP with FarSkip connectivity, overlapped.
    if (f.config.empty()) modes = {"ep+simple", "auto+simple", "auto+farskip"};
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
  std::vector<RunResult> runs;
  for (const std::string& m : modes) {
    runs.push_back(run_one(f, m, world, steps));
    if (!runs.back().ok) std::fprintf(stderr, "xdmoe launch: %s run failed: %s\n", m.c_str(), runs.back().error.c_str());
  }
  print_table(runs, job.cluster);
  for (const auto& r : runs)
    if (!r.ok) return 1;
  return 0;
}
}  // namespace

void add_launch_command(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<LaunchFlags>();
  CLI::App* cmd = app.add_subcommand("launch", "Run a whole job on this machine: coordinator + workers over loopback");
  cmd->add_option("--config", f->config,
                  "Job YAML (default: the built-in 2 DC x 2 worker demo: ep+simple, auto+simple, auto+farskip)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--mode", f->modes,
                  "Runs, one after another: MODE[+farskip][+simple][+rN] with MODE ep, ep_flat, hybrid or auto; "
                  "+farskip turns FarSkip connectivity on, +simple runs nothing overlapped, +r4 splits each A2A "
                  "into 4 chunks (r0: the planner's choice) (repeatable)");
  cmd->add_option("--trace-steps", f->trace_steps,
                  "Trace these steps of every run (Chrome trace JSON per worker in <run-dir>/<run>/trace; "
                  "scripts/trace_png.py draws them)")
      ->delimiter(',');
  cmd->add_option("--steps", f->steps, "Override train.steps");
  cmd->add_option("--run-dir", f->run_dir, "Where logs and summaries go")->capture_default_str();
  cmd->add_option("--cli-bind", f->cli_bind, "Coordinator CLI endpoint (for xdmoe status/top)")->capture_default_str();
  cmd->add_flag("--flat-ep", f->flat_ep, "EP sends tokens to their owner in one hop");
  cmd->callback([f, exit_code] { *exit_code = run_launch(*f); });
}

}  // namespace xd::cli
