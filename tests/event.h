// Synchronisation for tests, so that no test waits on a sleep: an Event that
// one thread sets and another waits for, and wait_until() for a condition
// another process or thread makes true (a counter, a file, a state).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace xd::testing {

class Event {
 public:
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      set_ = true;
    }
    cv_.notify_all();
  }
  // True when set within `timeout`.
  bool wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

// Re-checks `done` every millisecond until it holds (true) or `timeout`
// passes (false). For conditions nobody can signal: counters of another
// thread's sockets, another process's state.
template <typename F>
bool wait_until(F done, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace xd::testing
