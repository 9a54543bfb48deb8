#include "transport/detail/collective_threads.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace xd::detail {
namespace {

// Long enough to span the gaps between a training step's collectives, short
// enough that a burst of concurrent ones does not leave threads behind.
constexpr auto kIdleExit = std::chrono::seconds(10);

class Pool {
 public:
  void submit(std::shared_ptr<CollectiveCompletion> job) {
    std::unique_lock<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    if (idle_ > (int)jobs_.size() - 1) {
      lock.unlock();
      cv_.notify_one();
      return;
    }
    // Every idle thread is spoken for: start one more.
    ++idle_;  // counted as idle until it takes a job
    lock.unlock();
    std::thread([this] { loop(); }).detach();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (!cv_.wait_for(lock, kIdleExit, [this] { return !jobs_.empty(); })) {
        --idle_;
        return;
      }
      std::shared_ptr<CollectiveCompletion> job = std::move(jobs_.front());
      jobs_.pop_front();
      --idle_;
      lock.unlock();
      job->run_if_unclaimed();  // a no-op when its caller already ran it
      job.reset();
      lock.lock();
      ++idle_;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<CollectiveCompletion>> jobs_;
  int idle_ = 0;  // threads waiting for a job (or about to)
};

}  // namespace

std::shared_ptr<CollectiveCompletion> run_collective(std::function<Status()> body) {
  static Pool* pool = new Pool;  // never destroyed: detached threads use it until exit
  auto job = std::make_shared<CollectiveCompletion>(std::move(body));
  pool->submit(job);
  return job;
}

}  // namespace xd::detail
