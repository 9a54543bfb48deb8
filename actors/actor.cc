#include "actors/actor.h"

#include <exception>

#include "common/log.h"
#include "common/thread_name.h"

namespace xd {

Actor::Actor(std::string name, std::chrono::milliseconds tick) : name_(std::move(name)), tick_(tick) {}

Actor::~Actor() {
  stop();
  join();
}

void Actor::start() {
  XD_CHECK(!thread_.joinable());
  running_ = true;
  thread_ = std::thread([this] { loop(); });
}

void Actor::stop() {
  if (running_) post([this] { stop_requested_ = true; }, /*urgent=*/true);
}

void Actor::join() {
  if (thread_.joinable()) thread_.join();
}

void Actor::post(Message fn, bool urgent) { mailbox_.push(std::move(fn), urgent); }

void Actor::loop() {
  set_thread_name("xd-" + name_);
  try {
    on_start();
    auto next_tick = std::chrono::steady_clock::now() + tick_;
    while (!stop_requested_) {
      auto wait = next_tick - std::chrono::steady_clock::now();
      if (wait < std::chrono::milliseconds(0)) wait = std::chrono::milliseconds(0);
      if (auto msg = mailbox_.pop(wait)) (*msg)();
      if (std::chrono::steady_clock::now() >= next_tick) {
        on_tick();
        next_tick = std::chrono::steady_clock::now() + tick_;
      }
    }
    on_stop();
  } catch (const std::exception& e) {
    XD_LOG_ERROR(name_.c_str(), "unhandled exception in actor: %s", e.what());
    std::abort();
  }
  running_ = false;
}

}  // namespace xd
