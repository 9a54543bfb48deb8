// ModelConfig <-> HF Mixtral config.json. The standard keys mean what they mean
// to transformers' MixtralConfig, so an exported checkpoint loads there when our
// model stays inside Mixtral's semantics; what Mixtral lacks is stored under keys
// prefixed "xdmoe_", which HF ignores.
//
// Reading: the standard Mixtral keys we write are required. "xdmoe_" keys are
// optional and default to ModelConfig's defaults, which match Mixtral (softmax top-k,
// dropless, no shared experts, regular connectivity), so a plain HF Mixtral config
// loads too. HF settings we cannot honour (tied embeddings, a sliding window, an
// activation other than silu) are rejected rather than ignored. Every error names
// the key. Pure functions; no exceptions escape.
#pragma once

#include <nlohmann/json.hpp>

#include "model/model_config.h"

namespace xd {

nlohmann::json model_config_to_json(const ModelConfig& cfg);

// Also runs cfg.validate().
Expected<ModelConfig> model_config_from_json(const nlohmann::json& j);

}  // namespace xd
