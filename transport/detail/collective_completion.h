// CollectiveCompletion: the outcome of one collective, set once by the thread
// that ran it and awaited by its CollectiveHandle. Thread-safe.
#pragma once

#include <condition_variable>
#include <mutex>

#include "common/status.h"

namespace xd::detail {

class CollectiveCompletion {
 public:
  void set(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(s);
      done_ = true;
    }
    cv_.notify_all();
  }
  Status wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace xd::detail
