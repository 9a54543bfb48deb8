// Each collective with 2, 3, 4 and 8 real processes over loopback TCP; the
// zero-copy all_to_allv's failure statuses with two transports in one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "common/subprocess.h"
#include "transport/communicator.h"

namespace xd {
namespace {

namespace fs = std::filesystem;

class CollectivesAcrossProcesses : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesAcrossProcesses, MatchTheReferenceElementByElement) {
  const int world = GetParam();
  const fs::path dir = fs::temp_directory_path() /
                       ("xdmoe_coll_" + std::to_string(world) + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string tool = std::string(XD_BINARY_DIR) + "/xdmoe_collective_check";
  std::vector<subprocess::Child> children;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv = {tool, "--rank", std::to_string(r), "--world",
                                     std::to_string(world), "--rendezvous", dir.string(),
                                     "--seed", std::to_string(100 + world)};
    if (world % 2 == 0 && world > 2) argv.insert(argv.end(), {"--inner", "2"});
    children.push_back(subprocess::spawn(argv, (dir / ("rank" + std::to_string(r) + ".log")).string()));
  }
  // One deadline for the whole group: a broken collective makes every rank
  // sit out its timeouts, and waiting for each rank in turn would add them up.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  for (int r = 0; r < world; ++r) {
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - std::chrono::steady_clock::now());
    const int code = subprocess::wait_for(children[r], std::max(left, std::chrono::seconds(1)));
    const std::string log = subprocess::read_text(children[r].log_path);
    EXPECT_EQ(code, 0) << "rank " << r << " log:\n" << log;
    // ", 0 failures", not "0 failures": "10 failures" contains the latter.
    EXPECT_NE(log.find(", 0 failures"), std::string::npos) << log;
    if (r == 0) std::printf("%s", log.c_str());
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Processes, CollectivesAcrossProcesses, ::testing::Values(2, 3, 4, 8),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

// Two transports in this process, ranks 0 and 1, linked over loopback.
std::vector<std::unique_ptr<Transport>> linked_pair() {
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < 2; ++r) {
    TransportOptions o;
    o.rank = r;
    auto t = Transport::create(o);
    XD_CHECK(t);
    out.push_back(std::move(*t));
  }
  const std::vector<PeerInfo> peers = {{0, out[0]->endpoint(), 0}, {1, out[1]->endpoint(), 0}};
  for (auto& t : out) XD_CHECK(t->connect(peers).is_ok());
  return out;
}

TEST(ZeroCopyAllToAllv, ASilentPeerTimesOutNamingTheRankAndLeavesNoBlocks) {
  auto transports = linked_pair();
  Communicator comm(transports[0].get(), {0, 1}, std::chrono::milliseconds(300));
  const std::vector<uint8_t> send = {1, 2, 3};
  ReceivedBlocks blocks;
  const Status st = comm.all_to_allv({1, 0, 0}, send.data(), {1, 2}, &blocks).wait();
  EXPECT_EQ(st.code(), Status::Code::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("all_to_allv from rank 1"), std::string::npos) << st.to_string();
  EXPECT_EQ(blocks.size(), 0);
}

TEST(ZeroCopyAllToAllv, APeerThatDiesBetweenTwoExchangesFailsTheNextWithinItsTimeoutNamingIt) {
  auto transports = linked_pair();
  Communicator a(transports[0].get(), {0, 1}, std::chrono::milliseconds(500));
  Communicator b(transports[1].get(), {0, 1}, std::chrono::milliseconds(500));
  const std::vector<uint8_t> send = {1, 2, 3};
  {
    ReceivedBlocks from_b, from_a;
    auto ha = a.all_to_allv({1, 0, 0}, send.data(), {1, 2}, &from_b);
    auto hb = b.all_to_allv({1, 0, 0}, send.data(), {2, 1}, &from_a);
    ASSERT_TRUE(ha.wait().is_ok());
    ASSERT_TRUE(hb.wait().is_ok());
  }
  // Rank 1's process goes away: its sockets close with it.
  transports[1].reset();
  ReceivedBlocks blocks;
  const auto start = std::chrono::steady_clock::now();
  const Status st = a.all_to_allv({1, 1, 0}, send.data(), {1, 2}, &blocks).wait();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(st.code(), Status::Code::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("rank 1"), std::string::npos) << st.to_string();
  EXPECT_LT(waited, 5.0) << "nothing waits much past its timeout";
  EXPECT_EQ(blocks.size(), 0);
}

TEST(ZeroCopyAllToAllv, ASizeListOfTheWrongLengthIsRejected) {
  auto transports = linked_pair();
  Communicator comm(transports[0].get(), {0, 1}, std::chrono::milliseconds(300));
  const std::vector<uint8_t> send = {1, 2, 3};
  ReceivedBlocks blocks;
  const Status st = comm.all_to_allv({2, 0, 0}, send.data(), {1, 1, 1}, &blocks).wait();
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << st.to_string();
  EXPECT_EQ(blocks.size(), 0);
}

}  // namespace
}  // namespace xd
