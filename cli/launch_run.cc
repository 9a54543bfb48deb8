#include "cli/launch_run.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "cli/commands.h"
#include "common/clock.h"
#include "common/subprocess.h"
#include "model/distributed_checkpoint.h"
#include "transport/endpoint.h"

namespace xd::cli {

namespace {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

volatile std::sig_atomic_t g_interrupted = 0;

constexpr int kRunning = -2000;  // subprocess::try_wait() of a live child


// Copies a worker's output to its log file and to the terminal, each line
// prefixed with its rank ("[rank 3] "), until the worker closes it.
void forward_output(int fd, std::string prefix, const std::string& log_path, std::mutex* terminal) {
  FILE* in = ::fdopen(fd, "r");
  FILE* log = std::fopen(log_path.c_str(), "w");
  char line[8192];
  while (in && std::fgets(line, sizeof line, in)) {
    if (log) {
      std::fputs(line, log);
      std::fflush(log);
    }
    std::lock_guard<std::mutex> lock(*terminal);
    const size_t n = std::strlen(line);
    std::printf("%s%s%s", prefix.c_str(), line, n > 0 && line[n - 1] == '\n' ? "" : "\n");
    std::fflush(stdout);
  }
  if (in) std::fclose(in);
  if (log) std::fclose(log);
}

struct WorkerProcess {
  std::string name;  // "worker 3", "srun"
  subprocess::Child child;
  bool piped = false;
  int code = kRunning;
  std::thread output;
};

std::vector<std::string> place_worker(const WorkerPlacement& p, int rank, const std::string& endpoint,
                                      const std::string& level) {
  const std::string r = std::to_string(rank);
  switch (p.kind) {
    case WorkerPlacement::Kind::kLocal:
      return {self_exe(), "--log-level", level, "worker", "--coordinator", endpoint, "--rank", r,
              "--host-label", "local"};
    case WorkerPlacement::Kind::kNetns:
      return {"ip", "netns", "exec", p.host[rank], self_exe(), "--log-level", level, "worker",
              "--coordinator", endpoint, "--rank", r, "--bind-host", p.address[rank], "--host-label", p.host[rank]};
    case WorkerPlacement::Kind::kLauncher: {
      // Every rank at once; srun labels each line with its task, mpirun tags it.
      std::vector<std::string> argv = p.launcher;
      const bool srun = fs::path(argv[0]).filename() == "srun";
      const std::string world = std::to_string(p.world);
      if (srun) argv.insert(argv.end(), {"-n", world, "--label", "--kill-on-bad-exit=1"});
      else argv.insert(argv.end(), {"-np", world, "--tag-output", "-x", "OPENBLAS_NUM_THREADS=1"});
      argv.insert(argv.end(), {self_exe(), "--log-level", level, "worker", "--coordinator", endpoint});
      return argv;
    }
    case WorkerPlacement::Kind::kSsh: {
      // One string for the remote shell, as ssh hands it on.
      const std::string& host = p.host[rank];
      // Peers on other hosts cannot reach a loopback name: this machine's.
      const std::string advertised = is_loopback_host(host) ? p.loopback_advertised : host;
      std::string remote = "env OPENBLAS_NUM_THREADS=1 " + shell_quote(p.remote_exe) + " --log-level " + level +
                           " worker --coordinator " + shell_quote(endpoint) + " --rank " + r +
                           " --bind-host 0.0.0.0 --advertise-host " + shell_quote(advertised.empty() ? host : advertised) +
                           " --host-label " + shell_quote(host);
      for (const std::string& a : p.worker_args) remote += " " + shell_quote(a);
      std::vector<std::string> argv = p.ssh;
      argv.push_back(host);
      argv.push_back(remote);
      return argv;
    }
  }
  return {};
}
std::vector<std::string> worker_command(const WorkerPlacement& p, int rank, const std::string& endpoint,
                                        const std::string& level) {
  std::vector<std::string> argv = place_worker(p, rank, endpoint, level);
  if (p.kind != WorkerPlacement::Kind::kSsh)  // ssh: inside the quoted remote command
    argv.insert(argv.end(), p.worker_args.begin(), p.worker_args.end());
  return argv;
}
}  // namespace

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "xdmoe";
  buf[n] = 0;
  return buf;
}

std::string shell_quote(const std::string& text) {
  std::string q = "'";
  for (char c : text) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

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
    else if (part == "late" || part == "early") spec.replica_weight_gradients = part;
    else if (part == "sr") spec.sr_codecs = true;
    else if (part == "delta") spec.delta_weights = true;
    else if (part == "once") spec.tokens_once_per_worker = "true";
    else if (part == "perexpert") spec.tokens_once_per_worker = "false";
    else if (part.size() > 1 && part[0] == 'r' && isdigit((unsigned char)part[1]) &&
             part.find_first_not_of("0123456789/", 1) == std::string::npos) {
      // rN: r = N both ways; rN/M: forward N, backward M.
      const size_t slash = part.find('/');
      const std::string fwd = part.substr(1, slash == std::string::npos ? std::string::npos : slash - 1);
      const std::string bwd = slash == std::string::npos ? "" : part.substr(slash + 1);
      if (fwd.size() > 2 || (slash != std::string::npos && (bwd.empty() || bwd.size() > 2 ||
                                                            bwd.find('/') != std::string::npos)))
        return Status::invalid_argument("bad pipeline degree '" + part + "' in '" + run + "' (rN or rN/M)");
      spec.pipeline_degree = std::stoi(fwd);
      spec.backward_pipeline_degree = bwd.empty() ? -1 : std::stoi(bwd);  // -1: the forward's
      if (spec.pipeline_degree > 0 && spec.backward_pipeline_degree > 0 &&
          spec.pipeline_degree % spec.backward_pipeline_degree != 0)
        return Status::invalid_argument("pipeline degree '" + part + "' in '" + run +
                                        "': the backward's must divide the forward's");
    }
    else if (part.size() > 1 && part[0] == 'd' && part.find_first_not_of("0123456789x", 1) == std::string::npos) {
      std::stringstream sizes(part.substr(1));
      for (std::string d; std::getline(sizes, d, 'x');) {
        if (d.empty() || d.size() > 4) return Status::invalid_argument("bad domain sizes '" + part + "' in '" + run + "'");
        spec.domains.push_back(std::stoi(d));
      }
      if (spec.mode != "hybrid") return Status::invalid_argument("domain sizes (" + part + ") need mode hybrid");
    } else {
      return Status::invalid_argument("unknown run option '" + part + "' in '" + run +
                                      "' (farskip, simple, rN, dAxB, late, early, sr, delta, once, perexpert)");
    }
  }
  return spec;
}

std::string run_dir_name(std::string run) {
  std::replace(run.begin(), run.end(), '/', '_');
  return run;
}

RunResult run_job(const LaunchRun& run, const WorkerPlacement& placement) {
  RunResult r;
  r.mode = run.name;
  const RunSpec& spec = run.spec;
  const fs::path dir = fs::path(run.run_dir) / (run_dir_name(run.name) +
                                                (run.attempt > 0 ? "-restart" + std::to_string(run.attempt) : ""));
  fs::create_directories(dir);
  if (!run.trace_steps.empty()) r.trace_dir = (dir / "trace").string();
  const fs::path endpoints = dir / "endpoints.json", summary = dir / "summary.json";
  fs::remove(endpoints);
  fs::remove(summary);
  const std::string exe = self_exe();
  // The coordinator shares this terminal: only its progress lines and
  // warnings, unless a level was asked for. Workers log at info.
  const std::string coordinator_level = log_level_flag().empty() ? "warn" : log_level_flag();
  const std::string worker_level = log_level_flag().empty() ? "info" : log_level_flag();
  std::vector<std::string> args = {exe, "--log-level", coordinator_level, "coordinator", "--mode",
                                   spec.mode == "ep_flat" ? "ep" : spec.mode,
                                   "--bind", "tcp://" + placement.coordinator_bind + ":*", "--cli-bind", run.cli_bind,
                                   "--http-port", "0", "--name", run.name, "--summary", summary.string(),
                                   "--endpoints-file", endpoints.string()};
  if (spec.mode == "ep_flat" || run.flat_ep) args.push_back("--flat-ep");
  if (!run.config.empty()) args.insert(args.end(), {"--config", run.config});
  if (run.steps > 0) args.insert(args.end(), {"--steps", std::to_string(run.steps)});
  if (spec.farskip) args.push_back("--farskip");
  if (run.no_probe) args.push_back("--no-probe");
  if (run.no_replan) args.push_back("--no-replan");
  if (!spec.domains.empty()) {
    std::string list;
    for (int d : spec.domains) list += (list.empty() ? "" : ",") + std::to_string(d);
    args.insert(args.end(), {"--domains", list});
  }
  if (spec.simple) args.push_back("--no-overlap");
  if (spec.sr_codecs) args.push_back("--sr-codecs");
  if (spec.delta_weights) args.push_back("--delta-weights");
  if (!spec.tokens_once_per_worker.empty())
    args.push_back("--tokens-once-per-worker=" + spec.tokens_once_per_worker);
  if (!run.checkpoint_dir.empty()) args.insert(args.end(), {"--checkpoint-dir", run.checkpoint_dir});
  if (run.checkpoint_every >= 0) args.insert(args.end(), {"--checkpoint-every", std::to_string(run.checkpoint_every)});
  if (!run.resume.empty()) args.insert(args.end(), {"--resume", run.resume});
  if (spec.pipeline_degree >= 0) args.insert(args.end(), {"--pipeline-degree", std::to_string(spec.pipeline_degree)});
  if (spec.backward_pipeline_degree >= -1)
    args.insert(args.end(), {"--backward-pipeline-degree", std::to_string(spec.backward_pipeline_degree)});
  if (!spec.replica_weight_gradients.empty())
    args.insert(args.end(), {"--replica-weight-gradients", spec.replica_weight_gradients});
  if (!run.trace_steps.empty()) {
    std::string list;
    for (int64_t s : run.trace_steps) list += (list.empty() ? "" : ",") + std::to_string(s);
    args.insert(args.end(), {"--trace-steps", list, "--trace-dir", (dir / "trace").string()});
  }
  args.insert(args.end(), placement.coordinator_args.begin(), placement.coordinator_args.end());
  const std::string where = placement.kind == WorkerPlacement::Kind::kSsh        ? " over ssh"
                           : placement.kind == WorkerPlacement::Kind::kNetns    ? " in network namespaces"
                           : placement.kind == WorkerPlacement::Kind::kLauncher ? " by " + placement.launcher[0]
                                                                                : "";
  std::printf("\n=== %s: coordinator + %d workers%s (logs in %s) ===\n", run.name.c_str(), run.world, where.c_str(),
              dir.c_str());
  std::fflush(stdout);
  // Ctrl-C, a closed terminal or a kill reach only this process (every
  // child leads a group of its own): it stops the job in order.
  g_interrupted = 0;
  struct RestoreSignals {
    using Handler = void (*)(int);
    Handler old[3];
    RestoreSignals() {
      int i = 0;
      for (int sig : {SIGINT, SIGTERM, SIGHUP}) old[i++] = std::signal(sig, [](int) { g_interrupted = 1; });
    }
    ~RestoreSignals() {
      int i = 0;
      for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, old[i++]);
    }
  } restore;

  subprocess::Child coordinator = subprocess::spawn(args, "", {}, /*new_group=*/true);
  std::string worker_ep;
  for (int i = 0; i < 300 && worker_ep.empty() && !g_interrupted; ++i) {
    if (subprocess::try_wait(coordinator) != kRunning) {
      r.error = "the coordinator exited during start-up";
      return r;
    }
    std::ifstream in(endpoints);
    if (in) {
      try {
        nlohmann::json j;
        in >> j;
        worker_ep = endpoint_with_host(j.at("workers").get<std::string>(), placement.coordinator_host);
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
    r.interrupted = g_interrupted;
    r.error = g_interrupted ? "interrupted" : "the coordinator did not start within 30 s";
    return r;
  }

  std::mutex terminal;
  std::vector<std::unique_ptr<WorkerProcess>> workers;
  const bool one_launcher = placement.kind == WorkerPlacement::Kind::kLauncher;
  for (int rank = 0; rank < (one_launcher ? 1 : run.world); ++rank) {
    auto w = std::make_unique<WorkerProcess>();
    const std::vector<std::string> argv = worker_command(placement, rank, worker_ep, worker_level);
    w->name = one_launcher ? fs::path(argv[0]).filename().string() : "worker " + std::to_string(rank);
    const std::string log =
        (dir / (one_launcher ? std::string("workers.log") : "worker" + std::to_string(rank) + ".log")).string();
    if (placement.kind == WorkerPlacement::Kind::kLocal) {
      w->child = subprocess::spawn(argv, log, {"OPENBLAS_NUM_THREADS=1"}, /*new_group=*/true);
    } else {
      int fd = -1;
      w->child = subprocess::spawn_piped(argv, {"OPENBLAS_NUM_THREADS=1"}, &fd);
      w->piped = true;
      const std::string prefix = one_launcher ? "[" + w->name + "] " : "[rank " + std::to_string(rank) + "] ";
      if (fd >= 0) w->output = std::thread(forward_output, fd, prefix, log, &terminal);
    }
    workers.push_back(std::move(w));
  }

  // Wait for the coordinator; a failed worker or Ctrl-C stops everything.
  int coordinator_code = kRunning;
  std::string stop_reason;
  Clock::time_point kill_at{};
  auto stop_all = [&](int sig) {
    if (coordinator_code == kRunning) subprocess::signal_group(coordinator, sig);
    for (auto& w : workers)
      if (w->code == kRunning) subprocess::signal_group(w->child, sig);
  };
  for (;;) {
    // Before anything exits because of it, so that the run counts as interrupted.
    if (g_interrupted && stop_reason.empty()) {
      stop_reason = "interrupted";
      r.interrupted = true;
      std::fprintf(stderr, "\nxdmoe launch: interrupted; stopping the coordinator and every worker\n");
    }
    if (coordinator_code == kRunning) coordinator_code = subprocess::try_wait(coordinator);
    for (auto& wp : workers) {
      WorkerProcess& w = *wp;
      if (w.code != kRunning) continue;
      w.code = subprocess::try_wait(w.child);
      // Exit code 3: the coordinator told the worker to stop; its reason is the coordinator's to give.
      if (w.code != kRunning && w.code != 0 && w.code != 3 && stop_reason.empty() && coordinator_code == kRunning) {
        stop_reason = w.name + " exited with code " + std::to_string(w.code);
        std::lock_guard<std::mutex> lock(terminal);
        std::fprintf(stderr, "xdmoe launch: %s; stopping the job\n", stop_reason.c_str());
      }
    }
    // The coordinator ended badly: the workers need not wait out their heartbeats.
    if (coordinator_code != kRunning && coordinator_code != 0 && stop_reason.empty())
      stop_reason = "the coordinator exited with code " + std::to_string(coordinator_code);
    if ((!stop_reason.empty() || (coordinator_code != kRunning && coordinator_code != 0)) && r.failed_wall_s == 0)
      r.failed_wall_s = unix_seconds();
    if (!stop_reason.empty() && kill_at == Clock::time_point{}) {
      stop_all(SIGTERM);
      kill_at = Clock::now() + std::chrono::seconds(5);
    }
    if (kill_at != Clock::time_point{} && Clock::now() > kill_at) {
      stop_all(SIGKILL);
      kill_at = Clock::now() + std::chrono::hours(1);
    }
    bool workers_done = true;
    for (auto& w : workers) workers_done = workers_done && w->code != kRunning;
    if (coordinator_code != kRunning && workers_done) break;
    // After a clean end, workers leave once the coordinator closes the job.
    if (coordinator_code == 0 && kill_at == Clock::time_point{}) kill_at = Clock::now() + std::chrono::seconds(15);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& w : workers)
    if (w->output.joinable()) w->output.join();

  int worker_failures = 0;
  for (auto& w : workers) {
    if (w->code == 0) continue;
    ++worker_failures;
    if (w->piped) continue;  // its lines are on the terminal already
    // Stopped by us or by the coordinator, because of another: its log is not the story.
    if ((w->code == -SIGTERM && !stop_reason.empty()) || w->code == 3) continue;
    std::fprintf(stderr, "%s exited with %d; last lines of its log:\n", w->name.c_str(), w->code);
    std::string log = subprocess::read_text(w->child.log_path);
    std::fprintf(stderr, "%s\n", log.substr(log.size() > 1500 ? log.size() - 1500 : 0).c_str());
  }
  r.summary = nlohmann::json::object();
  std::ifstream in(summary);
  if (in) {
    try {
      in >> r.summary;
    } catch (const std::exception&) {
    }
    if (!r.summary.is_object()) r.summary = nlohmann::json::object();
  }
  r.ok = coordinator_code == 0 && worker_failures == 0 && r.summary.value("ok", false) && stop_reason.empty();
  // What made this launch stop the job says most (the coordinator then only
  // reports that it was stopped); else the coordinator's own account.
  const bool launch_stopped_it = !stop_reason.empty() && !stop_reason.starts_with("the coordinator exited");
  if (!r.ok)
    r.error = launch_stopped_it             ? stop_reason
              : r.summary.contains("error") ? r.summary["error"].get<std::string>()
              : !stop_reason.empty()        ? stop_reason
                                            : "coordinator exit code " + std::to_string(coordinator_code);
  return r;
}

namespace {
// The newest checkpoint this launch wrote that verifies (`written`: every
// attempt's summary "checkpoints"), else `fallback` (what it resumed from).
// A directory may hold other jobs' step_<N>: only our own are candidates.
std::string restart_point(const std::map<int64_t, std::string>& written, const std::string& fallback) {
  for (auto it = written.rbegin(); it != written.rend(); ++it) {
    Status st = verify_checkpoint(it->second);
    if (st.is_ok()) return it->second;
    std::fprintf(stderr, "xdmoe launch: skipping checkpoint %s\n", st.message().c_str());
  }
  return fallback;
}
}  // namespace

RunResult run_with_restarts(const LaunchRun& run_in, const WorkerPlacement& placement) {
  LaunchRun run = run_in;
  RunResult r = run_job(run, placement);
  nlohmann::json restarts = nlohmann::json::array();
  std::map<int64_t, std::string> written;  // step -> directory, by this launch
  for (int restart = 1; !r.ok && !r.interrupted && restart <= run.max_restarts; ++restart) {
    // A run that never got its workers going (or left no account) fails the same way again.
    if (!r.summary.is_object() || !r.summary.value("started", false)) break;
    int64_t failed_after = 0;
    if (r.summary.contains("steps") && r.summary["steps"].is_array() && !r.summary["steps"].empty())
      failed_after = r.summary["steps"].back().get<int64_t>();
    if (r.summary.contains("checkpoints") && r.summary["checkpoints"].is_array())
      for (const auto& c : r.summary["checkpoints"]) written[c.value("step", int64_t{0})] = c.value("dir", std::string());
    nlohmann::json event = {{"restart", restart}, {"reason", r.error}, {"failed_wall_s", r.failed_wall_s},
                            {"failed_after_step", failed_after}};
    run.resume = restart_point(written, run_in.resume);
    int64_t resumed_step = 0;
    if (!run.resume.empty())
      if (auto state = checkpoint_trainer_state(run.resume)) resumed_step = state->step;
    event["resumed_step"] = resumed_step;
    event["resumed_from"] = run.resume;
    // The plan in force when the run failed, kept fixed: the losses go on as
    // they would have (exactly, when it did not change after the checkpoint).
    if (r.summary.contains("domain_sizes")) {
      run.spec.domains = r.summary["domain_sizes"].get<std::vector<int>>();
      bool ep = true;
      for (int d : run.spec.domains) ep = ep && d == 1;
      if (run.spec.mode != "ep_flat") run.spec.mode = ep ? "ep" : "hybrid";
      if (run.spec.mode != "hybrid") run.spec.domains.clear();
      run.spec.pipeline_degree = r.summary.value("pipeline_degree", 1);
      run.spec.backward_pipeline_degree = r.summary.value("backward_pipeline_degree", run.spec.pipeline_degree);
      if (r.summary.contains("tokens_once_per_worker") && r.summary["tokens_once_per_worker"].is_boolean())
        run.spec.tokens_once_per_worker = r.summary["tokens_once_per_worker"].get<bool>() ? "true" : "false";
      run.no_probe = true;
      run.no_replan = true;
    }
    std::fprintf(stderr, "xdmoe launch: %s failed (%s); restart %d of %d from %s\n", run.name.c_str(),
                 r.error.c_str(), restart, run.max_restarts, run.resume.empty() ? "the start" : run.resume.c_str());
    run.attempt = restart;
    RunResult next = run_job(run, placement);
    if (next.summary.is_object() && next.summary.contains("first_step_wall_s") && r.failed_wall_s > 0)
      event["recovery_s"] = next.summary["first_step_wall_s"].get<double>() - r.failed_wall_s;
    restarts.push_back(event);
    r = std::move(next);
  }
  r.restarts = restarts;
  if (!restarts.empty() && r.summary.is_object()) {
    // The last attempt's summary also tells how it came to be.
    r.summary["restarts"] = restarts;
    const fs::path path =
        fs::path(run.run_dir) / (run_dir_name(run.name) + "-restart" + std::to_string(run.attempt)) / "summary.json";
    std::ofstream(path) << r.summary.dump(2) << "\n";
  }
  return r;
}

}  // namespace xd::cli
