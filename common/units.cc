#include "common/units.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>

namespace xd {


namespace {
// Splits "12.5mbit" into 12.5 and "mbit" (lower-cased).
bool split_number(const std::string& text, double* value, std::string* unit) {
  const char* begin = text.c_str();
  char* end = nullptr;
  *value = std::strtod(begin, &end);
  if (end == begin || !(*value >= 0)) return false;
  unit->clear();
  for (const char* p = end; *p; ++p)
    if (!std::isspace(static_cast<unsigned char>(*p)))
      unit->push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(*p))));
  return true;
}
}  // namespace

Expected<double> parse_bandwidth(const std::string& text) {
  double v;
  std::string u;
  if (!split_number(text, &v, &u)) return Status::invalid_argument("bad bandwidth '" + text + "'");
  if (u.empty() || u == "b/s" || u == "bps") return v;
  if (u == "bit" || u == "bit/s") return v / 8;
  if (u == "kbit" || u == "kbit/s") return v * 1e3 / 8;
  if (u == "mbit" || u == "mbit/s") return v * 1e6 / 8;
  if (u == "gbit" || u == "gbit/s") return v * 1e9 / 8;
  if (u == "kb/s" || u == "kbps") return v * 1e3;
  if (u == "mb/s" || u == "mbps") return v * 1e6;
  if (u == "gb/s" || u == "gbps") return v * 1e9;
  return Status::invalid_argument("bad bandwidth unit in '" + text +
                                  "' (use bit, kbit, mbit, gbit or kb/s, mb/s, gb/s)");
}

Expected<double> parse_duration(const std::string& text) {
  double v;
  std::string u;
  if (!split_number(text, &v, &u)) return Status::invalid_argument("bad duration '" + text + "'");
  if (u.empty() || u == "s") return v;
  if (u == "ms") return v * 1e-3;
  if (u == "us") return v * 1e-6;
  return Status::invalid_argument("bad duration unit in '" + text + "' (use s, ms or us)");
}


Expected<double> parse_byte_size(const std::string& text) {
  std::string t;
  for (char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch)))
      t.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  if (t == "unlimited" || t == "none" || t == "inf")
    return std::numeric_limits<double>::infinity();
  const char* begin = t.c_str();
  char* end = nullptr;
  const double v = std::strtod(begin, &end);
  if (end == begin || !(v >= 0) || !std::isfinite(v))
    return Status::invalid_argument("bad size '" + text + "'");
  const std::string unit(end);
  static const std::map<std::string, double> units = {
      {"", 1},      {"b", 1},
      {"kb", 1e3},  {"mb", 1e6},  {"gb", 1e9},  {"tb", 1e12},
      {"kib", 1024.0}, {"mib", 1024.0 * 1024}, {"gib", 1024.0 * 1024 * 1024},
      {"tib", 1024.0 * 1024 * 1024 * 1024}};
  auto it = units.find(unit);
  if (it == units.end())
    return Status::invalid_argument("bad size unit in '" + text +
                                    "' (use B, KB, MB, GB, KiB, MiB, GiB or unlimited)");
  return v * it->second;
}

}  // namespace xd
