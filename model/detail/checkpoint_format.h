// What one-process and distributed checkpoints share: file names, TrainerState
// as JSON ({"step", "data_position", "seed", "last_loss"}, the form of
// trainer_state.json and of manifests), and path spelling. Internal to model/.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "model/checkpoint.h"

namespace xd::detail {

inline constexpr const char* kConfigFile = "config.json";
inline constexpr const char* kExpAvg = "exp_avg.";        // AdamW m, beside each tensor's name
inline constexpr const char* kExpAvgSq = "exp_avg_sq.";   // AdamW v

// "a/b/" -> "a/b" ("/" stays).
inline std::string strip_trailing_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

nlohmann::json trainer_state_to_json(const TrainerState& t);
// Strict: a missing or mistyped key is corruption naming `path` and the key.
Status trainer_state_from_json(const nlohmann::json& j, const std::string& path, TrainerState* t);

}  // namespace xd::detail
