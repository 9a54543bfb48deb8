// A job that survives losing a worker: distributed checkpoints taken while
// it trains, a relaunch from the newest complete one after a worker is
// killed, a corrupt checkpoint passed over for the previous one, a checkpoint
// of 4 workers resumed by 2 workers and by one process, and the non-finite
// guard deciding alike on every worker. Real processes over loopback.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/clock.h"
#include "job_runner.h"
#include "model/checkpoint.h"
#include "model/distributed_checkpoint.h"
#include "model/param_layout.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using testing::run;
using testing::xdmoe_binary;

constexpr int kSteps = 200;

// 2 DCs x 2 workers, EP; or 2 DCs x 1 worker with twice the sequences each
// (the same global batch).
std::string job_yaml(int workers_per_dc, int batch_size, const std::string& extra_train = "") {
  std::string model = testing::model_yaml();
  model.replace(model.find("  batch_size: 2\n"), 16, "  batch_size: " + std::to_string(batch_size) + "\n");
  model.replace(model.find("  log_every: 5\n"), 15, "  log_every: 1\n" + extra_train);
  return model + "cluster:\n  levels:\n    - name: dc\n      size: 2\n      link: {bandwidth: 1gbit, latency: 0ms, shape: false}\n"
                 "    - name: worker\n      size: " + std::to_string(workers_per_dc) +
         "\n      link: {bandwidth: 10gbit, latency: 0ms, shape: false}\n"
         "  expert_parallel:\n    mode: ep\n    memory_cap: unlimited\n    pipeline_degree: 1\n";
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  nlohmann::json j;
  if (in) in >> j;
  return j;
}

// One uninterrupted run of kSteps with a checkpoint every 5 steps, shared by
// the tests (the slowest part of each).
class Recovery : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = (fs::temp_directory_path() / ("xdmoe_recovery_" + std::to_string(::getpid()))).string();
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::ofstream(root_ + "/job4.yaml") << job_yaml(2, 2);
    auto [code, out] = run(xdmoe_binary() + " launch --config " + root_ + "/job4.yaml --mode ep --steps " +
                           std::to_string(kSteps) + " --run-dir " + root_ + "/reference --cli-bind 'tcp://127.0.0.1:*'"
                           " --checkpoint-dir " + root_ + "/reference-ck --checkpoint-every 5");
    reference_out_ = out;
    reference_ = read_json(root_ + "/reference/ep/summary.json");
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }
  void lose_a_worker(const std::string& name, int signal, uint32_t seed, const std::vector<std::string>& extra);
  void SetUp() override {
    ASSERT_TRUE(reference_.contains("losses") && reference_["losses"].size() == kSteps) << reference_out_;
  }
  // The reference's loss after `step` (1-based).
  static double reference_loss(int64_t step) { return reference_["losses"][step - 1].get<double>(); }

  static std::string root_, reference_out_;
  static nlohmann::json reference_;
};
std::string Recovery::root_, Recovery::reference_out_;
nlohmann::json Recovery::reference_;

TEST_F(Recovery, EveryCheckpointOfTheRunIsCompleteAndVerifies) {
  for (int step = 5; step <= kSteps; step += 5) {
    const std::string dir = root_ + "/reference-ck/" + checkpoint_dir_name(step);
    ASSERT_TRUE(verify_checkpoint(dir).is_ok()) << verify_checkpoint(dir).to_string();
  }
  EXPECT_EQ(read_json(root_ + "/reference/ep/summary.json")["checkpoints"].size(), kSteps / 5u);
}

// Launches the job with one restart allowed, sends `signal` to a worker
// (rank and step drawn from `seed`) once the job has passed that step, and
// checks that the job finishes through a restart whose every loss is the
// uninterrupted run's. `extra`: more launch flags (a hostfile).
void Recovery::lose_a_worker(const std::string& name, int signal, uint32_t seed, const std::vector<std::string>& extra) {
  std::mt19937 rng(seed);
  const int kill_after = std::uniform_int_distribution<int>(8, 60)(rng);
  const int victim = std::uniform_int_distribution<int>(0, 3)(rng);
  const std::string dir = root_ + "/" + name;
  int fd = -1;
  std::vector<std::string> argv = {xdmoe_binary(), "launch", "--config", root_ + "/job4.yaml", "--mode", "ep",
                                   "--steps", std::to_string(kSteps), "--run-dir", dir, "--cli-bind",
                                   "tcp://127.0.0.1:*", "--checkpoint-dir", dir + "-ck", "--checkpoint-every", "5",
                                   "--max-restarts", "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  subprocess::Child launcher = subprocess::spawn_piped(argv, {}, &fd);
  ASSERT_GE(fd, 0);
  FILE* in = ::fdopen(fd, "r");
  std::string out, cli;
  char line[8192];
  const std::regex monitor("status --coordinator (\\S+)"), progress("^step +([0-9]+)/");
  double killed_at = 0;
  while (std::fgets(line, sizeof line, in)) {
    out += line;
    std::cmatch m;
    if (cli.empty() && std::regex_search(line, m, monitor)) cli = m[1];
    if (killed_at == 0 && std::regex_search(line, m, progress) && std::stoi(m[1]) >= kill_after) {
      auto [code, status] = run(xdmoe_binary() + " status --json --coordinator " + cli);
      ASSERT_EQ(code, 0) << status;
      const pid_t pid = nlohmann::json::parse(status)["workers"][victim]["pid"].get<int>();
      killed_at = unix_seconds();
      ASSERT_EQ(::kill(pid, signal), 0);
    }
  }
  std::fclose(in);
  const int code = subprocess::wait_for(launcher, std::chrono::seconds(120));
  ASSERT_EQ(code, 0) << out;
  ASSERT_GT(killed_at, 0) << "the run ended before the kill: " << out;
  const nlohmann::json s = read_json(dir + "/ep-restart1/summary.json");
  ASSERT_TRUE(s.value("ok", false)) << out;
  ASSERT_EQ(s["restarts"].size(), 1u) << s.dump(2);
  const nlohmann::json& restart = s["restarts"][0];
  const int64_t resumed = restart["resumed_step"].get<int64_t>();
  const int64_t failed_after = restart["failed_after_step"].get<int64_t>();
  EXPECT_EQ(resumed % 5, 0);
  EXPECT_GE(resumed, 5);
  EXPECT_LE(resumed, failed_after);
  // Killed: the launch sees the process end. Hung: the coordinator misses its heartbeats.
  const std::string why = signal == SIGSTOP ? "worker " + std::to_string(victim) + " was lost"
                                            : "worker " + std::to_string(victim) + " exited";
  EXPECT_NE(restart["reason"].get<std::string>().find(why), std::string::npos) << restart.dump() << out;
  // The resumed run's every step, bit for bit the uninterrupted run's.
  ASSERT_EQ(s["steps"].size(), size_t(kSteps - resumed));
  for (size_t i = 0; i < s["steps"].size(); ++i) {
    const int64_t step = s["steps"][i].get<int64_t>();
    ASSERT_EQ(step, resumed + 1 + (int64_t)i);
    ASSERT_EQ(s["losses"][i].get<double>(), reference_loss(step)) << "step " << step;
  }
  const double recovery = s["first_step_wall_s"].get<double>() - killed_at;
  std::printf("%s: worker %d got signal %d after step %d (seen at step %lld); resumed from step %lld; %.2f s from the "
              "signal to the first step after it (the launcher's own count: %.2f s); %lld steps computed twice\n",
              name.c_str(), victim, signal, kill_after, (long long)failed_after, (long long)resumed, recovery,
              restart["recovery_s"].get<double>(), (long long)(failed_after - resumed));
  EXPECT_GT(recovery, 0);
}

TEST_F(Recovery, AWorkerKilledAtARandomStepIsReplacedAndEveryLaterLossEqualsTheUninterruptedRun) {
  lose_a_worker("killed", SIGKILL, 20261123, {});
}

TEST_F(Recovery, AHungWorkerIsDeclaredLostAndTheJobRestartsFromItsCheckpoint) {
  lose_a_worker("hung", SIGSTOP, 7, {});  // alive, silent: only the heartbeats tell
}

TEST_F(Recovery, UnderTheHostfileLauncherAKilledWorkerIsRestartedOverSshToo) {
  const std::string hosts = root_ + "/hosts";
  std::ofstream(hosts) << "127.0.0.1 slots=4\n";
  lose_a_worker("ssh", SIGKILL, 99, {"--hostfile", hosts, "--ssh", "sh " + std::string(XD_SOURCE_DIR) + "/tests/tools/fake_ssh.sh"});
}

TEST_F(Recovery, ACorruptLatestCheckpointIsPassedOverForThePreviousOne) {
  const std::string ck = root_ + "/corrupt-ck";
  fs::create_directories(ck);
  for (int step : {10, 15, 20}) fs::copy(root_ + "/reference-ck/" + checkpoint_dir_name(step), ck + "/" + checkpoint_dir_name(step));
  const std::string shard = ck + "/" + checkpoint_dir_name(20) + "/" + shard_file_name(3, 4);
  std::string bytes = read_file(shard).value();
  bytes[bytes.size() - 7] ^= 1;
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  auto [code, out] = run(xdmoe_binary() + " launch --config " + root_ + "/job4.yaml --mode ep --steps " +
                         std::to_string(kSteps) + " --run-dir " + root_ + "/corrupt --cli-bind 'tcp://127.0.0.1:*' --resume " + ck);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("skipping checkpoint " + ck + "/step_000020"), std::string::npos) << out;
  EXPECT_NE(out.find("(corrupt)"), std::string::npos) << out;
  const nlohmann::json s = read_json(root_ + "/corrupt/ep/summary.json");
  EXPECT_EQ(s["resumed_from"]["step"], 15);
  ASSERT_EQ(s["steps"][0], 16);
  for (size_t i = 0; i < s["steps"].size(); ++i)
    ASSERT_EQ(s["losses"][i].get<double>(), reference_loss(s["steps"][i].get<int64_t>()));
}

TEST_F(Recovery, ACheckpointOfFourWorkersResumesOnTwoWorkersAndInOneProcessWithTheSameNextLoss) {
  std::ofstream(root_ + "/job2.yaml") << job_yaml(1, 4);
  const std::string ck = root_ + "/reference-ck/" + checkpoint_dir_name(10);
  auto [code, out] = run(xdmoe_binary() + " launch --config " + root_ + "/job2.yaml --mode ep --steps " +
                         std::to_string(kSteps) + " --run-dir " + root_ + "/two --cli-bind 'tcp://127.0.0.1:*' --resume " + ck);
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json s = read_json(root_ + "/two/ep/summary.json");
  ASSERT_EQ(s["world"], 2);
  ASSERT_EQ(s["steps"][0], 11);
  // The same weights and global batch; only the order of the sums differs.
  EXPECT_NEAR(s["losses"][0].get<double>(), reference_loss(11), 1e-5);
  // `xdmoe train` reads the same checkpoint: the one-process equivalent.
  auto [tcode, tout] = run(xdmoe_binary() + " train --config " + root_ + "/job4.yaml --resume " + ck + " --steps " +
                           std::to_string(kSteps));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(tout, m, std::regex("step +11/[0-9]+ \\| loss ([0-9.]+)"))) << tout;
  EXPECT_NEAR(std::stod(m[1]), reference_loss(11), 1e-4);
  // And `xdmoe forward` scores text with it.
  std::ofstream(root_ + "/text.txt") << "The quick brown fox jumps over the lazy dog, again and again.";
  auto [fcode, fout] = run(xdmoe_binary() + " forward --checkpoint " + ck + " --tokens " + root_ + "/text.txt --out " +
                           root_ + "/logits.safetensors");
  EXPECT_EQ(fcode, 0) << fout;
  EXPECT_TRUE(fs::exists(root_ + "/logits.safetensors")) << fout;
}

TEST_F(Recovery, APoisonedCheckpointWithNanPolicySkipSkipsTheSameStepsOnEveryWorkerAndFinishes) {
  // The checkpoint of step 10 with one byte's embedding row set to NaN, as a
  // one-process checkpoint (resume takes either kind).
  auto ck = load_checkpoint(root_ + "/reference-ck/" + checkpoint_dir_name(10));
  ASSERT_TRUE(ck) << ck.status().to_string();
  const ParamLayout layout(ck->config);
  const size_t row = layout.find("model.embed_tokens.weight")->offset + size_t('q') * ck->config.hidden_size;
  ck->params[row] = std::nanf("");
  const std::string poisoned = root_ + "/poisoned/" + checkpoint_dir_name(10);
  ASSERT_TRUE(save_checkpoint(poisoned, layout, ck->params.data(), ck->adam_m.data(), ck->adam_v.data(), ck->adam_step,
                              ck->trainer).is_ok());
  std::ofstream(root_ + "/skip.yaml") << job_yaml(2, 2, "  nan_policy: skip\n");
  auto [code, out] = run(xdmoe_binary() + " launch --config " + root_ + "/skip.yaml --mode ep --steps 40 --run-dir " +
                         root_ + "/skip --cli-bind 'tcp://127.0.0.1:*' --resume " + poisoned);
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json s = read_json(root_ + "/skip/ep/summary.json");
  const int64_t skipped = s["skipped_steps"].get<int64_t>();
  EXPECT_GT(skipped, 0) << out;
  EXPECT_LT(skipped, 30) << out;
  std::string logs;
  std::vector<std::set<int>> skipped_by_rank(4);
  for (int r = 0; r < 4; ++r) {
    const std::string log = subprocess::read_text(root_ + "/skip/ep/worker" + std::to_string(r) + ".log");
    logs += log;
    const std::regex line("skipped step ([0-9]+):");
    for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it)
      skipped_by_rank[r].insert(std::stoi((*it)[1]));
  }
  EXPECT_EQ(skipped_by_rank[0].size(), size_t(skipped)) << logs;
  for (int r = 1; r < 4; ++r) EXPECT_EQ(skipped_by_rank[r], skipped_by_rank[0]) << "rank " << r << " skipped other steps";
  EXPECT_NE(logs.find("model.embed_tokens.weight"), std::string::npos) << "the log names the tensor: " << logs;
  // With lossy codecs, which refuse NaN: the SR set on the DC link (4-bit
  // replica gradients) and 8-bit token rows inside the DCs. The rows and
  // gradients holding the NaN cross raw, and the same steps are skipped.
  std::string lossy = job_yaml(2, 2, "  nan_policy: skip\n");
  const std::string inner = "link: {bandwidth: 10gbit, latency: 0ms, shape: false}";
  lossy.replace(lossy.find(inner), inner.size(),
                "link: {bandwidth: 10gbit, latency: 0ms, shape: false,"
                " codecs: {dispatch: int8_row, combine: int8_row}}");
  std::ofstream(root_ + "/skip_lossy.yaml") << lossy;
  auto [lcode, lout] = run(xdmoe_binary() + " launch --config " + root_ + "/skip_lossy.yaml --mode hybrid+d2x1+sr "
                           "--steps 40 --run-dir " + root_ + "/skip_lossy --cli-bind 'tcp://127.0.0.1:*' --resume " +
                           poisoned);
  ASSERT_EQ(lcode, 0) << lout;
  const nlohmann::json ls = read_json(root_ + "/skip_lossy/hybrid+d2x1+sr/summary.json");
  EXPECT_EQ(ls["skipped_steps"].get<int64_t>(), skipped) << lout;
  EXPECT_TRUE(std::isfinite(ls["final_loss"].get<double>())) << lout;
  const nlohmann::json& bytes = ls["bytes_per_step"];
  EXPECT_GT(bytes.value("worker/moe_dispatch_raw", 0.0), bytes.value("worker/moe_dispatch", 0.0))
      << "the finite steps' rows were compressed: " << bytes.dump();
  // The default policy stops at the first such step, naming it.
  auto [scode, sout] = run(xdmoe_binary() + " launch --config " + root_ + "/job4.yaml --mode ep --steps 40 --run-dir " +
                           root_ + "/stop --cli-bind 'tcp://127.0.0.1:*' --resume " + poisoned);
  EXPECT_NE(scode, 0);
  EXPECT_NE(sout.find("train.nan_policy: stop"), std::string::npos) << sout;
}

}  // namespace
}  // namespace xd
