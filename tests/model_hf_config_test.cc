// ModelConfig <-> HF Mixtral config.json (model/hf_config.h).
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <gtest/gtest.h>
#include <limits>
#include <set>

#include "common/atomic_file.h"
#include "model/checkpoint.h"
#include "model/hf_config.h"
#include "model/param_layout.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace test_util;

// ---------------------------------------------------------------- config.json

TEST(HfConfig, EveryFieldRoundTripsExactly) {
  const ModelConfig c = small_config();
  json j = json::parse(model_config_to_json(c).dump(2));  // through text, like config.json
  Expected<ModelConfig> back = model_config_from_json(j);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(back->vocab_size, c.vocab_size);
  EXPECT_EQ(back->hidden_size, c.hidden_size);
  EXPECT_EQ(back->num_layers, c.num_layers);
  EXPECT_EQ(back->num_heads, c.num_heads);
  EXPECT_EQ(back->num_kv_heads, c.num_kv_heads);
  EXPECT_EQ(back->max_seq_len, c.max_seq_len);
  EXPECT_EQ(back->num_experts, c.num_experts);
  EXPECT_EQ(back->top_k, c.top_k);
  EXPECT_EQ(back->expert_intermediate_size, c.expert_intermediate_size);
  EXPECT_EQ(back->num_shared_experts, c.num_shared_experts);
  EXPECT_EQ(back->shared_intermediate_size, c.shared_intermediate_size);
  EXPECT_EQ(back->gating, c.gating);
  EXPECT_EQ(back->capacity_factor, c.capacity_factor);
  EXPECT_EQ(back->aux_loss_coef, c.aux_loss_coef);
  EXPECT_EQ(back->z_loss_coef, c.z_loss_coef);
  EXPECT_EQ(back->rope_theta, c.rope_theta);
  EXPECT_EQ(back->rms_norm_eps, c.rms_norm_eps);
  EXPECT_EQ(back->init_std, c.init_std);
  EXPECT_EQ(back->connectivity, c.connectivity);
}

TEST(HfConfig, EveryRoutersKeysRoundTripAndItsTensorsLoadBack) {
  for (Gating g : {Gating::kGShardNoisyTopK, Gating::kXMoe, Gating::kSoftMoe}) {
    ModelConfig c = small_config();
    c.gating = g;
    c.router_dim = g == Gating::kXMoe ? 3 : 0;
    c.soft_moe_slots = g == Gating::kSoftMoe ? 2 : 1;
    const json j = model_config_to_json(c);
    EXPECT_EQ(j.contains("xdmoe_router_dim"), g == Gating::kXMoe) << gating_name(g);
    EXPECT_EQ(j.contains("xdmoe_soft_moe_slots"), g == Gating::kSoftMoe) << gating_name(g);
    Expected<ModelConfig> back = model_config_from_json(json::parse(j.dump()));
    ASSERT_TRUE(back) << back.status().to_string();
    EXPECT_EQ(back->gating, g);
    EXPECT_EQ(back->router_rows(), c.router_rows()) << gating_name(g);
    EXPECT_EQ(back->soft_moe_slots, c.soft_moe_slots);

    TempDir tmp;
    ParamLayout layout(c);
    std::vector<float> params(layout.size());
    for (size_t i = 0; i < params.size(); ++i) params[i] = 0.001f * float(i % 997);
    ASSERT_TRUE(save_checkpoint(tmp / "ck", layout, params.data(), nullptr, nullptr, 0, TrainerState{}).is_ok());
    Expected<CheckpointData> d = load_checkpoint(tmp / "ck");
    ASSERT_TRUE(d) << gating_name(g) << ": " << d.status().to_string();
    EXPECT_EQ(d->config.gating, g);
    EXPECT_EQ(d->params, params) << gating_name(g);
    const std::string moe = "model.layers.0.block_sparse_moe.";
    const int64_t E = c.num_experts, dim = c.hidden_size;
    const std::vector<int64_t> gate_shape = g == Gating::kXMoe      ? std::vector<int64_t>{3, dim}
                                            : g == Gating::kSoftMoe ? std::vector<int64_t>{E * 2, dim}
                                                                    : std::vector<int64_t>{E, dim};
    ASSERT_NE(layout.find(moe + "gate.weight"), nullptr);
    EXPECT_EQ(layout.find(moe + "gate.weight")->shape, gate_shape) << gating_name(g);
    EXPECT_EQ(layout.find(moe + "gate_noise.weight") != nullptr, g == Gating::kGShardNoisyTopK);
    EXPECT_EQ(layout.find(moe + "gate_experts.weight") != nullptr, g == Gating::kXMoe);
    if (g == Gating::kXMoe) {
      EXPECT_EQ(layout.find(moe + "gate_experts.weight")->shape, (std::vector<int64_t>{E, 3}));
      EXPECT_EQ(layout.find(moe + "gate_log_scale")->shape, (std::vector<int64_t>{1}));
    }
  }
  ModelConfig bad = small_config();
  bad.soft_moe_slots = 0;
  EXPECT_NE(bad.validate().to_string().find("soft_moe_slots"), std::string::npos);
  bad = small_config();
  bad.router_dim = -1;
  EXPECT_NE(bad.validate().to_string().find("router_dim"), std::string::npos);
}

TEST(HfConfig, UsesMixtralKeys) {
  json j = model_config_to_json(small_config());
  EXPECT_EQ(j["architectures"], json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["intermediate_size"], 24);
  EXPECT_EQ(j["num_hidden_layers"], 2);
  EXPECT_EQ(j["num_local_experts"], 4);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["max_position_embeddings"], 24);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["torch_dtype"], "float32");
  EXPECT_EQ(j["xdmoe_gating"], gating_name(Gating::kSigmoidTopK));
  EXPECT_EQ(j["xdmoe_connectivity"][1], connectivity_name(Connectivity::kFarSkip));
}

TEST(HfConfig, MissingOrIllTypedKeyIsNamed) {
  json j = model_config_to_json(small_config());
  j.erase("hidden_size");
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"\"hidden_size\"", "missing"}));
  j = model_config_to_json(small_config());
  j["num_local_experts"] = "eight";
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"\"num_local_experts\"", "string"}));
  j = model_config_to_json(small_config());
  j["num_local_experts"] = 4.5;
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"\"num_local_experts\""}));
  j = model_config_to_json(small_config());
  j["vocab_size"] = uint64_t{1} << 40;
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"\"vocab_size\""}));
  j = model_config_to_json(small_config());
  j["xdmoe_connectivity"] = json::array({"regular", 3});
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"xdmoe_connectivity[1]"}));
  j = model_config_to_json(small_config());
  j["xdmoe_gating"] = "no_such_gating";
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"xdmoe_gating"}));
  EXPECT_FALSE(model_config_from_json(json::array()).has_value());
}

TEST(HfConfig, SettingsXdmoeCannotHonourAreRejected) {
  json j = model_config_to_json(small_config());
  j["tie_word_embeddings"] = true;
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"tie_word_embeddings"}));
  j = model_config_to_json(small_config());
  j["sliding_window"] = 4;
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"sliding_window"}));
  j = model_config_to_json(small_config());
  j["model_type"] = "llama";
  EXPECT_TRUE(has_message(model_config_from_json(j).status(), {"model_type", "llama"}));
}

TEST(HfConfig, InvalidConfigFailsValidation) {
  json j = model_config_to_json(small_config());
  j["num_experts_per_tok"] = 9;  // more than the 4 experts
  EXPECT_FALSE(model_config_from_json(j).has_value());
}

TEST(HfConfig, PlainHfMixtralConfigLoadsWithMixtralSemantics) {
  // transformers' Mixtral-8x7B config.json, shrunk.
  json j = json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 112, "max_position_embeddings": 128, "model_type": "mixtral",
    "num_attention_heads": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 8, "output_router_logits": false,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 320})");
  Expected<ModelConfig> c = model_config_from_json(j);
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->expert_intermediate_size, 112);
  EXPECT_EQ(c->gating, Gating::kSoftmaxTopK);
  EXPECT_EQ(c->num_shared_experts, 0);
  EXPECT_EQ(c->capacity_factor, 0.0);
  EXPECT_TRUE(c->connectivity.empty());
  EXPECT_EQ(c->rope_theta, 1e6);
}

}  // namespace
}  // namespace xd
