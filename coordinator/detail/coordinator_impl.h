// Coordinator::Impl: the coordinator's state and its loop's handlers,
// shared by the files that implement them (coordinator.cc: start-up, the
// loop and the workers' control messages; coordinator_replan.cc: live
// re-planning; coordinator_monitor.cc: progress lines, `xdmoe status/top`
// and Prometheus; coordinator_summary.cc: the run summary). Everything here
// runs on the coordinator's loop thread, except the Prometheus scrape, which
// takes prom_mu.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/progress.h"
#include "coordinator/checkpoint_tracker.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_metrics.h"
#include "coordinator/job_planner.h"
#include "coordinator/kernel_shaper.h"
#include "coordinator/replanner.h"
#include "coordinator/worker_registry.h"
#include "transport/control_channel.h"

namespace httplib {
class Server;
}

namespace xd {

enum class JobState { kWaiting, kRunning, kFinishing, kDone, kFailed };
const char* job_state_name(JobState s);

class Coordinator::Impl {
 public:
  Impl(JobConfig j, CoordinatorOptions o);
  ~Impl();  // where httplib::Server is complete (coordinator.cc)

  Status run();

  JobConfig job;
  CoordinatorOptions opts;
  WorkerRegistry registry;
  JobMetrics metrics;
  Plan plan;
  PlannerInputs plan_inputs;
  uint32_t job_id = 0;
  JobState state = JobState::kWaiting;
  Status outcome;
  std::unique_ptr<ControlServer> workers, cli;
  std::optional<KernelShaper> kernel;  // --netns: the outermost level's tbf
  std::unique_ptr<Replanner> replanner;  // live re-planning (opts.replan)
  std::unique_ptr<CheckpointTracker> checkpoints;  // manifests of train.checkpoint_dir
  std::string resume_dir;    // the checkpoint the workers start from, or empty
  int64_t resume_step = 0;   // its step
  double first_step_wall_s = 0;  // Unix time the first step of this run completed
  bool curve = false;            // CURVE on the coordinator's sockets (cluster.security)
  std::vector<std::string> worker_keys;  // by rank: the public key each registered with
  double started = 0, stop_deadline = 0;
  int64_t last_logged_step = 0, last_replan_step = 0;
  double startup_predicted_s = 0;  // the start-up plan's step, before any re-plan or re-fit
  std::vector<double> startup_a2a_imbalance;  // the F per level it assumed (the routing probe's; empty: 1)
  double startup_expert_imbalance = 1;        // the routed experts' load it assumed (ExpertLoad::layers_busiest)
  double running_since = 0;  // when the workers were assigned
  ProgressLine progress;     // stdout: a live bar on a terminal, plain lines elsewhere

  // The Prometheus text is rendered by the loop, which owns the metrics, when
  // a scrape asks for it (not on every turn: that cost the loop a steady
  // share of a core). A scrape takes a ticket and waits for the loop's next
  // turn, at most a poll interval; outside the loop it gets the last text.
  std::mutex prom_mu;
  std::condition_variable prom_cv;
  uint64_t prom_wanted = 0, prom_rendered = 0;
  bool prom_live = false;  // the loop is turning and renders on request
  std::string prom_text;
  std::unique_ptr<httplib::Server> http;
  std::thread http_thread;
  int http_port = -1;

 private:
  // CURVE keys and allow-lists from cluster.security, or plaintext when the
  // job may have it (docs/operations.md).
  Status set_up_security(SocketSecurity* control, SocketSecurity* cli);
  void handle_worker(const ControlMessage& m, double now);
  void refuse(const std::string& peer, const std::string& why);
  void handle_cli(const ControlMessage& m);
  void assign_all();
  void stop_all(const std::string& reason);
  void fail(const Status& st);
  void log_progress();
  // Feeds the last complete step's link measurements to the replanner and
  // sends the workers a plan update when it re-plans.
  void consider_replan();
  // The step's measured codec fractions per level, for the replanner.
  std::vector<CodecFractions> codec_fractions(const StepSummary& s) const;
  // The replanner, once the workers' endpoints are known (assign_all).
  void start_replanner();
  // The backward's r the workers run: the job's, or the planner's choice.
  int backward_degree() const {
    if (replanner) return replanner->backward_pipeline_degree();
    const int given = job.cluster.expert_parallel.backward_pipeline_degree;
    return given > 0 ? given : std::max(1, plan.choice().backward_pipeline_degree);
  }
  // The forward's r the workers run.
  int forward_degree() const {
    if (replanner) return replanner->pipeline_degree();
    const int given = job.cluster.expert_parallel.pipeline_degree;
    return given > 0 ? given : std::max(1, plan.choice().pipeline_degree);
  }
  // Whether the workers compute the replicas' weight gradients late: the
  // plan's choice (expert_parallel.replica_weight_gradients; never without
  // replicas or overlap).
  bool replica_weights_late() const {
    return replanner ? replanner->replica_weights_late() : plan.choice().replica_weights_late;
  }
  ReplicaWeightGradients replica_weight_gradients() const {
    return replica_weight_gradients_of(replica_weights_late());
  }
  nlohmann::json plan_changes_json() const;
  nlohmann::json status_json(double now);
  void write_summary();
  // Renders the Prometheus text when a scrape waits for it, or `always`.
  void refresh_prometheus(bool always = false);
  void set_prometheus_live(bool live);
  void start_http();
};

}  // namespace xd
