// Checkpoints of distributed runs: one directory per step, one shard per
// worker, and a manifest that makes the set complete.
//   shard-<rank>-of-<G>.safetensors  the worker's own tensors under their HF
//                 names: its routed experts, and on rank 0 also the replicated
//                 dense parameters; "exp_avg.<name>" / "exp_avg_sq.<name>" (AdamW
//                 m, v) beside them; metadata {"format": "pt", "step",
//                 "adam_step", "rank", "world"}
//   config.json   model_config_to_json (model/hf_config.h)
//   manifest.json {"format": "xdmoe-sharded", "version": 1, "step", "world",
//                 "trainer": {step, data_position, seed, last_loss},
//                 "shards": [{"rank", "file", "bytes", "crc32c"}]}
//
// Each worker writes its shard atomically and durably (write, fsync, rename,
// fsync the directory) and reports its size and CRC-32C. Whoever collects the
// reports (the coordinator) writes config.json and then the manifest, the same
// way, once every shard is in: a directory without a manifest is a torn
// checkpoint, and one whose shard does not match its manifest entry is a
// corrupt one. Both are skipped when looking for the checkpoint to resume.
//
// Loading merges the shards into one CheckpointData with every expert, so a
// job with any number of workers (or one process: `xdmoe train`, `xdmoe
// forward`) takes the slices it owns: that is the re-sharding. Every worker
// reads every shard; a file a worker cannot see (no shared filesystem) is a
// not_found naming it. Functions are independent and thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/checkpoint.h"
#include "model/model_config.h"
#include "model/param_layout.h"

namespace xd {

inline constexpr const char* kManifestFile = "manifest.json";

struct ShardRecord {
  int rank = 0;
  std::string file;  // inside the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

// "shard-00003-of-00004.safetensors".
std::string shard_file_name(int rank, int world);

// Writes worker `rank`'s shard into `dir` (created if missing): the routed
// experts of `layout` (the worker's layout), and every other slot when
// `include_dense`, with the AdamW moments (same layout as params).
Expected<ShardRecord> save_checkpoint_shard(const std::string& dir, int rank, int world, const ParamLayout& layout,
                                            const float* params, const float* adam_m, const float* adam_v,
                                            int64_t adam_step, int64_t step, bool include_dense);

// config.json, then manifest.json: the checkpoint is complete from here on.
// `shards` must hold ranks 0..world-1 once each.
Status write_checkpoint_manifest(const std::string& dir, const ModelConfig& config, int world,
                                 const TrainerState& trainer, const std::vector<ShardRecord>& shards);

// Whether `dir` holds a manifest (a distributed checkpoint, maybe torn or corrupt).
bool is_distributed_checkpoint(const std::string& dir);

// Checks every shard against the manifest (size, CRC-32C), then merges them.
Expected<CheckpointData> load_distributed_checkpoint(const std::string& dir);

// Whether `dir` is a complete checkpoint of either kind: a distributed one
// whose shards all match the manifest, or a one-process one with its files.
// The error says what is wrong.
Status verify_checkpoint(const std::string& dir);

// The newest step_<N> under `root` that verify_checkpoint accepts. Newer
// ones that fail are appended to `skipped` (may be null) as "DIR: why".
Expected<std::string> latest_valid_checkpoint(const std::string& root, std::vector<std::string>* skipped);

// The step, data position, seed and loss a checkpoint of either kind was
// taken at, without reading its tensors.
Expected<TrainerState> checkpoint_trainer_state(const std::string& dir);

// `path` itself when it is a checkpoint directory (it must verify), else the
// latest valid checkpoint under it, as latest_valid_checkpoint.
Expected<std::string> resolve_checkpoint(const std::string& path, std::vector<std::string>* skipped);

}  // namespace xd
