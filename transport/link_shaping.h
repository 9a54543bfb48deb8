// LinkShaping: the in-process emulation of a slow link (netem is unavailable).
// A token bucket paces each directed peer link at `bandwidth_bytes_per_s`, and
// every message is held back a further `latency_s` (one-way latency), while the
// next message already transmits. Plain data.
#pragma once

#include <string>

#include "common/status.h"

namespace xd {

struct LinkShaping {
  double bandwidth_bytes_per_s = 0;  // 0: unlimited
  double latency_s = 0;
  bool shaped() const { return bandwidth_bytes_per_s > 0 || latency_s > 0; }
};

// Parses "100mbit", "1.5gbit", "10MB/s", "800kbit" or a plain bytes/s number.
Expected<double> parse_bandwidth(const std::string& text);
// Parses "5ms", "250us", "0.1s" or a plain number of seconds.
Expected<double> parse_duration(const std::string& text);

}  // namespace xd
