// Runs a whole job from a test: a coordinator and its workers as real
// processes of the xdmoe binary, over loopback. Returns their exit codes and
// the coordinator's JSON summary; the job's directory goes when the test
// passes (scratch_dirs.h). Also the small model the distributed tests
// share.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/subprocess.h"
#include "scratch_dirs.h"

namespace xd::testing {

// model/train/data of a small MoE (8 experts, 2 layers) for distributed tests: 20
// steps of 2 sequences of 16 tokens per worker on the built-in corpus.
inline std::string model_yaml() {
  return R"(model:
  hidden_size: 32
  num_layers: 2
  num_heads: 2
  num_kv_heads: 1
  max_seq_len: 16
  num_experts: 8
  top_k: 2
  expert_intermediate_size: 32
  num_shared_experts: 1
  shared_intermediate_size: 32
  aux_loss_coef: 0.0
  z_loss_coef: 0.001
  init_std: 0.1
  connectivity: regular
train:
  steps: 20
  batch_size: 2
  seq_len: 16
  warmup_steps: 5
  log_every: 5
  eval_every: 0
data:
  builtin_bytes: 65536
)";
}

inline std::string xdmoe_binary() { return std::string(XD_BINARY_DIR) + "/xdmoe"; }

// Runs a shell command; returns its exit code and its stdout and stderr together.
inline std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  while (p && std::fgets(buf, sizeof buf, p)) out += buf;
  const int status = p ? ::pclose(p) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

struct JobResult {
  int coordinator_code = -1;
  std::vector<int> worker_codes;
  nlohmann::json summary;
  std::string coordinator_log;
  std::vector<std::string> worker_logs;
  bool ok() const {
    if (coordinator_code != 0) return false;
    for (int c : worker_codes)
      if (c != 0) return false;
    return true;
  }
  std::string logs() const {
    std::string s = "coordinator:\n" + coordinator_log;
    for (size_t i = 0; i < worker_logs.size(); ++i) s += "\nworker " + std::to_string(i) + ":\n" + worker_logs[i];
    return s;
  }
};

// Reads the endpoints file the coordinator writes once it has bound.
inline nlohmann::json wait_for_endpoints(const std::string& path, const subprocess::Child& coordinator) {
  for (int i = 0; i < 600; ++i) {
    std::ifstream in(path);
    if (in) {
      try {
        nlohmann::json j;
        in >> j;
        return j;
      } catch (const std::exception&) {
      }
    }
    if (subprocess::try_wait(coordinator) != -2000) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return nlohmann::json();
}

inline JobResult run_job(const std::string& dir, const std::string& config_yaml, int workers,
                         const std::vector<std::string>& coordinator_args,
                         std::chrono::seconds timeout = std::chrono::seconds(300)) {
  namespace fs = std::filesystem;
  remove_after_test(dir);
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string config = dir + "/job.yaml";
  std::ofstream(config) << config_yaml;
  std::vector<std::string> args = {xdmoe_binary(), "coordinator", "--config", config, "--bind", "tcp://127.0.0.1:*",
                                   "--cli-bind", "tcp://127.0.0.1:*", "--http-port", "-1",
                                   "--summary", dir + "/summary.json", "--endpoints-file", dir + "/endpoints.json"};
  args.insert(args.end(), coordinator_args.begin(), coordinator_args.end());
  JobResult r;
  subprocess::Child coordinator = subprocess::spawn(args, dir + "/coordinator.log");
  nlohmann::json eps = wait_for_endpoints(dir + "/endpoints.json", coordinator);
  std::vector<subprocess::Child> ws;
  if (eps.contains("workers"))
    for (int i = 0; i < workers; ++i)
      ws.push_back(subprocess::spawn({xdmoe_binary(), "worker", "--coordinator", eps["workers"].get<std::string>(),
                                      "--rank", std::to_string(i)},
                                     dir + "/worker" + std::to_string(i) + ".log", {"OPENBLAS_NUM_THREADS=1"}));
  r.coordinator_code = subprocess::wait_for(coordinator, timeout);
  for (auto& w : ws) r.worker_codes.push_back(subprocess::wait_for(w, std::chrono::seconds(20)));
  r.coordinator_log = subprocess::read_text(dir + "/coordinator.log");
  for (int i = 0; i < (int)ws.size(); ++i) r.worker_logs.push_back(subprocess::read_text(dir + "/worker" + std::to_string(i) + ".log"));
  std::ifstream in(dir + "/summary.json");
  if (in) {
    try {
      in >> r.summary;
    } catch (const std::exception&) {
    }
  }
  return r;
}

}  // namespace xd::testing
