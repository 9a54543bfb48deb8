// Minimal leveled logging to stderr with a wall-clock timestamp and a component
// tag. Thread-safe (one fprintf per line). XD_LOG_LEVEL=debug|info|warn|error.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sys/time.h>

namespace xd {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

inline LogLevel log_threshold() {
  static const LogLevel level = [] {
    const char* v = std::getenv("XD_LOG_LEVEL");
    if (!v) return LogLevel::kInfo;
    if (!std::strcmp(v, "debug")) return LogLevel::kDebug;
    if (!std::strcmp(v, "warn")) return LogLevel::kWarn;
    if (!std::strcmp(v, "error")) return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return level;
}

__attribute__((format(printf, 3, 4))) inline void log_line(LogLevel level, const char* tag,
                                                           const char* fmt, ...) {
  if (level < log_threshold()) return;
  static const char* names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm t;
  localtime_r(&tv.tv_sec, &t);
  std::fprintf(stderr, "%02d:%02d:%02d.%03d %-5s [%s] %s\n", t.tm_hour, t.tm_min, t.tm_sec,
               (int)(tv.tv_usec / 1000), names[(int)level], tag, msg);
}

}  // namespace xd

#define XD_LOG_DEBUG(tag, ...) ::xd::log_line(::xd::LogLevel::kDebug, tag, __VA_ARGS__)
#define XD_LOG_INFO(tag, ...) ::xd::log_line(::xd::LogLevel::kInfo, tag, __VA_ARGS__)
#define XD_LOG_WARN(tag, ...) ::xd::log_line(::xd::LogLevel::kWarn, tag, __VA_ARGS__)
#define XD_LOG_ERROR(tag, ...) ::xd::log_line(::xd::LogLevel::kError, tag, __VA_ARGS__)
