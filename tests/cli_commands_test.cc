// The xdmoe binary as a user runs it: `train` on a distributed job's config
// runs its one-process equivalent and says so; `forward` evaluates a file
// longer than the model's context with a sliding window, or the held-out
// tail of a config's data.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "job_runner.h"
#include "model/safetensors.h"
#include "model/trainer.h"

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
  validation_fraction: 0.1
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

TEST_F(Cli, PlanSaysWhichLinkClassRelaysTheExpertsThatCrossedACompressedOne) {
  auto [code, out] = run(bin + " plan --farskip --sr-codecs --no-probe");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("expert all-gather: relays what crossed dc as it arrived"), std::string::npos) << out;
  auto [raw_code, raw_out] = run(bin + " plan --farskip --no-probe");
  ASSERT_EQ(raw_code, 0) << raw_out;
  EXPECT_EQ(raw_out.find("relays"), std::string::npos) << "nothing is lossy, nothing is relayed:\n" << raw_out;
}

// The step probe times the model in three windows, and the compute model
// takes the median one's figure; the codecs' CPU share of the cores is said.
TEST_F(Cli, PlanTakesTheMedianOfTheStepProbesWindows) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "under ThreadSanitizer one probe window outlasts the start-up's budget, so the planner takes one";
#endif
  auto [code, out] =
      run("(" + bin + " plan --farskip --sr-codecs --mode hybrid --domains 2,2 --no-probe --json 2>/dev/null)");
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  const std::vector<double> windows = j.at("compute").at("step_probe_windows_s").get<std::vector<double>>();
  ASSERT_EQ(windows.size(), 3u) << out;
  EXPECT_GT(windows[0], 0);
  EXPECT_DOUBLE_EQ(j.at("compute").at("step_probe_s").get<double>(), windows[1]);
  EXPECT_EQ(j.at("compute").at("codecs_share_compute_cores").get<bool>(), std::thread::hardware_concurrency() <= 4)
      << "the codecs share the compute's cores where the 4 workers fill them";
  const nlohmann::json& chosen = j.at("candidates").at(j.at("chosen").get<size_t>());
  EXPECT_GT(chosen.at("codec_cpu_s").get<double>(), 0) << "the outer link's experts are coded";
  // Domains 2 x 2 gather every expert everywhere: each worker computes its
  // own rows, and even loads change nothing.
  EXPECT_DOUBLE_EQ(chosen.at("expert_imbalance").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j.at("even_expert_load_iteration_s").get<double>(), chosen.at("iteration_s").get<double>());
}

// The expert codecs are priced through the stream codec as the runtime runs
// it: the demo's SR codecs (4-bit rows with a scale per 128, zstd) leave
// about an eighth of the fp32 bytes and cost time; the raw inner level
// neither.
TEST_F(Cli, PlanPricesTheSrExpertCodecsOnTheDcLinkAndLeavesTheRawLevelFree) {
  auto [code, out] = run("(" + bin + " plan --farskip --sr-codecs --no-probe --json 2>/dev/null)");
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  const nlohmann::json& links = j.at("levels");
  ASSERT_EQ(links.size(), 2u) << out;
  for (const char* kind : {"expert_gather", "expert_grad"}) {
    const double fraction = links[0].at("codec_wire_fraction").at(kind).get<double>();
    EXPECT_GT(fraction, 0.10) << kind << ": 4 bits a value and the scales";
    EXPECT_LT(fraction, 0.20) << kind;
    EXPECT_GT(links[0].at("codec_s_per_byte").at(kind).get<double>(), 0.0) << kind;
    EXPECT_EQ(links[1].at("codec_wire_fraction").at(kind).get<double>(), 1.0) << kind << " inside a DC";
    EXPECT_EQ(links[1].at("codec_s_per_byte").at(kind).get<double>(), 0.0) << kind << " inside a DC";
  }
}

// In EP the busiest worker's experts compute more than the mean (routing at
// the initial weights is uneven); nothing overlapped, even loads would make
// the step shorter.
TEST_F(Cli, PlanSaysWhatTheBusiestWorkersExpertsCostTheStep) {
  auto [code, out] = run("(" + bin + " plan --mode ep --no-overlap --no-probe --json 2>/dev/null)");
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  const nlohmann::json& chosen = j.at("candidates").at(j.at("chosen").get<size_t>());
  EXPECT_GT(chosen.at("expert_imbalance").get<double>(), 1.0) << out;
  EXPECT_GE(chosen.at("expert_wait_s").get<double>(), 0.0);
  EXPECT_LT(j.at("even_expert_load_iteration_s").get<double>(), chosen.at("iteration_s").get<double>());
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

TEST_F(Cli, ForwardHeldOutScoresTheTailOfTheConfigsDataThatTrainingNeverSaw) {
  auto [tcode, tout] = run("OPENBLAS_NUM_THREADS=1 " + bin + " train --config " + dir + "/job.yaml");
  ASSERT_EQ(tcode, 0) << tout;
  DataConfig data;
  data.builtin_bytes = 8192;
  data.validation_fraction = 0.1;
  auto tokens = load_training_tokens(data);
  ASSERT_TRUE(tokens) << tokens.status().to_string();
  const size_t n = held_out_tokens(tokens->size(), data);
  ASSERT_EQ(n, 819u);
  std::string tail;
  for (size_t i = tokens->size() - n; i < tokens->size(); ++i) tail += static_cast<char>((*tokens)[i]);
  std::ofstream(dir + "/tail.bin", std::ios::binary) << tail;

  const std::string ck = " forward --checkpoint " + dir + "/ck/step_000002";
  auto [fcode, fout] = run(bin + ck + " --tokens " + dir + "/tail.bin");
  ASSERT_EQ(fcode, 0) << fout;
  auto [hcode, hout] = run(bin + ck + " --held-out " + dir + "/job.yaml");
  ASSERT_EQ(hcode, 0) << hout;
  const size_t at = hout.find("819 tokens held out, loss ");
  ASSERT_NE(at, std::string::npos) << hout;
  // The same tokens, the same loss; no --out, no file.
  const std::string loss = hout.substr(at + 26, 8);
  EXPECT_NE(fout.find("819 tokens, loss " + loss), std::string::npos) << fout << hout;
  EXPECT_FALSE(fs::exists(dir + "/out.safetensors"));

  auto [both, both_out] = run(bin + ck + " --tokens " + dir + "/tail.bin --held-out " + dir + "/job.yaml");
  EXPECT_NE(both, 0);
  EXPECT_NE(both_out.find("excludes"), std::string::npos) << both_out;
  auto [none, none_out] = run(bin + ck);
  EXPECT_EQ(none, 2);
  EXPECT_NE(none_out.find("give --tokens FILE or --held-out CONFIG"), std::string::npos) << none_out;
  std::ifstream in(dir + "/job.yaml");
  std::string yaml((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  yaml.replace(yaml.find("validation_fraction: 0.1"), 24, "validation_fraction: 0.0");
  std::ofstream(dir + "/nothing_held.yaml") << yaml;
  auto [empty, empty_out] = run(bin + ck + " --held-out " + dir + "/nothing_held.yaml");
  EXPECT_EQ(empty, 2);
  EXPECT_NE(empty_out.find("holds out 0 tokens"), std::string::npos) << empty_out;
}

}  // namespace
}  // namespace xd
