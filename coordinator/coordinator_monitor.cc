// The coordinator's monitoring (coordinator/detail/coordinator_impl.h): the
// progress lines, the answers to `xdmoe status` and `xdmoe top`, and the
// Prometheus endpoint.
#include <httplib.h>

#include <chrono>
#include <cstdio>

#include "common/clock.h"
#include "common/log.h"
#include "cluster/protocol.h"
#include "coordinator/detail/coordinator_impl.h"

namespace xd {

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

}  // namespace xd
