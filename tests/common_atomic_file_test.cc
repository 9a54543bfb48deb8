// Crash-safe whole-file writes (common/atomic_file.h).
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <gtest/gtest.h>
#include <limits>
#include <set>

#include "common/atomic_file.h"
#include "model/checkpoint.h"
#include "model/hf_config.h"
#include "model/param_layout.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace xd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace test_util;

TEST(AtomicFile, ReplacesTheFileAndLeavesNoTempBehind) {
  TempDir tmp;
  const std::string path = tmp / "f";
  ASSERT_TRUE(write_file_atomic(path, "old", 3).is_ok());
  ASSERT_TRUE(write_file_atomic(path, "new!", 4).is_ok());
  EXPECT_EQ(slurp(path), "new!");
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()), 1);
  EXPECT_TRUE(has_message(write_file_atomic(tmp / "no/such/dir/f", "x", 1),
                          {"no/such/dir"}));
}

TEST(AtomicFile, ParentDirHandlesBareNamesRootAndTrailingSlashes) {
  EXPECT_EQ(parent_dir("a/b/c"), "a/b");
  EXPECT_EQ(parent_dir("c"), ".");
  EXPECT_EQ(parent_dir("/c"), "/");
  EXPECT_EQ(parent_dir("a/b/"), "a");
}

}  // namespace
}  // namespace xd
