// Logging through spdlog: one named logger per component ("coordinator",
// "transport", "worker 3", ...), all writing to stderr through one shared
// sink as "HH:MM:SS.mmm level [component] message". The level is global: set
// from $XDMOE_LOG_LEVEL at start-up, then by `xdmoe --log-level` (debug,
// info, warn, error, off). Below the level a call costs one atomic load and
// formats nothing. The XD_LOG_* macros take printf-style formats (checked by
// the compiler). Thread-safe. spdlog stays out of this header.
#pragma once

#include <string>

#include "common/status.h"

namespace xd {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

Expected<LogLevel> parse_log_level(const std::string& name);  // "debug", "info", "warn", "error", "off"
void set_log_level(LogLevel level);
LogLevel log_level();
inline bool log_enabled(LogLevel level) { return level >= log_level(); }

__attribute__((format(printf, 3, 4))) void log_line(LogLevel level, const char* component, const char* fmt, ...);

}  // namespace xd

#define XD_LOG_AT(level, component, ...) \
  do {                                   \
    if (::xd::log_enabled(level)) ::xd::log_line(level, component, __VA_ARGS__); \
  } while (0)
#define XD_LOG_DEBUG(component, ...) XD_LOG_AT(::xd::LogLevel::kDebug, component, __VA_ARGS__)
#define XD_LOG_INFO(component, ...) XD_LOG_AT(::xd::LogLevel::kInfo, component, __VA_ARGS__)
#define XD_LOG_WARN(component, ...) XD_LOG_AT(::xd::LogLevel::kWarn, component, __VA_ARGS__)
#define XD_LOG_ERROR(component, ...) XD_LOG_AT(::xd::LogLevel::kError, component, __VA_ARGS__)
