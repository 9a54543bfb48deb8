// JobConfig: one job, whole -- the model/train/data sections (TrainConfig) and
// the cluster. It is read once, from YAML, by whoever starts the job (the
// coordinator, `xdmoe plan`, `xdmoe train`); every override from the command
// line is applied to it there; and the result, the *effective* configuration,
// travels to every worker as JSON inside the assignment (cluster/protocol.h).
// Workers never see or re-parse the YAML. Plain data; copyable; the functions
// are pure and never throw.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "cluster/cluster_spec.h"
#include "common/status.h"
#include "model/train_config.h"

namespace xd {

struct JobConfig {
  TrainConfig train;  // train.batch_size is per worker
  ClusterSpec cluster;

  // Every rule of the parsers: the train and cluster rules, and that
  // model.num_experts is a multiple of the world size.
  Status validate() const;
  // Whether tokens can travel once per worker: a token router (not soft_moe)
  // and lossless token codecs on every link class. Else the reason, for
  // tokens_once_per_worker: true to refuse and auto to stay off.
  Status can_send_tokens_once_per_worker() const;
};

// The built-in distributed demo: default_cluster_spec() and default_train_config()
// with 16 sequences per worker and experts of intermediate size 128.
JobConfig default_job_config();
// Parses the sections model/train/data (TrainConfig) and cluster of one file,
// then checks that they agree (JobConfig::validate()).
Expected<JobConfig> parse_job_config(const std::string& yaml_text, const std::string& source);
Expected<JobConfig> load_job_config(const std::string& path);

// One link class's codecs, {traffic kind: spec} (the JSON form of LinkCodecs).
nlohmann::json link_codecs_to_json(const LinkCodecs& codecs);

// The effective configuration as JSON, and back. Every field is written, so
// nothing depends on the reader's defaults; from_json rejects a missing,
// unknown or mistyped key (naming it) and runs validate().
nlohmann::json job_config_to_json(const JobConfig& job);
Expected<JobConfig> job_config_from_json(const nlohmann::json& j);

// The command line's expert-parallel overrides, as the coordinator and
// `xdmoe plan` apply them: a mode ("" keeps the config's; ep resets the
// domain sizes to all 1s), then domain sizes (empty keeps them). Then checks
// the whole job; errors name the flag or the key.
Status override_expert_parallel(JobConfig* job, const std::string& mode, const std::vector<int>& domain_sizes);

// The command line's schedule overrides (coordinator, `xdmoe plan`):
// --farskip turns FarSkip connectivity on for every layer, --no-overlap runs
// the simple schedule, --pipeline-degree sets r (0: the planner's),
// --backward-pipeline-degree the backward's (0: the planner's), --sr-codecs
// compresses the expert and dense-gradient traffic of the outermost link class
// (kSrCodecs), and --trace-steps / --trace-dir ask workers for step traces. It does not
// validate the job: callers apply it before override_expert_parallel, which
// checks the whole job once every override is in.
struct ScheduleOverrides {
  bool farskip = false;
  bool no_overlap = false;
  int pipeline_degree = -1;  // -1: keep the config's
  int backward_pipeline_degree = -2;  // -2: keep the config's; -1: follow r (a set r, else chosen)
  std::string replica_weight_gradients;  // auto, early or late; empty: keep the config's
  bool sr_codecs = false;
  bool delta_weights = false;  // the outermost link class's expert_gather: kDeltaWeights
  std::string tokens_once_per_worker;  // auto, true or false; empty: keep the config's
  std::vector<int64_t> trace_steps;
  std::string trace_dir;     // empty: keep the config's
};
Status override_schedule(JobConfig* job, const ScheduleOverrides& o);

// The codec set --sr-codecs (and a launch run's +sr) puts on the outermost
// link class: SR residuals and replica gradients as 4-bit integers with error
// feedback, dense gradients in bf16, the SR base re-synchronised every 10
// steps. Token rows stay as configured. It is the set that kept the loss
// within 0.1% of uncompressed training (docs/compression.md).
struct SrCodecSet {
  const char* expert_gather;
  const char* expert_grad;
  const char* dense_grad;
  int base_sync_every;
};
inline constexpr SrCodecSet kSrCodecs{"sr:ef:int4_row:128+zstd:1", "ef:int4_row:128+zstd:1", "bf16", 10};

// The expert all-gather codec --delta-weights (and a launch run's +delta)
// puts on the outermost link class: each weight's bit difference from what
// the receivers hold, byte plane by byte plane, then zstd. Exact, so the run
// keeps the one process's numbers (docs/compression.md).
inline constexpr const char* kDeltaWeights = "delta:zstd:1";

// Settings the job takes but that cannot change anything it does, each as
// "key: why", for `xdmoe plan` and the coordinator to point out: expert
// codecs in EP mode (no expert crosses a link), the SR base's settings
// without an sr: all-gather, replica_weight_gradients without an overlapped
// HybridEP backward, a codec schedule's switch after the last step.
std::vector<std::string> settings_without_effect(const JobConfig& job);

// The one-process run with the arithmetic of the distributed job: the same
// model, data and seed, and the global batch (world size x train.batch_size
// sequences) in every step. The only difference: the router's load-balancing
// aux loss is taken over the whole batch instead of per worker.
TrainConfig one_process_equivalent(const JobConfig& job);

}  // namespace xd
