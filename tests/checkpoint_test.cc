// Safetensors I/O, HF config.json mapping, atomic checkpoints, python interop.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <gtest/gtest.h>
#include <limits>
#include <random>
#include <set>

#include "model/checkpoint.h"
#include "common/atomic_file.h"
#include "model/hf_config.h"
#include "model/param_layout.h"
#include "model/safetensors.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> seq{0};
    path_ = (fs::temp_directory_path() /
             ("xdmoe_ckpt_test_" + std::to_string(::getpid()) + "_" + std::to_string(seq++)))
                .string();
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string slurp(const std::string& path) { return read_file(path).value(); }

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A hand-made safetensors file: `header` JSON verbatim, then `data`.
std::string raw_file(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  return out + header + data;
}

::testing::AssertionResult has_message(const Status& st, std::initializer_list<std::string> parts) {
  if (st.is_ok()) return ::testing::AssertionFailure() << "status is OK";
  for (const std::string& p : parts)
    if (st.message().find(p) == std::string::npos)
      return ::testing::AssertionFailure() << "\"" << st.to_string() << "\" lacks \"" << p << "\"";
  return ::testing::AssertionSuccess();
}

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 24;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_intermediate_size = 24;
  c.num_shared_experts = 1;
  c.shared_intermediate_size = 8;
  c.gating = Gating::kSigmoidTopK;
  c.capacity_factor = 1.25;
  c.aux_loss_coef = 0.02;
  c.z_loss_coef = 1e-3 / 3;
  c.rope_theta = 1e6;
  c.rms_norm_eps = 1e-6;
  c.init_std = 0.017;
  c.connectivity = {Connectivity::kRegular, Connectivity::kFarSkip};
  return c;
}

// Random values plus the awkward ones: -0, denormals, inf, a NaN payload.
std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  const float special[] = {-0.0f, std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::infinity(),
                           std::bit_cast<float>(0x7fc12345u)};
  for (size_t i = 0; i < std::size(special) && i < n; ++i) v[i * 7 % n] = special[i];
  return v;
}

bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---------------------------------------------------------------- safetensors

TEST(Safetensors, EveryDtypeRoundTripsBitForBitWithMetadata) {
  TempDir tmp;
  const std::vector<float> f32 = {1.5f, -0.0f, 3.25f, 1e-40f, 7.0f, -8.5f};
  const std::vector<double> f64 = {1.0 / 3.0, -2.5e300};
  const std::vector<uint16_t> bf16 = {0x3fc0, 0xc010, 0x4040};  // 1.5, -2.25, 3.0
  const std::vector<int64_t> i64 = {1, -2, INT64_MAX};
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path,
                                {{"b", Dtype::kBF16, {3}, bf16.data()},
                                 {"a", Dtype::kF32, {2, 3}, f32.data()},
                                 {"d", Dtype::kF64, {1, 2}, f64.data()},
                                 {"i", Dtype::kI64, {3}, i64.data()},
                                 {"empty", Dtype::kF32, {0, 4}, nullptr}},
                                {{"format", "pt"}, {"note", "hi"}})
                  .is_ok());
  Expected<SafetensorsFile> f = SafetensorsFile::open(path);
  ASSERT_TRUE(f) << f.status().to_string();
  EXPECT_EQ(f->names(), (std::vector<std::string>{"b", "a", "d", "i", "empty"}));
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("note"), "hi");
  const TensorInfo* a = f->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, Dtype::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(a->data, f32.data(), 24), 0);
  EXPECT_EQ(std::memcmp(f->find("d")->data, f64.data(), 16), 0);
  EXPECT_EQ(std::memcmp(f->find("b")->data, bf16.data(), 6), 0);
  EXPECT_EQ(std::memcmp(f->find("i")->data, i64.data(), 24), 0);
  EXPECT_EQ(f->find("empty")->numel(), 0);
  EXPECT_EQ(f->find("nope"), nullptr);
}

TEST(Safetensors, DataBufferStartsEightByteAligned) {
  TempDir tmp;
  const float x = 1.0f;
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"x", Dtype::kF32, {}, &x}}).is_ok());
  std::string bytes = slurp(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 4);
  EXPECT_EQ(bytes[8], '{');
}

TEST(Safetensors, ReadF32ConvertsBf16F16AndF64) {
  TempDir tmp;
  const std::vector<uint16_t> bf16 = {0x3fc0, 0xc010};
  const std::vector<uint16_t> f16 = {0x3e00, 0xc100, 0x0001, 0x7c00};  // 1.5 -2.5 2^-24 inf
  const std::vector<double> f64 = {0.25, -1e10};
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"b", Dtype::kBF16, {2}, bf16.data()},
                                       {"h", Dtype::kF16, {4}, f16.data()},
                                       {"d", Dtype::kF64, {2}, f64.data()}})
                  .is_ok());
  SafetensorsFile f = SafetensorsFile::open(path).value();
  float out[4];
  ASSERT_TRUE(f.read_f32("b", {2}, out).is_ok());
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -2.25f);
  ASSERT_TRUE(f.read_f32("h", {4}, out).is_ok());
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -2.5f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(out[3]));
  ASSERT_TRUE(f.read_f32("d", {2}, out).is_ok());
  EXPECT_EQ(out[0], 0.25f);
  EXPECT_EQ(out[1], -1e10f);
}

TEST(Safetensors, TruncatedFileIsRejectedWithAReason) {
  TempDir tmp;
  const std::vector<float> v(16, 2.0f);
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"weight", Dtype::kF32, {16}, v.data()}}).is_ok());
  std::string bytes = slurp(path);
  spit(path, bytes.substr(0, bytes.size() - 5));
  Status st = SafetensorsFile::open(path).status();
  EXPECT_EQ(st.code(), Status::Code::kCorruption);
  EXPECT_TRUE(has_message(st, {path, "\"weight\"", "truncated"}));

  spit(path, bytes.substr(0, 20));  // cut inside the header
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "truncated"}));
  spit(path, bytes.substr(0, 3));  // cut inside the length field
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "truncated"}));
}

TEST(Safetensors, CorruptHeaderJsonIsRejectedWithAReason) {
  TempDir tmp;
  const std::string path = tmp / "t.safetensors";
  spit(path, raw_file("{\"a\": {\"dtype\": \"F32\", ", std::string(8, '\0')));
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "bad header JSON"}));
  spit(path, raw_file("[1, 2]", ""));
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "not an object"}));
  uint64_t huge = uint64_t{1} << 62;
  spit(path, std::string(reinterpret_cast<const char*>(&huge), 8) + "{}");
  EXPECT_TRUE(has_message(SafetensorsFile::open(path).status(), {path, "header length"}));
}

TEST(Safetensors, MalformedTensorEntriesAreRejectedNamingTheTensor) {
  TempDir tmp;
  const std::string path = tmp / "t.safetensors";
  const std::string data(16, '\0');
  struct Case {
    const char* header;
    std::vector<std::string> expect;
  } cases[] = {
      {R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", {"\"w\"", "needs 12"}},
      {R"({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})", {"\"w\"", "past"}},
      {R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", {"\"w\"", "Q4"}},
      {R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", {"\"w\"", "shape"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8]}})", {"\"w\"", "data_offsets"}},
      {R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", {"\"w\"", "dtype"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       {"\"w\"", "\"v\"", "overlap"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       {"\"w\"", "twice"}},
      {R"({"__metadata__": {"step": 3}})", {"\"step\"", "not a string"}},
      {R"({"w": {"dtype": "F32", "shape": [1e30], "data_offsets": [0, 8]}})", {"\"w\"", "shape"}},
  };
  for (const Case& c : cases) {
    spit(path, raw_file(c.header, data));
    Status st = SafetensorsFile::open(path).status();
    EXPECT_EQ(st.code(), Status::Code::kCorruption) << c.header;
    EXPECT_TRUE(has_message(st, {path})) << c.header;
    for (const std::string& e : c.expect) EXPECT_TRUE(has_message(st, {e})) << c.header;
  }
}

TEST(Safetensors, WrongShapeNamesBothShapes) {
  TempDir tmp;
  const std::vector<float> v(6, 1.0f);
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"w", Dtype::kF32, {2, 3}, v.data()}}).is_ok());
  SafetensorsFile f = SafetensorsFile::open(path).value();
  float out[6];
  Status st = f.read_f32("w", {3, 2}, out);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(has_message(st, {path, "\"w\"", "[2, 3]", "[3, 2]"}));
}

TEST(Safetensors, MissingTensorIsNotFoundAndNamed) {
  TempDir tmp;
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {}).is_ok());
  float out;
  Status st = SafetensorsFile::open(path).value().read_f32("lm_head.weight", {}, &out);
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(has_message(st, {path, "lm_head.weight"}));
}

TEST(Safetensors, IntegerTensorIsNotReadAsFloat) {
  TempDir tmp;
  const int64_t v[2] = {1, 2};
  const std::string path = tmp / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"ids", Dtype::kI64, {2}, v}}).is_ok());
  float out[2];
  Status st = SafetensorsFile::open(path).value().read_f32("ids", {2}, out);
  EXPECT_TRUE(has_message(st, {"\"ids\"", "I64"}));
}

TEST(Safetensors, MissingFileIsNotFound) {
  TempDir tmp;
  Status st = SafetensorsFile::open(tmp / "absent.safetensors").status();
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(has_message(st, {"absent.safetensors"}));
}

TEST(Safetensors, WriterRefusesDuplicateAndReservedNames) {
  TempDir tmp;
  const float x = 0;
  EXPECT_TRUE(has_message(write_safetensors(tmp / "t", {{"a", Dtype::kF32, {}, &x},
                                                         {"a", Dtype::kF32, {}, &x}}),
                          {"\"a\"", "duplicate"}));
  EXPECT_FALSE(write_safetensors(tmp / "t", {{"__metadata__", Dtype::kF32, {}, &x}}).is_ok());
  EXPECT_FALSE(fs::exists(tmp / "t"));
}

TEST(AtomicFile, ReplacesTheFileAndLeavesNoTempBehind) {
  TempDir tmp;
  const std::string path = tmp / "f";
  ASSERT_TRUE(write_file_atomic(path, "old", 3).is_ok());
  ASSERT_TRUE(write_file_atomic(path, "new!", 4).is_ok());
  EXPECT_EQ(slurp(path), "new!");
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()), 1);
  EXPECT_TRUE(has_message(write_file_atomic(tmp / "no/such/dir/f", "x", 1),
                          {"no/such/dir"}));
}

TEST(AtomicFile, ParentDirHandlesBareNamesRootAndTrailingSlashes) {
  EXPECT_EQ(parent_dir("a/b/c"), "a/b");
  EXPECT_EQ(parent_dir("c"), ".");
  EXPECT_EQ(parent_dir("/c"), "/");
  EXPECT_EQ(parent_dir("a/b/"), "a");
}

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

// ---------------------------------------------------------------- checkpoints

struct Saved {
  ParamLayout layout{small_config()};
  std::vector<float> params = random_floats(layout.size(), 1);
  std::vector<float> m = random_floats(layout.size(), 2);
  std::vector<float> v = random_floats(layout.size(), 3);
  TrainerState trainer{1234, (uint64_t{1} << 63) + 5, 0xdeadbeefcafef00dull, 2.718281828459045};
};

TEST(Checkpoint, ParamsAndOptimizerStateRoundTripBitIdentically) {
  TempDir tmp;
  Saved s;
  const std::string dir = tmp / "step_000100";
  ASSERT_TRUE(save_checkpoint(dir, s.layout, s.params.data(), s.m.data(), s.v.data(), 99,
                              s.trainer)
                  .is_ok());
  Expected<CheckpointData> d = load_checkpoint(dir);
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_TRUE(bit_identical(d->params, s.params));
  ASSERT_TRUE(d->has_optimizer);
  EXPECT_TRUE(bit_identical(d->adam_m, s.m));
  EXPECT_TRUE(bit_identical(d->adam_v, s.v));
  EXPECT_EQ(d->adam_step, 99);
  EXPECT_EQ(d->trainer.step, s.trainer.step);
  EXPECT_EQ(d->trainer.data_position, s.trainer.data_position);
  EXPECT_EQ(d->trainer.seed, s.trainer.seed);
  EXPECT_EQ(d->trainer.last_loss, s.trainer.last_loss);
  EXPECT_EQ(d->config.connectivity, small_config().connectivity);
  EXPECT_EQ(d->config.num_shared_experts, 1);
}

TEST(Checkpoint, DirectoryHoldsHfStyleFiles) {
  TempDir tmp;
  Saved s;
  const std::string dir = tmp / "ck";
  ASSERT_TRUE(save_checkpoint(dir + "/", s.layout, s.params.data(), s.m.data(), s.v.data(), 1,
                              s.trainer)
                  .is_ok());
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.insert(e.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{"model.safetensors", "config.json",
                                          "optimizer.safetensors", "trainer_state.json"}));
  SafetensorsFile model = SafetensorsFile::open(dir + "/model.safetensors").value();
  EXPECT_EQ(model.metadata().at("format"), "pt");
  EXPECT_EQ(model.names().size(), s.layout.slots().size());
  const TensorInfo* w2 = model.find("model.layers.1.block_sparse_moe.experts.3.w2.weight");
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{16, 24}));
  SafetensorsFile opt = SafetensorsFile::open(dir + "/optimizer.safetensors").value();
  EXPECT_NE(opt.find("exp_avg_sq.lm_head.weight"), nullptr);
  EXPECT_EQ(opt.metadata().at("step"), "1");
  json config = json::parse(slurp(dir + "/config.json"));
  EXPECT_EQ(config["model_type"], "mixtral");
}

TEST(Checkpoint, WithoutOptimizerLoadsWithoutOptimizer) {
  TempDir tmp;
  Saved s;
  s.trainer.last_loss = std::numeric_limits<double>::infinity();
  ASSERT_TRUE(
      save_checkpoint(tmp / "c", s.layout, s.params.data(), nullptr, nullptr, 0, s.trainer).is_ok());
  EXPECT_FALSE(fs::exists(tmp / "c/optimizer.safetensors"));
  CheckpointData d = load_checkpoint(tmp / "c").value();
  EXPECT_FALSE(d.has_optimizer);
  EXPECT_TRUE(d.adam_m.empty());
  EXPECT_TRUE(bit_identical(d.params, s.params));
  EXPECT_TRUE(std::isnan(d.trainer.last_loss));  // JSON cannot hold inf
}

TEST(Checkpoint, SaveReplacesAnOldCheckpointAndLeavesNoTempDir) {
  TempDir tmp;
  Saved s;
  const std::string dir = tmp / "step_000001";
  ASSERT_TRUE(save_checkpoint(dir, s.layout, s.params.data(), s.m.data(), s.v.data(), 1,
                              s.trainer)
                  .is_ok());
  std::vector<float> newer = random_floats(s.layout.size(), 42);
  ASSERT_TRUE(
      save_checkpoint(dir, s.layout, newer.data(), nullptr, nullptr, 0, s.trainer).is_ok());
  CheckpointData d = load_checkpoint(dir).value();
  EXPECT_TRUE(bit_identical(d.params, newer));
  EXPECT_FALSE(d.has_optimizer);  // nothing of the old directory survives
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp.path()))
    names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"step_000001"});
}

TEST(Checkpoint, PartialLayoutOrOneMomentIsRefused) {
  TempDir tmp;
  Saved s;
  ParamLayout half(small_config(), 2, 2);
  std::vector<float> p(half.size());
  EXPECT_TRUE(has_message(save_checkpoint(tmp / "c", half, p.data(), nullptr, nullptr, 0, {}),
                          {"experts [2, 4)"}));
  EXPECT_FALSE(save_checkpoint(tmp / "c", s.layout, s.params.data(), s.m.data(), nullptr, 0, {})
                   .is_ok());
  EXPECT_FALSE(fs::exists(tmp / "c"));
}

// Saves a checkpoint, then lets `mutate` damage it; returns the load status.
template <typename F>
Status load_after(F mutate) {
  TempDir tmp;
  Saved s;
  const std::string dir = tmp / "c";
  XD_CHECK(save_checkpoint(dir, s.layout, s.params.data(), s.m.data(), s.v.data(), 5, s.trainer)
               .is_ok());
  mutate(dir, s.layout, s.params);
  return load_checkpoint(dir).status();
}

// Rewrites `file` in `dir` with the layout's tensors, transformed by `edit`.
void rewrite(const std::string& path, const ParamLayout& layout, const std::vector<float>& p,
             const std::function<void(std::vector<SafetensorsEntry>&)>& edit) {
  std::vector<SafetensorsEntry> e;
  for (const TensorSlot& s : layout.slots())
    e.push_back({s.name, Dtype::kF32, s.shape, p.data() + s.offset});
  edit(e);
  XD_CHECK(write_safetensors(path, e).is_ok());
}

TEST(Checkpoint, MissingTensorIsNamed) {
  const std::string victim = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
  Status st = load_after([&](const std::string& dir, const ParamLayout& l,
                             const std::vector<float>& p) {
    rewrite(dir + "/model.safetensors", l, p, [&](std::vector<SafetensorsEntry>& e) {
      std::erase_if(e, [&](const SafetensorsEntry& x) { return x.name == victim; });
    });
  });
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(has_message(st, {"model.safetensors", victim}));
}

TEST(Checkpoint, WrongShapeIsNamedWithBothShapes) {
  Status st = load_after([](const std::string& dir, const ParamLayout& l,
                            const std::vector<float>& p) {
    rewrite(dir + "/model.safetensors", l, p, [](std::vector<SafetensorsEntry>& e) {
      for (SafetensorsEntry& x : e)
        if (x.name == "model.layers.0.self_attn.k_proj.weight") x.shape = {16, 8};
    });
  });
  EXPECT_TRUE(has_message(st, {"model.layers.0.self_attn.k_proj.weight", "[16, 8]", "[8, 16]"}));
}

TEST(Checkpoint, TensorOutsideTheLayoutIsRejected) {
  const float extra[1] = {1};
  Status st = load_after([&](const std::string& dir, const ParamLayout& l,
                             const std::vector<float>& p) {
    rewrite(dir + "/model.safetensors", l, p, [&](std::vector<SafetensorsEntry>& e) {
      e.push_back({"model.layers.0.block_sparse_moe.experts.9.w1.weight", Dtype::kF32, {1}, extra});
    });
  });
  EXPECT_TRUE(has_message(st, {"unexpected tensor", "experts.9.w1"}));
}

TEST(Checkpoint, DamagedFilesGiveReasonsNamingTheFile) {
  auto truncate = [](const std::string& file) {
    return [file](const std::string& dir, const ParamLayout&, const std::vector<float>&) {
      std::string b = slurp(dir + "/" + file);
      spit(dir + "/" + file, b.substr(0, b.size() / 2));
    };
  };
  EXPECT_TRUE(has_message(load_after(truncate("model.safetensors")),
                          {"model.safetensors", "truncated"}));
  EXPECT_TRUE(has_message(load_after(truncate("optimizer.safetensors")),
                          {"optimizer.safetensors", "truncated"}));
  EXPECT_TRUE(has_message(load_after(truncate("config.json")), {"config.json", "JSON"}));
  EXPECT_TRUE(has_message(
      load_after([](const std::string& dir, const ParamLayout&, const std::vector<float>&) {
        spit(dir + "/trainer_state.json", R"({"step": 1, "seed": 2, "last_loss": 0.5})");
      }),
      {"trainer_state.json", "data_position"}));
  EXPECT_TRUE(has_message(
      load_after([](const std::string& dir, const ParamLayout&, const std::vector<float>&) {
        fs::remove(dir + "/config.json");
      }),
      {"config.json"}));
  EXPECT_TRUE(has_message(
      load_after([](const std::string& dir, const ParamLayout&, const std::vector<float>&) {
        json j = json::parse(slurp(dir + "/config.json"));
        j.erase("num_local_experts");
        spit(dir + "/config.json", j.dump());
      }),
      {"config.json", "num_local_experts"}));
}

TEST(Checkpoint, LatestCheckpointPicksTheHighestCompleteStep) {
  TempDir tmp;
  Saved s;
  for (int64_t step : {100, 250, 1000000})
    ASSERT_TRUE(save_checkpoint(tmp / checkpoint_dir_name(step), s.layout, s.params.data(),
                                nullptr, nullptr, 0, s.trainer)
                    .is_ok());
  EXPECT_EQ(checkpoint_dir_name(250), "step_000250");
  // Higher, but in flight / incomplete / not a checkpoint name.
  fs::copy(tmp / "step_000250", tmp / "step_2000000.tmp-123");
  fs::copy(tmp / "step_000250", tmp / "step_3000000.old-7");
  fs::copy(tmp / "step_000250", tmp / "step_x4000000");
  fs::create_directory(tmp / "step_5000000");
  fs::copy(tmp / "step_000250/config.json", tmp / "step_5000000/config.json");
  Expected<std::string> latest = latest_checkpoint(tmp.path());
  ASSERT_TRUE(latest) << latest.status().to_string();
  EXPECT_EQ(latest.value(), tmp / "step_1000000");
}

TEST(Checkpoint, LatestCheckpointOfAnEmptyOrMissingRootIsNotFound) {
  TempDir tmp;
  EXPECT_EQ(latest_checkpoint(tmp.path()).status().code(), Status::Code::kNotFound);
  EXPECT_EQ(latest_checkpoint(tmp / "absent").status().code(), Status::Code::kNotFound);
}

// ---------------------------------------------------------------- python interop

// Skips the calling test unless python3 with torch can run.
bool python_with_torch() {
  return ::access("/usr/bin/python3", X_OK) == 0 &&
         std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

int run_python(const TempDir& tmp, const std::string& script, const std::string& arg) {
  spit(tmp / "script.py", script);
  std::string cmd = "/usr/bin/python3 '" + (tmp / "script.py") + "' '" + arg + "'";
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// A hand-written safetensors writer: json + struct, tensors from torch, the BF16
// one first so the F32 after it is not 4-byte aligned.
constexpr const char* kPythonWriter = R"PY(
import json, struct, sys, torch
tensors = {
    "bf": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
    "w": (torch.arange(6, dtype=torch.float32) * 0.5 - 1.0).reshape(2, 3),
    "d": torch.tensor([[1e-3, -7.25]], dtype=torch.float64),
    "ids": torch.tensor([1, -2, 3], dtype=torch.int64),
}
names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
header, blobs, off = {"__metadata__": {"format": "pt", "who": "python"}}, [], 0
for name, t in tensors.items():
    b = t.contiguous().view(torch.uint8).numpy().tobytes()
    header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
h = json.dumps(header).encode()
h += b" " * (-(8 + len(h)) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
)PY";

TEST(PythonInterop, FileWrittenByPythonIsReadable) {
  if (!python_with_torch()) GTEST_SKIP() << "needs /usr/bin/python3 with torch importable";
  TempDir tmp;
  const std::string path = tmp / "py.safetensors";
  ASSERT_EQ(run_python(tmp, kPythonWriter, path), 0);
  Expected<SafetensorsFile> f = SafetensorsFile::open(path);
  ASSERT_TRUE(f) << f.status().to_string();
  EXPECT_EQ(f->metadata().at("who"), "python");
  float w[6], bf[3], d[2];
  ASSERT_TRUE(f->read_f32("w", {2, 3}, w).is_ok());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(w[i], i * 0.5f - 1.0f);
  ASSERT_TRUE(f->read_f32("bf", {3}, bf).is_ok());
  EXPECT_EQ(bf[0], 1.5f);
  EXPECT_EQ(bf[1], -2.25f);
  EXPECT_EQ(bf[2], 3.0f);
  ASSERT_TRUE(f->read_f32("d", {1, 2}, d).is_ok());
  EXPECT_EQ(d[0], 1e-3f);
  EXPECT_EQ(d[1], -7.25f);
  const TensorInfo* ids = f->find("ids");
  ASSERT_NE(ids, nullptr);
  int64_t v[3];
  std::memcpy(v, ids->data, sizeof(v));
  EXPECT_EQ(v[1], -2);
}

// A hand-written reader that checks a checkpoint of ours, byte-exact, from python.
constexpr const char* kPythonReader = R"PY(
import json, struct, sys, torch
d = sys.argv[1]
def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 8 == 0, "data not aligned"
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    dt = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "I64": torch.int64}
    out, spans = {}, []
    for name, info in header.items():
        b, e = info["data_offsets"]
        spans.append((b, e))
        t = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=dt[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n, "buffer not covered"
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "gaps between tensors"
    return out, meta
model, meta = load(d + "/model.safetensors")
assert meta == {"format": "pt"}, meta
cfg = json.load(open(d + "/config.json"))
assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
h, ff = cfg["hidden_size"], cfg["intermediate_size"]
assert model["model.embed_tokens.weight"].shape == (cfg["vocab_size"], h)
assert model["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (h, ff)
# The test wrote params[i] = i * 0.25 in ParamLayout order, embed_tokens first.
emb = model["model.embed_tokens.weight"].flatten()
assert torch.equal(emb, torch.arange(emb.numel(), dtype=torch.float32) * 0.25)
opt, ometa = load(d + "/optimizer.safetensors")
assert ometa["step"] == "7", ometa
assert set(opt) == {p + k for p in ("exp_avg.", "exp_avg_sq.") for k in model}
assert torch.equal(opt["exp_avg.lm_head.weight"], -model["lm_head.weight"])
st = json.load(open(d + "/trainer_state.json"))
assert st == {"step": 3, "data_position": 17, "seed": 9, "last_loss": 1.25}, st
)PY";

TEST(PythonInterop, CheckpointWrittenByUsIsReadableByPython) {
  if (!python_with_torch()) GTEST_SKIP() << "needs /usr/bin/python3 with torch importable";
  TempDir tmp;
  ParamLayout layout(small_config());
  std::vector<float> p(layout.size()), m(layout.size()), v(layout.size(), 1.0f);
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = static_cast<float>(i) * 0.25f;
    m[i] = -p[i];
  }
  const std::string dir = tmp / "ck";
  ASSERT_TRUE(
      save_checkpoint(dir, layout, p.data(), m.data(), v.data(), 7, {3, 17, 9, 1.25}).is_ok());
  EXPECT_EQ(run_python(tmp, kPythonReader, dir), 0);
}

}  // namespace
}  // namespace xd
