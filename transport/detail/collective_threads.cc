#include "transport/detail/collective_threads.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/thread_name.h"

namespace xd::detail {
namespace {

// Long enough to span the gaps between a training step's collectives, short
// enough that a burst of concurrent ones does not leave threads behind.
constexpr auto kIdleExit = std::chrono::seconds(10);

class Pool {
 public:
  void submit(std::shared_ptr<CollectiveCompletion> job) {
    std::unique_lock<std::mutex> lock(mu_);
    // Jobs their callers already ran would otherwise count as waiting and
    // start threads nobody needs.
    std::erase_if(jobs_, [](const auto& j) { return j->claimed(); });
    jobs_.push_back(std::move(job));
    if (idle_ >= (int)jobs_.size()) {
      lock.unlock();
      cv_.notify_one();
      return;
    }
    // Every idle thread is spoken for: start one more.
    ++idle_;  // counted as idle until it takes a job
    lock.unlock();
    try {
      std::thread([this] { loop(); }).detach();
    } catch (const std::system_error& e) {
      // The job stays queued: an idle thread or its own waiter will run it.
      XD_LOG_WARN("collective", "cannot start a collective thread: %s", e.what());
      std::lock_guard<std::mutex> relock(mu_);
      --idle_;
    }
  }

 private:
  void loop() {
    set_thread_name("xd-collective");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (!cv_.wait_for(lock, kIdleExit, [this] { return !jobs_.empty(); })) {
        --idle_;
        return;
      }
      std::shared_ptr<CollectiveCompletion> job = std::move(jobs_.front());
      jobs_.pop_front();
      if (job->claimed()) continue;  // its waiter ran it; stay idle
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
