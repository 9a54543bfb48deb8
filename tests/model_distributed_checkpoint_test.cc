// Distributed checkpoints: shards of any number of workers merge into the
// whole model, a manifest makes a set complete, and torn or corrupt sets are
// found and passed over for the previous one. Also CRC-32C itself.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "model/checkpoint.h"
#include "model/distributed_checkpoint.h"
#include "model/param_layout.h"
#include "test_util.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using namespace test_util;

TEST(Crc32c, MatchesTheStandardCheckValueAndContinuesAcrossPieces) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32c(text.data(), text.size()), 0xE3069283u);  // RFC 3720's check value
  const uint32_t first = crc32c(text.data(), 4);
  EXPECT_EQ(crc32c(text.data() + 4, text.size() - 4, first), 0xE3069283u);
  std::vector<char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c_text(0xE3069283u), "crc32c:e3069283");
}

// The whole model, and `world` workers' shards of it written to `dir`.
struct ShardedModel {
  ModelConfig config = small_config();
  ParamLayout full{config};
  std::vector<float> params = random_floats(full.size(), 11);
  std::vector<float> m = random_floats(full.size(), 12);
  std::vector<float> v = random_floats(full.size(), 13);
  TrainerState trainer{7, 7, 1, 3.25};

  void write(const std::string& dir, int world) const {
    const int per = config.num_experts / world;
    std::vector<ShardRecord> shards;
    for (int r = 0; r < world; ++r) {
      // The worker's own layout, its tensors copied out of the whole model by name.
      ParamLayout local(config, r * per, per);
      std::vector<float> p(local.size()), lm(local.size()), lv(local.size());
      for (const TensorSlot& s : local.slots()) {
        const TensorSlot* f = full.find(s.name);
        std::copy_n(params.begin() + f->offset, s.numel(), p.begin() + s.offset);
        std::copy_n(m.begin() + f->offset, s.numel(), lm.begin() + s.offset);
        std::copy_n(v.begin() + f->offset, s.numel(), lv.begin() + s.offset);
      }
      auto rec = save_checkpoint_shard(dir, r, world, local, p.data(), lm.data(), lv.data(), 7, trainer.step, r == 0);
      ASSERT_TRUE(rec) << rec.status().to_string();
      shards.push_back(*rec);
    }
    ASSERT_TRUE(write_checkpoint_manifest(dir, config, world, trainer, shards).is_ok());
  }
};

TEST(DistributedCheckpoint, ShardsOfAnyWorldSizeMergeIntoTheWholeModelBitIdentically) {
  for (int world : {1, 2, 4}) {
    TempDir tmp;
    ShardedModel model;
    model.write(tmp / "step_000007", world);
    auto loaded = load_checkpoint(tmp / "step_000007");  // the one entry point `xdmoe train` and `forward` use
    ASSERT_TRUE(loaded) << loaded.status().to_string();
    EXPECT_TRUE(bit_identical(loaded->params, model.params)) << world << " workers";
    EXPECT_TRUE(bit_identical(loaded->adam_m, model.m));
    EXPECT_TRUE(bit_identical(loaded->adam_v, model.v));
    EXPECT_EQ(loaded->adam_step, 7);
    EXPECT_EQ(loaded->trainer.step, 7);
    EXPECT_EQ(loaded->trainer.last_loss, 3.25);
    EXPECT_TRUE(verify_checkpoint(tmp / "step_000007").is_ok());
  }
}

TEST(DistributedCheckpoint, ADirectoryWithoutItsManifestIsTornAndThePreviousOneIsTaken) {
  TempDir tmp;
  ShardedModel model;
  model.write(tmp / "step_000003", 2);
  model.write(tmp / "step_000006", 2);
  fs::remove(tmp / "step_000006/manifest.json");  // the coordinator never saw every shard
  std::vector<std::string> skipped;
  auto latest = latest_valid_checkpoint(tmp.path(), &skipped);
  ASSERT_TRUE(latest) << latest.status().to_string();
  EXPECT_EQ(fs::path(*latest).filename(), "step_000003");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("torn"), std::string::npos) << skipped[0];
  // Named explicitly, a torn checkpoint is an error, not a silent fallback.
  EXPECT_FALSE(resolve_checkpoint(tmp / "step_000006", nullptr));
}

TEST(DistributedCheckpoint, AFlippedByteOrAShortShardIsCaughtByTheManifest) {
  TempDir tmp;
  ShardedModel model;
  model.write(tmp / "step_000003", 4);
  model.write(tmp / "step_000006", 4);
  model.write(tmp / "step_000009", 4);
  const std::string flipped = tmp / ("step_000009/" + shard_file_name(2, 4));
  std::string bytes = slurp(flipped);
  bytes[bytes.size() / 2] ^= 0x40;
  spit(flipped, bytes);
  const std::string shortened = tmp / ("step_000006/" + shard_file_name(1, 4));
  spit(shortened, slurp(shortened).substr(0, 1000));
  auto corrupt = load_checkpoint(tmp / "step_000009");
  ASSERT_FALSE(corrupt);
  EXPECT_NE(corrupt.status().message().find("corrupt"), std::string::npos) << corrupt.status().to_string();
  EXPECT_NE(corrupt.status().message().find(shard_file_name(2, 4)), std::string::npos);
  EXPECT_NE(verify_checkpoint(tmp / "step_000006").message().find("bytes, the manifest says"), std::string::npos);
  std::vector<std::string> skipped;
  auto latest = resolve_checkpoint(tmp.path(), &skipped);
  ASSERT_TRUE(latest) << latest.status().to_string();
  EXPECT_EQ(fs::path(*latest).filename(), "step_000003");
  EXPECT_EQ(skipped.size(), 2u);
}

TEST(DistributedCheckpoint, AManifestThatLiesAboutItsShardsIsRejectedWithAReason) {
  TempDir tmp;
  ShardedModel model;
  model.write(tmp / "step_000001", 2);
  const std::string manifest = tmp / "step_000001/manifest.json";
  const std::string good = slurp(manifest);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    text.replace(text.find(from), from.size(), to);
    spit(manifest, text);
    return load_checkpoint(tmp / "step_000001").status().message();
  };
  EXPECT_NE(with("\"shard-00001-of-00002.safetensors\"", "\"../escape\"").find("plain file name"), std::string::npos);
  EXPECT_NE(with("\"rank\": 1", "\"rank\": 0").find("repeated"), std::string::npos);
  EXPECT_NE(with("\"xdmoe-sharded\"", "\"other\"").find("format"), std::string::npos);
  EXPECT_NE(with("crc32c:", "crc32:").find("checksum"), std::string::npos);
  spit(manifest, "{not json");
  EXPECT_EQ(load_checkpoint(tmp / "step_000001").status().code(), Status::Code::kCorruption);
}

TEST(DistributedCheckpoint, AShardMissingATensorIsReportedByName) {
  TempDir tmp;
  ShardedModel model;
  // Rank 0 without the dense parameters: nobody holds them.
  const ModelConfig& c = model.config;
  std::vector<ShardRecord> shards;
  for (int r = 0; r < 2; ++r) {
    ParamLayout local(c, r * c.num_experts / 2, c.num_experts / 2);
    std::vector<float> p(local.size(), 1.0f);
    auto rec = save_checkpoint_shard(tmp / "step_000002", r, 2, local, p.data(), p.data(), p.data(), 2, 2, false);
    ASSERT_TRUE(rec);
    shards.push_back(*rec);
  }
  ASSERT_TRUE(write_checkpoint_manifest(tmp / "step_000002", c, 2, model.trainer, shards).is_ok());
  auto loaded = load_checkpoint(tmp / "step_000002");
  ASSERT_FALSE(loaded);
  EXPECT_NE(loaded.status().message().find("no shard holds tensor \"model.embed_tokens.weight\""), std::string::npos)
      << loaded.status().to_string();
}

}  // namespace
}  // namespace xd
