// The coordinator and workers as real processes: registration, liveness,
// the monitoring CLI, the Prometheus endpoint, and workers that survive
// hostile traffic on their data socket.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <optional>
#include <cstdio>
#include <regex>
#include <sstream>
#include <thread>
#include <zmq.hpp>

#include "cluster/protocol.h"
#include "event.h"
#include "job_runner.h"
#include "transport/control_channel.h"

namespace xd {
namespace {

using namespace std::chrono_literals;

using testing::run;
using testing::wait_until;

// Checks the Prometheus text exposition format line by line.
std::string exposition_error(const std::string& text) {
  static const std::regex help(R"(^# HELP [a-zA-Z_:][a-zA-Z0-9_:]* .*$)");
  static const std::regex type(R"(^# TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (counter|gauge|histogram|summary|untyped)$)");
  static const std::regex sample(
      R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*")*\})? [-+]?([0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?|NaN|[+-]Inf)$)");
  std::istringstream in(text);
  std::string line;
  int samples = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line.rfind("# HELP", 0) == 0) {
      if (!std::regex_match(line, help)) return "bad HELP line: " + line;
    } else if (line.rfind("# TYPE", 0) == 0) {
      if (!std::regex_match(line, type)) return "bad TYPE line: " + line;
    } else if (!std::regex_match(line, sample)) {
      return "bad sample line: " + line;
    } else {
      ++samples;
    }
  }
  return samples > 0 ? "" : "no samples";
}

TEST(Cluster, ALostWorkerIsReportedWithinThreeAndAHalfSecondsAndTheCliShowsIt) {
  const std::string dir = testing::remove_after_test(
      (std::filesystem::temp_directory_path() / ("xdmoe_cluster_" + std::to_string(::getpid()))).string());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string bin = testing::xdmoe_binary();
  subprocess::Child coordinator = subprocess::spawn(
      {bin, "coordinator", "--hold", "--bind", "tcp://127.0.0.1:*", "--cli-bind", "tcp://127.0.0.1:*",
       "--http-port", "0", "--endpoints-file", dir + "/endpoints.json", "--name", "liveness-test"},
      dir + "/coordinator.log");
  nlohmann::json eps = testing::wait_for_endpoints(dir + "/endpoints.json", coordinator);
  ASSERT_TRUE(eps.contains("workers")) << subprocess::read_text(dir + "/coordinator.log");
  const std::string cli = eps["cli"];
  std::vector<subprocess::Child> workers;
  for (int r = 0; r < 4; ++r)
    workers.push_back(subprocess::spawn({bin, "worker", "--coordinator", eps["workers"], "--rank", std::to_string(r)},
                                        dir + "/worker" + std::to_string(r) + ".log"));
  auto status = [&]() -> nlohmann::json {
    auto r = control_request(cli, {{"op", "status"}}, 2000ms);
    return r ? *r : nlohmann::json();
  };
  auto state_of = [](const nlohmann::json& s, int rank) -> std::string {
    for (const auto& w : s.value("workers", nlohmann::json::array()))
      if (w["rank"] == rank) return w.value("state", "");
    return "";
  };
  const bool all_running = wait_until([&] {
    const nlohmann::json s = status();
    for (int r = 0; r < 4; ++r)
      if (state_of(s, r) != "running") return false;
    return true;
  }, 10s);
  ASSERT_TRUE(all_running) << subprocess::read_text(dir + "/coordinator.log");

  // Prometheus text exposition.
  httplib::Client http("127.0.0.1", eps["http_port"].get<int>());
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res) << "no answer from the metrics endpoint";
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(exposition_error(res->body), "") << res->body;
  EXPECT_NE(res->body.find("xdmoe_workers{job=\"liveness-test\",state=\"running\"} 4"), std::string::npos) << res->body;

  // Hostile traffic at worker 0's data socket: it must carry on.
  std::string data_ep;
  const nlohmann::json before = status();
  for (const auto& w : before["workers"])
    if (w["rank"] == 0) data_ep = w["data_endpoint"];
  {
    zmq::context_t ctx;
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::routing_id, std::string("w3"));
    s.set(zmq::sockopt::linger, 500);
    s.connect(data_ep);
    for (int i = 0; i < 50; ++i) {
      std::string junk(40 + i, static_cast<char>(i));
      s.send(zmq::buffer(junk), zmq::send_flags::sndmore);
      s.send(zmq::buffer(std::string("\xc1")), zmq::send_flags::none);
    }
    const int port = std::stoi(data_ep.substr(data_ep.rfind(':') + 1));
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      const char garbage[] = "\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f garbage that is not ZMTP";
      (void)!::write(fd, garbage, sizeof garbage);
    }
    ::close(fd);
  }
  // Worker 0 has read and dropped the junk before the next act.
  ASSERT_TRUE(wait_until([&] {
    return subprocess::read_text(dir + "/worker0.log").find("dropped a message") != std::string::npos;
  }, 10s)) << subprocess::read_text(dir + "/worker0.log");

  // SIGKILL worker 2 and time the detection.
  const auto killed_at = std::chrono::steady_clock::now();
  ::kill(workers[2].pid, SIGKILL);
  double detected = -1;
  if (wait_until([&] { return state_of(status(), 2) == "lost"; }, 6s))
    detected = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  std::printf("[liveness] SIGKILLed worker reported lost after %.2f s\n", detected);
  EXPECT_GT(detected, 0) << "never reported lost";
  EXPECT_LE(detected, 3.5);
  EXPECT_EQ(state_of(status(), 0), "running") << "worker 0 did not survive the hostile traffic";

  auto [code, text] = run(bin + " status --coordinator " + cli);
  EXPECT_EQ(code, 0) << text;
  auto [top_code, top_text] = run(bin + " top --iterations 1 --coordinator " + cli);
  EXPECT_EQ(top_code, 0) << top_text;
  for (const std::string& screen : {text, top_text}) {  // both fit an 80-column terminal
    std::istringstream lines(std::regex_replace(screen, std::regex("\x1b\\[[0-9;]*[A-Za-z]"), ""));
    std::string line;
    int n = 0;
    while (std::getline(lines, line)) {
      EXPECT_LE(line.size(), 80u) << "too wide: " << line;
      ++n;
    }
    EXPECT_GE(n, 7) << screen;
  }
  EXPECT_NE(text.find("lost"), std::string::npos) << text;
  EXPECT_NE(text.find("running"), std::string::npos) << text;
  auto [jcode, json_text] = run(bin + " status --json --coordinator " + cli);
  EXPECT_EQ(jcode, 0);
  EXPECT_TRUE(nlohmann::json::accept(json_text)) << json_text;
  EXPECT_NE(subprocess::read_text(dir + "/coordinator.log").find("worker 2 ("), std::string::npos);

  auto [scode, stop_text] = run(bin + " stop --coordinator " + cli);
  EXPECT_EQ(scode, 0) << stop_text;
  EXPECT_NE(subprocess::wait_for(coordinator, 20s), -1000) << "coordinator did not exit after stop";
  for (int r : {0, 1, 3}) EXPECT_NE(subprocess::wait_for(workers[r], 20s), -1000) << "worker " << r << " did not exit";
  subprocess::wait_for(workers[2], 1s);
}

TEST(Cluster, MonitoringCommandsSayClearlyWhenNoCoordinatorAnswers) {
  const std::string bin = testing::xdmoe_binary();
  for (const char* cmd : {"status", "metrics", "top --iterations 1", "stop"}) {
    auto [code, text] = run(bin + " " + cmd + " --coordinator tcp://127.0.0.1:9");
    EXPECT_EQ(code, 3) << cmd << ": " << text;
    EXPECT_NE(text.find("no coordinator reachable at tcp://127.0.0.1:9"), std::string::npos) << text;
  }
}

// The next control message of `op` (heartbeats skipped), or null.
std::optional<nlohmann::json> next_message(ControlClient& c, const std::string& op) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline)
    if (auto m = c.poll(200ms); m && m->body.value("op", "") == op) return m->body;
  return std::nullopt;
}

TEST(Cluster, AWorkerGetsTheEffectiveConfigurationAndOneOfAnotherVersionIsRefused) {
  const std::string dir = testing::remove_after_test(
      (std::filesystem::temp_directory_path() / ("xdmoe_assign_" + std::to_string(::getpid()))).string());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string config = std::string(XD_SOURCE_DIR) + "/examples/2dc.yaml";
  subprocess::Child coordinator = subprocess::spawn(
      {testing::xdmoe_binary(), "coordinator", "--config", config, "--steps", "7", "--mode", "hybrid",
       "--domains", "2,1", "--hold", "--no-probe", "--bind", "tcp://127.0.0.1:*", "--cli-bind", "tcp://127.0.0.1:*",
       "--http-port", "-1", "--endpoints-file", dir + "/endpoints.json", "--name", "assign-test"},
      dir + "/coordinator.log");
  nlohmann::json eps = testing::wait_for_endpoints(dir + "/endpoints.json", coordinator);
  ASSERT_TRUE(eps.contains("workers")) << subprocess::read_text(dir + "/coordinator.log");

  // A worker of protocol version 1 (it sent no version) is refused at once.
  auto old = ControlClient::connect(eps["workers"], "worker-old");
  ASSERT_TRUE(old);
  nlohmann::json v1 = to_json(RegisterRequest{kProtocolVersion, -1, "old-host", 1, "tcp://127.0.0.1:1"});
  v1.erase("protocol_version");
  ASSERT_TRUE((*old)->send(MessageKind::kHello, v1).is_ok());
  auto refusal = next_message(**old, op::kError);
  ASSERT_TRUE(refusal) << subprocess::read_text(dir + "/coordinator.log");
  ErrorReport report;
  ASSERT_TRUE(from_json(*refusal, &report).is_ok());
  EXPECT_EQ(report.error, protocol_mismatch_message(1));

  // Four current workers, played by this test.
  std::vector<std::unique_ptr<ControlClient>> clients;
  for (int r = 0; r < 4; ++r) {
    auto c = ControlClient::connect(eps["workers"], "worker-" + std::to_string(r));
    ASSERT_TRUE(c);
    ASSERT_TRUE((*c)->send(MessageKind::kHello, to_json(RegisterRequest{kProtocolVersion, r, "test", 100 + r,
                                                                       "tcp://127.0.0.1:" + std::to_string(2000 + r)}))
                    .is_ok());
    clients.push_back(std::move(*c));
  }
  JobConfig expected = *load_job_config(config);
  expected.train.steps = 7;
  expected.cluster.expert_parallel.mode = EpMode::kHybrid;
  expected.cluster.expert_parallel.domain_sizes = {2, 1};
  uint32_t job_id = 0;
  for (int r = 0; r < 4; ++r) {
    auto body = next_message(*clients[r], op::kAssign);
    ASSERT_TRUE(body) << "worker " << r << " got no assignment\n" << subprocess::read_text(dir + "/coordinator.log");
    Assignment a;
    Status st = from_json(*body, &a);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(a.rank, r);
    EXPECT_EQ(a.job_name, "assign-test");
    EXPECT_TRUE(a.hold);
    EXPECT_EQ(a.domain_sizes, (std::vector<int>{2, 1}));
    EXPECT_EQ(a.peers[3].endpoint, "tcp://127.0.0.1:2003");
    EXPECT_EQ(a.peers[r ^ 2].link_class, 0) << "ranks in different DCs talk over the dc link";
    // pipeline degrees auto reach the worker as the planner's choice.
    ASSERT_EQ(expected.cluster.expert_parallel.pipeline_degree, 0);
    ASSERT_EQ(expected.cluster.expert_parallel.backward_pipeline_degree, -1);
    const int forward_r = a.job.cluster.expert_parallel.pipeline_degree;
    const int backward_r = a.job.cluster.expert_parallel.backward_pipeline_degree;
    EXPECT_GE(forward_r, 1);
    EXPECT_GE(backward_r, 1);
    EXPECT_EQ(forward_r % std::max(1, backward_r), 0) << "the backward's degree divides the forward's";
    // So does replica_weight_gradients auto: early or late, never auto.
    ASSERT_EQ(expected.cluster.expert_parallel.replica_weight_gradients, ReplicaWeightGradients::kAuto);
    const ReplicaWeightGradients replicas = a.job.cluster.expert_parallel.replica_weight_gradients;
    EXPECT_NE(replicas, ReplicaWeightGradients::kAuto);
    // And tokens_once_per_worker auto: true or false, never auto.
    ASSERT_EQ(expected.cluster.expert_parallel.tokens_once_per_worker, TokensOncePerWorker::kAuto);
    const TokensOncePerWorker once = a.job.cluster.expert_parallel.tokens_once_per_worker;
    EXPECT_NE(once, TokensOncePerWorker::kAuto);
    JobConfig resolved = expected;
    resolved.cluster.expert_parallel.pipeline_degree = forward_r;
    resolved.cluster.expert_parallel.backward_pipeline_degree = backward_r;
    resolved.cluster.expert_parallel.replica_weight_gradients = replicas;
    resolved.cluster.expert_parallel.tokens_once_per_worker = once;
    EXPECT_EQ(job_config_to_json(a.job), job_config_to_json(resolved)) << "the overrides must reach the worker";
    EXPECT_NE(a.job_id, 0u);
    if (r == 0) job_id = a.job_id;
    EXPECT_EQ(a.job_id, job_id) << "one job, one id";
  }
  EXPECT_NE(subprocess::read_text(dir + "/coordinator.log").find("protocol version mismatch"), std::string::npos);
  auto stopped = control_request(eps["cli"], to_json(StopOrder{"test over"}), 5000ms);
  EXPECT_TRUE(stopped && stopped->value("ok", false));
  EXPECT_NE(subprocess::wait_for(coordinator, 20s), -1000) << "coordinator did not exit after stop";
}

}  // namespace
}  // namespace xd
