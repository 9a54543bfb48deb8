#include "coordinator/coordinator.h"

#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <random>

#include "common/clock.h"
#include "common/log.h"
#include "cluster/protocol.h"
#include "coordinator/detail/coordinator_impl.h"
#include "transport/endpoint.h"
#include "transport/security.h"

namespace xd {

namespace {

// SIGTERM or SIGINT: stop the workers, write the summary, then exit (a
// launcher that stops a job this way still gets its account).
volatile std::sig_atomic_t g_terminate = 0;

}  // namespace

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

Coordinator::Impl::Impl(JobConfig j, CoordinatorOptions o)
    : job(std::move(j)),
      opts(std::move(o)),
      registry(job.cluster.world_size(), opts.heartbeat_interval_s, opts.liveness),
      metrics(job.cluster.world_size()) {
  std::random_device rd;
  job_id = rd() & 0x7FFFFFFF;
}
Coordinator::Impl::~Impl() = default;

Coordinator::Coordinator(JobConfig job, CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(job), std::move(options))) {}
Coordinator::~Coordinator() = default;
Status Coordinator::run() { return impl_->run(); }

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

}  // namespace xd
