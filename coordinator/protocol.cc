#include "coordinator/protocol.h"

namespace xd {

nlohmann::json to_json(const RegisterRequest& r) {
  return {{"op", op::kRegister}, {"requested_rank", r.requested_rank}, {"host", r.host},
          {"pid", r.pid}, {"data_endpoint", r.data_endpoint}};
}

Expected<RegisterRequest> register_from_json(const nlohmann::json& j) {
  RegisterRequest r;
  XD_RETURN_IF_ERROR(read_field(j, "requested_rank", &r.requested_rank));
  XD_RETURN_IF_ERROR(read_field(j, "host", &r.host));
  XD_RETURN_IF_ERROR(read_field(j, "pid", &r.pid));
  XD_RETURN_IF_ERROR(read_field(j, "data_endpoint", &r.data_endpoint));
  if (r.data_endpoint.rfind("tcp://", 0) != 0)
    return Status::invalid_argument("data_endpoint must be a tcp:// endpoint");
  return r;
}

nlohmann::json to_json(const StepMetrics& m) {
  return {{"op", op::kMetrics},       {"step", m.step},
          {"loss", m.loss},           {"ce_loss", m.ce_loss},
          {"aux_loss", m.aux_loss},   {"tokens_per_s", m.tokens_per_s},
          {"step_s", m.step_s},       {"compute_s", m.compute_s},
          {"comm_s", m.comm_s},       {"exposed_comm_s", m.exposed_comm_s},
          {"predicted_step_s", m.predicted_step_s},
          {"peak_rss_bytes", m.peak_rss_bytes},
          {"bytes", m.bytes},
          {"gather_wait_s", m.gather_wait_s}};
}

Expected<StepMetrics> metrics_from_json(const nlohmann::json& j) {
  StepMetrics m;
  XD_RETURN_IF_ERROR(read_field(j, "step", &m.step));
  XD_RETURN_IF_ERROR(read_field(j, "loss", &m.loss));
  XD_RETURN_IF_ERROR(read_field(j, "ce_loss", &m.ce_loss));
  XD_RETURN_IF_ERROR(read_field(j, "aux_loss", &m.aux_loss));
  XD_RETURN_IF_ERROR(read_field(j, "tokens_per_s", &m.tokens_per_s));
  XD_RETURN_IF_ERROR(read_field(j, "step_s", &m.step_s));
  XD_RETURN_IF_ERROR(read_field(j, "compute_s", &m.compute_s));
  XD_RETURN_IF_ERROR(read_field(j, "comm_s", &m.comm_s));
  XD_RETURN_IF_ERROR(read_field(j, "exposed_comm_s", &m.exposed_comm_s));
  XD_RETURN_IF_ERROR(read_field(j, "predicted_step_s", &m.predicted_step_s));
  XD_RETURN_IF_ERROR(read_field(j, "peak_rss_bytes", &m.peak_rss_bytes));
  XD_RETURN_IF_ERROR(read_field(j, "bytes", &m.bytes));
  if (j.contains("gather_wait_s")) XD_RETURN_IF_ERROR(read_field(j, "gather_wait_s", &m.gather_wait_s));
  return m;
}

}  // namespace xd
