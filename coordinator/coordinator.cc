#include "coordinator/coordinator.h"

#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "common/progress.h"
#include "coordinator/checkpoint_tracker.h"
#include "coordinator/job_metrics.h"
#include "coordinator/job_planner.h"
#include "coordinator/kernel_shaper.h"
#include "coordinator/replanner.h"
#include "cluster/protocol.h"
#include "coordinator/worker_registry.h"
#include "transport/control_channel.h"
#include "transport/endpoint.h"
#include "transport/security.h"

namespace xd {

namespace {

// SIGTERM or SIGINT: stop the workers, write the summary, then exit (a
// launcher that stops a job this way still gets its account).
volatile std::sig_atomic_t g_terminate = 0;

enum class JobState { kWaiting, kRunning, kFinishing, kDone, kFailed };
const char* job_state_name(JobState s) {
  switch (s) {
    case JobState::kWaiting: return "waiting for workers";
    case JobState::kRunning: return "running";
    case JobState::kFinishing: return "stopping";
    case JobState::kDone: return "done";
    case JobState::kFailed: return "failed";
  }
  return "?";
}
}  // namespace

class Coordinator::Impl {
 public:
  Impl(JobConfig j, CoordinatorOptions o)
      : job(std::move(j)),
        opts(std::move(o)),
        registry(job.cluster.world_size(), opts.heartbeat_interval_s, opts.liveness),
        metrics(job.cluster.world_size()) {
    std::random_device rd;
    job_id = rd() & 0x7FFFFFFF;
  }

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

Coordinator::Coordinator(JobConfig job, CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(job), std::move(options))) {}
Coordinator::~Coordinator() = default;
Status Coordinator::run() { return impl_->run(); }

void Coordinator::Impl::start_http() {
  if (opts.http_port < 0) return;
  http = std::make_unique<httplib::Server>();
  http->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    std::unique_lock<std::mutex> lock(prom_mu);
    if (prom_live) {
      const uint64_t ticket = ++prom_wanted;
      prom_cv.wait_for(lock, std::chrono::seconds(2), [&] { return prom_rendered >= ticket || !prom_live; });
    }
    res.set_content(prom_text, "text/plain; version=0.0.4");
  });
  if (opts.http_port == 0) {
    http_port = http->bind_to_any_port("127.0.0.1");
  } else {
    http_port = http->bind_to_port("127.0.0.1", opts.http_port) ? opts.http_port : -1;
  }
  if (http_port < 0) {
    XD_LOG_WARN("coordinator", "cannot serve metrics on port %d; continuing without HTTP", opts.http_port);
    http.reset();
    return;
  }
  http_thread = std::thread([this] { http->listen_after_bind(); });
}

Status Coordinator::Impl::run() {
  // From the start: a stop during start-up (planning probes take seconds)
  // still ends with a summary.
  g_terminate = 0;
  struct RestoreSignals {
    using Handler = void (*)(int);
    Handler term = std::signal(SIGTERM, [](int) { g_terminate = 1; });
    Handler intr = std::signal(SIGINT, [](int) { g_terminate = 1; });
    ~RestoreSignals() {
      std::signal(SIGTERM, term);
      std::signal(SIGINT, intr);
    }
  } restore;
  XD_RETURN_IF_ERROR(job.cluster.validate());
  checkpoints = std::make_unique<CheckpointTracker>(job.train.model, job.cluster.world_size(), job.train.seed,
                                                    job.train.checkpoint_dir, job.train.steps);
  if (!opts.resume.empty()) {
    std::vector<std::string> skipped;
    auto dir = resolve_checkpoint(opts.resume, &skipped);
    if (!dir) return dir.status().with_context("--resume");
    auto state = checkpoint_trainer_state(*dir);
    if (!state) return state.status().with_context("--resume");
    if (state->step >= job.train.steps)
      return Status::invalid_argument("--resume: " + *dir + " is at step " + std::to_string(state->step) +
                                      ", and the job ends at train.steps " + std::to_string(job.train.steps));
    resume_dir = *dir;
    resume_step = state->step;
    for (const std::string& s : skipped) std::printf("resume: skipped %s\n", s.c_str());
    std::printf("resume: from %s (step %lld)\n", resume_dir.c_str(), (long long)resume_step);
    std::fflush(stdout);
  }
  if (!opts.netns_state.empty()) {
    auto k = KernelShaper::load(opts.netns_state);
    if (!k) return k.status();
    kernel = std::move(*k);
  }
  SocketSecurity control_security, cli_security;
  XD_RETURN_IF_ERROR(set_up_security(&control_security, &cli_security));
  auto w = ControlServer::bind(opts.worker_endpoint, control_security);
  if (!w) return w.status();
  workers = std::move(*w);
  auto c = ControlServer::bind(opts.cli_endpoint, cli_security);
  if (!c) return c.status();
  cli = std::move(*c);
  JobPlanOptions po;
  po.probe_links = opts.probe_links;
  if (!resume_dir.empty())
    po.skip_routing_probe = "a resumed run routes with its checkpoint's weights, not the initial ones";
  else if (opts.flat_ep && job.cluster.expert_parallel.mode == EpMode::kEp)
    po.skip_routing_probe = "flat EP sends each row to its expert's owner in one hop, not level by level";
  auto planned = plan_job(job, po);
  if (!planned) return planned.status();
  for (const LinkEstimate& e : planned->links) {
    if (e.source == "probe")
      XD_LOG_INFO("coordinator", "link class %s: fitted alpha %.3f ms, 1/beta %.2f MB/s (r2 %.4f); configured %.3f ms, %.2f MB/s",
                  e.name.c_str(), e.model.alpha_s * 1e3, 1e-6 / e.model.beta_s_per_byte, e.r2,
                  e.configured.alpha_s * 1e3, 1e-6 / e.configured.beta_s_per_byte);
    else if (!e.note.empty())
      XD_LOG_INFO("coordinator", "link class %s: planning with its spec (%s)", e.name.c_str(), e.note.c_str());
  }
  if (!planned->compute_note.empty()) XD_LOG_WARN("coordinator", "%s", planned->compute_note.c_str());
  for (const std::string& s : settings_without_effect(job)) XD_LOG_WARN("coordinator", "%s", s.c_str());
  XD_LOG_INFO("coordinator", "compute model: %.2f GFLOP/s per worker, x %.2f for non-GEMM work (a model step of %lld tokens took %.1f ms)",
              planned->compute.flops_per_s / 1e9, planned->compute.non_gemm_factor, planned->step_probe.tokens,
              planned->step_probe.seconds * 1e3);
  if (planned->routing.workers > 0) {
    std::string fs;
    const std::vector<double>& f = planned->plan.choice().a2a_imbalance;
    for (size_t l = 0; l < f.size() && l < job.cluster.levels.size(); ++l) {
      char one[32];
      std::snprintf(one, sizeof one, " %.2f", f[l]);
      fs += (fs.empty() ? "" : ",") + job.cluster.levels[l].name + one;
    }
    XD_LOG_INFO("coordinator", "routing probe: each worker's first %lld tokens through the initial weights (%.0f ms): "
                "a token A2A hop lasts F times the mean rows' time, %s under the chosen domains",
                planned->routing.tokens_per_worker, planned->routing.seconds * 1e3, fs.c_str());
  } else {
    XD_LOG_WARN("coordinator", "routing not probed (%s); uniform routing (F = 1) until the run measures it",
                planned->routing_note.c_str());
  }
  plan = planned->plan;
  plan_inputs = planned->inputs;
  start_http();
  if (!opts.endpoints_path.empty()) {
    std::ofstream out(opts.endpoints_path);
    out << nlohmann::json{{"workers", workers->endpoint()}, {"cli", cli->endpoint()},
                          {"http_port", http_port}, {"pid", ::getpid()}}.dump(2);
  }
  const PlanCandidate& choice = plan.choice();
  std::string domains;
  for (int s : choice.domain_sizes) domains += (domains.empty() ? "" : "x") + std::to_string(s);
  XD_LOG_INFO("coordinator", "job %s (id %u): %d workers, levels %s; plan %s, domains %s, predicted %.1f ms/step%s%s",
              opts.job_name.c_str(), job_id, registry.world_size(),
              [&] { std::string s; for (int v : job.cluster.level_sizes()) s += (s.empty() ? "" : "x") + std::to_string(v); return s; }().c_str(),
              ep_mode_name(plan.mode), domains.c_str(), choice.iteration_s * 1e3,
              replica_weights_late() ? "; the replicas' weight gradients late" : "",
              choice.tokens_once_per_worker ? "; a token once per worker" : "");
  const std::string metrics_url =
      http_port > 0 ? "http://127.0.0.1:" + std::to_string(http_port) + "/metrics" : "off";
  XD_LOG_INFO("coordinator", "workers connect to %s; CLI at %s; Prometheus metrics %s",
              workers->endpoint().c_str(), cli->endpoint().c_str(), metrics_url.c_str());

  started = steady_seconds();
  set_prometheus_live(true);
  double next_heartbeat = started + opts.heartbeat_interval_s;
  while (state != JobState::kDone && state != JobState::kFailed) {
    if (g_terminate && state != JobState::kFinishing) fail(Status::unavailable("the coordinator was told to stop (signal)"));
    if (auto m = workers->poll(std::chrono::milliseconds(20))) handle_worker(*m, steady_seconds());
    while (auto m = cli->poll(std::chrono::milliseconds(0))) handle_cli(*m);
    const double now = steady_seconds();
    if (now >= next_heartbeat) {
      for (const auto& e : registry.workers())
        if (e && (e->state == WorkerState::kRegistered || e->state == WorkerState::kRunning))
          workers->send(e->peer_id, MessageKind::kHeartbeat, to_json(Heartbeat{}));
      next_heartbeat = now + opts.heartbeat_interval_s;
    }
    for (int rank : registry.expire(now)) {
      const WorkerEntry* e = registry.find(rank);
      XD_LOG_ERROR("coordinator", "worker %d (%s pid %d) lost: no heartbeat for %.1f s", rank,
                   e->info.host.c_str(), e->info.pid, now - e->last_seen);
      if (state == JobState::kRunning || state == JobState::kWaiting) {
        if (!opts.hold || state == JobState::kWaiting)
          fail(Status::unavailable("worker " + std::to_string(rank) + " was lost"));
      }
    }
    if (state == JobState::kWaiting && registry.complete()) assign_all();
    if (state == JobState::kWaiting && now - started > opts.register_timeout_s)
      fail(Status::timeout("only some workers registered within " +
                           std::to_string((int)opts.register_timeout_s) + " s"));
    if (state == JobState::kRunning) {
      bool all_done = true;
      for (const auto& e : registry.workers()) all_done &= e && e->state == WorkerState::kDone;
      if (all_done) {
        for (const auto& e : registry.workers())
          workers->send(e->peer_id, MessageKind::kControl, to_json(StopOrder{"job finished"}));
        state = JobState::kDone;
      }
    }
    if (state == JobState::kFinishing && now >= stop_deadline)
      state = outcome.is_ok() ? JobState::kDone : JobState::kFailed;
    refresh_prometheus();
  }
  set_prometheus_live(false);  // the end state, served from now on without the loop
  // Let CLI clients that asked for status see the end state for a moment.
  const double linger_until = steady_seconds() + 0.3;
  while (steady_seconds() < linger_until)
    if (auto m = cli->poll(std::chrono::milliseconds(20))) handle_cli(*m);
  write_summary();
  if (http) {
    http->stop();
    http_thread.join();
  }
  return outcome;
}

Status Coordinator::Impl::set_up_security(SocketSecurity* control, SocketSecurity* cli) {
  const SecuritySpec& s = job.cluster.security;
  if (!s.curve()) {
    auto local = [](const std::string& ep) {
      return ep.starts_with("ipc://") || ep.starts_with("inproc://") || is_loopback_host(endpoint_host(ep));
    };
    const bool loopback = local(opts.worker_endpoint) && local(opts.cli_endpoint);
    if (!s.configured && !loopback)
      return Status::invalid_argument(
          "the coordinator listens beyond this machine (" + opts.worker_endpoint + ", " + opts.cli_endpoint +
          ") and cluster.security names no keys: make keys with `xdmoe keygen` and list them, or say "
          "`insecure: true` to run in plaintext (docs/operations.md)");
    std::printf("security: plaintext links (%s); cluster.security with keys turns CURVE on\n",
                s.insecure ? "cluster.security.insecure: true" : "every process on this machine, over loopback");
    std::fflush(stdout);
    return Status::ok();
  }
  if (!curve_available()) return Status::unavailable("cluster.security asks for CURVE, which this libzmq lacks");
  auto own = read_secret_key_file(s.coordinator_key);
  if (!own) return own.status().with_context("cluster.security.coordinator_key");
  std::vector<std::string> allowed;
  for (const std::string& k : s.allowed_keys) {
    auto pub = read_public_key(k);
    if (!pub) return pub.status().with_context("cluster.security.allowed_keys");
    allowed.push_back(*pub);
  }
  set_allowed_keys(kZapDomainControl, allowed);
  set_allowed_keys(kZapDomainCli, allowed, s.read_only_any_key);
  *control = {true, *own, "", kZapDomainControl};
  *cli = {true, *own, "", kZapDomainCli};
  curve = true;
  XD_LOG_INFO("coordinator", "CURVE on every link: coordinator key %s, %zu allowed keys%s",
              key_label(own->public_key).c_str(), allowed.size(),
              s.read_only_any_key ? "; any key may read status" : "");
  return Status::ok();
}

void Coordinator::Impl::refuse(const std::string& peer, const std::string& why) {
  workers->send(peer, MessageKind::kControl, to_json(ErrorReport{why}));
}

void Coordinator::Impl::handle_worker(const ControlMessage& m, double now) {
  auto opname = op_of(m.body);
  if (!opname) return;
  if (*opname == op::kRegister) {
    RegisterRequest req;
    if (Status st = from_json(m.body, &req); !st.is_ok()) {
      XD_LOG_WARN("coordinator", "refused a worker from %s (pid %d): %s", req.host.c_str(), req.pid,
                  st.message().c_str());
      return refuse(m.peer, st.message());
    }
    if (state != JobState::kWaiting) return refuse(m.peer, "the job has already started");
    auto rank = registry.add(m.peer, req, now);
    if (!rank) {
      XD_LOG_WARN("coordinator", "refused a worker from %s: %s", req.host.c_str(), rank.status().message().c_str());
      return refuse(m.peer, rank.status().message());
    }
    worker_keys.resize(registry.world_size());
    worker_keys[*rank] = m.user_id;
    XD_LOG_INFO("coordinator", "worker %d registered (%s pid %d, data %s%s%s)", *rank, req.host.c_str(),
                req.pid, req.data_endpoint.c_str(), curve ? ", key " : "", curve ? key_label(m.user_id).c_str() : "");
    return;
  }
  auto rank = registry.touch(m.peer, now);
  if (!rank) return refuse(m.peer, "unknown worker: register first");
  WorkerEntry* e = registry.find(*rank);
  if (*opname == op::kMetrics) {
    StepMetrics sm;
    if (Status st = from_json(m.body, &sm); !st.is_ok()) {
      XD_LOG_WARN("coordinator", "bad metrics from worker %d: %s", *rank, st.message().c_str());
      return;
    }
    e->last_metrics = sm;
    metrics.record(*rank, sm, e->info.host);
    log_progress();
    consider_replan();
  } else if (*opname == op::kCheckpoint) {
    CheckpointSaved report;
    if (Status st = from_json(m.body, &report); !st.is_ok()) {
      XD_LOG_WARN("coordinator", "bad checkpoint report from worker %d: %s", *rank, st.message().c_str());
      return;
    }
    double loss = 0;
    const std::vector<StepSummary>& steps = metrics.complete_steps();
    for (auto it = steps.rbegin(); it != steps.rend(); ++it)
      if (it->step == report.step) {
        loss = it->loss;
        break;
      }
    auto done = checkpoints->record(*rank, report, loss);
    if (!done) return fail(done.status().with_context("checkpoint"));
    if (*done) {
      progress.clear();
      std::printf("checkpoint: step %lld complete in %s (%d shards, %.1f MB, written in %.0f ms)\n",
                  (long long)(*done)->step, (*done)->dir.c_str(), registry.world_size(), (*done)->bytes / 1e6,
                  (*done)->write_s * 1e3);
      std::fflush(stdout);
    }
  } else if (*opname == op::kDone) {
    e->state = WorkerState::kDone;
  } else if (*opname == op::kError) {
    ErrorReport report;
    if (!from_json(m.body, &report).is_ok()) report.error = "unknown error (malformed report)";
    e->state = WorkerState::kFailed;
    e->error = report.error;
    XD_LOG_ERROR("coordinator", "worker %d failed: %s", *rank, report.error.c_str());
    fail(Status::internal("worker " + std::to_string(*rank) + " failed: " + report.error));
  }
}

void Coordinator::Impl::assign_all() {
  const std::vector<int> sizes = job.cluster.level_sizes();
  Assignment a;
  a.job_id = job_id;
  a.job_name = opts.job_name;
  a.domain_sizes = plan.choice().domain_sizes;
  a.flat_ep = opts.flat_ep && plan.mode == EpMode::kEp;
  a.predicted_step_s = plan.choice().iteration_s;
  startup_predicted_s = a.predicted_step_s;
  startup_a2a_imbalance = plan.choice().a2a_imbalance;
  startup_expert_imbalance = plan.choice().expert_imbalance;
  a.hold = opts.hold;
  a.resume_dir = resume_dir;
  a.job = job;
  // pipeline degrees auto: the planner's r per direction for the chosen
  // domains (its backward r follows a forward r set by hand).
  a.job.cluster.expert_parallel.pipeline_degree = forward_degree();
  a.job.cluster.expert_parallel.backward_pipeline_degree = backward_degree();
  a.job.cluster.expert_parallel.replica_weight_gradients = replica_weight_gradients();
  a.job.cluster.expert_parallel.tokens_once_per_worker = tokens_once_per_worker_of(plan.choice().tokens_once_per_worker);
  for (const auto& e : registry.workers()) {
    a.rank = e->rank;
    a.peers.clear();
    for (const auto& p : registry.workers())
      a.peers.push_back({p->rank, p->info.data_endpoint, std::max(0, link_level(sizes, e->rank, p->rank)),
                         p->rank < (int)worker_keys.size() ? worker_keys[p->rank] : ""});
    workers->send(e->peer_id, MessageKind::kControl, to_json(a));
    registry.find(e->rank)->state = WorkerState::kRunning;
  }
  if (opts.replan) start_replanner();
  state = JobState::kRunning;
  running_since = steady_seconds();
  XD_LOG_INFO("coordinator", "all %d workers registered; job started", registry.world_size());
}

void Coordinator::Impl::start_replanner() {
  // A class is measured when something shapes it (the workers, or a kernel
  // tbf), or when some pair of its workers talk across a real network: an
  // unshaped class between processes on loopback would measure the CPU.
  const std::vector<int> sizes = job.cluster.level_sizes();
  std::vector<std::string> names;
  std::vector<bool> measured;
  for (const LevelSpec& l : job.cluster.levels) {
    names.push_back(l.link.name);
    measured.push_back(l.link.shape);
  }
  for (const auto& a : registry.workers())
    for (const auto& b : registry.workers()) {
      const int level = link_level(sizes, a->rank, b->rank);
      const std::string ha = endpoint_host(a->info.data_endpoint), hb = endpoint_host(b->info.data_endpoint);
      if (level >= 0 && ha != hb && !(is_loopback_host(ha) && is_loopback_host(hb))) measured[level] = true;
    }
  const int r = forward_degree(), backward_r = backward_degree();  // before the replanner exists
  // The run's first three steps are warm-up (a resumed run's too).
  ReplanOptions options;
  options.first_fitted_step = resume_step + 4;
  replanner = std::make_unique<Replanner>(plan_inputs, plan, names, measured, r, backward_r, options);
}

void Coordinator::Impl::stop_all(const std::string& reason) {
  for (const auto& e : registry.workers())
    if (e && e->state != WorkerState::kLost)
      workers->send(e->peer_id, MessageKind::kControl, to_json(StopOrder{reason}));
  state = JobState::kFinishing;
  // Told to stop by a signal, the launch stops the workers itself: no need to wait for them.
  stop_deadline = steady_seconds() + (g_terminate ? 0.3 : 2.0);
}

void Coordinator::Impl::fail(const Status& st) {
  if (!outcome.is_ok()) return;
  outcome = st;
  stop_all(st.message());
}

namespace {
std::string domains_text(const std::vector<int>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(d[i]);
  }
  return s + "]";
}
}  // namespace

void Coordinator::Impl::consider_replan() {
  const StepSummary* s = metrics.last_complete();
  if (!replanner || !s || s->step <= last_replan_step || state != JobState::kRunning) return;
  last_replan_step = s->step;
  std::vector<double> imbalance;  // per level; 0 where no token crossed it
  for (const LevelSpec& l : job.cluster.levels) imbalance.push_back(s->a2a_imbalance(l.link.name));
  auto c = replanner->on_step(s->step, s->link_bursts, metrics.latest_step(), job.train.steps, s->step_s,
                              s->compute_s, imbalance);
  if (!c) return;
  plan = replanner->plan();
  plan_inputs = replanner->inputs();
  metrics.set_predicted_step(c->switched() ? c->from_step : c->at_step + 1, plan.choice().iteration_s);
  if (c->model_refit()) {  // the progress lines' "predicted" moves; the console stays quiet
    XD_LOG_INFO("coordinator", "re-fit after step %lld: %s: %.1f ms a step (%.1f ms before)", (long long)c->at_step,
                c->reason.c_str(), c->new_predicted_s * 1e3, c->old_predicted_s * 1e3);
    return;
  }
  progress.clear();
  const std::string old_schedule = c->old_schedule.text(), new_schedule = c->new_schedule.text();
  if (!c->switched()) {
    std::printf("re-plan after step %lld: %s: %s r=%s stays (predicted %.1f ms, %.1f ms before)\n",
                (long long)c->at_step, c->reason.c_str(), domains_text(c->old_domains).c_str(), old_schedule.c_str(),
                c->old_now_predicted_s * 1e3, c->old_predicted_s * 1e3);
    std::fflush(stdout);
    return;
  }
  if (c->reverted)
    std::printf("re-plan after step %lld: %s: %s r=%s from step %lld\n", (long long)c->at_step, c->reason.c_str(),
                domains_text(c->new_domains).c_str(), new_schedule.c_str(), (long long)c->from_step);
  else
    std::printf("re-plan after step %lld: %s: domains %s r=%s (predicted %.1f ms before, %.1f ms now) -> %s r=%s "
                "(predicted %.1f ms) from step %lld\n",
                (long long)c->at_step, c->reason.c_str(), domains_text(c->old_domains).c_str(), old_schedule.c_str(),
                c->old_predicted_s * 1e3, c->old_now_predicted_s * 1e3, domains_text(c->new_domains).c_str(),
                new_schedule.c_str(), c->new_predicted_s * 1e3, (long long)c->from_step);
  std::fflush(stdout);
  const PlanUpdate update{c->from_step, c->new_domains, c->new_schedule.pipeline_degree,
                          c->new_schedule.backward_pipeline_degree, c->new_predicted_s, c->reason,
                          c->new_schedule.replica_weights_late};
  for (const auto& e : registry.workers())
    if (e && e->state == WorkerState::kRunning) workers->send(e->peer_id, MessageKind::kControl, to_json(update));
}

nlohmann::json Coordinator::Impl::plan_changes_json() const {
  nlohmann::json changes = nlohmann::json::array();
  if (!replanner) return changes;
  for (const PlanChange& c : replanner->history())
    changes.push_back({{"after_step", c.at_step}, {"from_step", c.from_step}, {"switched", c.switched()},
                       {"link", c.link}, {"assumed_bytes_per_s", c.assumed_bytes_per_s},
                       {"measured_bytes_per_s", c.measured_bytes_per_s}, {"old_domain_sizes", c.old_domains},
                       {"new_domain_sizes", c.new_domains}, {"old_pipeline_degree", c.old_schedule.pipeline_degree},
                       {"new_pipeline_degree", c.new_schedule.pipeline_degree},
                       {"old_backward_pipeline_degree", c.old_schedule.backward_pipeline_degree},
                       {"new_backward_pipeline_degree", c.new_schedule.backward_pipeline_degree},
                       {"old_replica_weights_late", c.old_schedule.replica_weights_late},
                       {"new_replica_weights_late", c.new_schedule.replica_weights_late}, {"reverted", c.reverted},
                       {"old_predicted_s", c.old_predicted_s},
                       {"old_now_predicted_s", c.old_now_predicted_s}, {"new_predicted_s", c.new_predicted_s},
                       {"reason", c.reason}});
  return changes;
}

void Coordinator::Impl::log_progress() {
  const StepSummary* s = metrics.last_complete();
  if (!s || s->step == last_logged_step) return;
  last_logged_step = s->step;
  if (first_step_wall_s == 0)
    first_step_wall_s = unix_seconds();
  const int64_t steps = job.train.steps;
  const double elapsed = steady_seconds() - running_since;
  if (s->step % job.train.log_every == 0 || s->step == 1 || s->step == steps) {
    char text[400];
    std::snprintf(text, sizeof text,
                  "step %5lld/%lld | loss %.4f | %.0f tok/s | step %.1f ms (compute %.1f, exposed comm %.1f, "
                  "overlap fwd %.0f%% bwd %.0f%%) | step / bound %.2f | predicted %.1f ms%s",
                  (long long)s->step, (long long)steps, s->loss, s->tokens_per_s, s->step_s * 1e3,
                  s->compute_s * 1e3, s->exposed_comm_s * 1e3, s->fwd_overlap_percent(), s->bwd_overlap_percent(),
                  s->step_over_bound(), s->predicted_step_s * 1e3,
                  ProgressLine::eta(s->step - resume_step, steps - resume_step, elapsed).c_str());
    progress.line(text);
  }
  char live[160];
  std::snprintf(live, sizeof live, "step %lld/%lld | loss %.4f | %.0f ms/step | step / bound %.2f", (long long)s->step,
                (long long)steps, s->loss, s->step_s * 1e3, s->step_over_bound());
  if (s->step < steps) progress.live(s->step - resume_step, steps - resume_step, elapsed, live);
}

nlohmann::json Coordinator::Impl::status_json(double now) {
  nlohmann::json ws = nlohmann::json::array();
  for (int r = 0; r < registry.world_size(); ++r) {
    const WorkerEntry* e = registry.find(r);
    if (!e) {
      ws.push_back({{"rank", r}, {"state", "missing"}});
      continue;
    }
    nlohmann::json w = {{"rank", r}, {"state", worker_state_name(e->state)}, {"host", e->info.host},
                        {"pid", e->info.pid}, {"last_seen_s_ago", now - e->last_seen},
                        {"data_endpoint", e->info.data_endpoint}};
    if (e->last_metrics) {
      w["step"] = e->last_metrics->step;
      w["loss"] = e->last_metrics->loss;
      w["tokens_per_s"] = e->last_metrics->tokens_per_s;
      w["step_s"] = e->last_metrics->step_s;
      w["exposed_comm_s"] = e->last_metrics->exposed_comm_s;
      w["compute_s"] = e->last_metrics->compute_s;
    }
    if (!e->error.empty()) w["error"] = e->error;
    ws.push_back(w);
  }
  nlohmann::json links = nlohmann::json::array();
  for (const LevelSpec& l : job.cluster.levels)
    links.push_back({{"name", l.link.name}, {"bandwidth_bytes_per_s", l.link.bandwidth_bytes_per_s},
                     {"latency_s", l.link.latency_s}, {"shaped", l.link.shape}});
  nlohmann::json j = {{"job", opts.job_name}, {"job_id", job_id}, {"state", job_state_name(state)},
                      {"world", registry.world_size()}, {"steps", job.train.steps},
                      {"mode", ep_mode_name(plan.mode)}, {"domain_sizes", plan.choice().domain_sizes},
                      {"pipeline_degree", forward_degree()},
                      {"backward_pipeline_degree", backward_degree()},
                      {"replica_weight_gradients", replica_weight_gradients_name(replica_weight_gradients())},
                      {"tokens_once_per_worker", plan.choice().tokens_once_per_worker},
                      {"predicted_step_s", plan.choice().iteration_s}, {"uptime_s", now - started},
                      {"workers", ws}, {"links", links}, {"plan_changes", plan_changes_json()},
                      {"measured_link_bytes_per_s", replanner ? nlohmann::json(replanner->measured()) : nlohmann::json::object()},
                      // malformed or foreign control messages dropped on either socket
                      {"rejected_control_messages", workers->rejected() + cli->rejected()}};
  nlohmann::json refused = nlohmann::json::array();
  for (const Refusal& r : refusals())
    refused.push_back({{"domain", r.domain}, {"address", r.address}, {"key", r.key}, {"unix_s", r.unix_s}});
  j["security"] = {{"curve", curve}, {"refused", refused}};
  if (metrics.last_complete()) j["last_step"] = metrics.to_json()["last_step"];
  if (!outcome.is_ok()) j["error"] = outcome.message();
  if (!resume_dir.empty()) j["resumed_from"] = {{"dir", resume_dir}, {"step", resume_step}};
  if (!checkpoints->completed().empty()) {
    const CompletedCheckpoint& c = checkpoints->completed().back();
    j["last_checkpoint"] = {{"step", c.step}, {"dir", c.dir}, {"bytes", c.bytes}, {"write_s", c.write_s}};
  }
  return j;
}

void Coordinator::Impl::handle_cli(const ControlMessage& m) {
  auto reply_error = [&](const std::string& why) {
    cli->send(m.peer, MessageKind::kControl, {{"ok", false}, {"error", why}});
  };
  auto opname = op_of(m.body);
  if (!opname) return reply_error(opname.status().message());
  const double now = steady_seconds();
  if (*opname == op::kStatus) {
    nlohmann::json j = status_json(now);
    j["ok"] = true;
    cli->send(m.peer, MessageKind::kControl, j);
  } else if (*opname == op::kMetrics) {
    nlohmann::json j = metrics.to_json();
    j["ok"] = true;
    j["links"] = status_json(now)["links"];
    cli->send(m.peer, MessageKind::kControl, j);
  } else if ((*opname == op::kStop || *opname == op::kThrottle) && curve &&
             !key_is_allowed(kZapDomainCli, m.user_id)) {
    XD_LOG_WARN("coordinator", "refused '%s' from key %s: it may read status, not change the job", opname->c_str(),
                key_label(m.user_id).c_str());
    reply_error("'" + *opname + "' needs a key listed in cluster.security.allowed_keys; " + key_label(m.user_id) +
                " may only read");
  } else if (*opname == op::kStop) {
    StopOrder order;
    if (!from_json(m.body, &order).is_ok() || order.reason.empty()) order.reason = "stopped by request";
    XD_LOG_INFO("coordinator", "stop requested from the CLI: %s", order.reason.c_str());
    if (outcome.is_ok()) outcome = Status::unavailable(order.reason);
    stop_all(order.reason);
    cli->send(m.peer, MessageKind::kControl, {{"ok", true}, {"state", job_state_name(state)}});
  } else if (*opname == op::kThrottle) {
    ThrottleRequest req;
    if (Status st = from_json(m.body, &req); !st.is_ok()) return reply_error(st.message());
    int level = -1;
    for (size_t l = 0; l < job.cluster.levels.size(); ++l)
      if (job.cluster.levels[l].link.name == req.link || job.cluster.levels[l].name == req.link) level = (int)l;
    if (level < 0) return reply_error("no link class named '" + req.link + "'");
    if (req.rank >= registry.world_size()) return reply_error("no worker " + std::to_string(req.rank));
    if (req.rank >= 0) {
      // One worker's egress: the job's spec (and the plan) stay as they are.
      if (kernel && level == 0) return reply_error("--rank needs in-process shaping; --netns shapes the class in the kernel");
      const LinkClassSpec& spec = job.cluster.levels[level].link;
      const ThrottleOrder order{level, req.bandwidth_bytes_per_s, req.latency_s >= 0 ? req.latency_s : spec.latency_s};
      if (const WorkerEntry* e = registry.find(req.rank); e && e->state == WorkerState::kRunning)
        workers->send(e->peer_id, MessageKind::kControl, to_json(order));
      XD_LOG_INFO("coordinator", "throttled link class %s of worker %d to %.3g B/s", req.link.c_str(), req.rank,
                  req.bandwidth_bytes_per_s);
      cli->send(m.peer, MessageKind::kControl, {{"ok", true}});
      return;
    }
    LinkClassSpec& spec = job.cluster.levels[level].link;
    // In a namespace cluster the kernel's tbf carries the outermost level's
    // bandwidth; the workers add only its latency.
    if (kernel && level == 0)
      if (Status st = kernel->set_rate(req.bandwidth_bytes_per_s); !st.is_ok()) return reply_error(st.message());
    spec.bandwidth_bytes_per_s = req.bandwidth_bytes_per_s;
    if (req.latency_s >= 0) spec.latency_s = req.latency_s;
    spec.shape = true;
    const ThrottleOrder order{level, spec.bandwidth_bytes_per_s, spec.latency_s};
    for (const auto& e : registry.workers())
      if (e && e->state == WorkerState::kRunning)
        workers->send(e->peer_id, MessageKind::kControl, to_json(order));
    XD_LOG_INFO("coordinator", "throttled link class %s to %.3g B/s%s, %.3g ms", req.link.c_str(),
                spec.bandwidth_bytes_per_s, kernel && level == 0 ? " (kernel tbf)" : "", spec.latency_s * 1e3);
    cli->send(m.peer, MessageKind::kControl, {{"ok", true}});
  } else {
    reply_error("unknown op '" + *opname + "'");
  }
}

void Coordinator::Impl::refresh_prometheus(bool always) {
  uint64_t wanted;
  {
    std::lock_guard<std::mutex> lock(prom_mu);
    wanted = prom_wanted;
    if (!always && wanted == prom_rendered) return;
  }
  std::vector<std::string> states;
  for (const auto& e : registry.workers()) states.push_back(e ? worker_state_name(e->state) : "missing");
  std::string text = metrics.prometheus(opts.job_name, states);
  std::lock_guard<std::mutex> lock(prom_mu);
  prom_text = std::move(text);
  prom_rendered = wanted;
  prom_cv.notify_all();
}

void Coordinator::Impl::set_prometheus_live(bool live) {
  refresh_prometheus(/*always=*/true);
  std::lock_guard<std::mutex> lock(prom_mu);
  prom_live = live;
  prom_cv.notify_all();
}

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
    if (!mean.gather_wait_s.empty()) {
      std::printf("  wait for gathered experts per layer (ms):");
      for (double w : mean.gather_wait_s) std::printf(" %.1f", w * 1e3);
      std::printf("\n");
    }
    std::fflush(stdout);
  }
}

}  // namespace xd
