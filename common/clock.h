// steady_seconds: the monotonic clock in seconds, for deadlines and timings
// that are plain doubles (shaping, heartbeats, probes). unix_seconds: the
// wall clock, for times compared across processes (a restart's recovery).
// Thread-safe.
#pragma once

#include <chrono>

namespace xd {

inline double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace xd
