// The xdmoe binary as a user runs it: `train` on a distributed job's config
// runs its one-process equivalent and says so; `forward` evaluates a file
// longer than the model's context with a sliding window.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "job_runner.h"
#include "model/safetensors.h"

namespace xd {
namespace {

namespace fs = std::filesystem;

using testing::run;

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (fs::temp_directory_path() / ("xdmoe_cli_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::ofstream(dir + "/job.yaml") << R"(model:
  hidden_size: 16
  num_layers: 1
  num_heads: 2
  num_kv_heads: 1
  max_seq_len: 16
  num_experts: 4
  top_k: 2
  expert_intermediate_size: 16
train:
  steps: 2
  batch_size: 3
  seq_len: 16
  warmup_steps: 1
  eval_every: 0
  checkpoint_dir: )" << dir << R"(/ck
data:
  builtin_bytes: 8192
cluster:
  levels:
    - {name: dc, size: 2, link: {bandwidth: 1gbit}}
    - {name: worker, size: 2, link: {bandwidth: 10gbit}}
)";
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string dir;
  const std::string bin = testing::xdmoe_binary();
};

TEST_F(Cli, TrainOnAJobConfigRunsTheOneProcessEquivalentAndSaysSo) {
  auto [code, out] = run("OPENBLAS_NUM_THREADS=1 " + bin + " train --config " + dir + "/job.yaml");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("describes a distributed job: 4 workers (2 dc x 2 worker), 3 sequences each"), std::string::npos) << out;
  EXPECT_NE(out.find("one-process equivalent"), std::string::npos) << out;
  EXPECT_NE(out.find("batch of 12 sequences per step"), std::string::npos) << out;
  EXPECT_NE(out.find("12 x 16 tokens per step"), std::string::npos) << out;
}

TEST_F(Cli, ForwardEvaluatesAFileLongerThanTheContextWithASlidingWindow) {
  auto [tcode, tout] = run("OPENBLAS_NUM_THREADS=1 " + bin + " train --config " + dir + "/job.yaml");
  ASSERT_EQ(tcode, 0) << tout;
  std::string text;
  for (int i = 0; i < 10; ++i) text += "a sliding window scores every byte once. ";
  std::ofstream(dir + "/long.txt") << text;
  const int T = static_cast<int>(text.size());
  ASSERT_GT(T, 16 * 20);
  auto [code, out] = run(bin + " forward --checkpoint " + dir + "/ck/step_000002 --tokens " + dir +
                         "/long.txt --out " + dir + "/out.safetensors --stride 12");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("windows of 16 tokens, stride 12: every token scored once"), std::string::npos) << out;
  auto file = SafetensorsFile::open(dir + "/out.safetensors");
  ASSERT_TRUE(file) << file.status().to_string();
  std::vector<float> logits(size_t(T) * 256);
  ASSERT_TRUE(file->read_f32("logits", {T, 256}, logits.data()).is_ok());
  float loss = -1;
  ASSERT_TRUE(file->read_f32("loss", {}, &loss).is_ok());
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_GT(loss, 0.0f);
  EXPECT_EQ(file->metadata().at("stride"), "12");
  for (float x : logits) ASSERT_TRUE(std::isfinite(x));

  auto [bad, bad_out] = run(bin + " forward --checkpoint " + dir + "/ck/step_000002 --tokens " + dir +
                            "/long.txt --out " + dir + "/x.safetensors --stride 16");
  EXPECT_EQ(bad, 2);
  EXPECT_NE(bad_out.find("consecutive windows must overlap"), std::string::npos) << bad_out;
}

}  // namespace
}  // namespace xd
