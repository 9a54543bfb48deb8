// Actor: one thread, one Mailbox. Work reaches an actor only as posted
// closures, so its state needs no locks: posted closures, on_start(),
// on_tick() and on_stop() always run on the actor's own thread, one at a
// time. stop() goes in the urgent lane and overtakes queued work; post(fn,
// true) does too. Any thread may post(). A std::exception escaping a handler
// is a broken invariant: it is logged and the process aborts (anything else
// aborts unlogged), so nothing throws across the actor boundary. A subclass
// must call stop() and join() in its own destructor, before its members die.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "common/mailbox.h"

namespace xd {

class Actor {
 public:
  using Message = std::function<void()>;

  explicit Actor(std::string name, std::chrono::milliseconds tick = std::chrono::milliseconds(100));
  virtual ~Actor();  // stops and joins
  Actor(const Actor&) = delete;
  Actor& operator=(const Actor&) = delete;

  void start();
  // Urgent: runs after the handler in progress, before queued normal work.
  void stop();
  void join();

  // Runs `fn` on the actor's thread.
  void post(Message fn, bool urgent = false);

 protected:
  virtual void on_start() {}
  virtual void on_tick() {}  // at least every `tick` while idle
  virtual void on_stop() {}

 private:
  void loop();

  std::string name_;
  std::chrono::milliseconds tick_;
  Mailbox<Message> mailbox_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  bool stop_requested_ = false;  // actor thread only
};

}  // namespace xd
