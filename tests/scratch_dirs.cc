#include "scratch_dirs.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <set>

namespace xd::testing {
namespace {

std::set<std::string>& registered() {
  static std::set<std::string> dirs;
  return dirs;
}

class RemoveScratchDirs : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    const bool failed = info.result() != nullptr && info.result()->Failed();
    for (const std::string& dir : registered()) {
      if (failed) {
        std::fprintf(stderr, "[scratch] kept %s (the test failed)\n", dir.c_str());
        continue;
      }
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
    registered().clear();
  }
};

// Installed before main() runs the tests; gtest owns the listener.
const bool kInstalled = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new RemoveScratchDirs);
  return true;
}();

}  // namespace

const std::string& remove_after_test(const std::string& dir) {
  registered().insert(dir);
  return dir;
}

}  // namespace xd::testing
