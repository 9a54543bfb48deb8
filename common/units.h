// Parsers for the units people write in configs and on the command line:
// bandwidths, durations and byte sizes. Pure functions; thread-safe. Errors
// name the text and list the units accepted.
#pragma once

#include <string>

#include "common/status.h"

namespace xd {

// "100mbit", "1.5gbit", "10MB/s", "800kbit" or a plain bytes/s number; in bytes/s.
Expected<double> parse_bandwidth(const std::string& text);
// "5ms", "250us", "0.1s" or a plain number of seconds.
Expected<double> parse_duration(const std::string& text);
// "512", "64KB", "1.5GB" (10^3 steps), "64MiB" (2^10 steps), case-insensitive,
// or "unlimited" (+infinity); in bytes.
Expected<double> parse_byte_size(const std::string& text);

}  // namespace xd
