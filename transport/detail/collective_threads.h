// CollectiveThreads: the threads that run collective bodies, kept between
// collectives. Starting a thread per collective cost a clone, a stack and a
// join on the critical path of every call; an idle thread here is woken
// instead. A body never waits for another to finish: when no thread is idle a
// new one starts, so concurrent collectives that depend on each other across
// ranks cannot deadlock. Threads idle for a while exit.
//
// Thread-safe. The pool is process-wide and never destroyed (a body may still
// run while the process exits); each body's state is owned by its
// CollectiveCompletion.
#pragma once

#include <functional>
#include <memory>

#include "transport/detail/collective_completion.h"

namespace xd::detail {

// Runs `body` on an idle pool thread (or a new one) and stores its Status in
// `done`, which wakes every waiter.
void run_collective(std::function<Status()> body, std::shared_ptr<CollectiveCompletion> done);

}  // namespace xd::detail
