// Names the calling thread, as `top -H`, `ps -L` and debuggers show it
// (Linux keeps the first 15 characters). Best effort: a failure is ignored.
#pragma once

#include <pthread.h>

#include <string>

namespace xd {

inline void set_thread_name(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace xd
