// CURVE on every link: keys from `xdmoe keygen`, a job whose workers and CLI
// hold allowed keys trains exactly as in plaintext, a key that is not listed
// is refused and shows in `xdmoe status`, a read-only key cannot stop the
// job, and a coordinator reachable from other hosts will not run in
// plaintext unless told to. Real processes over loopback.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/atomic_file.h"
#include "job_runner.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using testing::run;
using testing::xdmoe_binary;

std::string cluster_yaml(const std::string& security) {
  return "cluster:\n  levels:\n    - name: dc\n      size: 2\n      link: {bandwidth: 1gbit, latency: 0ms, shape: false}\n"
         "    - name: worker\n      size: 2\n      link: {bandwidth: 10gbit, latency: 0ms, shape: false}\n"
         "  expert_parallel:\n    mode: ep\n    memory_cap: unlimited\n    pipeline_degree: 1\n" + security;
}

class Security : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (fs::temp_directory_path() / ("xdmoe_security_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name())).string();
    fs::remove_all(dir);
    fs::create_directories(dir);
    auto [code, out] = run(xdmoe_binary() + " keygen --dir " + dir + "/keys coordinator worker admin intruder");
    ASSERT_EQ(code, 0) << out;
    keygen_out = out;
    security = "  security:\n    coordinator_key: " + dir + "/keys/coordinator.key\n    coordinator_public_key: " + dir +
               "/keys/coordinator.pub\n    worker_key: " + dir + "/keys/worker.key\n    allowed_keys: [" + dir +
               "/keys/worker.pub, " + dir + "/keys/admin.pub]\n    read_only_any_key: true\n";
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir);
  }
  std::string config(const std::string& name, const std::string& security_yaml) {
    std::ofstream(dir + "/" + name) << testing::model_yaml() << cluster_yaml(security_yaml);
    return dir + "/" + name;
  }
  std::string dir, security, keygen_out;
};

TEST_F(Security, KeygenWritesPrivateSecretFilesAndNeverPrintsASecret) {
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/keys/worker.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const std::string secret_file = read_file(dir + "/keys/worker.key").value();
  const size_t at = secret_file.find("secret-key = \"") + 14;
  const std::string secret = secret_file.substr(at, 40);
  EXPECT_EQ(keygen_out.find(secret), std::string::npos) << "keygen printed a secret key";
  // Never overwritten.
  auto [code, out] = run(xdmoe_binary() + " keygen --dir " + dir + "/keys worker");
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find("never overwritten"), std::string::npos) << out;
}

TEST_F(Security, AJobOnCurveLinksTrainsExactlyAsInPlaintextAndLogsNoSecret) {
  auto [pcode, pout] = run(xdmoe_binary() + " launch --config " + config("plain.yaml", "") +
                           " --mode ep --steps 6 --run-dir " + dir + "/plain --cli-bind 'tcp://127.0.0.1:*'");
  ASSERT_EQ(pcode, 0) << pout;
  EXPECT_NE(pout.find("security: plaintext links (every process on this machine"), std::string::npos) << pout;
  auto [code, out] = run(xdmoe_binary() + " --log-level info launch --config " + config("curve.yaml", security) +
                         " --mode ep --steps 6 --run-dir " + dir + "/curve --cli-bind 'tcp://127.0.0.1:*'");
  ASSERT_EQ(code, 0) << out;
  nlohmann::json plain, curve;
  std::ifstream(dir + "/plain/ep/summary.json") >> plain;
  std::ifstream(dir + "/curve/ep/summary.json") >> curve;
  ASSERT_EQ(curve["losses"].size(), 6u);
  EXPECT_EQ(curve["losses"], plain["losses"]);
  std::string logs = out;
  for (int r = 0; r < 4; ++r) logs += subprocess::read_text(dir + "/curve/ep/worker" + std::to_string(r) + ".log");
  EXPECT_NE(logs.find("CURVE: this worker's key"), std::string::npos) << logs;
  for (const char* name : {"coordinator", "worker"}) {
    const std::string file = read_file(dir + "/keys/" + name + ".key").value();
    const std::string secret = file.substr(file.find("secret-key = \"") + 14, 40);
    EXPECT_EQ(logs.find(secret), std::string::npos) << "the " << name << " secret key is in a log";
  }
}

TEST_F(Security, AnUnlistedKeyIsRefusedAndShowsInStatusAndAReadOnlyKeyCannotStopTheJob) {
  const std::string cfg = config("curve.yaml", security);
  const std::vector<std::string> args = {xdmoe_binary(), "coordinator", "--config", cfg, "--bind", "tcp://127.0.0.1:*",
                                         "--cli-bind", "tcp://127.0.0.1:*", "--http-port", "-1", "--endpoints-file",
                                         dir + "/endpoints.json", "--no-probe"};
  subprocess::Child coordinator = subprocess::spawn(args, dir + "/coordinator.log");
  const nlohmann::json eps = testing::wait_for_endpoints(dir + "/endpoints.json", coordinator);
  ASSERT_TRUE(eps.contains("workers")) << subprocess::read_text(dir + "/coordinator.log");
  const std::string keys = dir + "/keys/";
  // A worker with a key nobody listed: the handshake is refused, so it never registers.
  subprocess::Child intruder = subprocess::spawn(
      {xdmoe_binary(), "worker", "--coordinator", eps["workers"].get<std::string>(), "--key", keys + "intruder.key",
       "--coordinator-key", keys + "coordinator.pub"},
      dir + "/intruder.log");
  const std::string cli = eps["cli"].get<std::string>();
  const std::string as_admin = " --coordinator " + cli + " --key " + keys + "admin.key --coordinator-key " + keys + "coordinator.pub";
  const std::string as_intruder = " --coordinator " + cli + " --key " + keys + "intruder.key --coordinator-key " + keys + "coordinator.pub";
  nlohmann::json status;
  for (int i = 0; i < 100; ++i) {  // until the refusal is on record
    auto [code, out] = run(xdmoe_binary() + " status --json" + as_admin);
    ASSERT_EQ(code, 0) << out;
    status = nlohmann::json::parse(out);
    if (!status["security"]["refused"].empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(status["security"]["curve"].get<bool>());
  ASSERT_FALSE(status["security"]["refused"].empty()) << status.dump(2);
  const std::string intruder_key = read_file(keys + "intruder.pub").value();
  const std::string label = intruder_key.substr(intruder_key.find("public-key = \"") + 14, 8) + "...";
  EXPECT_EQ(status["security"]["refused"][0]["key"], label);
  EXPECT_EQ(status["workers"][0]["state"], "missing") << "the intruder must not have registered";
  auto [tcode, table] = run(xdmoe_binary() + " status" + as_admin);
  EXPECT_NE(table.find("refused key " + label), std::string::npos) << table;
  // Read-only for any key: the intruder may look, not stop.
  auto [rcode, rout] = run(xdmoe_binary() + " status --json" + as_intruder);
  EXPECT_EQ(rcode, 0) << rout;
  auto [scode, sout] = run(xdmoe_binary() + " stop" + as_intruder);
  EXPECT_NE(scode, 0);
  EXPECT_NE(sout.find("may only read"), std::string::npos) << sout;
  // A plaintext client gets no answer at all.
  auto [pcode, pout] = run(xdmoe_binary() + " status --coordinator " + cli);
  EXPECT_NE(pcode, 0) << pout;
  auto [acode, aout] = run(xdmoe_binary() + " stop" + as_admin);
  EXPECT_EQ(acode, 0) << aout;
  EXPECT_NE(subprocess::wait_for(coordinator, std::chrono::seconds(30)), -2000);
  ::kill(intruder.pid, SIGTERM);
  subprocess::wait_for(intruder, std::chrono::seconds(10));
}

TEST_F(Security, ACoordinatorReachableFromOtherHostsRefusesPlaintextUnlessToldInsecure) {
  auto [code, out] = run(xdmoe_binary() + " coordinator --config " + config("open.yaml", "") +
                         " --bind 'tcp://0.0.0.0:*' --cli-bind 'tcp://127.0.0.1:*' --http-port -1 --no-probe");
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find("insecure: true"), std::string::npos) << out;
  EXPECT_NE(out.find("xdmoe keygen"), std::string::npos) << out;
  auto [icode, iout] = run(xdmoe_binary() + " launch --config " + config("insecure.yaml", "  security:\n    insecure: true\n") +
                           " --mode ep --steps 2 --run-dir " + dir + "/insecure --cli-bind 'tcp://127.0.0.1:*'");
  EXPECT_EQ(icode, 0) << iout;
  EXPECT_NE(iout.find("security: plaintext links (cluster.security.insecure: true)"), std::string::npos) << iout;
}

}  // namespace
}  // namespace xd
