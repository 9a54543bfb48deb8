// Each collective with 2, 3, 4 and 8 real processes over loopback TCP.
#include <gtest/gtest.h>

#include <filesystem>

#include "common/subprocess.h"

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
  for (int r = 0; r < world; ++r) {
    const int code = subprocess::wait_for(children[r], std::chrono::seconds(240));
    const std::string log = subprocess::read_text(children[r].log_path);
    EXPECT_EQ(code, 0) << "rank " << r << " log:\n" << log;
    EXPECT_NE(log.find("0 failures"), std::string::npos) << log;
    if (r == 0) std::printf("%s", log.c_str());
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Processes, CollectivesAcrossProcesses, ::testing::Values(2, 3, 4, 8),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

}  // namespace
}  // namespace xd
