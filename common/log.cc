#include "common/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

namespace xd {

namespace {

LogLevel level_from_environment() {
  if (const char* v = std::getenv("XDMOE_LOG_LEVEL"))
    if (auto l = parse_log_level(v)) return *l;
  return LogLevel::kInfo;
}

std::atomic<int>& current_level() {
  static std::atomic<int> level{static_cast<int>(level_from_environment())};
  return level;
}

spdlog::level::level_enum to_spdlog(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

// Loggers by component, kept out of spdlog's global registry so that nothing
// else in the process can change or drop them. All share one sink, which
// serialises whole lines.
class Loggers {
 public:
  spdlog::logger& get(const char* component) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_name_.find(component);
    if (it == by_name_.end()) {
      auto logger = std::make_shared<spdlog::logger>(component, sink_);
      logger->set_pattern("%H:%M:%S.%e %v");  // level and component: log_line()
      logger->set_level(spdlog::level::trace);  // the global level filters first
      it = by_name_.emplace(component, std::move(logger)).first;
    }
    return *it->second;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<spdlog::sinks::stderr_sink_mt> sink_ = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  std::map<std::string, std::shared_ptr<spdlog::logger>, std::less<>> by_name_;
};

Loggers& loggers() {
  static Loggers* l = new Loggers();  // never destroyed: threads may log during exit
  return *l;
}

}  // namespace

Expected<LogLevel> parse_log_level(const std::string& name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warn" || name == "warning") return LogLevel::kWarn;
  if (name == "error") return LogLevel::kError;
  if (name == "off") return LogLevel::kOff;
  return Status::invalid_argument("unknown log level '" + name + "' (use debug, info, warn, error or off)");
}

void set_log_level(LogLevel level) { current_level().store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(current_level().load(std::memory_order_relaxed)); }

void log_line(LogLevel level, const char* component, const char* fmt, ...) {
  if (!log_enabled(level)) return;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  static const char* const names[] = {"DEBUG", "INFO", "WARN", "ERROR", "OFF"};
  char line[2200];
  const int n = std::snprintf(line, sizeof line, "%-5s [%s] %s", names[static_cast<int>(level)], component, msg);
  spdlog::logger& logger = loggers().get(component);
  logger.log(to_spdlog(level), spdlog::string_view_t(line, n < 0 ? 0 : std::min<size_t>(n, sizeof line - 1)));
  if (level >= LogLevel::kWarn) logger.flush();
}

}  // namespace xd
