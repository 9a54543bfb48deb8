// TrainerState as JSON ({"step", "data_position", "seed", "last_loss"}), the
// form trainer_state.json and distributed checkpoint manifests share.
// Internal to model/.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "model/checkpoint.h"

namespace xd::detail {

nlohmann::json trainer_state_to_json(const TrainerState& t);
// Strict: a missing or mistyped key is corruption naming `path` and the key.
Status trainer_state_from_json(const nlohmann::json& j, const std::string& path, TrainerState* t);

}  // namespace xd::detail
