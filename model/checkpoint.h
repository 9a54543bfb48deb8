// Training checkpoints, one directory each, laid out so HF tooling can read it:
//   model.safetensors      one F32 tensor per ParamLayout slot, HF Mixtral names,
//                          metadata {"format": "pt"}
//   config.json            model_config_to_json (model/hf_config.h)
//   optimizer.safetensors  "exp_avg.<param>" and "exp_avg_sq.<param>" (AdamW m, v),
//                          metadata {"format": "pt", "step": "<adam step>"}; optional
//   trainer_state.json     {"step", "data_position", "seed", "last_loss"}
//
// save_checkpoint is atomic as a whole: never a torn mix of old and new files
// (on the fallback path below, <dir> is briefly absent between the renames). Everything is written and fsynced in "<dir>.tmp-<pid>/",
// which then replaces <dir> (an atomic exchange where the filesystem supports it,
// else rename old to "<dir>.old-<pid>", rename new in, delete old). A crash can
// leave "*.tmp-*" / "*.old-*" siblings behind; they are garbage, and
// latest_checkpoint ignores them.
//
// Loading is strict: every layout tensor must be present with its shape, and no
// tensor outside the layout may be. Errors name the file and the tensor or key.
// Functions are independent; concurrent saves must target different directories.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/model_config.h"
#include "model/param_layout.h"

namespace xd {

struct TrainerState {
  int64_t step = 0;
  uint64_t data_position = 0;
  uint64_t seed = 0;
  double last_loss = 0;  // a non-finite loss round-trips as NaN (JSON has no NaN)
};

struct CheckpointData {
  ModelConfig config;
  std::vector<float> params;  // ParamLayout(config) order, all experts
  bool has_optimizer = false;
  std::vector<float> adam_m, adam_v;  // same layout as params; empty without optimizer
  int64_t adam_step = 0;
  TrainerState trainer;
};

// `layout` must hold every expert (first_expert 0, all local). `params`, and
// `adam_m` / `adam_v` when given (both or neither), hold layout.size() floats.
// Creates missing parent directories of `dir`.
Status save_checkpoint(const std::string& dir, const ParamLayout& layout, const float* params,
                       const float* adam_m, const float* adam_v, int64_t adam_step,
                       const TrainerState& trainer);

Expected<CheckpointData> load_checkpoint(const std::string& dir);

// "step_000100": the directory name latest_checkpoint understands.
std::string checkpoint_dir_name(int64_t step);

// Path of the highest-numbered complete "step_<N>" directory under `root`;
// not_found if there is none (or no root).
Expected<std::string> latest_checkpoint(const std::string& root);

}  // namespace xd
