// YamlReader: strict YAML-to-struct reading for config files. It keeps the first
// error, with the file:line of the offending node and the dotted key, and
// remembers where each key was read so rules checked later can still point at
// the line. Unknown keys and missing required keys are errors. Not thread-safe;
// one per parse.
#pragma once

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <type_traits>

#include "common/status.h"

namespace xd {

class YamlReader {
 public:
  explicit YamlReader(std::string source) : source_(std::move(source)) {}

  std::string where(const YAML::Node& n) const {
    return source_ + ":" + std::to_string(n.Mark().line + 1);
  }
  void fail(const YAML::Node& n, const std::string& key, const std::string& why) {
    if (status_.is_ok()) status_ = Status::invalid_argument(where(n) + ": " + key + ": " + why);
  }
  void fail_at(const std::string& key, const std::string& why) {
    if (!status_.is_ok()) return;
    // The mark of the key itself, else of the closest enclosing key.
    std::string k = key;
    while (!k.empty()) {
      auto it = lines_.find(k);
      if (it != lines_.end()) {
        status_ = Status::invalid_argument(source_ + ":" + std::to_string(it->second) + ": " + key +
                                           ": " + why);
        return;
      }
      const size_t cut = k.find_last_of(".[");
      k = cut == std::string::npos ? "" : k.substr(0, cut);
    }
    status_ = Status::invalid_argument(source_ + ": " + key + ": " + why);
  }
  void mark(const std::string& key, const YAML::Node& n) { lines_[key] = n.Mark().line + 1; }

  // Visits every key of `map`; unknown keys and missing required keys are
  // errors. An empty section (null) has no keys.
  template <typename F>
  void section(const YAML::Node& map, const std::string& prefix, const std::set<std::string>& keys,
               const std::set<std::string>& required, F field) {
    if (!ok() || !map) return;
    if (map.IsNull()) {
      for (const auto& r : required) return fail(map, prefix + "." + r, "missing (required)");
      return;
    }
    if (!map.IsMap()) return fail(map, prefix, "must be a mapping");
    mark(prefix, map);
    std::map<std::string, int> seen;  // key -> its line
    for (const auto& kv : map) {
      const std::string key = kv.first.Scalar();
      if (!keys.count(key)) {
        std::string known;
        for (const auto& k : keys) known += (known.empty() ? "" : ", ") + k;
        return fail(kv.first, prefix + "." + key, "unknown key (known: " + known + ")");
      }
      // YAML forbids duplicate keys, but yaml-cpp keeps both copies and the fields would merge silently.
      if (auto it = seen.find(key); it != seen.end())
        return fail(kv.first, prefix + "." + key, "given twice (first on line " + std::to_string(it->second) + ")");
      seen[key] = kv.first.Mark().line + 1;
      mark(prefix + "." + key, kv.second);
      field(key, kv.second, prefix + "." + key);
      if (!ok()) return;
    }
    for (const auto& r : required)
      if (!seen.count(r)) return fail(map, prefix + "." + r, "missing (required)");
  }

  template <typename F>
  void section(const YAML::Node& map, const std::string& prefix, const std::set<std::string>& keys, F field) {
    section(map, prefix, keys, {}, field);
  }

  template <typename T>
  void get(const YAML::Node& n, const std::string& key, T* out) {
    if (!ok()) return;
    if (!n.IsScalar()) return fail(n, key, "expected a scalar");
    try {
      *out = n.as<T>();
    } catch (const YAML::Exception&) {
      if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
        if (out_of_range<T>(n.Scalar()))
          return fail(n, key, "'" + n.Scalar() + "' is out of range (" + std::to_string(std::numeric_limits<T>::min()) +
                                  ".." + std::to_string(std::numeric_limits<T>::max()) + ")");
      }
      fail(n, key, std::string("expected ") + type_name<T>() + ", got '" + n.Scalar() + "'");
    }
  }

  // A scalar run through a unit parser such as parse_bandwidth.
  template <typename P>
  void get_unit(const YAML::Node& n, const std::string& key, double* out, P parse) {
    std::string s;
    get(n, key, &s);
    if (!ok()) return;
    auto v = parse(s);
    if (!v) return fail(n, key, v.status().message());
    *out = *v;
  }

  bool ok() const { return status_.is_ok(); }
  const Status& status() const { return status_; }

 private:
  // A decimal integer too large for T (and not, say, "08", which yaml-cpp reads as bad octal).
  template <typename T>
  static bool out_of_range(const std::string& s) {
    const char* begin = s.data() + (!s.empty() && s[0] == '+' ? 1 : 0);
    T v{};
    const auto [end, ec] = std::from_chars(begin, s.data() + s.size(), v);
    return ec == std::errc::result_out_of_range && end == s.data() + s.size();
  }
  template <typename T>
  static const char* type_name() {
    if constexpr (std::is_same_v<T, bool>) return "a boolean";
    else if constexpr (std::is_integral_v<T>) return "an integer";
    else if constexpr (std::is_floating_point_v<T>) return "a number";
    else return "a string";
  }
  std::string source_;
  Status status_;
  std::map<std::string, int> lines_;
};

// Parses one YAML document; a syntax error names the file and line.
inline Expected<YAML::Node> load_yaml_document(const std::string& text, const std::string& source) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Status::invalid_argument(source + ":" + std::to_string(e.mark.line + 1) +
                                    ": YAML syntax error: " + e.msg);
  }
}

}  // namespace xd
