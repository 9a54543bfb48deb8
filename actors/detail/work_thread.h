// WorkThread: an Actor that only runs posted closures, in order, on its own
// thread -- the comm threads of the exchange, the expert communicator and the
// dense all-reduce. Destroying it stops the thread after the closure in
// progress; queued closures are dropped. Thread-safe (post from anywhere).
#pragma once

#include <string>

#include "actors/actor.h"

namespace xd::detail {

class WorkThread final : public Actor {
 public:
  explicit WorkThread(std::string name) : Actor(std::move(name)) { start(); }
  ~WorkThread() override {
    stop();
    join();
  }
};

}  // namespace xd::detail
