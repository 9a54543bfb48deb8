// steady_seconds: the monotonic clock in seconds, for deadlines and timings
// that are plain doubles (shaping, heartbeats, probes); seconds_since: the
// seconds from a steady_clock time point to now. unix_seconds: the
// wall clock, for times compared across processes (a restart's recovery).
// process_cpu_seconds: CPU time of every thread of this process (probes);
// thread_cpu_seconds: of the calling thread only (what a piece of work cost
// the cores, without the waits for a core or a lock that wall time counts).
// Thread-safe.
#pragma once

#include <chrono>
#include <ctime>

namespace xd {

inline double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

inline double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

inline double process_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

inline double thread_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

}  // namespace xd
