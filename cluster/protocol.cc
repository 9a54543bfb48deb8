#include "cluster/protocol.h"

#include <cmath>

#include "cluster/detail/json_fields.h"

namespace xd {

using nlohmann::json;
using detail::JsonFields;

namespace {

// Checks the op and hands the other fields to `read`; unknown fields fail.
template <typename F>
Status read_message(const json& j, const char* expected_op, F read) {
  auto op = op_of(j);
  if (!op) return op.status();
  if (*op != expected_op)
    return Status::invalid_argument(std::string("expected a '") + expected_op + "' message, got '" + *op + "'");
  JsonFields f(j, std::string(expected_op));
  std::string ignored;
  f.get("op", &ignored);
  read(f);
  return f.finish();
}

}  // namespace

Expected<std::string> op_of(const json& message) {
  if (!message.is_object()) return Status::invalid_argument("control message is not a JSON object");
  auto it = message.find("op");
  if (it == message.end() || !it->is_string()) return Status::invalid_argument("control message without an 'op' string");
  return it->get<std::string>();
}

std::string protocol_mismatch_message(int worker_version) {
  return "protocol version mismatch: this worker speaks version " + std::to_string(worker_version) +
         ", the coordinator version " + std::to_string(kProtocolVersion) +
         "; run the same xdmoe build on every host";
}

json to_json(const RegisterRequest& m) {
  return {{"op", op::kRegister},     {"protocol_version", m.protocol_version},
          {"requested_rank", m.requested_rank}, {"host", m.host},
          {"pid", m.pid},            {"data_endpoint", m.data_endpoint}};
}

Status from_json(const json& j, RegisterRequest* out) {
  // A version-1 worker sends no version: read it first, so that it gets the
  // version refusal rather than a field error.
  RegisterRequest r;
  r.protocol_version = 1;
  if (j.is_object() && j.contains("protocol_version") && j["protocol_version"].is_number_integer())
    r.protocol_version = j["protocol_version"].get<int>();
  if (r.protocol_version != kProtocolVersion) {
    // Best effort, for the refusal's log line: who it was.
    if (j.is_object() && j.contains("host") && j["host"].is_string()) r.host = j["host"].get<std::string>();
    if (j.is_object() && j.contains("pid") && j["pid"].is_number_integer()) r.pid = j["pid"].get<int>();
    *out = r;
    return Status::invalid_argument(protocol_mismatch_message(r.protocol_version));
  }
  XD_RETURN_IF_ERROR(read_message(j, op::kRegister, [&](JsonFields& f) {
    f.get("protocol_version", &r.protocol_version);
    f.get("requested_rank", &r.requested_rank);
    f.get("host", &r.host);
    f.get("pid", &r.pid);
    f.get("data_endpoint", &r.data_endpoint);
  }));
  if (r.data_endpoint.rfind("tcp://", 0) != 0)
    return Status::invalid_argument("register.data_endpoint must be a tcp:// endpoint");
  *out = r;
  return Status::ok();
}

json to_json(const Assignment& m) {
  json peers = json::array();
  for (const PeerAssignment& p : m.peers)
    peers.push_back({{"rank", p.rank}, {"endpoint", p.endpoint}, {"link_class", p.link_class},
                     {"public_key", p.public_key}});
  return {{"op", op::kAssign},
          {"job_id", m.job_id},
          {"job_name", m.job_name},
          {"rank", m.rank},
          {"peers", peers},
          {"domain_sizes", m.domain_sizes},
          {"flat_ep", m.flat_ep},
          {"predicted_step_s", m.predicted_step_s},
          {"hold", m.hold},
          {"resume_dir", m.resume_dir},
          {"job", job_config_to_json(m.job)}};
}

Status from_json(const json& j, Assignment* out) {
  Assignment a;
  XD_RETURN_IF_ERROR(read_message(j, op::kAssign, [&](JsonFields& f) {
    f.get("job_id", &a.job_id);
    f.get("job_name", &a.job_name);
    f.get("rank", &a.rank);
    f.get("domain_sizes", &a.domain_sizes);
    f.get("flat_ep", &a.flat_ep);
    f.get("predicted_step_s", &a.predicted_step_s);
    f.get("hold", &a.hold);
    f.get("resume_dir", &a.resume_dir);
    if (const json* peers = f.object("peers")) {
      if (!peers->is_array()) return f.fail("assign.peers", "must be a list");
      for (size_t i = 0; i < peers->size() && f.ok(); ++i) {
        JsonFields pf((*peers)[i], "assign.peers[" + std::to_string(i) + "]");
        PeerAssignment p;
        pf.get("rank", &p.rank);
        pf.get("endpoint", &p.endpoint);
        pf.get("link_class", &p.link_class);
        pf.get("public_key", &p.public_key);
        f.fail(pf.finish());
        a.peers.push_back(p);
      }
    }
    if (const json* job = f.object("job")) {
      auto parsed = job_config_from_json(*job);
      if (!parsed) return f.fail("assign", parsed.status().message());
      a.job = std::move(*parsed);
    }
  }));
  const int world = a.job.cluster.world_size();
  if (static_cast<int>(a.peers.size()) != world)
    return Status::invalid_argument("assign.peers: " + std::to_string(a.peers.size()) + " peers for " +
                                    std::to_string(world) + " workers");
  for (int r = 0; r < world; ++r) {
    const PeerAssignment& p = a.peers[r];
    if (p.rank != r) return Status::invalid_argument("assign.peers[" + std::to_string(r) + "].rank: out of order");
    if (p.link_class < 0 || p.link_class >= static_cast<int>(a.job.cluster.levels.size()))
      return Status::invalid_argument("assign.peers[" + std::to_string(r) + "].link_class: no such level");
  }
  if (a.rank < 0 || a.rank >= world) return Status::invalid_argument("assign.rank: out of range");
  if (a.domain_sizes.size() != a.job.cluster.levels.size())
    return Status::invalid_argument("assign.domain_sizes: one per level expected");
  *out = std::move(a);
  return Status::ok();
}

json to_json(const Heartbeat&) { return {{"op", op::kHeartbeat}}; }
json to_json(const Done&) { return {{"op", op::kDone}}; }
json to_json(const StatusRequest&) { return {{"op", op::kStatus}}; }
json to_json(const MetricsRequest&) { return {{"op", op::kMetrics}}; }

namespace {
// "direction/wait", each part 1-32 of a-z and '_': it goes into Prometheus
// labels and 80-column screens as it is.
bool is_wait_name(const std::string& name) {
  const auto slash = name.find('/');
  if (slash == std::string::npos || slash == 0 || slash > 32 || name.size() - slash - 1 < 1 ||
      name.size() - slash - 1 > 32)
    return false;
  for (size_t i = 0; i < name.size(); ++i)
    if (i != slash && !((name[i] >= 'a' && name[i] <= 'z') || name[i] == '_')) return false;
  return true;
}
}  // namespace

json to_json(const StepMetrics& m) {
  return {{"op", op::kMetrics},       {"step", m.step},
          {"loss", m.loss},           {"ce_loss", m.ce_loss},
          {"aux_loss", m.aux_loss},   {"tokens_per_s", m.tokens_per_s},
          {"step_s", m.step_s},       {"compute_s", m.compute_s},
          {"comm_s", m.comm_s},       {"exposed_comm_s", m.exposed_comm_s},
          {"link_busy_s", m.link_busy_s},   {"phase_floor_s", m.phase_floor_s},
          {"fwd_comm_s", m.fwd_comm_s},   {"fwd_exposed_s", m.fwd_exposed_s},
          {"bwd_comm_s", m.bwd_comm_s},   {"bwd_exposed_s", m.bwd_exposed_s},
          {"fwd_compute_s", m.fwd_compute_s}, {"bwd_compute_s", m.bwd_compute_s},
          {"codec_s", m.codec_s},
          {"cpu_s", m.cpu_s},         {"cpus", m.cpus},   {"machine", m.machine},
          {"predicted_step_s", m.predicted_step_s},
          {"peak_rss_bytes", m.peak_rss_bytes},
          {"bytes", m.bytes},
          {"nmse", m.nmse},
          {"codec_encode_seconds", m.codec_encode_seconds},
          {"codec_decode_seconds", m.codec_decode_seconds},
          {"gather_wait_s", m.gather_wait_s},
          {"waits_s", m.waits_s},
          {"link_bursts", m.link_bursts},
          {"skipped", m.skipped}};
}

Status from_json(const json& j, StepMetrics* out) {
  StepMetrics m;
  XD_RETURN_IF_ERROR(read_message(j, op::kMetrics, [&](JsonFields& f) {
    f.get("step", &m.step);
    f.get("loss", &m.loss);
    f.get("ce_loss", &m.ce_loss);
    f.get("aux_loss", &m.aux_loss);
    f.get("tokens_per_s", &m.tokens_per_s);
    f.get("step_s", &m.step_s);
    f.get("compute_s", &m.compute_s);
    f.get("comm_s", &m.comm_s);
    f.get("exposed_comm_s", &m.exposed_comm_s);
    f.get("link_busy_s", &m.link_busy_s);
    f.get("phase_floor_s", &m.phase_floor_s);
    f.get("fwd_comm_s", &m.fwd_comm_s);
    f.get("fwd_exposed_s", &m.fwd_exposed_s);
    f.get("bwd_comm_s", &m.bwd_comm_s);
    f.get("bwd_exposed_s", &m.bwd_exposed_s);
    f.get("fwd_compute_s", &m.fwd_compute_s);
    f.get("bwd_compute_s", &m.bwd_compute_s);
    f.get("codec_s", &m.codec_s);
    f.get("cpu_s", &m.cpu_s);
    f.get("cpus", &m.cpus);
    f.get("machine", &m.machine);
    f.get("predicted_step_s", &m.predicted_step_s);
    f.get("peak_rss_bytes", &m.peak_rss_bytes);
    f.get("bytes", &m.bytes);
    f.get("nmse", &m.nmse);
    f.get("codec_encode_seconds", &m.codec_encode_seconds);
    f.get("codec_decode_seconds", &m.codec_decode_seconds);
    f.get("gather_wait_s", &m.gather_wait_s);
    f.get("waits_s", &m.waits_s);
    f.get("link_bursts", &m.link_bursts);
    f.get("skipped", &m.skipped);
  }));
  if (!(m.cpu_s >= 0) || !std::isfinite(m.cpu_s)) return Status::invalid_argument("metrics.cpu_s must be finite and >= 0");
  for (int c : m.cpus)
    if (c < 0 || c >= 1 << 20) return Status::invalid_argument("metrics.cpus holds a CPU id out of range");
  if (m.waits_s.size() > 64) return Status::invalid_argument("metrics.waits_s holds more than 64 waits");
  for (const auto& [name, w] : m.waits_s)
    if (!is_wait_name(name) || !(w >= 0) || !std::isfinite(w))
      return Status::invalid_argument("metrics.waits_s: each wait needs a name 'direction/wait' (a-z and _, "
                                      "1-32 each) and finite seconds >= 0");
  for (const auto& [field, map] : {std::pair{"codec_encode_seconds", &m.codec_encode_seconds},
                                    std::pair{"codec_decode_seconds", &m.codec_decode_seconds}}) {
    const std::string name = std::string("metrics.") + field;
    if (map->size() > 256) return Status::invalid_argument(name + " holds more than 256 keys");
    for (const auto& [key, seconds] : *map) {
      if (key.empty() || key.size() > 256 || key.find('/') == std::string::npos)
        return Status::invalid_argument(name + ": each key is 'link class/traffic', at most 256 bytes");
      if (!(seconds >= 0) || !std::isfinite(seconds))
        return Status::invalid_argument(name + "." + key + " must be finite and >= 0");
    }
  }
  for (const auto& [name, b] : m.link_bursts)
    if (b.size() != 3 || !(b[0] >= 0) || !(b[1] >= 0) || !(b[2] >= 0))
      return Status::invalid_argument("metrics.link_bursts." + name + " must be [bursts, bytes, seconds] >= 0");
  *out = std::move(m);
  return Status::ok();
}

json to_json(const ErrorReport& m) { return {{"op", op::kError}, {"error", m.error}}; }

Status from_json(const json& j, ErrorReport* out) {
  ErrorReport e;
  XD_RETURN_IF_ERROR(read_message(j, op::kError, [&](JsonFields& f) { f.get("error", &e.error); }));
  *out = std::move(e);
  return Status::ok();
}

json to_json(const StopOrder& m) { return {{"op", op::kStop}, {"reason", m.reason}}; }

Status from_json(const json& j, StopOrder* out) {
  StopOrder s;
  XD_RETURN_IF_ERROR(read_message(j, op::kStop, [&](JsonFields& f) { f.get("reason", &s.reason); }));
  *out = std::move(s);
  return Status::ok();
}

json to_json(const ThrottleRequest& m) {
  return {{"op", op::kThrottle}, {"link", m.link}, {"bandwidth_bytes_per_s", m.bandwidth_bytes_per_s},
          {"latency_s", m.latency_s}, {"rank", m.rank}};
}

Status from_json(const json& j, ThrottleRequest* out) {
  ThrottleRequest t;
  XD_RETURN_IF_ERROR(read_message(j, op::kThrottle, [&](JsonFields& f) {
    f.get("link", &t.link);
    f.get("bandwidth_bytes_per_s", &t.bandwidth_bytes_per_s);
    f.get("latency_s", &t.latency_s);
    f.get("rank", &t.rank);
  }));
  if (!(t.bandwidth_bytes_per_s >= 0)) return Status::invalid_argument("throttle: bandwidth must be >= 0");
  if (t.rank < -1) return Status::invalid_argument("throttle: rank must be >= 0, or -1 for every worker");
  *out = std::move(t);
  return Status::ok();
}

json to_json(const ThrottleOrder& m) {
  return {{"op", op::kThrottle}, {"level", m.level}, {"bandwidth_bytes_per_s", m.bandwidth_bytes_per_s},
          {"latency_s", m.latency_s}};
}

Status from_json(const json& j, ThrottleOrder* out) {
  ThrottleOrder t;
  XD_RETURN_IF_ERROR(read_message(j, op::kThrottle, [&](JsonFields& f) {
    f.get("level", &t.level);
    f.get("bandwidth_bytes_per_s", &t.bandwidth_bytes_per_s);
    f.get("latency_s", &t.latency_s);
  }));
  if (t.level < 0 || !(t.bandwidth_bytes_per_s >= 0) || !(t.latency_s >= 0))
    return Status::invalid_argument("throttle: level, bandwidth and latency must be >= 0");
  *out = t;
  return Status::ok();
}

json to_json(const PlanUpdate& m) {
  return {{"op", op::kPlan}, {"step", m.step}, {"domain_sizes", m.domain_sizes},
          {"pipeline_degree", m.pipeline_degree}, {"backward_pipeline_degree", m.backward_pipeline_degree},
          {"predicted_step_s", m.predicted_step_s}, {"reason", m.reason},
          {"replica_weights_late", m.replica_weights_late}};
}

Status from_json(const json& j, PlanUpdate* out) {
  PlanUpdate p;
  XD_RETURN_IF_ERROR(read_message(j, op::kPlan, [&](JsonFields& f) {
    f.get("step", &p.step);
    f.get("domain_sizes", &p.domain_sizes);
    f.get("pipeline_degree", &p.pipeline_degree);
    f.get("backward_pipeline_degree", &p.backward_pipeline_degree);
    f.get("predicted_step_s", &p.predicted_step_s);
    f.get("reason", &p.reason);
    f.get("replica_weights_late", &p.replica_weights_late);
  }));
  if (p.step < 1 || p.domain_sizes.empty() || p.pipeline_degree < 1 || p.pipeline_degree > 64)
    return Status::invalid_argument("plan: step >= 1, domain sizes and a pipeline degree in 1..64 are needed");
  if (p.backward_pipeline_degree < 1 || p.pipeline_degree % p.backward_pipeline_degree != 0)
    return Status::invalid_argument("plan: the backward pipeline degree must divide the forward one");
  for (int s : p.domain_sizes)
    if (s < 1) return Status::invalid_argument("plan: domain sizes must be >= 1");
  *out = std::move(p);
  return Status::ok();
}

json to_json(const CheckpointSaved& m) {
  return {{"op", op::kCheckpoint}, {"step", m.step},   {"dir", m.dir},           {"file", m.file},
          {"data_position", m.data_position}, {"bytes", m.bytes},      {"crc32c", m.crc32c}, {"seconds", m.seconds}};
}

Status from_json(const json& j, CheckpointSaved* out) {
  CheckpointSaved c;
  XD_RETURN_IF_ERROR(read_message(j, op::kCheckpoint, [&](JsonFields& f) {
    f.get("step", &c.step);
    f.get("dir", &c.dir);
    f.get("file", &c.file);
    f.get("data_position", &c.data_position);
    f.get("bytes", &c.bytes);
    f.get("crc32c", &c.crc32c);
    f.get("seconds", &c.seconds);
  }));
  if (c.step < 1 || c.dir.empty() || c.file.empty() || c.file.find('/') != std::string::npos || !(c.seconds >= 0))
    return Status::invalid_argument("checkpoint: step >= 1, a directory and a plain file name are needed");
  *out = std::move(c);
  return Status::ok();
}

}  // namespace xd
