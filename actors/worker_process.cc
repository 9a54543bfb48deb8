#include "actors/worker_process.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <future>
#include <memory>
#include <mutex>
#include <optional>

#include "actors/actor.h"
#include "actors/distributed_trainer.h"
#include "common/clock.h"
#include "common/log.h"
#include "cluster/protocol.h"
#include "model/checkpoint.h"
#include "model/distributed_checkpoint.h"
#include "transport/control_channel.h"
#include "transport/endpoint.h"

namespace xd {

int rank_from_environment() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return -1;
}

std::pair<int, std::string> world_from_environment() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"})
    if (const char* v = std::getenv(var)) return {std::atoi(v), std::string(var) + "=" + v};
  return {-1, ""};
}

namespace {

class ComputeActor;

// Everything the actors share; each field is touched by the thread named.
struct WorkerShared {
  WorkerOptions options;
  SocketSecurity control_security;         // to the coordinator
  std::unique_ptr<Transport> transport;    // thread-safe
  std::promise<int> exit_code;             // set once, by the control actor
  std::atomic<bool> exit_set{false};
  std::atomic<bool> stop{false};           // compute actor checks between steps
  std::mutex plan_mu;                      // guards next_plan: control actor writes, compute actor takes
  std::optional<PlanUpdate> next_plan;
  void finish(int code) {
    if (!exit_set.exchange(true)) exit_code.set_value(code);
  }
};

class ControlActor : public Actor {
 public:
  ControlActor(WorkerShared* shared) : Actor("control", std::chrono::milliseconds(20)), s_(shared) {}
  ~ControlActor() override {
    stop();
    join();
  }
  void set_compute(ComputeActor* c) { compute_ = c; }
  // From the compute actor.
  void send_metrics(const StepMetrics& m) {
    post([this, m] { send(MessageKind::kControl, to_json(m)); });
  }
  void send_checkpoint(const CheckpointSaved& c) {
    post([this, c] { send(MessageKind::kControl, to_json(c)); });
  }
  void report_done() {
    post([this] {
      send(MessageKind::kControl, to_json(Done{}));
      XD_LOG_INFO(tag_.c_str(), "training finished; waiting for the coordinator to close the job");
      done_ = true;
    });
  }
  void report_error(const Status& st) {
    post([this, st] {
      send(MessageKind::kControl, to_json(ErrorReport{st.message()}));
      XD_LOG_ERROR(tag_.c_str(), "%s", st.message().c_str());
      s_->finish(1);
    });
  }

 protected:
  void on_start() override;
  void on_tick() override;

 private:
  void send(MessageKind kind, const nlohmann::json& body) {
    if (client_) (void)client_->send(kind, body);
  }
  void handle(const ControlMessage& m);
  void on_assign(const nlohmann::json& body);
  // The in-process shaping of a link class: latency only where the kernel
  // shapes its bandwidth.
  LinkShaping shaping(int level, double bandwidth_bytes_per_s, double latency_s) const {
    for (const std::string& k : s_->options.kernel_shaped)
      if (level < static_cast<int>(level_names_.size()) && level_names_[level] == k)
        return {0, latency_s, bandwidth_bytes_per_s};
    return {bandwidth_bytes_per_s, latency_s};
  }

  WorkerShared* s_;
  ComputeActor* compute_ = nullptr;
  std::unique_ptr<ControlClient> client_;
  std::string tag_ = "worker";
  std::vector<std::string> level_names_;  // link class names by level, from the assignment
  double last_heard_ = 0, last_sent_ = 0;
  bool assigned_ = false, done_ = false;
};

class ComputeActor : public Actor {
 public:
  ComputeActor(WorkerShared* shared, ControlActor* control)
      : Actor("compute"), s_(shared), control_(control) {}
  ~ComputeActor() override {
    stop();
    join();
  }
  void run_job(JobConfig job, DistributedOptions options) {
    post([this, job = std::move(job), options] { train(job, options); });
  }

 private:
  void train(const JobConfig& job, const DistributedOptions& options) {
    auto trainer = DistributedTrainer::create(job, options, s_->transport.get());
    if (!trainer) {
      control_->report_error(trainer.status());
      return;
    }
    XD_LOG_INFO("compute", "rank %d: %d local experts, %.1f MB of gathered replicas", options.rank,
                (*trainer)->model().layout().num_local_experts(), (*trainer)->replica_bytes() / 1e6);
    DistributedTrainer& t = **trainer;
    const TrainConfig& tc = job.train;
    while (t.current_step() < tc.steps && !s_->stop) {
      auto m = t.step();
      if (!m) {
        if (!s_->stop) control_->report_error(m.status().with_context("step " + std::to_string(t.current_step() + 1)));
        return;
      }
      control_->send_metrics(*m);
      const int64_t step = t.current_step();
      if (!tc.checkpoint_dir.empty() && (step == tc.steps || (tc.checkpoint_every > 0 && step % tc.checkpoint_every == 0)))
        if (Status st = save_checkpoint(t, tc, options.rank); !st.is_ok()) {
          control_->report_error(st);
          return;
        }
    }
    if (!s_->stop) control_->report_done();
  }

  // This worker's shard of the checkpoint after the step just taken; the
  // coordinator completes it with the manifest once every shard is in.
  Status save_checkpoint(const DistributedTrainer& t, const TrainConfig& tc, int rank) {
    const auto start = std::chrono::steady_clock::now();
    const std::string dir = tc.checkpoint_dir + "/" + checkpoint_dir_name(t.current_step());
    auto shard = t.save_checkpoint_shard(dir);
    if (!shard) return shard.status().with_context("checkpoint of step " + std::to_string(t.current_step()));
    CheckpointSaved c;
    c.step = t.current_step();
    c.dir = dir;
    c.file = shard->file;
    c.data_position = t.data_position();
    c.bytes = shard->bytes;
    c.crc32c = shard->crc32c;
    c.seconds = seconds_since(start);
    control_->send_checkpoint(c);
    XD_LOG_INFO("compute", "rank %d wrote its shard of step %lld to %s (%.1f MB in %.0f ms)", rank,
                (long long)c.step, dir.c_str(), c.bytes / 1e6, c.seconds * 1e3);
    return Status::ok();
  }

  WorkerShared* s_;
  ControlActor* control_;
};

void ControlActor::on_start() {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const std::string label = s_->options.host_label.empty() ? host : s_->options.host_label;
  auto client = ControlClient::connect(s_->options.coordinator,
                                       "worker-" + label + "-" + std::to_string(::getpid()), s_->control_security);
  if (!client) {
    XD_LOG_ERROR("worker", "%s", client.status().message().c_str());
    s_->finish(2);
    return;
  }
  client_ = std::move(*client);
  RegisterRequest req;
  req.requested_rank = s_->options.rank;
  req.host = label;
  req.pid = ::getpid();
  req.data_endpoint = s_->transport->endpoint();
  if (!s_->options.advertise_host.empty())
    req.data_endpoint = endpoint_with_host(req.data_endpoint, s_->options.advertise_host);
  send(MessageKind::kHello, to_json(req));
  last_heard_ = last_sent_ = steady_seconds();
  XD_LOG_INFO("worker", "registering with %s (data endpoint %s)", s_->options.coordinator.c_str(),
              req.data_endpoint.c_str());
}

void ControlActor::on_tick() {
  if (!client_) return;
  while (auto m = client_->poll(std::chrono::milliseconds(0))) handle(*m);
  const double now = steady_seconds();
  if (now - last_sent_ >= s_->options.heartbeat_interval_s) {
    send(MessageKind::kHeartbeat, to_json(Heartbeat{}));
    last_sent_ = now;
  }
  const double silent = now - last_heard_;
  if (silent > s_->options.heartbeat_interval_s * s_->options.liveness && !s_->exit_set) {
    XD_LOG_ERROR(tag_.c_str(), "coordinator lost: nothing heard for %.1f s", silent);
    s_->stop = true;
    s_->transport->cancel(Status::unavailable("coordinator lost"));
    s_->finish(done_ ? 0 : 1);
  }
}

void ControlActor::handle(const ControlMessage& m) {
  last_heard_ = steady_seconds();
  auto opname = op_of(m.body);
  if (!opname) {
    XD_LOG_WARN(tag_.c_str(), "ignored a control message: %s", opname.status().message().c_str());
    return;
  }
  if (*opname == op::kHeartbeat) return;
  if (*opname == op::kAssign) {
    on_assign(m.body);
  } else if (*opname == op::kStop) {
    StopOrder order{"stop"};
    (void)from_json(m.body, &order);
    XD_LOG_INFO(tag_.c_str(), "stopping: %s", order.reason.c_str());
    s_->stop = true;
    s_->transport->cancel(Status::unavailable("job stopped: " + order.reason));
    s_->finish(done_ ? 0 : 3);
  } else if (*opname == op::kThrottle) {
    ThrottleOrder order;
    if (Status st = from_json(m.body, &order); !st.is_ok()) {
      XD_LOG_WARN(tag_.c_str(), "ignored a throttle order: %s", st.message().c_str());
      return;
    }
    s_->transport->set_shaping(order.level, shaping(order.level, order.bandwidth_bytes_per_s, order.latency_s));
    XD_LOG_INFO(tag_.c_str(), "link class %d now %.3g B/s, %.3g ms", order.level, order.bandwidth_bytes_per_s,
                order.latency_s * 1e3);
  } else if (*opname == op::kPlan) {
    PlanUpdate plan;
    if (Status st = from_json(m.body, &plan); !st.is_ok()) {
      report_error(st.with_context("bad plan update"));
      return;
    }
    XD_LOG_INFO(tag_.c_str(), "plan update for step %lld: %s", (long long)plan.step, plan.reason.c_str());
    std::lock_guard<std::mutex> lock(s_->plan_mu);
    s_->next_plan = std::move(plan);
  } else if (*opname == op::kError) {
    ErrorReport report{"(malformed refusal)"};
    (void)from_json(m.body, &report);
    XD_LOG_ERROR(tag_.c_str(), "coordinator refused us: %s", report.error.c_str());
    s_->finish(2);
  }
}

void ControlActor::on_assign(const nlohmann::json& body) {
  if (assigned_) return;
  assigned_ = true;
  Assignment a;
  if (Status st = from_json(body, &a); !st.is_ok()) {
    report_error(st.with_context("bad assignment"));
    return;
  }
  tag_ = "worker " + std::to_string(a.rank);
  if (auto [launched, variable] = world_from_environment();
      s_->options.check_launcher_world && launched > 0 && launched != a.job.cluster.world_size()) {
    report_error(Status::invalid_argument("the launcher started " + std::to_string(launched) + " workers (" +
                                          variable + "), but the job has " +
                                          std::to_string(a.job.cluster.world_size()) +
                                          ": start one worker per rank (mpirun -np / srun -n)"));
    return;
  }
  // Every link class of the job, shaped as the spec says.
  std::vector<PeerInfo> peers;
  std::vector<std::string> peer_keys;
  for (const PeerAssignment& p : a.peers) {
    peers.push_back({p.rank, p.endpoint, p.link_class, p.public_key});
    if (!p.public_key.empty()) peer_keys.push_back(p.public_key);
  }
  // Only the job's own workers may open a data link to this one.
  if (s_->control_security.curve) set_allowed_keys(kZapDomainData, peer_keys);
  const std::vector<LevelSpec>& levels = a.job.cluster.levels;
  for (const LevelSpec& l : levels) level_names_.push_back(l.link.name);
  for (size_t c = 0; c < levels.size(); ++c)
    s_->transport->set_shaping(static_cast<int>(c),
                               levels[c].link.shape ? shaping(static_cast<int>(c), levels[c].link.bandwidth_bytes_per_s,
                                                              levels[c].link.latency_s)
                                                    : LinkShaping{});
  if (Status st = s_->transport->connect(peers, a.rank, a.job_id); !st.is_ok()) {
    report_error(st);
    return;
  }
  XD_LOG_INFO(tag_.c_str(), "assigned: %d of %d in job %s (id %u), %s mode", a.rank, a.job.cluster.world_size(),
              a.job_name.c_str(), a.job_id, a.flat_ep ? "ep_flat" : ep_mode_name(a.job.cluster.expert_parallel.mode));
  if (a.hold) return;
  DistributedOptions o;
  o.rank = a.rank;
  o.level_sizes = a.job.cluster.level_sizes();
  o.domain_sizes = a.domain_sizes;
  o.flat_ep = a.flat_ep;
  for (const LevelSpec& l : levels) o.link_names.push_back(l.link.name);
  o.predicted_step_s = a.predicted_step_s;
  o.resume_dir = a.resume_dir;
  WorkerShared* shared = s_;
  o.take_plan = [shared]() -> std::optional<PlanUpdate> {
    std::lock_guard<std::mutex> lock(shared->plan_mu);
    std::optional<PlanUpdate> p = std::move(shared->next_plan);
    shared->next_plan.reset();
    return p;
  };
  o.memory_cap_bytes = std::isfinite(a.job.cluster.expert_parallel.memory_cap_bytes)
                           ? a.job.cluster.expert_parallel.memory_cap_bytes : 0;
  compute_->run_job(a.job, o);
}

}  // namespace

int run_worker(const WorkerOptions& options) {
  WorkerShared shared;
  shared.options = options;
  TransportOptions t;
  if (options.key_file.empty() != options.coordinator_key.empty()) {
    XD_LOG_ERROR("worker", "CURVE needs both --key and --coordinator-key");
    return 2;
  }
  if (!options.key_file.empty()) {
    auto own = read_secret_key_file(options.key_file);
    auto server = read_public_key(options.coordinator_key);
    if (!own || !server) {
      XD_LOG_ERROR("worker", "%s", (!own ? own.status() : server.status()).message().c_str());
      return 2;
    }
    shared.control_security = {true, *own, *server, ""};
    t.security = {true, *own, "", kZapDomainData};
    XD_LOG_INFO("worker", "CURVE: this worker's key %s, the coordinator's %s", key_label(own->public_key).c_str(),
                key_label(*server).c_str());
  }
  t.rank = -1;
  t.bind_endpoint = "tcp://" + options.bind_host + ":*";
  t.link_classes.assign(8, LinkShaping{});  // levels of any job; shaped on assignment
  t.link_class_names.assign(8, "");
  auto transport = Transport::create(t);
  if (!transport) {
    XD_LOG_ERROR("worker", "%s", transport.status().message().c_str());
    return 2;
  }
  shared.transport = std::move(*transport);
  auto result = shared.exit_code.get_future();
  ControlActor control(&shared);
  ComputeActor compute(&shared, &control);
  control.set_compute(&compute);
  compute.start();
  control.start();
  const int code = result.get();
  // Unblock a step waiting on peers, then stop the actors in order.
  shared.stop = true;
  shared.transport->cancel(Status::unavailable("worker shutting down"));
  compute.stop();
  compute.join();
  control.stop();
  control.join();
  // Every link's message and byte counters, for a soak run to check that
  // what each worker sent its peers is what they received.
  nlohmann::json links = nlohmann::json::array();
  for (const LinkStats& l : shared.transport->stats().links)
    links.push_back({{"peer", l.peer}, {"messages_sent", l.messages_sent}, {"bytes_sent", l.bytes_sent},
                     {"messages_received", l.messages_received}, {"bytes_received", l.bytes_received}});
  XD_LOG_INFO("worker", "link counters: %s", links.dump().c_str());
  return code;
}

}  // namespace xd
