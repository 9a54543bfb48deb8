// Directories a test writes its jobs' logs and summaries into, under the
// system's temporary directory. Each is removed when the test that registered
// it ends passed or skipped, and kept (its path printed) when the test failed,
// so the logs of a failure can be read. Not thread-safe: register from the
// test's own thread.
#pragma once

#include <string>

namespace xd::testing {

// Removes `dir` (and everything in it) at the end of the current test,
// unless the test failed. Returns `dir`.
const std::string& remove_after_test(const std::string& dir);

}  // namespace xd::testing
