#include "model/hf_config.h"

#include <climits>

namespace xd {
namespace {

using nlohmann::json;

std::string describe(const json& v) {
  std::string d = v.dump();
  if (d.size() > 40) d = d.substr(0, 37) + "...";
  return std::string(v.type_name()) + " " + d;
}

Status missing(const char* key) {
  return Status::invalid_argument("config key \"" + std::string(key) + "\" is missing");
}

Status ill_typed(const char* key, const char* want, const json& got) {
  return Status::invalid_argument("config key \"" + std::string(key) + "\" must be " + want +
                                  ", got " + describe(got));
}

// Each getter leaves *out untouched when the key is absent and !required.
Status get_int(const json& j, const char* key, bool required, int* out) {
  auto it = j.find(key);
  if (it == j.end()) return required ? missing(key) : Status::ok();
  bool fits = (it->is_number_unsigned() && it->get<uint64_t>() <= INT_MAX) ||
              (it->is_number_integer() && !it->is_number_unsigned() &&
               it->get<int64_t>() >= INT_MIN && it->get<int64_t>() <= INT_MAX);
  if (!fits) return ill_typed(key, "an integer that fits in int", *it);
  *out = it->get<int>();
  return Status::ok();
}

Status get_double(const json& j, const char* key, bool required, double* out) {
  auto it = j.find(key);
  if (it == j.end()) return required ? missing(key) : Status::ok();
  if (!it->is_number()) return ill_typed(key, "a number", *it);
  *out = it->get<double>();
  return Status::ok();
}

Status get_string(const json& j, const char* key, bool required, std::string* out) {
  auto it = j.find(key);
  if (it == j.end()) return required ? missing(key) : Status::ok();
  if (!it->is_string()) return ill_typed(key, "a string", *it);
  *out = it->get<std::string>();
  return Status::ok();
}

// Rejects Mixtral settings our model cannot reproduce.
Status check_hf_extras(const json& j, const ModelConfig& cfg) {
  std::string model_type;
  XD_RETURN_IF_ERROR(get_string(j, "model_type", true, &model_type));
  if (model_type != "mixtral")
    return Status::invalid_argument("config key \"model_type\" is \"" + model_type +
                                    "\", only \"mixtral\" is supported");
  if (auto it = j.find("tie_word_embeddings"); it != j.end()) {
    if (!it->is_boolean()) return ill_typed("tie_word_embeddings", "a boolean", *it);
    if (it->get<bool>())
      return Status::invalid_argument(
          "config key \"tie_word_embeddings\" is true; xdmoe keeps a separate lm_head");
  }
  std::string act = "silu";
  XD_RETURN_IF_ERROR(get_string(j, "hidden_act", false, &act));
  if (act != "silu")
    return Status::invalid_argument("config key \"hidden_act\" is \"" + act +
                                    "\", only \"silu\" is supported");
  if (auto it = j.find("sliding_window"); it != j.end() && !it->is_null()) {
    int window = 0;
    XD_RETURN_IF_ERROR(get_int(j, "sliding_window", true, &window));
    // A window covering every position is no window at all.
    if (window < cfg.max_seq_len)
      return Status::invalid_argument("config key \"sliding_window\" is " +
                                      std::to_string(window) +
                                      "; sliding-window attention is not supported");
  }
  if (auto it = j.find("head_dim"); it != j.end() && !it->is_null()) {
    int head_dim = 0;
    XD_RETURN_IF_ERROR(get_int(j, "head_dim", true, &head_dim));
    if (cfg.num_heads > 0 && head_dim != cfg.head_dim())
      return Status::invalid_argument("config key \"head_dim\" is " + std::to_string(head_dim) +
                                      " but hidden_size / num_attention_heads is " +
                                      std::to_string(cfg.head_dim()));
  }
  return Status::ok();
}

Status read_xdmoe_keys(const json& j, ModelConfig* cfg) {
  std::string gating;
  XD_RETURN_IF_ERROR(get_string(j, "xdmoe_gating", false, &gating));
  if (!gating.empty()) {
    Expected<Gating> g = parse_gating(gating);
    if (!g) return g.status().with_context("config key \"xdmoe_gating\"");
    cfg->gating = *g;
  }
  XD_RETURN_IF_ERROR(get_double(j, "xdmoe_capacity_factor", false, &cfg->capacity_factor));
  XD_RETURN_IF_ERROR(get_double(j, "xdmoe_z_loss_coef", false, &cfg->z_loss_coef));
  XD_RETURN_IF_ERROR(get_int(j, "xdmoe_num_shared_experts", false, &cfg->num_shared_experts));
  XD_RETURN_IF_ERROR(
      get_int(j, "xdmoe_shared_intermediate_size", false, &cfg->shared_intermediate_size));
  // HF's name for the init std, overridden by ours when both are present.
  XD_RETURN_IF_ERROR(get_double(j, "initializer_range", false, &cfg->init_std));
  XD_RETURN_IF_ERROR(get_double(j, "xdmoe_init_std", false, &cfg->init_std));
  XD_RETURN_IF_ERROR(get_double(j, "xdmoe_expert_init_spread", false, &cfg->expert_init_spread));
  XD_RETURN_IF_ERROR(get_int(j, "xdmoe_router_dim", false, &cfg->router_dim));
  XD_RETURN_IF_ERROR(get_int(j, "xdmoe_soft_moe_slots", false, &cfg->soft_moe_slots));

  if (auto it = j.find("xdmoe_connectivity"); it != j.end()) {
    if (!it->is_array()) return ill_typed("xdmoe_connectivity", "a list of names", *it);
    cfg->connectivity.clear();
    for (size_t i = 0; i < it->size(); ++i) {
      const json& e = (*it)[i];
      std::string key = "xdmoe_connectivity[" + std::to_string(i) + "]";
      if (!e.is_string()) return ill_typed(key.c_str(), "a string", e);
      Expected<Connectivity> c = parse_connectivity(e.get<std::string>());
      if (!c) return c.status().with_context("config key \"" + key + "\"");
      cfg->connectivity.push_back(*c);
    }
  }
  return Status::ok();
}

}  // namespace

json model_config_to_json(const ModelConfig& cfg) {
  json j;
  j["architectures"] = json::array({"MixtralForCausalLM"});
  j["model_type"] = "mixtral";
  j["torch_dtype"] = "float32";
  j["vocab_size"] = cfg.vocab_size;
  j["hidden_size"] = cfg.hidden_size;
  j["intermediate_size"] = cfg.expert_intermediate_size;
  j["num_hidden_layers"] = cfg.num_layers;
  j["num_attention_heads"] = cfg.num_heads;
  j["num_key_value_heads"] = cfg.num_kv_heads;
  if (cfg.num_heads > 0) j["head_dim"] = cfg.head_dim();
  j["num_local_experts"] = cfg.num_experts;
  j["num_experts_per_tok"] = cfg.top_k;
  j["rms_norm_eps"] = cfg.rms_norm_eps;
  j["rope_theta"] = cfg.rope_theta;
  j["max_position_embeddings"] = cfg.max_seq_len;
  j["tie_word_embeddings"] = false;
  j["router_aux_loss_coef"] = cfg.aux_loss_coef;
  j["hidden_act"] = "silu";
  j["sliding_window"] = nullptr;
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = cfg.init_std;

  j["xdmoe_gating"] = gating_name(cfg.gating);
  j["xdmoe_capacity_factor"] = cfg.capacity_factor;
  j["xdmoe_z_loss_coef"] = cfg.z_loss_coef;
  j["xdmoe_num_shared_experts"] = cfg.num_shared_experts;
  j["xdmoe_shared_intermediate_size"] = cfg.shared_intermediate_size;
  j["xdmoe_init_std"] = cfg.init_std;
  j["xdmoe_expert_init_spread"] = cfg.expert_init_spread;
  if (cfg.gating == Gating::kXMoe) j["xdmoe_router_dim"] = cfg.resolved_router_dim();
  if (cfg.gating == Gating::kSoftMoe) j["xdmoe_soft_moe_slots"] = cfg.soft_moe_slots;
  // Written as stored: an empty list keeps meaning "every layer regular".
  json conn = json::array();
  for (Connectivity c : cfg.connectivity) conn.push_back(connectivity_name(c));
  j["xdmoe_connectivity"] = std::move(conn);
  return j;
}

Expected<ModelConfig> model_config_from_json(const json& j) {
  if (!j.is_object()) return Status::invalid_argument("config is not a JSON object");
  ModelConfig cfg;
  try {
    XD_RETURN_IF_ERROR(get_int(j, "vocab_size", true, &cfg.vocab_size));
    XD_RETURN_IF_ERROR(get_int(j, "hidden_size", true, &cfg.hidden_size));
    XD_RETURN_IF_ERROR(get_int(j, "intermediate_size", true, &cfg.expert_intermediate_size));
    XD_RETURN_IF_ERROR(get_int(j, "num_hidden_layers", true, &cfg.num_layers));
    XD_RETURN_IF_ERROR(get_int(j, "num_attention_heads", true, &cfg.num_heads));
    XD_RETURN_IF_ERROR(get_int(j, "num_key_value_heads", true, &cfg.num_kv_heads));
    XD_RETURN_IF_ERROR(get_int(j, "num_local_experts", true, &cfg.num_experts));
    XD_RETURN_IF_ERROR(get_int(j, "num_experts_per_tok", true, &cfg.top_k));
    XD_RETURN_IF_ERROR(get_int(j, "max_position_embeddings", true, &cfg.max_seq_len));
    XD_RETURN_IF_ERROR(get_double(j, "rms_norm_eps", true, &cfg.rms_norm_eps));
    XD_RETURN_IF_ERROR(get_double(j, "rope_theta", true, &cfg.rope_theta));
    XD_RETURN_IF_ERROR(get_double(j, "router_aux_loss_coef", true, &cfg.aux_loss_coef));
    XD_RETURN_IF_ERROR(check_hf_extras(j, cfg));
    XD_RETURN_IF_ERROR(read_xdmoe_keys(j, &cfg));
  } catch (const json::exception& e) {  // type checks precede every get; belt and braces
    return Status::invalid_argument(std::string("config: ") + e.what());
  }
  XD_RETURN_IF_ERROR(cfg.validate().with_context("config"));
  return cfg;
}

}  // namespace xd
