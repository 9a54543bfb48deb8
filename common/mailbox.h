// Mailbox<T>: a multi-writer, single-reader queue with two lanes. The urgent
// lane (an actor's stop, a transport's stop, connect and wake-ups) is always
// drained before the normal lane, so control never waits behind tensor traffic. Writers are thread-safe.
// The reader can block in pop(), or poll notify_fd() (an eventfd that is
// readable while messages are pending) next to its sockets.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

#include "common/check.h"

namespace xd {

template <typename T>
class Mailbox {
 public:
  Mailbox() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) { XD_CHECK(fd_ >= 0); }
  ~Mailbox() { ::close(fd_); }
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  void push(T item, bool urgent = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      (urgent ? urgent_ : normal_).push_back(std::move(item));
    }
    cv_.notify_one();
    uint64_t one = 1;
    ssize_t n = ::write(fd_, &one, sizeof one);
    (void)n;  // the counter saturating is harmless: the fd stays readable
  }

  // Non-blocking; urgent lane first.
  std::optional<T> try_pop() {
    std::lock_guard<std::mutex> lock(mu_);
    return pop_locked();
  }

  // Blocks up to `timeout`; nullopt on timeout.
  template <typename Rep, typename Period>
  std::optional<T> pop(std::chrono::duration<Rep, Period> timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return !urgent_.empty() || !normal_.empty(); });
    return pop_locked();
  }

  // Readable while items may be pending; call drain_notifications() before
  // emptying the mailbox with try_pop() so no wake-up is lost.
  int notify_fd() const { return fd_; }
  void drain_notifications() {
    uint64_t v;
    ssize_t n = ::read(fd_, &v, sizeof v);
    (void)n;
  }

 private:
  std::optional<T> pop_locked() {
    std::deque<T>& lane = !urgent_.empty() ? urgent_ : normal_;
    if (lane.empty()) return std::nullopt;
    T item = std::move(lane.front());
    lane.pop_front();
    return item;
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> urgent_, normal_;
  int fd_;
};

}  // namespace xd
