// Launching a job the ways people do: `xdmoe launch --hostfile` over ssh (here
// `ssh` is tests/tools/fake_ssh.sh, which runs the command on this machine),
// workers under the real `mpirun`, and the whole job stopped when a worker
// fails or on Ctrl-C. Each launched job must train exactly as the same job
// launched locally.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "job_runner.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using testing::run;
using testing::xdmoe_binary;

std::string cluster_yaml() {
  return "cluster:\n  levels:\n    - name: dc\n      size: 2\n      link: {bandwidth: 1gbit, latency: 0ms, shape: false}\n"
         "    - name: worker\n      size: 2\n      link: {bandwidth: 10gbit, latency: 0ms, shape: false}\n"
         "  expert_parallel:\n    mode: ep\n    memory_cap: unlimited\n    pipeline_degree: 1\n"
         // mpirun and srun workers reach the coordinator on every interface.
         "  security:\n    insecure: true\n";
}

std::string fake_ssh() { return std::string(XD_SOURCE_DIR) + "/tests/tools/fake_ssh.sh"; }

class Launch : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (fs::temp_directory_path() / ("xdmoe_launch_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name()))
              .string();
    fs::remove_all(dir);
    fs::create_directories(dir);
    config = dir + "/job.yaml";
    std::ofstream(config) << testing::model_yaml() << cluster_yaml();
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir);
  }
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  }
  // `xdmoe launch` of the job, one EP run of 6 steps, with extra flags.
  std::pair<int, std::string> launch(const std::string& run_dir, const std::string& flags) {
    return run(xdmoe_binary() + " launch --config " + config + " --mode ep --steps 6 --run-dir " + dir + "/" +
               run_dir + " --cli-bind 'tcp://127.0.0.1:*' " + flags);
  }
  nlohmann::json summary(const std::string& run_dir) {
    std::ifstream in(dir + "/" + run_dir + "/ep/summary.json");
    nlohmann::json j;
    if (in) in >> j;
    return j;
  }
  std::string dir, config;
};

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

TEST_F(Launch, AHostfileJobOverSshTrainsExactlyAsTheSameJobLaunchedHere) {
  auto [local_code, local_out] = launch("local", "");
  ASSERT_EQ(local_code, 0) << local_out;
  // dc=b comes first, so it is coordinate 0: ranks 0 and 1 on 127.0.0.1.
  const std::string hostfile = write("hosts", "# two datacenters\n127.0.0.1 slots=2 dc=b\nlocalhost slots=2 dc=a\n");
  const std::string ssh_log = dir + "/ssh.log";
  auto [code, out] = launch("ssh", "--hostfile " + hostfile + " --ssh 'env FAKE_SSH_LOG=" + ssh_log + " sh " +
                                       fake_ssh() + " -o BatchMode=yes'");
  ASSERT_EQ(code, 0) << out;
  // Each worker was started through ssh on its rank's host...
  const std::vector<std::string> calls = lines_of(ssh_log);
  ASSERT_EQ(calls.size(), 4u);
  for (const std::string& call : calls) {
    const size_t at = call.find(" --rank ");
    ASSERT_NE(at, std::string::npos) << call;
    const int rank = std::stoi(call.substr(at + 8));
    EXPECT_EQ(call.substr(0, call.find(' ')), rank < 2 ? "127.0.0.1" : "localhost") << call;
  }
  // ...its log reached this terminal with its rank in front...
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(out.find("[rank " + std::to_string(r) + "] "), std::string::npos) << out;
  EXPECT_NE(out.find("data endpoint tcp://localhost:"), std::string::npos) << out;  // advertised, bound on 0.0.0.0
  // ...and the job trained exactly as it does locally.
  const nlohmann::json local = summary("local"), remote = summary("ssh");
  ASSERT_EQ(local["losses"].size(), 6u);
  EXPECT_EQ(remote["losses"], local["losses"]);
  // The workers reported their CPU time: the cores of this machine (the one
  // host) cannot have run more than they have each step.
  EXPECT_GT(local["cpu_floor_s"].get<double>(), 0.0) << local.dump();
  EXPECT_GT(local["step_over_cpu_floor"].get<double>(), 0.8) << local.dump();
}

// A run's +late and +early reach the workers: the summaries say which ran,
// and the table marks the late one. The losses are the same bits; an
// unknown run option is refused by name.
TEST_F(Launch, PlusLateAndPlusEarlyChooseWhenTheReplicasWeightGradientsRun) {
  auto [code, out] = run(xdmoe_binary() + " launch --config " + config +
                         " --mode hybrid+farskip+d2x1+late --mode hybrid+farskip+d2x1+early --steps 3 --run-dir " +
                         dir + "/run --cli-bind 'tcp://127.0.0.1:*'");
  ASSERT_EQ(code, 0) << out;
  nlohmann::json late, early;
  std::ifstream(dir + "/run/hybrid+farskip+d2x1+late/summary.json") >> late;
  std::ifstream(dir + "/run/hybrid+farskip+d2x1+early/summary.json") >> early;
  EXPECT_EQ(late.value("replica_weight_gradients", ""), "late");
  EXPECT_EQ(early.value("replica_weight_gradients", ""), "early");
  ASSERT_EQ(late["losses"].size(), 3u);
  EXPECT_EQ(late["losses"], early["losses"]);
  EXPECT_NE(out.find(", late)"), std::string::npos) << out;
  auto [bad, why] = run(xdmoe_binary() + " launch --config " + config + " --mode hybrid+soon --steps 1 --run-dir " +
                        dir + "/bad");
  EXPECT_NE(bad, 0);
  EXPECT_NE(why.find("unknown run option 'soon' in 'hybrid+soon' (farskip, simple, rN, dAxB, late, early, sr, delta, "
                     "once, perexpert)"),
            std::string::npos)
      << why;
}

// +once and +perexpert: the coordinator's --tokens-once-per-worker=true and
// =false. HybridEP 1 x 2 (each worker computes its DC's 4 experts of 8,
// top-2): fewer token bytes cross the DC link once per worker, and the
// losses are those of one row per expert up to the order of sums.
TEST_F(Launch, PlusOnceSendsATokenOnceToEachWorkerComputingItsExperts) {
  auto [code, out] = run(xdmoe_binary() + " launch --config " + config +
                         " --mode hybrid+farskip+d1x2+perexpert --mode hybrid+farskip+d1x2+once --steps 3 --run-dir " +
                         dir + "/run --cli-bind 'tcp://127.0.0.1:*'");
  ASSERT_EQ(code, 0) << out;
  nlohmann::json per_expert, once;
  std::ifstream(dir + "/run/hybrid+farskip+d1x2+perexpert/summary.json") >> per_expert;
  std::ifstream(dir + "/run/hybrid+farskip+d1x2+once/summary.json") >> once;
  EXPECT_FALSE(per_expert.value("tokens_once_per_worker", true));
  EXPECT_TRUE(once.value("tokens_once_per_worker", false));
  for (const char* kind : {"dc/moe_dispatch", "dc/moe_combine"}) {
    const double rows = per_expert["bytes_per_step"].value(kind, 0.0);
    EXPECT_GT(rows, 0.0) << kind;
    EXPECT_LT(once["bytes_per_step"].value(kind, 1e30), 0.95 * rows) << kind;
  }
  ASSERT_EQ(once["losses"].size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(once["losses"][i].get<double>(), per_expert["losses"][i].get<double>(), 1e-5) << i;
}

TEST_F(Launch, PlusSrCompressesTheExpertAndDenseTrafficOfTheOutermostLinkAndKeepsTheLoss) {
  auto [code, out] = run(xdmoe_binary() + " launch --config " + config +
                         " --mode hybrid+farskip+d2x1 --mode hybrid+farskip+d2x1+sr --steps 4 --run-dir " + dir +
                         "/run --cli-bind 'tcp://127.0.0.1:*'");
  ASSERT_EQ(code, 0) << out;
  nlohmann::json raw, sr;
  std::ifstream(dir + "/run/hybrid+farskip+d2x1/summary.json") >> raw;
  std::ifstream(dir + "/run/hybrid+farskip+d2x1+sr/summary.json") >> sr;
  const nlohmann::json& rb = raw["bytes_per_step"];
  const nlohmann::json& sb = sr["bytes_per_step"];
  EXPECT_EQ(rb.value("dc/expert_gather", -1.0), rb.value("dc/expert_gather_raw", -2.0));
  // After the first step's exact all-gather, the SR residuals cross in 4 bits.
  EXPECT_LT(sb.value("dc/expert_gather", 1e30), sb.value("dc/expert_gather_raw", 0.0) / 2);
  EXPECT_LT(sb.value("dc/expert_grad", 1e30), sb.value("dc/expert_grad_raw", 0.0) / 4);
  EXPECT_LT(sb.value("dc/all_reduce", 1e30), rb.value("dc/all_reduce", 0.0) * 0.6);  // bf16 on the wire
  EXPECT_EQ(sb.value("worker/all_reduce", -1.0), rb.value("worker/all_reduce", -2.0));  // inner links stay raw
  // The dense gradients' fp32 bytes are counted beside what crossed in bf16.
  EXPECT_EQ(sb.value("dc/all_reduce_raw", 0.0), 2 * sb.value("dc/all_reduce", -1.0));
  EXPECT_EQ(sb.value("dc/all_reduce_raw", 0.0), rb.value("dc/all_reduce", -1.0));
  EXPECT_FALSE(rb.contains("dc/all_reduce_raw"));
  EXPECT_FALSE(sb.contains("worker/all_reduce_raw"));
  // bf16 inside the DCs too: the inner stage's reduce-scatter and all-gather both count.
  std::string inner = testing::model_yaml() + cluster_yaml();
  const std::string worker_link = "link: {bandwidth: 10gbit, latency: 0ms, shape: false}";
  ASSERT_NE(inner.find(worker_link), std::string::npos);
  inner.replace(inner.find(worker_link), worker_link.size(),
                "link: {bandwidth: 10gbit, latency: 0ms, shape: false, codecs: {dense_grad: bf16}}");
  auto [inner_code, inner_out] = run(xdmoe_binary() + " launch --config " + write("inner.yaml", inner) +
                                     " --mode hybrid+farskip+d2x1+sr --steps 2 --run-dir " + dir +
                                     "/inner --cli-bind 'tcp://127.0.0.1:*'");
  ASSERT_EQ(inner_code, 0) << inner_out;
  nlohmann::json both;
  std::ifstream(dir + "/inner/hybrid+farskip+d2x1+sr/summary.json") >> both;
  const nlohmann::json& bb = both["bytes_per_step"];
  for (const char* op : {"worker/reduce_scatter", "worker/all_reduce"}) {
    EXPECT_GT(bb.value(op, 0.0), 0.0) << op;
    EXPECT_EQ(bb.value(std::string(op) + "_raw", 0.0), 2 * bb.value(op, -1.0)) << op;
    EXPECT_EQ(bb.value(std::string(op) + "_raw", 0.0), rb.value(op, -1.0)) << op;  // fp32 in the raw run
  }
  ASSERT_EQ(sr["losses"].size(), 4u);
  ASSERT_EQ(raw["losses"].size(), 4u);
  // The first step reads the replicas as base + exact residual: equal but for rounding.
  EXPECT_NEAR(sr["losses"][0].get<double>(), raw["losses"][0].get<double>(), 1e-7);
  const double last_raw = raw["losses"][3].get<double>(), last_sr = sr["losses"][3].get<double>();
  EXPECT_NE(last_sr, last_raw);
  EXPECT_NEAR(last_sr, last_raw, 0.01 * last_raw);
  EXPECT_NE(out.find("hybrid+farskip+d2x1+sr vs hybrid+farskip+d2x1"), std::string::npos) << out;
  // The codecs' CPU time is counted, and shown beside the raw run's nothing.
  EXPECT_EQ(raw.value("mean_codec_s", -1.0), 0.0);
  EXPECT_GT(sr.value("mean_codec_s", 0.0), 0.0);
  EXPECT_NE(out.find("codec time (ms)"), std::string::npos) << out;
}

TEST_F(Launch, AWorkerThatCannotStartStopsTheWholeJob) {
  const std::string hostfile = write("hosts", "127.0.0.1 slots=3\nnode.invalid slots=1\n");
  auto [code, out] = launch("ssh", "--hostfile " + hostfile + " --ssh 'sh " + fake_ssh() + "'");
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("[rank 3] ssh: Could not resolve hostname node.invalid"), std::string::npos) << out;
  EXPECT_NE(out.find("worker 3 exited with code 255; stopping the job"), std::string::npos) << out;
  EXPECT_NE(out.find("ep run failed: worker 3 exited with code 255"), std::string::npos) << out;
}

TEST_F(Launch, CtrlCStopsTheCoordinatorAndEveryWorker) {
  const std::string hostfile = write("hosts", "127.0.0.1 slots=4\n");
  const std::string ssh_log = dir + "/ssh.log";
  int fd = -1;
  // Long enough that only Ctrl-C ends it.
  subprocess::Child launcher = subprocess::spawn_piped(
      {xdmoe_binary(), "launch", "--config", config, "--mode", "ep", "--steps", "100000", "--run-dir", dir + "/run",
       "--cli-bind", "tcp://127.0.0.1:*", "--hostfile", hostfile, "--ssh", "sh " + fake_ssh()},
      {"FAKE_SSH_LOG=" + ssh_log}, &fd);
  ASSERT_GE(fd, 0);
  FILE* in = ::fdopen(fd, "r");
  std::string out;
  char line[4096];
  int assigned = 0;
  while (assigned < 4 && std::fgets(line, sizeof line, in)) {  // every worker has joined the job
    out += line;
    if (std::string(line).find("assigned:") != std::string::npos) ++assigned;
  }
  ASSERT_EQ(assigned, 4) << out;
  ::kill(launcher.pid, SIGINT);  // what the terminal sends
  while (std::fgets(line, sizeof line, in)) out += line;
  std::fclose(in);
  const int code = subprocess::wait_for(launcher, std::chrono::seconds(60));
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("interrupted; stopping the coordinator and every worker"), std::string::npos) << out;
  // Every worker process is gone: the pids fake_ssh.sh logged (it execs into them).
  const std::vector<std::string> calls = lines_of(ssh_log);
  ASSERT_EQ(calls.size(), 4u);
  for (const std::string& c : calls) {
    const size_t a = c.find(' ') + 1;
    const pid_t pid = std::stoi(c.substr(a, c.find(' ', a) - a));
    EXPECT_TRUE(::kill(pid, 0) != 0 && errno == ESRCH) << "worker process " << pid << " still runs";
  }
}

TEST_F(Launch, WorkersStartedByMpirunTrainExactlyAsTheSameJobLaunchedHere) {
  if (run("command -v mpirun").first != 0)
    FAIL() << "mpirun is missing: scripts/install-deps.sh installs openmpi-bin";
  auto [local_code, local_out] = launch("local", "");
  ASSERT_EQ(local_code, 0) << local_out;
  // The coordinator alone, then the workers as one mpirun job: ranks from OMPI_COMM_WORLD_RANK.
  const std::string run_dir = dir + "/mpi";
  fs::create_directories(run_dir);
  subprocess::Child coordinator = subprocess::spawn(
      {xdmoe_binary(), "coordinator", "--config", config, "--mode", "ep", "--steps", "6", "--bind",
       "tcp://127.0.0.1:*", "--cli-bind", "tcp://127.0.0.1:*", "--http-port", "-1", "--summary",
       run_dir + "/summary.json", "--endpoints-file", run_dir + "/endpoints.json"},
      run_dir + "/coordinator.log");
  const nlohmann::json eps = testing::wait_for_endpoints(run_dir + "/endpoints.json", coordinator);
  ASSERT_TRUE(eps.contains("workers")) << subprocess::read_text(run_dir + "/coordinator.log");
  auto [mpi_code, mpi_out] =
      run("mpirun --allow-run-as-root --oversubscribe -np 4 -x OPENBLAS_NUM_THREADS=1 " + xdmoe_binary() +
          " worker --coordinator " + eps["workers"].get<std::string>());
  const int coordinator_code = subprocess::wait_for(coordinator, std::chrono::seconds(120));
  ASSERT_EQ(mpi_code, 0) << mpi_out;
  ASSERT_EQ(coordinator_code, 0) << subprocess::read_text(run_dir + "/coordinator.log");
  std::ifstream in(run_dir + "/summary.json");
  nlohmann::json mpi;
  in >> mpi;
  // mpirun's ranks, not the order of registration: every rank asked for its own.
  EXPECT_NE(mpi_out.find("assigned: 3 of 4"), std::string::npos) << mpi_out;
  EXPECT_EQ(mpi["losses"], summary("local")["losses"]);
  // The same through `xdmoe launch --launcher mpirun`: its lines tagged by mpirun.
  auto [code, out] = launch("mpilaunch", "--launcher 'mpirun --allow-run-as-root --oversubscribe'");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("by mpirun"), std::string::npos) << out;
  EXPECT_NE(out.find("[mpirun] [1,3]<std"), std::string::npos) << out;  // --tag-output: job 1, rank 3
  EXPECT_EQ(summary("mpilaunch")["losses"], summary("local")["losses"]);
}

TEST_F(Launch, WorkersOfALauncherJobOfAnotherSizeSaySoAndTheJobFails) {
  const std::string run_dir = dir + "/mismatch";
  fs::create_directories(run_dir);
  subprocess::Child coordinator = subprocess::spawn(
      {xdmoe_binary(), "coordinator", "--config", config, "--mode", "ep", "--steps", "6", "--bind",
       "tcp://127.0.0.1:*", "--cli-bind", "tcp://127.0.0.1:*", "--http-port", "-1", "--endpoints-file",
       run_dir + "/endpoints.json"},
      run_dir + "/coordinator.log");
  const nlohmann::json eps = testing::wait_for_endpoints(run_dir + "/endpoints.json", coordinator);
  ASSERT_TRUE(eps.contains("workers"));
  // As `mpirun -np 5` would start them, for a job of 4.
  std::vector<subprocess::Child> workers;
  for (int r = 0; r < 4; ++r)
    workers.push_back(subprocess::spawn(
        {xdmoe_binary(), "worker", "--coordinator", eps["workers"].get<std::string>()},
        run_dir + "/worker" + std::to_string(r) + ".log",
        {"OMPI_COMM_WORLD_SIZE=5", "OMPI_COMM_WORLD_RANK=" + std::to_string(r)}));
  EXPECT_NE(subprocess::wait_for(coordinator, std::chrono::seconds(60)), 0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(subprocess::wait_for(workers[r], std::chrono::seconds(30)), 0);
    EXPECT_NE(subprocess::read_text(workers[r].log_path)
                  .find("the launcher started 5 workers (OMPI_COMM_WORLD_SIZE=5), but the job has 4"),
              std::string::npos)
        << subprocess::read_text(workers[r].log_path);
  }
}

// A real single-node Slurm (scripts/slurm-local.sh): an sbatch job whose
// script is `xdmoe launch --launcher srun`.
TEST_F(Launch, AnSbatchJobStartsTheWorkersWithSrunAndTrainsExactlyAsHere) {
  const std::string script = std::string(XD_SOURCE_DIR) + "/scripts/slurm-local.sh";
  const std::string slurm = "/tmp/xdmoe-slurm-test";  // its ports are fixed: one test uses it
  (void)run("bash " + script + " down --dir " + slurm);
  auto [up_code, up_out] = run("bash " + script + " up --dir " + slurm);
  if (up_code == 3) GTEST_SKIP() << "Slurm cannot run here, so this test is skipped: " << up_out;
  ASSERT_EQ(up_code, 0) << up_out;
  struct Down {
    std::string cmd;
    ~Down() { (void)run(cmd); }
  } down{"bash " + script + " down --dir " + slurm};
  auto [local_code, local_out] = launch("local", "");
  ASSERT_EQ(local_code, 0) << local_out;
  const std::string batch = write("job.sbatch", "#!/bin/sh\n#SBATCH --ntasks=4\n#SBATCH --output=" + dir +
                                                    "/sbatch.out\nexec " + xdmoe_binary() + " launch --config " +
                                                    config + " --mode ep --steps 6 --run-dir " + dir +
                                                    "/slurm --cli-bind 'tcp://127.0.0.1:*' --launcher srun\n");
  auto [code, out] = run("SLURM_CONF=" + slurm + "/slurm.conf timeout 300 sbatch --wait " + batch);
  const std::string job_out = subprocess::read_text(dir + "/sbatch.out");
  ASSERT_EQ(code, 0) << out << job_out;
  EXPECT_NE(job_out.find("by srun"), std::string::npos) << job_out;
  EXPECT_NE(job_out.find("[srun] 3: "), std::string::npos) << job_out;  // srun's label: the task's rank
  EXPECT_NE(job_out.find("assigned: 3 of 4"), std::string::npos) << job_out;
  EXPECT_EQ(summary("slurm")["losses"], summary("local")["losses"]);
}

}  // namespace
}  // namespace xd
