#include "actors/worker_process.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <future>
#include <memory>

#include "actors/actor.h"
#include "actors/distributed_trainer.h"
#include "common/log.h"
#include "coordinator/protocol.h"
#include "model/checkpoint.h"
#include "transport/control_channel.h"

namespace xd {

int rank_from_environment() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return -1;
}

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class ComputeActor;

// Everything the actors share; each field is touched by the thread named.
struct WorkerShared {
  WorkerOptions options;
  std::unique_ptr<Transport> transport;    // thread-safe
  std::promise<int> exit_code;             // set once, by the control actor
  std::atomic<bool> exit_set{false};
  std::atomic<bool> stop{false};           // compute actor checks between steps
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
  void report_done() {
    post([this] {
      send(MessageKind::kControl, {{"op", op::kDone}});
      XD_LOG_INFO(tag_.c_str(), "training finished; waiting for the coordinator to close the job");
      done_ = true;
    });
  }
  void report_error(const Status& st) {
    post([this, st] {
      send(MessageKind::kControl, {{"op", op::kError}, {"error", st.message()}});
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

  WorkerShared* s_;
  ComputeActor* compute_ = nullptr;
  std::unique_ptr<ControlClient> client_;
  std::string tag_ = "worker";
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
    while ((*trainer)->current_step() < job.train.steps && !s_->stop) {
      auto m = (*trainer)->step();
      if (!m) {
        if (!s_->stop) control_->report_error(m.status().with_context("step " + std::to_string((*trainer)->current_step() + 1)));
        return;
      }
      control_->send_metrics(*m);
    }
    if (!s_->stop && !job.train.checkpoint_dir.empty()) {
      const std::string dir = job.train.checkpoint_dir + "/" + checkpoint_dir_name((*trainer)->current_step());
      Status st = (*trainer)->save_shard(dir);
      if (!st.is_ok()) {
        control_->report_error(st);
        return;
      }
      XD_LOG_INFO("compute", "rank %d wrote its shard to %s", options.rank, dir.c_str());
    }
    if (!s_->stop) control_->report_done();
  }

  WorkerShared* s_;
  ControlActor* control_;
};

void ControlActor::on_start() {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const std::string label = s_->options.host_label.empty() ? host : s_->options.host_label;
  auto client = ControlClient::connect(s_->options.coordinator,
                                       "worker-" + label + "-" + std::to_string(::getpid()));
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
  send(MessageKind::kHello, to_json(req));
  last_heard_ = last_sent_ = now_s();
  XD_LOG_INFO("worker", "registering with %s (data endpoint %s)", s_->options.coordinator.c_str(),
              req.data_endpoint.c_str());
}

void ControlActor::on_tick() {
  if (!client_) return;
  while (auto m = client_->poll(std::chrono::milliseconds(0))) handle(*m);
  const double now = now_s();
  if (now - last_sent_ >= s_->options.heartbeat_interval_s) {
    send(MessageKind::kHeartbeat, {{"op", op::kHeartbeat}});
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
  last_heard_ = now_s();
  std::string opname;
  if (!read_field(m.body, "op", &opname).is_ok()) return;
  if (opname == op::kHeartbeat) return;
  if (opname == op::kAssign) {
    on_assign(m.body);
  } else if (opname == op::kStop) {
    std::string reason = "stop";
    (void)read_field(m.body, "reason", &reason);
    XD_LOG_INFO(tag_.c_str(), "stopping: %s", reason.c_str());
    s_->stop = true;
    s_->transport->cancel(Status::unavailable("job stopped: " + reason));
    s_->finish(done_ ? 0 : 3);
  } else if (opname == op::kThrottle) {
    int level = 0;
    double bandwidth = 0, latency = 0;
    if (read_field(m.body, "level", &level).is_ok() && read_field(m.body, "bandwidth", &bandwidth).is_ok() &&
        read_field(m.body, "latency", &latency).is_ok() && level >= 0) {
      s_->transport->set_shaping(level, LinkShaping{bandwidth, latency});
      XD_LOG_INFO(tag_.c_str(), "link class %d now %.3g B/s, %.3g ms", level, bandwidth, latency * 1e3);
    }
  } else if (opname == op::kError) {
    std::string error;
    (void)read_field(m.body, "error", &error);
    XD_LOG_ERROR(tag_.c_str(), "coordinator refused us: %s", error.c_str());
    s_->finish(2);
  }
}

void ControlActor::on_assign(const nlohmann::json& body) {
  if (assigned_) return;
  assigned_ = true;
  int rank = -1, world = 0;
  std::vector<int> level_sizes, domain_sizes;
  std::string mode, job_yaml;
  double predicted = 0;
  bool hold = false;
  Status st = read_field(body, "rank", &rank);
  if (st.is_ok()) st = read_field(body, "world", &world);
  if (st.is_ok()) st = read_field(body, "level_sizes", &level_sizes);
  if (st.is_ok()) st = read_field(body, "domain_sizes", &domain_sizes);
  if (st.is_ok()) st = read_field(body, "mode", &mode);
  if (st.is_ok()) st = read_field(body, "job_yaml", &job_yaml);
  if (st.is_ok()) st = read_field(body, "predicted_step_s", &predicted);
  if (st.is_ok()) st = read_field(body, "hold", &hold);
  std::vector<PeerInfo> peers;
  std::vector<std::string> link_names;
  if (st.is_ok() && body.contains("peers") && body["peers"].is_array() && body.contains("links") &&
      body["links"].is_array()) {
    for (const auto& p : body["peers"]) {
      PeerInfo info;
      if (!read_field(p, "rank", &info.rank).is_ok() || !read_field(p, "endpoint", &info.endpoint).is_ok() ||
          !read_field(p, "link_class", &info.link_class).is_ok())
        st = Status::invalid_argument("malformed peer in the assignment");
      peers.push_back(info);
    }
  } else if (st.is_ok()) {
    st = Status::invalid_argument("assignment without peers or links");
  }
  std::vector<LinkShaping> shaping;
  if (st.is_ok()) {
    for (const auto& l : body["links"]) {
      std::string name;
      double bw = 0, lat = 0;
      bool shape = true;
      (void)read_field(l, "name", &name);
      (void)read_field(l, "bandwidth", &bw);
      (void)read_field(l, "latency", &lat);
      (void)read_field(l, "shape", &shape);
      link_names.push_back(name);
      shaping.push_back(shape ? LinkShaping{bw, lat} : LinkShaping{});
    }
  }
  tag_ = "worker " + std::to_string(rank);
  if (!st.is_ok()) {
    report_error(st.with_context("bad assignment"));
    return;
  }
  // Every link class of the job, shaped as the spec says.
  for (size_t c = 0; c < shaping.size(); ++c) s_->transport->set_shaping(static_cast<int>(c), shaping[c]);
  st = s_->transport->connect(peers, rank);
  if (!st.is_ok()) {
    report_error(st);
    return;
  }
  XD_LOG_INFO(tag_.c_str(), "assigned: %d of %d, %s mode", rank, world, mode.c_str());
  if (hold) return;
  auto job = job_yaml.empty() ? Expected<JobConfig>(default_job_config()) : parse_job_config(job_yaml, "<job>");
  if (!job) {
    report_error(job.status());
    return;
  }
  int64_t steps = job->train.steps;
  if (read_field(body, "steps", &steps).is_ok() && steps > 0) job->train.steps = steps;
  DistributedOptions o;
  o.rank = rank;
  o.level_sizes = level_sizes;
  o.domain_sizes = domain_sizes;
  o.flat_ep = mode == "ep_flat";
  o.link_names = link_names;
  o.predicted_step_s = predicted;
  o.memory_cap_bytes = std::isfinite(job->cluster.expert_parallel.memory_cap_bytes)
                           ? job->cluster.expert_parallel.memory_cap_bytes : 0;
  compute_->run_job(*job, o);
}

}  // namespace

int run_worker(const WorkerOptions& options) {
  WorkerShared shared;
  shared.options = options;
  TransportOptions t;
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
  return code;
}

}  // namespace xd
