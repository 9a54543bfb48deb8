// One run of `xdmoe launch`: a coordinator process here and the job's workers,
// started here, over ssh on the hosts of a hostfile, or inside the network
// namespaces of scripts/netns-cluster.sh. Internal to the cli.
//
// The run ends when the coordinator exits. A worker that fails, or Ctrl-C
// (or SIGTERM, SIGHUP), stops the whole job: the coordinator and every
// worker lead process groups of their own, and each group gets SIGTERM, then
// SIGKILL 5 s later; remote workers the signal cannot reach see the
// coordinator go silent and leave after 3 missed heartbeats.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace xd::cli {

// "auto+farskip+simple" -> the mode and the schedule flags of the coordinator.
struct RunSpec {
  std::string mode;
  bool farskip = false, simple = false;
  int pipeline_degree = -1;  // -1: the config's
  int backward_pipeline_degree = -2;  // +r4/2: 2; +r4: -1 (the forward's); -2: the config's
  std::vector<int> domains;  // +d2x1: these domain sizes (mode hybrid); empty: the plan's
  std::string replica_weight_gradients;  // +late, +early; empty: the config's
  bool sr_codecs = false;  // +sr: the coordinator's --sr-codecs
  bool delta_weights = false;  // +delta: the coordinator's --delta-weights
  // +once: the coordinator's --tokens-once-per-worker=true; +perexpert:
  // =false (a token row per expert); empty: the config's.
  std::string tokens_once_per_worker;
};
Expected<RunSpec> parse_run(const std::string& run);
// The run's directory under --run-dir: its name with '/' (as in +r4/2) as '_'.
std::string run_dir_name(std::string run);

// Where and how the workers start.
struct WorkerPlacement {
  // kLauncher: one `srun` or `mpirun` starts every worker; each worker takes
  // its rank from the launcher's environment.
  enum class Kind : int { kLocal = 0, kSsh = 1, kNetns = 2, kLauncher = 3 };
  Kind kind = Kind::kLocal;
  int world = 0;                        // workers to start
  std::vector<std::string> ssh;         // kSsh: the ssh command, split into words
  std::vector<std::string> launcher;    // kLauncher: e.g. {"srun"} or {"mpirun", "--oversubscribe"}
  std::string remote_exe;               // kSsh: the xdmoe binary on the hosts
  std::vector<std::string> host;        // by rank: ssh host (kSsh) or namespace (kNetns)
  std::vector<std::string> address;     // by rank: the address the worker binds (kNetns)
  std::string coordinator_bind = "127.0.0.1";  // the address the coordinator listens on
  std::string coordinator_host = "127.0.0.1";  // the address workers reach it at
  std::string loopback_advertised;  // kSsh: what a loopback host advertises when others are remote
  std::vector<std::string> coordinator_args;   // extra flags (--hostfile, --netns ...)
  std::vector<std::string> worker_args;        // extra worker flags (--kernel-shaped ...)
};

struct LaunchRun {
  std::string config, run_dir, cli_bind, name;
  RunSpec spec;
  int64_t steps = 0;
  // Checkpoints (docs/operations.md): where, how often (-1: the config's),
  // what to start from (a checkpoint or a directory of them; empty: fresh),
  // and how many times a failed run is relaunched from its last checkpoint.
  std::string checkpoint_dir, resume;
  int64_t checkpoint_every = -1;
  int max_restarts = 0;
  int attempt = 0;  // 0: the first; N: the Nth restart (logs in <run-dir>/<name>-restartN)
  bool flat_ep = false, no_probe = false, no_replan = false;
  std::vector<int64_t> trace_steps;
  int world = 0;
};

struct RunResult {
  std::string mode;
  bool ok = false, interrupted = false;  // interrupted: Ctrl-C, SIGTERM or SIGHUP
  nlohmann::json summary = nlohmann::json::object();  // the coordinator's, of the last attempt
  std::string error;
  double failed_wall_s = 0;              // Unix time the launch saw the run fail
  nlohmann::json restarts = nlohmann::json::array();  // one object per relaunch
  std::string trace_dir;                 // the workers' step traces, when steps were traced
};

// Runs one job to its end. Never throws; errors come back in RunResult.
RunResult run_job(const LaunchRun& run, const WorkerPlacement& placement);

// run_job, and after a failure that is not an interruption (a worker died,
// hung or failed) the whole job again from the newest complete checkpoint
// in run.checkpoint_dir, with the plan the failed run had, up to
// run.max_restarts times.
RunResult run_with_restarts(const LaunchRun& run, const WorkerPlacement& placement);

// The path of this executable (/proc/self/exe).
std::string self_exe();

// 'text' quoted for a POSIX shell.
std::string shell_quote(const std::string& text);

}  // namespace xd::cli
