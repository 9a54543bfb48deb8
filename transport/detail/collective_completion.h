// CollectiveCompletion: one collective's body and outcome. The body runs
// exactly once, on whichever thread claims it first: a pool thread, or the
// caller that reaches wait() before any pool thread got to it (which saves two
// thread wake-ups on the critical path). Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>

#include "common/status.h"

namespace xd::detail {

class CollectiveCompletion {
 public:
  explicit CollectiveCompletion(std::function<Status()> body) : body_(std::move(body)) {}

  // Runs the body unless another thread has claimed it.
  void run_if_unclaimed() {
    bool expected = false;
    if (!claimed_.compare_exchange_strong(expected, true)) return;
    Status s = body_();
    body_ = nullptr;  // release the captures before waking the waiters
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(s);
      done_ = true;
    }
    cv_.notify_all();
  }

  bool claimed() const { return claimed_.load(); }

  // Runs the body here if nobody has started it yet, else waits for it; every
  // call returns the body's Status.
  Status wait() {
    run_if_unclaimed();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return status_;
  }

 private:
  std::atomic<bool> claimed_{false};
  std::function<Status()> body_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace xd::detail
