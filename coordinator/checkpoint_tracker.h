// CheckpointTracker: the coordinator's side of distributed checkpoints
// (model/distributed_checkpoint.h). Workers report their shard of a step when
// it is durable; once every worker's shard of that step is in, the tracker
// writes config.json and the manifest, which makes the checkpoint complete.
// Not thread-safe: the coordinator loop owns it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cluster/protocol.h"
#include "common/status.h"
#include "model/distributed_checkpoint.h"
#include "model/model_config.h"

namespace xd {

struct CompletedCheckpoint {
  int64_t step = 0;
  std::string dir;
  uint64_t bytes = 0;        // all shards
  double write_s = 0;        // the slowest worker's write, fsync and checksum
};

class CheckpointTracker {
 public:
  // `root`: train.checkpoint_dir; `steps`: train.steps. A report must name
  // <root>/step_<N> with 0 < N <= steps and the reporter's own shard file.
  CheckpointTracker(ModelConfig config, int world, uint64_t seed, std::string root, int64_t steps)
      : config_(std::move(config)), world_(world), seed_(seed), root_(std::move(root)), steps_(steps) {}

  // One worker's report. Returns the checkpoint when this report completed
  // it (manifest written), nothing while shards are missing, or the error
  // of a report that contradicts the others or of writing the manifest.
  Expected<std::optional<CompletedCheckpoint>> record(int rank, const CheckpointSaved& report, double loss);

  const std::vector<CompletedCheckpoint>& completed() const { return completed_; }

 private:
  struct Pending {
    std::string dir;
    std::vector<ShardRecord> shards;
    std::vector<bool> seen;
    uint64_t data_position = 0;
    double write_s = 0;
  };
  ModelConfig config_;
  int world_;
  uint64_t seed_;
  std::string root_;
  int64_t steps_;
  std::map<int64_t, Pending> pending_;
  std::vector<CompletedCheckpoint> completed_;
};

}  // namespace xd
