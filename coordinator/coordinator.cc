#include "coordinator/coordinator.h"

#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "coordinator/job_metrics.h"
#include "coordinator/link_probe.h"
#include "coordinator/protocol.h"
#include "coordinator/worker_registry.h"
#include "transport/control_channel.h"
#include "transport/link_shaping.h"

namespace xd {

namespace {

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

ComputeModel local_compute_model(const JobConfig& job, LinearFit* fit, StepProbe* step) {
  ComputeModel compute;
  LinearFit gemm = probe_gemm();
  if (gemm.beta > 0) {
    compute.flops_per_s = 1.0 / gemm.beta;
    compute.gemm_overhead_s = std::max(0.0, gemm.alpha);
  }
  auto probe = probe_model_step(job.train.model, job.train.seq_len,
                                static_cast<long long>(job.train.batch_size) * job.train.seq_len);
  if (probe) {
    compute = calibrated_compute_model(compute, *probe);
    if (step) *step = *probe;
  } else {
    XD_LOG_WARN("coordinator", "model step probe failed (%s); compute counts GEMMs only",
                probe.status().message().c_str());
  }
  // Without a host list every worker runs on this machine: they share its
  // cores (the probe measured one thread).
  if (job.cluster.hosts.empty()) {
    const double cores = std::max(1u, std::thread::hardware_concurrency());
    compute.flops_per_s *= std::min(1.0, cores / job.cluster.world_size());
  }
  if (fit) *fit = gemm;
  return compute;
}

Plan plan_for_job(const JobConfig& job) {
  return plan_iteration(planner_inputs_for(job, spec_link_models(job.cluster), local_compute_model(job)));
}

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
  uint32_t job_id = 0;
  JobState state = JobState::kWaiting;
  Status outcome;
  std::unique_ptr<ControlServer> workers, cli;
  double started = 0, stop_deadline = 0;
  int64_t last_logged_step = 0;

  std::mutex prom_mu;
  std::string prom_text;
  std::unique_ptr<httplib::Server> http;
  std::thread http_thread;
  int http_port = -1;

 private:
  void handle_worker(const ControlMessage& m, double now);
  void handle_cli(const ControlMessage& m);
  void assign_all();
  void stop_all(const std::string& reason);
  void fail(const Status& st);
  void log_progress();
  nlohmann::json status_json(double now);
  void write_summary();
  void refresh_prometheus();
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
    std::lock_guard<std::mutex> lock(prom_mu);
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
  XD_RETURN_IF_ERROR(job.cluster.validate());
  auto w = ControlServer::bind(opts.worker_endpoint);
  if (!w) return w.status();
  workers = std::move(*w);
  auto c = ControlServer::bind(opts.cli_endpoint);
  if (!c) return c.status();
  cli = std::move(*c);
  std::vector<LinkModel> links = spec_link_models(job.cluster);
  if (opts.probe_links) {
    for (size_t l = 0; l < job.cluster.levels.size(); ++l) {
      const LinkClassSpec& spec = job.cluster.levels[l].link;
      if (!spec.shape) continue;  // a loopback probe says nothing of a real link
      LinkProbeOptions po;
      po.time_budget_s = 1.5;
      auto fit = probe_link(LinkShaping{spec.bandwidth_bytes_per_s, spec.latency_s}, po);
      if (!fit || fit->beta <= 0) {
        XD_LOG_WARN("coordinator", "probing link class %s failed; planning with its spec", spec.name.c_str());
        continue;
      }
      links[l] = LinkModel{std::max(0.0, fit->alpha), fit->beta};
      XD_LOG_INFO("coordinator", "link class %s: fitted alpha %.3f ms, 1/beta %.2f MB/s (r2 %.4f); configured %.3f ms, %.2f MB/s",
                  spec.name.c_str(), fit->alpha * 1e3, 1e-6 / fit->beta, fit->r2, spec.latency_s * 1e3,
                  spec.bandwidth_bytes_per_s / 1e6);
    }
  }
  StepProbe step_probe;
  const ComputeModel compute = local_compute_model(job, nullptr, &step_probe);
  XD_LOG_INFO("coordinator", "compute model: %.2f GFLOP/s per worker, x %.2f for non-GEMM work (a model step of %lld tokens took %.1f ms)",
              compute.flops_per_s / 1e9, compute.non_gemm_factor, step_probe.tokens, step_probe.seconds * 1e3);
  plan = plan_iteration(planner_inputs_for(job, links, compute));
  start_http();
  if (!opts.endpoints_path.empty()) {
    std::ofstream out(opts.endpoints_path);
    out << nlohmann::json{{"workers", workers->endpoint()}, {"cli", cli->endpoint()},
                          {"http_port", http_port}, {"pid", ::getpid()}}.dump(2);
  }
  const PlanCandidate& choice = plan.choice();
  std::string domains;
  for (int s : choice.domain_sizes) domains += (domains.empty() ? "" : "x") + std::to_string(s);
  XD_LOG_INFO("coordinator", "job %s (id %u): %d workers, levels %s; plan %s, domains %s, predicted %.1f ms/step",
              opts.job_name.c_str(), job_id, registry.world_size(),
              [&] { std::string s; for (int v : job.cluster.level_sizes()) s += (s.empty() ? "" : "x") + std::to_string(v); return s; }().c_str(),
              ep_mode_name(plan.mode), domains.c_str(), choice.iteration_s * 1e3);
  const std::string metrics_url =
      http_port > 0 ? "http://127.0.0.1:" + std::to_string(http_port) + "/metrics" : "off";
  XD_LOG_INFO("coordinator", "workers connect to %s; CLI at %s; Prometheus metrics %s",
              workers->endpoint().c_str(), cli->endpoint().c_str(), metrics_url.c_str());

  started = steady_seconds();
  double next_heartbeat = started + opts.heartbeat_interval_s;
  while (state != JobState::kDone && state != JobState::kFailed) {
    if (auto m = workers->poll(std::chrono::milliseconds(20))) handle_worker(*m, steady_seconds());
    while (auto m = cli->poll(std::chrono::milliseconds(0))) handle_cli(*m);
    const double now = steady_seconds();
    if (now >= next_heartbeat) {
      for (const auto& e : registry.workers())
        if (e && (e->state == WorkerState::kRegistered || e->state == WorkerState::kRunning))
          workers->send(e->peer_id, MessageKind::kHeartbeat, {{"op", op::kHeartbeat}});
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
          workers->send(e->peer_id, MessageKind::kControl, {{"op", op::kStop}, {"reason", "job finished"}});
        state = JobState::kDone;
      }
    }
    if (state == JobState::kFinishing && now >= stop_deadline)
      state = outcome.is_ok() ? JobState::kDone : JobState::kFailed;
    refresh_prometheus();
  }
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

void Coordinator::Impl::handle_worker(const ControlMessage& m, double now) {
  std::string opname;
  if (!read_field(m.body, "op", &opname).is_ok()) return;
  if (opname == op::kRegister) {
    auto req = register_from_json(m.body);
    if (!req) {
      workers->send(m.peer, MessageKind::kControl, {{"op", op::kError}, {"error", req.status().message()}});
      return;
    }
    if (state != JobState::kWaiting) {
      workers->send(m.peer, MessageKind::kControl, {{"op", op::kError}, {"error", "the job has already started"}});
      return;
    }
    auto rank = registry.add(m.peer, *req, now);
    if (!rank) {
      workers->send(m.peer, MessageKind::kControl, {{"op", op::kError}, {"error", rank.status().message()}});
      XD_LOG_WARN("coordinator", "refused a worker from %s: %s", req->host.c_str(), rank.status().message().c_str());
      return;
    }
    XD_LOG_INFO("coordinator", "worker %d registered (%s pid %d, data %s)", *rank, req->host.c_str(),
                req->pid, req->data_endpoint.c_str());
    return;
  }
  auto rank = registry.touch(m.peer, now);
  if (!rank) {
    workers->send(m.peer, MessageKind::kControl, {{"op", op::kError}, {"error", "unknown worker: register first"}});
    return;
  }
  WorkerEntry* e = registry.find(*rank);
  if (opname == op::kMetrics) {
    auto sm = metrics_from_json(m.body);
    if (!sm) {
      XD_LOG_WARN("coordinator", "bad metrics from worker %d: %s", *rank, sm.status().message().c_str());
      return;
    }
    e->last_metrics = *sm;
    metrics.record(*rank, *sm);
    log_progress();
  } else if (opname == op::kDone) {
    e->state = WorkerState::kDone;
  } else if (opname == op::kError) {
    std::string error = "unknown error";
    (void)read_field(m.body, "error", &error);
    e->state = WorkerState::kFailed;
    e->error = error;
    XD_LOG_ERROR("coordinator", "worker %d failed: %s", *rank, error.c_str());
    fail(Status::internal("worker " + std::to_string(*rank) + " failed: " + error));
  }
}

void Coordinator::Impl::assign_all() {
  const std::vector<int> sizes = job.cluster.level_sizes();
  nlohmann::json links = nlohmann::json::array();
  for (const LevelSpec& l : job.cluster.levels)
    links.push_back({{"name", l.link.name}, {"bandwidth", l.link.bandwidth_bytes_per_s},
                     {"latency", l.link.latency_s}, {"shape", l.link.shape}});
  const PlanCandidate& choice = plan.choice();
  for (const auto& e : registry.workers()) {
    nlohmann::json peers = nlohmann::json::array();
    for (const auto& p : registry.workers())
      peers.push_back({{"rank", p->rank}, {"endpoint", p->info.data_endpoint},
                       {"link_class", std::max(0, link_level(sizes, e->rank, p->rank))}});
    nlohmann::json body = {{"op", op::kAssign},
                           {"rank", e->rank},
                           {"world", registry.world_size()},
                           {"job_id", job_id},
                           {"level_sizes", sizes},
                           {"links", links},
                           {"peers", peers},
                           {"mode", opts.flat_ep && plan.mode == EpMode::kEp ? "ep_flat" : ep_mode_name(plan.mode)},
                           {"steps", job.train.steps},
                           {"domain_sizes", choice.domain_sizes},
                           {"predicted_step_s", choice.iteration_s},
                           {"job_yaml", opts.job_yaml},
                           {"hold", opts.hold}};
    workers->send(e->peer_id, MessageKind::kControl, body);
    registry.find(e->rank)->state = WorkerState::kRunning;
  }
  state = JobState::kRunning;
  XD_LOG_INFO("coordinator", "all %d workers registered; job started", registry.world_size());
}

void Coordinator::Impl::stop_all(const std::string& reason) {
  for (const auto& e : registry.workers())
    if (e && e->state != WorkerState::kLost)
      workers->send(e->peer_id, MessageKind::kControl, {{"op", op::kStop}, {"reason", reason}});
  state = JobState::kFinishing;
  stop_deadline = steady_seconds() + 2.0;
}

void Coordinator::Impl::fail(const Status& st) {
  if (!outcome.is_ok()) return;
  outcome = st;
  stop_all(st.message());
}

void Coordinator::Impl::log_progress() {
  const StepSummary* s = metrics.last_complete();
  if (!s || s->step == last_logged_step) return;
  const int64_t steps = job.train.steps;
  if (s->step % job.train.log_every != 0 && s->step != 1 && s->step != steps) return;
  last_logged_step = s->step;
  std::printf("step %5lld/%lld | loss %.4f | %.0f tok/s | step %.1f ms (compute %.1f, exposed comm %.1f, overlap %.0f%%) | predicted %.1f ms\n",
              (long long)s->step, (long long)steps, s->loss, s->tokens_per_s, s->step_s * 1e3,
              s->compute_s * 1e3, s->exposed_comm_s * 1e3, s->overlap_percent(),
              s->predicted_step_s * 1e3);
  std::fflush(stdout);
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
                      {"predicted_step_s", plan.choice().iteration_s}, {"uptime_s", now - started},
                      {"workers", ws}, {"links", links}};
  if (metrics.last_complete()) j["last_step"] = metrics.to_json()["last_step"];
  if (!outcome.is_ok()) j["error"] = outcome.message();
  return j;
}

void Coordinator::Impl::handle_cli(const ControlMessage& m) {
  std::string opname;
  if (!read_field(m.body, "op", &opname).is_ok()) {
    cli->send(m.peer, MessageKind::kControl, {{"ok", false}, {"error", "request without 'op'"}});
    return;
  }
  const double now = steady_seconds();
  if (opname == op::kStatus) {
    nlohmann::json j = status_json(now);
    j["ok"] = true;
    cli->send(m.peer, MessageKind::kControl, j);
  } else if (opname == op::kMetrics) {
    nlohmann::json j = metrics.to_json();
    j["ok"] = true;
    j["links"] = status_json(now)["links"];
    cli->send(m.peer, MessageKind::kControl, j);
  } else if (opname == op::kStop) {
    XD_LOG_INFO("coordinator", "stop requested from the CLI");
    if (outcome.is_ok()) outcome = Status::unavailable("stopped by request");
    stop_all("stopped by request");
    cli->send(m.peer, MessageKind::kControl, {{"ok", true}, {"state", job_state_name(state)}});
  } else if (opname == op::kThrottle) {
    std::string link;
    double bandwidth = 0, latency = -1;
    Status st = read_field(m.body, "link", &link);
    if (st.is_ok()) st = read_field(m.body, "bandwidth", &bandwidth);
    (void)read_field(m.body, "latency", &latency);
    int level = -1;
    for (size_t l = 0; l < job.cluster.levels.size(); ++l)
      if (job.cluster.levels[l].link.name == link || job.cluster.levels[l].name == link) level = (int)l;
    if (st.is_ok() && level < 0) st = Status::invalid_argument("no link class named '" + link + "'");
    if (st.is_ok() && !(bandwidth >= 0)) st = Status::invalid_argument("bandwidth must be >= 0");
    if (!st.is_ok()) {
      cli->send(m.peer, MessageKind::kControl, {{"ok", false}, {"error", st.message()}});
      return;
    }
    LinkClassSpec& spec = job.cluster.levels[level].link;
    spec.bandwidth_bytes_per_s = bandwidth;
    if (latency >= 0) spec.latency_s = latency;
    spec.shape = true;
    for (const auto& e : registry.workers())
      if (e && e->state == WorkerState::kRunning)
        workers->send(e->peer_id, MessageKind::kControl,
                      {{"op", op::kThrottle}, {"level", level}, {"bandwidth", spec.bandwidth_bytes_per_s},
                       {"latency", spec.latency_s}});
    XD_LOG_INFO("coordinator", "throttled link class %s to %.3g B/s, %.3g ms", link.c_str(),
                spec.bandwidth_bytes_per_s, spec.latency_s * 1e3);
    cli->send(m.peer, MessageKind::kControl, {{"ok", true}});
  } else {
    cli->send(m.peer, MessageKind::kControl, {{"ok", false}, {"error", "unknown op '" + opname + "'"}});
  }
}

void Coordinator::Impl::refresh_prometheus() {
  std::vector<std::string> states;
  for (const auto& e : registry.workers()) states.push_back(e ? worker_state_name(e->state) : "missing");
  std::string text = metrics.prometheus(opts.job_name, states);
  std::lock_guard<std::mutex> lock(prom_mu);
  prom_text = std::move(text);
}

void Coordinator::Impl::write_summary() {
  const StepSummary mean = metrics.mean(2);
  nlohmann::json j = {{"job", opts.job_name},
                      {"ok", outcome.is_ok() && state == JobState::kDone},
                      {"mode", ep_mode_name(plan.mode)},
                      {"domain_sizes", plan.choice().domain_sizes},
                      {"world", registry.world_size()},
                      {"steps_complete", metrics.complete_steps().size()},
                      {"predicted_step_s", plan.choice().iteration_s}};
  if (!outcome.is_ok()) j["error"] = outcome.message();
  nlohmann::json losses = nlohmann::json::array(), step_times = nlohmann::json::array();
  for (const StepSummary& s : metrics.complete_steps()) {
    losses.push_back(s.loss);
    step_times.push_back(s.step_s);
  }
  j["losses"] = losses;
  j["step_times_s"] = step_times;
  if (const StepSummary* last = metrics.last_complete()) {
    j["final_loss"] = last->loss;
    j["final_ce_loss"] = last->ce_loss;
    j["mean_tokens_per_s"] = mean.tokens_per_s;
    j["mean_step_s"] = mean.step_s;
    j["mean_compute_s"] = mean.compute_s;
    j["mean_comm_s"] = mean.comm_s;
    j["mean_exposed_comm_s"] = mean.exposed_comm_s;
    j["overlap_percent"] = mean.overlap_percent();
    j["bytes_per_step"] = mean.bytes;
    j["gather_wait_s_per_layer"] = mean.gather_wait_s;
    j["peak_rss_bytes"] = mean.peak_rss_bytes;
  }
  if (!opts.summary_path.empty()) {
    std::ofstream out(opts.summary_path);
    out << j.dump(2) << "\n";
  }
  if (const StepSummary* last = metrics.last_complete()) {
    std::printf("summary: %zu steps | final loss %.4f | %.0f tok/s | step %.1f ms = compute %.1f + exposed comm %.1f (overlap %.0f%%) | predicted %.1f ms | peak RSS %.0f MB\n",
                metrics.complete_steps().size(), last->loss, mean.tokens_per_s, mean.step_s * 1e3,
                mean.compute_s * 1e3, mean.exposed_comm_s * 1e3, mean.overlap_percent(),
                mean.predicted_step_s * 1e3, mean.peak_rss_bytes / 1e6);
    for (const auto& [k, v] : mean.bytes) std::printf("  bytes/step %-24s %12.0f\n", k.c_str(), v);
    if (!mean.gather_wait_s.empty()) {
      std::printf("  wait for gathered experts per layer (ms):");
      for (double w : mean.gather_wait_s) std::printf(" %.1f", w * 1e3);
      std::printf("\n");
    }
    std::fflush(stdout);
  }
}

}  // namespace xd
