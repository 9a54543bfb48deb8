// XD_CHECK: aborts on a broken invariant, printing file, line and condition.
// Use it for programming errors only. Faults that can happen in a correct program
// (bad input, network, peers, config) return Status / Expected<T> instead.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace xd::detail {
[[noreturn]] inline void check_failed(const char* file, int line, const char* cond,
                                      const char* msg) {
  std::fprintf(stderr, "XD_CHECK failed at %s:%d: %s%s%s\n", file, line, cond,
               msg[0] ? " -- " : "", msg);
  std::fflush(stderr);
  std::abort();
}
}  // namespace xd::detail

#define XD_CHECK(cond)                                                   \
  do {                                                                   \
    if (!(cond)) ::xd::detail::check_failed(__FILE__, __LINE__, #cond, ""); \
  } while (0)

#define XD_CHECK_MSG(cond, msg)                                           \
  do {                                                                    \
    if (!(cond)) ::xd::detail::check_failed(__FILE__, __LINE__, #cond, msg); \
  } while (0)
