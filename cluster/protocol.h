// The control protocol, version kProtocolVersion: every message between the
// coordinator, its workers and CLI clients, as typed structs. The one place
// the control vocabulary is defined (the data plane's is
// transport/wire_format.h).
//
// On the wire a message is a JSON object with an "op" string, packed as
// msgpack into the metadata frame of a control message (see
// transport/control_channel.h). to_json() writes the op and every field;
// from_json() reads one message strictly: a missing, mistyped or unknown
// field is an error naming it, and nothing throws.
//
//   worker -> coordinator   register, heartbeat, metrics, checkpoint, done, error
//   coordinator -> worker   assign, heartbeat, stop, throttle, error (refusal)
//   CLI -> coordinator      status, metrics, stop, throttle; one JSON reply
//                           each: {"ok": true, ...} or {"ok": false, "error"}
//
// Versioning: a worker states its protocol version when it registers; the
// coordinator refuses any other version with an error that names both, so
// mixed builds fail at once instead of mid-job. Append fields and ops; any
// change an older peer cannot read raises kProtocolVersion.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster/job_config.h"
#include "common/status.h"

namespace xd {

// 1: untyped JSON with the job's YAML text in the assignment. 2: typed
// messages; the assignment carries the effective JobConfig. 3: metrics carry
// link bursts; the coordinator may send a plan update mid-job. 4: workers
// report checkpoint shards; assignments may resume from a checkpoint; metrics
// say when the non-finite guard skipped a step. 5: the assigned JobConfig's
// expert_parallel carries fused_encode. 6: ... and base_codec. 7: metrics
// carry the worker process's CPU time, the CPUs it may run on and its machine.
// 8: the assigned expert_parallel and plan updates carry the backward's
// pipeline degree. 9: the assigned expert_parallel and plan updates carry
// when the replicas' weight gradients are computed. 10: metrics carry the
// compute thread's waits by what it waited for. 11: metrics carry each
// direction's compute. 12: the assigned expert_parallel carries
// tokens_once_per_worker. 13: ... as auto, true or false (a JSON string).
// 14: metrics carry the codecs' time per link class and traffic kind.
// 15: ... as encoding and decoding apart, the coding threads' CPU time.
inline constexpr int kProtocolVersion = 15;

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
inline constexpr const char* kPlan = "plan";
inline constexpr const char* kCheckpoint = "checkpoint";
}  // namespace op

// The message's op, or an error when it has none.
Expected<std::string> op_of(const nlohmann::json& message);

// worker -> coordinator: the first message of a worker.
struct RegisterRequest {
  int protocol_version = kProtocolVersion;
  int requested_rank = -1;  // from --rank or the launcher's environment; -1: any
  std::string host;
  int pid = 0;
  std::string data_endpoint;  // tcp://...
};

struct PeerAssignment {
  PeerAssignment(int rank_ = 0, std::string endpoint_ = "", int link_class_ = 0, std::string public_key_ = "")
      : rank(rank_), endpoint(std::move(endpoint_)), link_class(link_class_), public_key(std::move(public_key_)) {}
  int rank = 0;
  std::string endpoint;  // the peer's data socket
  int link_class = 0;    // the level of the first coordinate where the ranks differ
  std::string public_key;  // its CURVE key, as it registered with it; empty in plaintext
};

// coordinator -> worker: everything a worker needs to run its share of the job.
struct Assignment {
  uint32_t job_id = 0;  // stamped on, and checked in, every data-plane message
  std::string job_name;
  int rank = 0;
  std::vector<PeerAssignment> peers;  // every worker, this one included, by rank
  std::vector<int> domain_sizes;      // the plan's S^l, one per level
  bool flat_ep = false;               // EP in one all-to-all hop instead of one per level
  double predicted_step_s = 0;
  bool hold = false;                  // connect, then stay idle until stopped
  // A checkpoint directory (model/distributed_checkpoint.h) to start from, or
  // empty: a fresh start.
  std::string resume_dir;
  JobConfig job;                      // the effective configuration
};

struct Heartbeat {};

// The keys of StepMetrics::waits_s, "direction/wait". Only appended to.
namespace step_waits {
inline constexpr const char* kForwardTokenExchange = "forward/token_exchange";        // Dispatch, Combine
inline constexpr const char* kForwardExpertAllGather = "forward/expert_all_gather";   // gathered replicas
inline constexpr const char* kBackwardTokenExchange = "backward/token_exchange";      // their backward
inline constexpr const char* kBackwardReplicaGradients = "backward/replica_gradients";  // to the owners
inline constexpr const char* kBackwardDenseAllReduce = "backward/dense_all_reduce";    // the buckets
inline constexpr const char* kBackwardGradientNorm = "backward/gradient_norm";        // the clip's global norm
}  // namespace step_waits

// worker -> coordinator: per-step figures; the coordinator aggregates them.
struct StepMetrics {
  int64_t step = 0;
  double loss = 0, ce_loss = 0, aux_loss = 0;
  double tokens_per_s = 0;
  double step_s = 0, compute_s = 0, comm_s = 0, exposed_comm_s = 0;
  // Per direction: the busiest link class's transmit time while that pass
  // ran (at least the exposed time), and the time compute waited for
  // communication; overlap = 1 - exposed / comm. Forward covers the forward
  // pass; backward the rest of the step (backward, all-reduce, optimizer).
  double fwd_comm_s = 0, fwd_exposed_s = 0, bwd_comm_s = 0, bwd_exposed_s = 0;
  // Per direction: the compute of that pass, less its waits (the two sum to
  // compute_s; backward holds this step's optimizer step). Beside
  // fwd_comm_s / bwd_comm_s they say which phase its link bounds and which
  // its compute.
  double fwd_compute_s = 0, bwd_compute_s = 0;
  // The busiest shaped link class's transmit time this step (bytes /
  // bandwidth; TransportStats::class_transmit_seconds); the step's bound is
  // max(compute_s, link_busy_s).
  double link_busy_s = 0;
  // The step's floor by phase (phase_floor_seconds, actors/distributed_trainer.h):
  // each phase's own max(compute, link), since a phase's traffic cannot use
  // the other's idle link. At least max(compute_s, link_busy_s).
  double phase_floor_s = 0;
  // Encoding and decoding: token rows (on the compute thread, part of
  // compute_s) and expert tensors (on the expert communicator's thread).
  double codec_s = 0;
  // CPU time of every thread of the worker's process during the step (the
  // comm threads and the socket library's included), the CPUs it may run on
  // (ids, its affinity mask) and its machine (the kernel's boot id, the same
  // for every network namespace of one machine): the coordinator sums the
  // first over the workers of a machine and divides by the number of CPUs
  // they may run on together (StepSummary::cpu_floor_s).
  double cpu_s = 0;
  std::vector<int> cpus;
  std::string machine;
  double predicted_step_s = 0;
  double peak_rss_bytes = 0;
  // bytes sent this step per "link class/operation", e.g. "dc/moe_dispatch"
  std::map<std::string, double> bytes;
  // Reconstruction error of the lossy codecs this step, per "link
  // class/traffic" (the codec config's keys and expert_base, the SR base's
  // all-reduce), e.g. "dc/expert_gather": ||x - rebuilt||^2 / ||x||^2. Token
  // rows: over the first message of each peer and direction (a sample);
  // bf16 dense gradients and base: the rounding of what this worker sent.
  std::map<std::string, double> nmse;
  // CPU seconds in the codecs this step (the coding threads' own), per "link
  // class/traffic" like nmse: encoding what this worker sent (packing inside
  // the optimizer step included) and decoding what it received. Together
  // they sum to codec_s. Required from protocol version 15 (14 sent one
  // total per key, in wall seconds).
  std::map<std::string, double> codec_encode_seconds, codec_decode_seconds;
  // Time the compute thread waited for each layer's gathered experts (the
  // async communicator's receive queue); empty without replicas.
  std::vector<double> gather_wait_s;
  // This step's exposed communication by what the compute thread waited for
  // (the step_waits:: keys, "direction/wait"): the parts of fwd_exposed_s
  // and bwd_exposed_s. Required from protocol version 10.
  std::map<std::string, double> waits_s;
  // Per link class name, this step's {bursts, bytes, seconds} of the periods
  // during which some of its bytes waited to leave this worker
  // (TransportStats::class_bursts): what the coordinator re-fits links from.
  std::map<std::string, std::vector<double>> link_bursts;
  // The loss or a gradient was not finite and train.nan_policy is "skip": the
  // weights did not change this step.
  bool skipped = false;
};

// worker -> coordinator: this worker's shard of the checkpoint after `step`
// is durable in `dir` (model/distributed_checkpoint.h); the coordinator
// writes the manifest once every worker's has come.
struct CheckpointSaved {
  int64_t step = 0;
  std::string dir;
  std::string file;
  uint64_t data_position = 0;  // batches drawn so far (BatchSampler::position)
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  double seconds = 0;  // writing, fsync and checksum
};

// coordinator -> worker: from step `step` (1-based) on, run with these
// domains and these pipeline degrees. Sent at least two steps ahead (a worker
// gathers step s's experts at the end of step s-1); one that arrives later
// fails the job rather than letting workers disagree.
struct PlanUpdate {
  int64_t step = 0;
  std::vector<int> domain_sizes;
  int pipeline_degree = 1;
  int backward_pipeline_degree = 1;  // divides pipeline_degree
  double predicted_step_s = 0;
  std::string reason;
  // expert_parallel.replica_weight_gradients from then on: late, else early.
  bool replica_weights_late = false;
};

struct Done {};

// A failure (worker -> coordinator) or a refusal (coordinator -> worker).
struct ErrorReport {
  std::string error;
};

// coordinator -> worker, and CLI -> coordinator.
struct StopOrder {
  std::string reason;
};

// CLI -> coordinator: reshape a link class, named by level or link name.
struct ThrottleRequest {
  std::string link;
  double bandwidth_bytes_per_s = 0;  // 0: unlimited
  double latency_s = -1;             // < 0: keep the current latency
  int rank = -1;                     // only this worker's sends; -1: the whole class
};

// coordinator -> worker: the new shaping of one level's link class.
struct ThrottleOrder {
  int level = 0;
  double bandwidth_bytes_per_s = 0;
  double latency_s = 0;
};

// CLI -> coordinator: the job's status, or its aggregated metrics.
struct StatusRequest {};
struct MetricsRequest {};

nlohmann::json to_json(const RegisterRequest& m);
nlohmann::json to_json(const Assignment& m);
nlohmann::json to_json(const Heartbeat& m);
nlohmann::json to_json(const StepMetrics& m);
nlohmann::json to_json(const Done& m);
nlohmann::json to_json(const ErrorReport& m);
nlohmann::json to_json(const StopOrder& m);
nlohmann::json to_json(const ThrottleRequest& m);
nlohmann::json to_json(const ThrottleOrder& m);
nlohmann::json to_json(const PlanUpdate& m);
nlohmann::json to_json(const CheckpointSaved& m);
nlohmann::json to_json(const StatusRequest& m);
nlohmann::json to_json(const MetricsRequest& m);

// Each checks the op and every field; `*out` is only complete on ok.
Status from_json(const nlohmann::json& j, RegisterRequest* out);
Status from_json(const nlohmann::json& j, Assignment* out);
Status from_json(const nlohmann::json& j, StepMetrics* out);
Status from_json(const nlohmann::json& j, ErrorReport* out);
Status from_json(const nlohmann::json& j, StopOrder* out);
Status from_json(const nlohmann::json& j, ThrottleRequest* out);
Status from_json(const nlohmann::json& j, ThrottleOrder* out);
Status from_json(const nlohmann::json& j, PlanUpdate* out);
Status from_json(const nlohmann::json& j, CheckpointSaved* out);

// The coordinator's refusal of a registration from another protocol version.
std::string protocol_mismatch_message(int worker_version);

}  // namespace xd
