#include "model/train_config.h"

#include "common/atomic_file.h"
#include "common/yaml_reader.h"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

namespace xd {

TrainConfig default_train_config() {
  TrainConfig c;
  ModelConfig& m = c.model;
  m.vocab_size = 256;
  m.hidden_size = 128;
  m.num_layers = 4;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.max_seq_len = 64;
  m.num_experts = 8;
  m.top_k = 2;
  m.expert_intermediate_size = 256;
  m.num_shared_experts = 1;
  m.shared_intermediate_size = 256;
  return c;
}

Status TrainConfig::validate() const {
  XD_RETURN_IF_ERROR(model.validate());
  auto bad = [](const std::string& k, const std::string& why) {
    return Status::invalid_argument(k + ": " + why);
  };
  if (steps <= 0) return bad("train.steps", "must be positive");
  if (batch_size <= 0) return bad("train.batch_size", "must be positive");
  if (seq_len <= 0 || seq_len > model.max_seq_len)
    return bad("train.seq_len", "must be in 1..model.max_seq_len (" +
                                    std::to_string(model.max_seq_len) + ")");
  if (!(optimizer.learning_rate > 0)) return bad("train.learning_rate", "must be positive");
  if (!(min_learning_rate >= 0) || min_learning_rate > optimizer.learning_rate)
    return bad("train.min_learning_rate", "must be in [0, learning_rate]");
  if (warmup_steps < 0) return bad("train.warmup_steps", "must be >= 0");
  if (!(optimizer.beta1 >= 0 && optimizer.beta1 < 1)) return bad("train.beta1", "must be in [0, 1)");
  if (!(optimizer.beta2 >= 0 && optimizer.beta2 < 1)) return bad("train.beta2", "must be in [0, 1)");
  if (!(optimizer.eps > 0)) return bad("train.eps", "must be positive");
  if (!(optimizer.weight_decay >= 0)) return bad("train.weight_decay", "must be >= 0");
  if (log_every <= 0) return bad("train.log_every", "must be positive");
  if (eval_every < 0) return bad("train.eval_every", "must be >= 0");
  if (eval_batches <= 0) return bad("train.eval_batches", "must be positive");
  if (checkpoint_every < 0) return bad("train.checkpoint_every", "must be >= 0");
  if (max_restarts < 0) return bad("train.max_restarts", "must be >= 0");
  if (nan_policy != "stop" && nan_policy != "skip")
    return bad("train.nan_policy", "must be stop or skip, not '" + nan_policy + "'");
  if ((farskip.attention_only || farskip.moe_only) && !farskip.enabled)
    return bad(farskip.attention_only ? "farskip.attention_only" : "farskip.moe_only", "needs farskip.enabled: true");
  if (farskip.attention_only && farskip.moe_only)
    return bad("farskip", "attention_only and moe_only exclude each other (both off is full FarSkip)");
  if (farskip.enabled) {
    const Connectivity want = farskip.attention_only ? Connectivity::kFarSkipAttention
                              : farskip.moe_only     ? Connectivity::kFarSkipMoe
                                                     : Connectivity::kFarSkip;
    for (int l = 0; l < model.num_layers; ++l)
      if (model.layer_connectivity(l) != want)
        return bad("farskip.enabled", std::string("asks for ") + connectivity_name(want) + " on every layer, but " +
                                          "model.connectivity says " + connectivity_name(model.layer_connectivity(l)) +
                                          " for layer " + std::to_string(l));
  }
  for (int64_t s : trace_steps)
    if (s < 1 || s > steps)
      return bad("train.trace_steps", "step " + std::to_string(s) + " is outside 1.." + std::to_string(steps) +
                                          " (train.steps)");
  if (!trace_steps.empty() && trace_dir.empty()) return bad("train.trace_dir", "must be set to trace steps");
  if (model.vocab_size < 256) return bad("model.vocab_size", "must be >= 256 for byte tokens");
  if (!(data.validation_fraction >= 0 && data.validation_fraction < 0.5))
    return bad("data.validation_fraction", "must be in [0, 0.5)");
  if (data.source == "builtin" && data.builtin_bytes < 4096)
    return bad("data.builtin_bytes", "must be at least 4096");
  return Status::ok();
}

double TrainConfig::learning_rate_at(int64_t step) const {
  const double peak = optimizer.learning_rate;
  if (step < warmup_steps) return peak * (step + 1) / warmup_steps;
  const double progress =
      steps > warmup_steps ? double(step - warmup_steps) / double(steps - warmup_steps) : 1.0;
  return min_learning_rate + 0.5 * (peak - min_learning_rate) * (1 + std::cos(M_PI * std::min(1.0, progress)));
}

namespace {


void read_model(YamlReader& r, const YAML::Node& node, ModelConfig* m) {
  static const std::set<std::string> keys = {
      "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len",
      "num_experts", "top_k", "expert_intermediate_size", "num_shared_experts",
      "shared_intermediate_size", "gating", "capacity_factor", "aux_loss_coef", "z_loss_coef",
      "rope_theta", "rms_norm_eps", "init_std", "expert_init_spread", "connectivity", "router_dim",
      "soft_moe_slots"};
  r.section(node, "model", keys, [&](const std::string& k, const YAML::Node& v, const std::string& key) {
    if (k == "vocab_size") r.get(v, key, &m->vocab_size);
    else if (k == "hidden_size") r.get(v, key, &m->hidden_size);
    else if (k == "num_layers") r.get(v, key, &m->num_layers);
    else if (k == "num_heads") r.get(v, key, &m->num_heads);
    else if (k == "num_kv_heads") r.get(v, key, &m->num_kv_heads);
    else if (k == "max_seq_len") r.get(v, key, &m->max_seq_len);
    else if (k == "num_experts") r.get(v, key, &m->num_experts);
    else if (k == "top_k") r.get(v, key, &m->top_k);
    else if (k == "expert_intermediate_size") r.get(v, key, &m->expert_intermediate_size);
    else if (k == "num_shared_experts") r.get(v, key, &m->num_shared_experts);
    else if (k == "shared_intermediate_size") r.get(v, key, &m->shared_intermediate_size);
    else if (k == "capacity_factor") r.get(v, key, &m->capacity_factor);
    else if (k == "aux_loss_coef") r.get(v, key, &m->aux_loss_coef);
    else if (k == "z_loss_coef") r.get(v, key, &m->z_loss_coef);
    else if (k == "rope_theta") r.get(v, key, &m->rope_theta);
    else if (k == "rms_norm_eps") r.get(v, key, &m->rms_norm_eps);
    else if (k == "init_std") r.get(v, key, &m->init_std);
    else if (k == "expert_init_spread") r.get(v, key, &m->expert_init_spread);
    else if (k == "router_dim") r.get(v, key, &m->router_dim);
    else if (k == "soft_moe_slots") r.get(v, key, &m->soft_moe_slots);
    else if (k == "gating") {
      std::string s;
      r.get(v, key, &s);
      auto g = parse_gating(s);
      if (!g) r.fail(v, key, g.status().message()); else m->gating = *g;
    } else if (k == "connectivity") {
      // One name for every layer, or a list with one name per layer.
      m->connectivity.clear();
      std::vector<YAML::Node> items;
      if (v.IsSequence()) for (const auto& item : v) items.push_back(item);
      else items.push_back(v);
      for (const auto& item : items) {
        std::string s;
        r.get(item, key, &s);
        auto c = parse_connectivity(s);
        if (!c) return r.fail(item, key, c.status().message());
        m->connectivity.push_back(*c);
      }
    }
  });
}

}  // namespace

Status apply_farskip(TrainConfig* c) {
  const FarSkipConfig& f = c->farskip;
  if (!f.enabled || (f.attention_only && f.moe_only)) return c->validate();
  const Connectivity want = f.attention_only ? Connectivity::kFarSkipAttention
                            : f.moe_only     ? Connectivity::kFarSkipMoe
                                             : Connectivity::kFarSkip;
  // Regular layers take the wanted connectivity; any other stays, for
  // validate() to name the contradiction.
  bool contradicts = false;
  for (Connectivity given : c->model.connectivity) contradicts |= given != want && given != Connectivity::kRegular;
  if (!contradicts) c->model.connectivity.assign(c->model.num_layers, want);
  return c->validate();
}

Expected<TrainConfig> parse_train_config(const std::string& text, const std::string& source,
                                         const std::vector<std::string>& other_sections) {
  auto document = load_yaml_document(text, source);
  if (!document) return document.status();
  const YAML::Node root = *document;
  TrainConfig c = default_train_config();
  YamlReader r(source);
  if (root && !root.IsNull() && !root.IsMap())
    return Status::invalid_argument(source + ": the top level must be a mapping");
  std::set<std::string> sections = {"model", "train", "data", "farskip"};
  sections.insert(other_sections.begin(), other_sections.end());
  r.section(root, "config", sections,
            [&](const std::string& k, const YAML::Node& v, const std::string&) {
    if (k == "model") read_model(r, v, &c.model);
    else if (k == "farskip") {
      r.section(v, "farskip", {"enabled", "overlapped", "attention_only", "moe_only"},
                [&](const std::string& k2, const YAML::Node& v2, const std::string& key) {
        if (k2 == "enabled") r.get(v2, key, &c.farskip.enabled);
        else if (k2 == "overlapped") r.get(v2, key, &c.farskip.overlapped);
        else if (k2 == "attention_only") r.get(v2, key, &c.farskip.attention_only);
        else r.get(v2, key, &c.farskip.moe_only);
      });
    } else if (k != "data" && k != "train") return;  // another reader's section
    else if (k == "data") {
      r.section(v, "data", {"source", "builtin_bytes", "builtin_seed", "validation_fraction"},
                [&](const std::string& k2, const YAML::Node& v2, const std::string& key) {
        if (k2 == "source") r.get(v2, key, &c.data.source);
        else if (k2 == "builtin_bytes") r.get(v2, key, &c.data.builtin_bytes);
        else if (k2 == "builtin_seed") r.get(v2, key, &c.data.builtin_seed);
        else r.get(v2, key, &c.data.validation_fraction);
      });
    } else {
      static const std::set<std::string> keys = {
          "steps", "batch_size", "seq_len", "learning_rate", "min_learning_rate",
          "warmup_steps", "beta1", "beta2", "eps", "weight_decay", "grad_clip", "seed",
          "log_every", "eval_every", "eval_batches", "checkpoint_every", "checkpoint_dir", "trace_steps",
          "trace_dir", "max_restarts", "nan_policy"};
      r.section(v, "train", keys, [&](const std::string& k2, const YAML::Node& v2, const std::string& key) {
        if (k2 == "steps") r.get(v2, key, &c.steps);
        else if (k2 == "batch_size") r.get(v2, key, &c.batch_size);
        else if (k2 == "seq_len") r.get(v2, key, &c.seq_len);
        else if (k2 == "learning_rate") r.get(v2, key, &c.optimizer.learning_rate);
        else if (k2 == "min_learning_rate") r.get(v2, key, &c.min_learning_rate);
        else if (k2 == "warmup_steps") r.get(v2, key, &c.warmup_steps);
        else if (k2 == "beta1") r.get(v2, key, &c.optimizer.beta1);
        else if (k2 == "beta2") r.get(v2, key, &c.optimizer.beta2);
        else if (k2 == "eps") r.get(v2, key, &c.optimizer.eps);
        else if (k2 == "weight_decay") r.get(v2, key, &c.optimizer.weight_decay);
        else if (k2 == "grad_clip") r.get(v2, key, &c.optimizer.grad_clip);
        else if (k2 == "seed") r.get(v2, key, &c.seed);
        else if (k2 == "log_every") r.get(v2, key, &c.log_every);
        else if (k2 == "eval_every") r.get(v2, key, &c.eval_every);
        else if (k2 == "eval_batches") r.get(v2, key, &c.eval_batches);
        else if (k2 == "checkpoint_every") r.get(v2, key, &c.checkpoint_every);
        else if (k2 == "trace_dir") r.get(v2, key, &c.trace_dir);
        else if (k2 == "max_restarts") r.get(v2, key, &c.max_restarts);
        else if (k2 == "nan_policy") r.get(v2, key, &c.nan_policy);
        else if (k2 == "trace_steps") {
          if (!v2.IsSequence()) return r.fail(v2, key, "must be a list of steps, e.g. [5, 6]");
          c.trace_steps.clear();
          for (size_t i = 0; i < v2.size(); ++i) {
            int64_t step = 0;
            r.get(v2[i], key + "[" + std::to_string(i) + "]", &step);
            c.trace_steps.push_back(step);
          }
        } else r.get(v2, key, &c.checkpoint_dir);
      });
    }
  });
  XD_RETURN_IF_ERROR(r.status());
  if (c.model.connectivity.size() == 1 && c.model.num_layers > 1)
    c.model.connectivity.assign(c.model.num_layers, c.model.connectivity[0]);
  XD_RETURN_IF_ERROR(apply_farskip(&c).with_context(source));  // and validates
  return c;
}

Expected<TrainConfig> load_train_config(const std::string& path) {
  auto text = read_file(path);
  if (!text) return text.status().with_context("cannot read config");
  return parse_train_config(*text, path);
}

}  // namespace xd
