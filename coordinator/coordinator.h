// Coordinator: the job's control process (`xdmoe coordinator`). It registers
// workers (ROUTER/DEALER, zguide Majordomo style), gives each its rank,
// location, peers and the expert-parallel plan, and watches liveness with
// heartbeats (Paranoid Pirate: every interval, lost after `liveness` misses).
// It aggregates per-step metrics, answers CLI requests (status, metrics, stop,
// throttle) on a second socket and serves Prometheus text over HTTP.
// run() owns every socket and returns when the job ends; not thread-safe.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "cluster/job_config.h"

namespace xd {

struct CoordinatorOptions {
  std::string worker_endpoint = "tcp://127.0.0.1:7371";
  std::string cli_endpoint = "tcp://127.0.0.1:7370";
  int http_port = 7372;           // Prometheus /metrics; 0: a free port; -1: off
  std::string job_name = "xdmoe";
  double heartbeat_interval_s = 1.0;
  int liveness = 3;
  bool hold = false;              // workers stay idle after assignment until stopped
  bool flat_ep = false;           // EP with one all-to-all hop instead of one per level
  std::string summary_path;       // JSON summary written at the end, if set
  std::string endpoints_path;     // where the bound endpoints are written, if set
  double register_timeout_s = 120;
  // Fit alpha/beta of every shaped link class at start-up (FSMoE Eq. 1) and
  // plan with the fits instead of the spec's figures (coordinator/job_planner.h).
  bool probe_links = true;
  // A network-namespace cluster's state file (scripts/netns-cluster.sh): the
  // outermost level's bandwidth is the kernel's tbf, which `xdmoe throttle`
  // then changes. Empty: every link is shaped in the workers.
  std::string netns_state;
  // Re-plan when a shaped link class's measured bandwidth moves far from the
  // plan's (coordinator/replanner.h), switching domains at a step boundary.
  bool replan = true;
  // Start from a checkpoint: a checkpoint directory, or a directory of
  // step_<N> checkpoints whose newest complete one is taken (torn or corrupt
  // ones are skipped, with a warning). Empty: a fresh start.
  std::string resume;
};

class Coordinator {
 public:
  Coordinator(JobConfig job, CoordinatorOptions options);
  ~Coordinator();
  // Runs the job to its end: ok when every worker finished; an error when one
  // was lost or failed, the job was stopped early, or registration timed out.
  Status run();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace xd
