// Checkpoint directories: parameters and optimizer state round-trip, atomic
// replacement, damaged or partial checkpoints, the latest complete step.
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

}  // namespace
}  // namespace xd
