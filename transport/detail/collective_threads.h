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

// Starts `body` on an idle pool thread (or a new one); the caller's wait() on
// the result runs it instead if no pool thread has taken it yet.
std::shared_ptr<CollectiveCompletion> run_collective(std::function<Status()> body);

}  // namespace xd::detail
