// The coordinator <-> worker and coordinator <-> CLI control protocol.
// Every message is a JSON object (sent as msgpack, see transport/control_channel.h)
// with an "op" string. Workers speak: register, heartbeat, metrics, done,
// error. The coordinator speaks: assign, heartbeat, stop, throttle. CLI
// clients send status, metrics, stop, throttle and get one reply each.
// Parsing never throws: a malformed body yields an error Status.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace xd {

namespace op {
inline constexpr const char* kRegister = "register";
inline constexpr const char* kAssign = "assign";
inline constexpr const char* kHeartbeat = "heartbeat";
inline constexpr const char* kMetrics = "metrics";
inline constexpr const char* kDone = "done";
inline constexpr const char* kError = "error";
inline constexpr const char* kStop = "stop";
inline constexpr const char* kThrottle = "throttle";
inline constexpr const char* kStatus = "status";
}  // namespace op

struct RegisterRequest {
  int requested_rank = -1;  // from --rank or the launcher's environment; -1: any
  std::string host;
  int pid = 0;
  std::string data_endpoint;
};

// Per-step figures a worker reports; the coordinator aggregates them.
struct StepMetrics {
  int64_t step = 0;
  double loss = 0, ce_loss = 0, aux_loss = 0;
  double tokens_per_s = 0;
  double step_s = 0, compute_s = 0, comm_s = 0, exposed_comm_s = 0;
  double predicted_step_s = 0;
  double peak_rss_bytes = 0;
  // bytes sent this step per "link class/operation", e.g. "dc/moe_dispatch"
  std::map<std::string, double> bytes;
  // Time the compute thread waited for each layer's gathered experts (the
  // async communicator's receive queue); empty without replicas.
  std::vector<double> gather_wait_s;
  double overlap_percent() const {
    return comm_s > 0 ? 100.0 * (1.0 - exposed_comm_s / comm_s) : 0.0;
  }
};

nlohmann::json to_json(const RegisterRequest& r);
Expected<RegisterRequest> register_from_json(const nlohmann::json& j);
nlohmann::json to_json(const StepMetrics& m);
Expected<StepMetrics> metrics_from_json(const nlohmann::json& j);

// Reads a typed field; error naming the field when missing or mistyped.
template <typename T>
Status read_field(const nlohmann::json& j, const char* key, T* out) {
  auto it = j.find(key);
  if (it == j.end()) return Status::invalid_argument(std::string("missing field '") + key + "'");
  try {
    *out = it->template get<T>();
  } catch (const std::exception&) {
    return Status::invalid_argument(std::string("field '") + key + "' has the wrong type");
  }
  return Status::ok();
}

}  // namespace xd
