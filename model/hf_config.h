// ModelConfig <-> HF Mixtral config.json. The standard keys mean what they mean
// to transformers' MixtralConfig, so an exported checkpoint loads there when our
// model stays inside Mixtral's semantics; what Mixtral lacks is stored under keys
// prefixed "xdmoe_", which HF ignores.
//
// Reading: the shape keys (vocab, hidden, intermediate, layers, heads, KV
// heads, experts, experts per token, max positions), rms_norm_eps,
// rope_theta, router_aux_loss_coef and model_type are required; the other
// standard keys are optional and checked when present. HF settings we cannot
// honour (tied embeddings, a sliding window, an activation other than silu)
// are rejected rather than ignored. "xdmoe_" keys are optional and default to
// ModelConfig's defaults: softmax top-k, dropless, no shared experts and
// regular connectivity, as in Mixtral, so a plain HF Mixtral config loads with
// Mixtral's forward pass; only training differs, by our default router z-loss
// (z_loss_coef 0.001, which Mixtral lacks). Every error names the key. Pure
// functions; no exceptions escape.
#pragma once

#include <nlohmann/json.hpp>

#include "model/model_config.h"

namespace xd {

nlohmann::json model_config_to_json(const ModelConfig& cfg);

// Also runs cfg.validate().
Expected<ModelConfig> model_config_from_json(const nlohmann::json& j);

}  // namespace xd
